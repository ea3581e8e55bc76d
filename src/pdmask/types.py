"""The data types every layer shares: ``PolicyStats`` (what the masks read) and its parts.

The backends fill them (``pdmask.stats`` chooses one), the math reads them (``pdmask.estimators``,
``pdmask.backbone``, ``pdmask.methods``); this module imports nothing else of pdmask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class FullReductions:
    """Reductions over the whole vocabulary against a full μ, each [...]."""

    tv: Tensor  # ½ Σ|π_i − μ_i|
    kl: Tensor  # Σ μ_i (log μ_i − log π_i)
    mu_dot_pi: Tensor  # ⟨μ, π⟩
    sign_pi: Tensor  # Σ s_i π_i,   s_i = sign(π_i − μ_i)
    sign_pi2: Tensor  # Σ s_i π_i²


@dataclass
class HeadMeans:
    """Sums over the LM head's rows w_j for the backbone-aware direction (``pdmask.backbone``), each [..., d]
    (flat [n, d] inside a pass). All are summed in the pass, over every rank's shard, so that the masks
    communicate nothing; s_j = sign(π_j − μ_j)."""

    tail: Tensor  # Σ_{j∉S} π_j w_j (Wᵀπ = tail + set_pi)
    mu: Tensor | None = None  # Wᵀμ (full μ)
    sign_pi: Tensor | None = None  # Σ_j s_j π_j w_j over the vocabulary (full μ)
    set_pi: Tensor | None = None  # Σ_{j∈S} π_j w_j (top-K or full μ)
    at_a: Tensor | None = None  # w_a (top-K or full μ)
    set_mu: Tensor | None = None  # Σ_{j∈S} μ_j w_j (top-K)
    set_sign_pi: Tensor | None = None  # Σ_{j∈S} s_j π_j w_j (top-K)


@dataclass
class PolicyStats:
    """Per-position statistics of π (from the trainer's logits) and μ (from the rollout).

    Only ``logp`` carries a gradient. S is the set of tokens whose μ is known: TopK(μ) ∪ {a} with
    top-K information ({a} with binary information), stored as columns with a last; a column is
    invalid when it repeats a (a among the top-K ids). Masses off S are summed exactly in the pass,
    not as 1 − Σ_S π, so peaked distributions keep their tails in float32.
    """

    logp: Tensor  # [...] log π(a), differentiable
    rollout_logp: Tensor  # [...] log μ(a)
    has_topk: bool  # the rollout gave μ's top-K (otherwise S = {a})
    has_full: bool  # the rollout gave μ over the whole vocabulary
    set_ids: Tensor  # [..., C] token ids of S (C = K+1, or 1 for binary), a last
    set_logp: Tensor  # [..., C] log π at S
    set_mu: Tensor  # [..., C] μ at S, 0 at invalid columns
    set_valid: Tensor  # [..., C] bool
    rest_mass: Tensor  # [...] π_R = Σ_{j∉S} π_j
    tail_sq: Tensor | None = None  # [...] Q = Σ_{j∉S} π_j²
    sq_norm: Tensor | None = None  # [...] ‖π‖² = Σ_S π_j² + Q
    full: FullReductions | None = None
    tail_count: Tensor | None = None  # [...] T = V − |S|, the number of distinct ids off S
    #: [2, ...] Σ_{j∉S} s_j π_j and Σ_{j∉S} s_j π_j² with s_j = sign(π_j − u), u = ``even_tail_mu``
    #: (the pass's ``need_exactpi=True``).
    exactpi_sums: Tensor | None = None
    head: HeadMeans | None = None  # with the LM head W (backbone-aware masks)

    @property
    def pi_a(self) -> Tensor:
        """π(a) [...], detached."""
        return self.logp.detach().exp()

    @property
    def mu_a(self) -> Tensor:
        """μ(a) [...]."""
        return self.rollout_logp.exp()

    @property
    def ratio(self) -> Tensor:
        """r = π(a)/μ(a) [...], detached."""
        return (self.logp.detach() - self.rollout_logp).exp()

    @property
    def info(self) -> str:
        """The richest information about μ: "full", "topk" or "binary"."""
        return "full" if self.has_full else "topk" if self.has_topk else "binary"

    @property
    def set_pi(self) -> Tensor:
        """π at S [..., C], 0 at invalid columns."""
        return self.set_logp.exp().masked_fill(~self.set_valid, 0.0)

    @property
    def rollout_rest_mass(self) -> Tensor:
        """μ_R = 1 − Σ_S μ [...], clamped at 0."""
        return rest_of(self.set_mu)

    @property
    def even_tail_mu(self) -> Tensor:
        """u = μ_R / T [...]: μ's unseen tail spread evenly over the T ids off S (0 when T = 0)."""
        if self.tail_count is None:
            raise ValueError("the exactpi estimator needs the vocabulary size: pass stats_from_set(..., vocab_size=V).")
        return even_mu(self.set_mu, self.tail_count)

    def exactpi_tail_sums(self) -> Tensor:
        """[2, ...] Σ_{j∉S} sign(π_j − u)·π_j and ·π_j², as the pass summed them when asked to."""
        if self.exactpi_sums is None:
            raise ValueError(
                "the exactpi estimator's TV needs sums over the vocabulary off S, asked for up front: compute the "
                "statistics with pdmask.policy_stats or pdmask.policy_stats_from_hidden and need_exactpi=True "
                "(pdmask.policy_loss asks for them itself); stats_from_set cannot give them."
            )
        return self.exactpi_sums


def rest_of(set_mu: Tensor) -> Tensor:
    """μ_R = 1 − Σ_S μ [...], clamped at 0."""
    return (1 - set_mu.sum(-1)).clamp_min(0.0)


def even_mu(set_mu: Tensor, count: Tensor) -> Tensor:
    """u = μ_R / T [...] for T = ``count`` (0 when T = 0)."""
    return torch.where(count > 0, rest_of(set_mu) / count.clamp_min(1), 0.0)


__all__ = ["FullReductions", "HeadMeans", "PolicyStats", "even_mu", "rest_of"]
