"""The experimental kernel-aware direction signal G_W (method.md, last section).

The logit-space signal G = ⟨∇_z D, e_a − π⟩ is exact when only the output layer moves. When the
backbone moves the final hidden state h, the logits move through W (logits = W h): if h moved along
the token's own gradient ∇_h log π_a = Wᵀ(e_a − π), D would change by

    G_W = ⟨Wᵀ ∇_z D, Wᵀ (e_a − π)⟩,     W ∈ R^{V×d} the unembedding matrix.

∇_z D has closed forms: KL(μ‖π): π − μ; TV: ½ π ⊙ (s − ⟨s, π⟩), s = sign(π − μ). With top-K
information (``proportional``), μ's tail is taken proportional to π's tail, as in method.md's ``proportional``
estimator, so the tail part of ∇_z D is proportional to π and Wᵀ∇_z D costs one product Wᵀπ plus
K+1 gathered rows of W.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pdmask.rollout import RolloutLogprobs


def _topk_set(rollout: RolloutLogprobs, tokens: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """S = TopK(μ) ∪ {a} as ids [n, k+1], μ at S [n, k+1] and a validity mask [n, k+1] (a listed once)."""
    if rollout.topk_ids is None or rollout.topk_logp is None:
        raise ValueError("the proportional estimator needs top-K information: rollout.topk_ids and rollout.topk_logp.")
    if not 1 <= k <= rollout.k:
        raise ValueError(f"k must be in [1, {rollout.k}] (the rollout's K), got {k}.")
    # Engines list top-K by decreasing probability; sort anyway so the first k are μ's k most likely.
    order = rollout.topk_logp.argsort(-1, descending=True)[..., :k]
    ids = rollout.topk_ids.gather(-1, order)
    mu = rollout.topk_logp.gather(-1, order).double().exp()
    a = tokens.unsqueeze(-1)
    a_in = (ids == a).any(-1, keepdim=True)
    ids = torch.cat([ids, a], -1)
    mu = torch.cat([mu, torch.where(a_in, 0.0, rollout.logp.double().exp().unsqueeze(-1))], -1)
    valid = torch.cat([torch.ones_like(ids[..., :k], dtype=torch.bool), ~a_in], -1)
    return ids, mu, valid


def kernel_change(
    logits: Tensor,
    tokens: Tensor,
    rollout: RolloutLogprobs,
    weight: Tensor,
    kind: str,
    estimator: str = "full",
    k: int | None = None,
) -> Tensor:
    """G_W = ⟨Wᵀ ∇_z D, Wᵀ (e_a − π)⟩ per position, float64.

    Args:
        logits: z [n, V] (after temperature); tokens: a [n]; weight: W [V, d].
        rollout: μ; ``full`` needs ``full_logp``, ``proportional`` needs top-K.
        kind: "tv" | "kl" (KL(μ‖π)).
        estimator: "full" (exact μ) or "proportional" (top-k of μ, tail proportional to π's).
        k: how many of μ's top log-probs ``proportional`` uses (default: all the rollout has).
    Returns:
        G_W [n], float64.
    """
    if kind not in ("tv", "kl"):
        raise ValueError(f"kind must be 'tv' or 'kl', got {kind!r}.")
    z = logits.detach().double()
    w = weight.detach().double()
    pi = torch.softmax(z, -1)
    w_pi = pi @ w  # Wᵀπ [n, d]
    w_u = w[tokens] - w_pi  # Wᵀ(e_a − π)
    if estimator == "full":
        if rollout.full_logp is None:
            raise ValueError("the full estimator needs rollout.full_logp.")
        mu = rollout.full_logp.double().exp()
        if kind == "kl":
            grad_z = pi - mu
        else:
            s = (pi - mu).sign()
            grad_z = 0.5 * pi * (s - (s * pi).sum(-1, keepdim=True))
        w_g = grad_z @ w
    elif estimator == "proportional":
        ids, mu_s, valid = _topk_set(rollout, tokens, rollout.k if k is None else k)
        pi_s = pi.gather(-1, ids) * valid
        pi_r = (1 - pi_s.sum(-1)).clamp(min=0)
        mu_r = (1 - mu_s.sum(-1)).clamp(min=0)
        rows = w[ids]  # [n, k+1, d]
        if kind == "kl":
            # Tail: ∂D/∂z_j = π_j (1 − ρ), ρ = μ_R/π_R; in S: π_j − μ_j.
            rho = torch.where(pi_r > 0, mu_r / pi_r.clamp(min=torch.finfo(torch.float64).tiny), 0.0)
            coef = (rho[:, None] * pi_s - mu_s) * valid
            w_g = (1 - rho)[:, None] * w_pi + torch.einsum("nk,nkd->nd", coef, rows)
        else:
            # Every tail token has s_R = sign(π_R − μ_R): ∂D/∂z_j = ½ π_j (s_j − s̄), s̄ = Σ_S s π + s_R π_R.
            s_s = (pi_s - mu_s).sign()
            s_r = (pi_r - mu_r).sign()
            s_bar = (s_s * pi_s).sum(-1) + s_r * pi_r
            coef = pi_s * (s_s - s_r[:, None]) * valid
            w_g = 0.5 * ((s_r - s_bar)[:, None] * w_pi + torch.einsum("nk,nkd->nd", coef, rows))
    else:
        raise ValueError(f"estimator must be 'full' or 'proportional', got {estimator!r}.")
    return (w_g * w_u).sum(-1)
