"""The backbone-aware predictive direction G_W (pdmask's extension; docs/method.md, "Backbone-aware masks").

A token's own plain gradient step (size η, advantage A) moves its logits by Δz = ηA·Θ(e_a − π), where
Θ = ‖h‖²·I (+ I with a bias) comes from the LM head and W K Wᵀ from the backbone (K = J Jᵀ, J = ∂h/∂θ).
With K ≈ κ·I the first-order change of D is ηA·(‖h‖²·G + κ·G_W), G_W = ⟨Wᵀ∇_z D, Wᵀ(e_a − π)⟩.
The backbone term is the larger one at the median on TinyGPT and SmolLM2 (``pdmask backbone-scale``,
docs/method.md), so the ``pdm_backbone_*`` masks use G_W. It needs the LM head's sums in the pass: ``PolicyStats.head`` (``HeadMeans``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from pdmask.rows import row_slices
from pdmask.types import HeadMeans, PolicyStats

#: The backbone-aware estimators: with μ over the whole vocabulary, or from top-K (μ's tail taken
#: proportional to π's, as pdmask's ``proportional``).
BACKBONE_ESTIMATORS = ("backbone_full", "backbone_topk")
#: Elements of the [rows, d] temporaries made at once while G_W is formed (the inputs are [N, d] already).
ROW_ELEMENTS = 1 << 20


def backbone_change(stats: PolicyStats, kind: str, estimator: str) -> Tensor:
    """G_W = ⟨Wᵀ∇_z D, Wᵀ(e_a − π)⟩ [...] for D = TV (kind "tv") or KL(μ‖π) ("kl").

    ∇_z KL = π − μ; ∇_z TV = ½ π ⊙ (s − ⟨s, π⟩), s = sign(π − μ). ``backbone_full`` uses the full μ;
    ``backbone_topk`` knows μ on S and takes μ_j = π_j·μ_R/π_R off S, so every tail id has s_R = sign(π_R − μ_R).
    Wᵀ∇_z D and Wᵀ(e_a − π) are weighted sums of the pass's d-vectors (``HeadMeans``), formed a slice of rows
    at a time; nothing is communicated here.
    """
    head = require_head(stats)
    n = stats.logp.numel()
    rows = lambda x: x.reshape(n, -1)  # [..., k] -> [n, k]
    if head.set_pi is None or head.at_a is None:
        raise ValueError(
            "the backbone-aware estimators need top-K or full information about μ: pass "
            "RolloutLogprobs(topk_ids=..., topk_logp=...) or RolloutLogprobs(full_logp=...)."
        )
    # Each term: (weight [n, 1] or a float, a [n, d] sum); Wᵀ∇_z D is their sum.
    if estimator == "backbone_full":
        if stats.full is None or head.mu is None or head.sign_pi is None:
            raise ValueError(
                "the backbone_full estimator needs μ over the whole vocabulary in the pass: "
                "pass RolloutLogprobs(full_logp=...) to policy_stats(..., head_weight=W)."
            )
        if kind == "kl":  # π − μ
            terms = [(1.0, head.tail), (1.0, head.set_pi), (-1.0, head.mu)]
        else:  # ½ Σ s_j π_j w_j − ½ ⟨s, π⟩ Wᵀπ
            s_bar = -0.5 * rows(stats.full.sign_pi)
            terms = [(0.5, head.sign_pi), (s_bar, head.tail), (s_bar, head.set_pi)]
    elif estimator == "backbone_topk":
        if head.set_mu is None or head.set_sign_pi is None:
            raise ValueError(
                "the backbone_topk estimator needs top-K information about μ: pass RolloutLogprobs(topk_ids=..., topk_logp=...)."
            )
        # Off S, π_j − μ_j = (1 − ρ)·π_j with ρ = μ_R/π_R: the tail enters through Σ_{j∉S} π_j w_j.
        pi_s, mu_s = stats.set_pi, stats.set_mu
        pi_r, mu_r = stats.rest_mass, stats.rollout_rest_mass
        if kind == "kl":
            rho = torch.where(pi_r > 0, mu_r / pi_r.clamp_min(torch.finfo(pi_r.dtype).tiny), 0.0)
            terms = [(1.0, head.set_pi), (-1.0, head.set_mu), (rows(1 - rho), head.tail)]
        else:  # on S ½ π_j (s_j − s̄), off S ½ π_j (s_R − s̄)
            s_rest = torch.sign(pi_r - mu_r)
            s_bar = (torch.sign(pi_s - mu_s) * pi_s).sum(-1) + s_rest * pi_r
            terms = [(0.5, head.set_sign_pi), (rows(-0.5 * s_bar), head.set_pi), (rows(0.5 * (s_rest - s_bar)), head.tail)]
    else:
        raise ValueError(f"estimator must be one of {BACKBONE_ESTIMATORS}, got {estimator!r}.")
    tail = rows(head.tail)
    out = torch.empty(n, dtype=tail.dtype, device=tail.device)
    for sl in row_slices(n, max(1, ROW_ELEMENTS // max(tail.shape[1], 1))):
        grad = torch.zeros_like(tail[sl])
        for w, x in terms:
            grad.add_(rows(x)[sl] * (w if isinstance(w, float) else w[sl]))
        direction = rows(head.at_a)[sl] - rows(head.tail)[sl] - rows(head.set_pi)[sl]  # Wᵀ(e_a − π)
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
