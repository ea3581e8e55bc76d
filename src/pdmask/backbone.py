"""The backbone-aware predictive direction G_W (pdmask's extension; docs/method.md, "Backbone-aware masks").

A token's own plain gradient step (size η, advantage A) moves its logits by Δz = ηA·Θ(e_a − π), where
Θ = ‖h‖²·I (+ I with a bias) comes from the LM head and W K Wᵀ from the backbone (K = J Jᵀ, J = ∂h/∂θ).
With K ≈ κ·I the first-order change of D is ηA·(‖h‖²·G + κ·G_W), G_W = ⟨Wᵀ∇_z D, Wᵀ(e_a − π)⟩.
The backbone term is the larger one at the median on TinyGPT and SmolLM2 (``pdmask backbone-scale``,
docs/method.md), so the ``pdm_backbone_*`` masks use G_W. It needs the LM head W [V, d]: ``PolicyStats.head`` (``HeadMeans``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from pdmask.stats import HeadMeans, PolicyStats
from pdmask.vocab_pass import row_slices

#: The backbone-aware estimators: with μ over the whole vocabulary, or from top-K (μ's tail taken
#: proportional to π's, as pdmask's ``proportional``).
BACKBONE_ESTIMATORS = ("backbone_full", "backbone_topk")


#: Elements of the [rows, d] temporaries made at once while G_W is formed (the outputs are [N, d] already).
ROW_ELEMENTS = 1 << 20


def backbone_change(stats: PolicyStats, kind: str, estimator: str) -> Tensor:
    """G_W = ⟨Wᵀ∇_z D, Wᵀ(e_a − π)⟩ [...] for D = TV (kind "tv") or KL(μ‖π) ("kl").

    ∇_z KL = π − μ; ∇_z TV = ½ π ⊙ (s − ⟨s, π⟩), s = sign(π − μ). ``backbone_full`` uses the full μ;
    ``backbone_topk`` knows μ on S and takes μ_j = π_j·μ_R/π_R off S, so every tail id has s_R = sign(π_R − μ_R).
    Wᵀ∇_z D is a weighted sum of the pass's d-vectors plus rows of W at S; it is formed a slice of rows at a time.
    """
    head = require_head(stats)
    n = stats.logp.numel()
    rows = lambda x: x.reshape(n, -1)  # [..., k] -> [n, k]
    flat = lambda x: x.reshape(n, 1)  # a per-position weight [...] -> [n, 1]
    set_coef = None
    if estimator == "backbone_full":
        if stats.full is None or head.mu is None or head.sign_pi is None:
            raise ValueError(
                "the backbone_full estimator needs μ over the whole vocabulary in the pass: "
                "pass RolloutLogprobs(full_logp=...) to policy_stats(..., head_weight=W)."
            )
        if kind == "kl":
            terms = [(1.0, None), (-1.0, rows(head.mu))]  # None: Wᵀπ, formed per slice below
        else:
            terms = [(0.5, rows(head.sign_pi)), (-0.5 * flat(stats.full.sign_pi), None)]
    elif estimator == "backbone_topk":
        # Off S, π_j − μ_j = (1 − ρ)·π_j with ρ = μ_R/π_R: the tail enters through Σ_{j∉S} π_j w_j.
        pi_s, mu_s = stats.set_pi, stats.set_mu
        pi_r, mu_r = stats.rest_mass, stats.rollout_rest_mass
        if kind == "kl":
            rho = torch.where(pi_r > 0, mu_r / pi_r.clamp_min(torch.finfo(pi_r.dtype).tiny), 0.0)
            set_coef, terms = pi_s - mu_s, [(flat(1 - rho), rows(head.tail))]
        else:
            s_set, s_rest = torch.sign(pi_s - mu_s), torch.sign(pi_r - mu_r)
            s_bar = (s_set * pi_s).sum(-1) + s_rest * pi_r
            set_coef = 0.5 * pi_s * (s_set - s_bar.unsqueeze(-1))
            terms = [(flat(0.5 * (s_rest - s_bar)), rows(head.tail))]
        set_coef = rows(set_coef.masked_fill(~stats.set_valid, 0.0))
    else:
        raise ValueError(f"estimator must be one of {BACKBONE_ESTIMATORS}, got {estimator!r}.")
    tail, ids = rows(head.tail), stats.set_ids.reshape(n, -1)
    set_pi = rows(stats.set_pi)
    at_a = torch.tensor([ids.shape[1] - 1], device=ids.device)  # a is S's last column
    out = torch.empty(n, dtype=tail.dtype, device=tail.device)
    for sl in row_slices(n, max(1, ROW_ELEMENTS // max(tail.shape[1], 1))):
        # Wᵀπ = Σ_{j∉S} π_j w_j + Σ_S π_j w_j, made here so that the pass keeps one [N, d] sum, not two.
        # One gather of S's rows for Σ_S π_j w_j, w_a and Σ_S coef_j w_j.
        coefs = [set_pi[sl], torch.zeros_like(set_pi[sl]).index_fill_(1, at_a, 1.0)]
        sums = head.rows_dot(ids[sl], torch.stack(coefs if set_coef is None else coefs + [set_coef[sl]]))
        pi_mean = sums[0].add_(tail[sl])
        grad = torch.zeros_like(pi_mean)
        for w, x in terms:
            grad.add_((pi_mean if x is None else x[sl]) * (w if isinstance(w, float) else w[sl]))
        if set_coef is not None:
            grad.add_(sums[2])
        direction = sums[1].sub_(pi_mean)  # Wᵀ(e_a − π)
        out[sl] = torch.linalg.vecdot(grad, direction)
    return out.reshape(stats.logp.shape)


def require_head(stats: PolicyStats) -> HeadMeans:
    """The statistics' unembedding sums; a clear error when the pass was not given W."""
    if stats.head is None:
        raise ValueError(
            "the backbone-aware pdm_backbone_* masks need the LM head W [V, d]: pass head_weight=W to "
            "pdmask.policy_stats, or need_backbone=True to pdmask.policy_stats_from_hidden."
        )
    return stats.head


__all__ = ["BACKBONE_ESTIMATORS", "backbone_change", "require_head"]
