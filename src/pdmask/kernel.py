"""The kernel-aware predictive direction G_W (pdmask's extension; docs/method.md, "Kernel-aware masks").

A token's own plain gradient step (size η, advantage A) moves its logits by Δz = ηA·Θ(e_a − π), where
Θ = ‖h‖²·I (+ I with a bias) comes from the LM head and W K Wᵀ from the backbone (K = J Jᵀ, J = ∂h/∂θ).
With K ≈ κ·I the first-order change of D is ηA·(‖h‖²·G + κ·G_W), G_W = ⟨Wᵀ∇_z D, Wᵀ(e_a − π)⟩.
Measured κ/‖h‖² is far above 1 (docs/method.md), so the backbone term decides the sign and the
``pdm_kernel_*`` masks use G_W. It needs the LM head W [V, d]: ``PolicyStats.head`` (``HeadMeans``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from pdmask.stats import HeadMeans, PolicyStats
from pdmask.vocab_pass import set_rows_dot

#: The kernel-aware estimators: with μ over the whole vocabulary, or from top-K (μ's tail taken
#: proportional to π's, as pdmask's ``proportional``).
KERNEL_ESTIMATORS = ("kernel_full", "kernel_topk")


def kernel_change(stats: PolicyStats, kind: str, estimator: str) -> Tensor:
    """G_W = ⟨Wᵀ∇_z D, Wᵀ(e_a − π)⟩ [...] for D = TV (kind "tv") or KL(μ‖π) ("kl").

    ∇_z KL = π − μ; ∇_z TV = ½ π ⊙ (s − ⟨s, π⟩), s = sign(π − μ). ``kernel_full`` uses the full μ;
    ``kernel_topk`` knows μ on S and takes μ_j = π_j·μ_R/π_R off S, so every tail id has s_R = sign(π_R − μ_R).
    """
    head = require_head(stats)
    pi_mean = head.pi
    if estimator == "kernel_full":
        if stats.full is None or head.mu is None or head.sign_pi is None:
            raise ValueError(
                "the kernel_full estimator needs μ over the whole vocabulary in the pass: "
                "pass RolloutLogprobs(full_logp=...) to policy_stats(..., head_weight=W)."
            )
        if kind == "kl":
            grad = pi_mean - head.mu
        else:
            grad = 0.5 * (head.sign_pi - stats.full.sign_pi.unsqueeze(-1) * pi_mean)
    elif estimator == "kernel_topk":
        # Off S, π_j − μ_j = (1 − ρ)·π_j with ρ = μ_R/π_R: the tail enters through Σ_{j∉S} π_j w_j.
        pi_s, mu_s = stats.set_pi, stats.set_mu
        pi_r, mu_r = stats.rest_mass, stats.rollout_rest_mass
        if kind == "kl":
            rho = torch.where(pi_r > 0, mu_r / pi_r.clamp_min(torch.finfo(pi_r.dtype).tiny), 0.0)
            grad = _rows_dot(stats, head, pi_s - mu_s) + (1 - rho).unsqueeze(-1) * head.tail
        else:
            s_set, s_rest = torch.sign(pi_s - mu_s), torch.sign(pi_r - mu_r)
            s_bar = (s_set * pi_s).sum(-1) + s_rest * pi_r
            set_coef = pi_s * (s_set - s_bar.unsqueeze(-1))
            grad = 0.5 * (_rows_dot(stats, head, set_coef) + (s_rest - s_bar).unsqueeze(-1) * head.tail)
    else:
        raise ValueError(f"estimator must be one of {KERNEL_ESTIMATORS}, got {estimator!r}.")
    w_a = head.weight[stats.set_ids[..., -1]].to(pi_mean.dtype)
    return (grad * (w_a - pi_mean)).sum(-1)


def require_head(stats: PolicyStats) -> HeadMeans:
    """The statistics' unembedding sums; a clear error when the pass was not given W."""
    if stats.head is None:
        raise ValueError(
            "the kernel-aware pdm_kernel_* masks need the LM head W [V, d]: pass head_weight=W to "
            "pdmask.policy_stats, or need_kernel=True to pdmask.policy_stats_from_hidden."
        )
    return stats.head


def _rows_dot(stats: PolicyStats, head: HeadMeans, coef: Tensor) -> Tensor:
    """Σ_c coef[..., c] · W[S_c] [..., d] over the valid columns of S."""
    shape = coef.shape
    ids = stats.set_ids.reshape(-1, shape[-1])
    flat = coef.masked_fill(~stats.set_valid, 0.0).reshape(-1, shape[-1])
    return set_rows_dot(head.weight, ids, flat).reshape(shape[:-1] + (-1,))


__all__ = ["KERNEL_ESTIMATORS", "kernel_change", "require_head"]
