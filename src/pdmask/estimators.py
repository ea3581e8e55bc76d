"""Divergence estimates D(π, μ) and the predictive direction G = ⟨∇_z D, e_a − π⟩ from PolicyStats.

Notation (docs/method.md): S = TopK(μ) ∪ {a}; R = the rest bucket, π_R = 1 − Σ_S π, μ_R = 1 − Σ_S μ.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from pdmask.backbone import BACKBONE_ESTIMATORS, backbone_change
from pdmask.exact import KINDS
from pdmask.types import FullReductions, PolicyStats

INFOS = ("binary", "topk", "full")
#: The paper's top-K estimators of G (docs/method.md): the aggregated tail and the uniform tail.
PAPER_TOPK_ESTIMATORS = ("aggregated", "uniform")
#: The paper's estimators of G: the exact ``full`` and its two top-K tails.
PAPER_ESTIMATORS = ("full", *PAPER_TOPK_ESTIMATORS)
#: The predictive estimators of G: the paper's, pdmask's two refinements (``proportional``, ``exactpi``),
#: then pdmask's backbone-aware direction G_W (``pdmask.backbone``), with a full or a top-K μ.
ESTIMATORS = (*PAPER_ESTIMATORS, "proportional", "exactpi", *BACKBONE_ESTIMATORS)
#: The estimators whose G needs μ over the whole vocabulary.
FULL_ESTIMATORS = ("full", "backbone_full")
#: The estimators that need the exact ‖π‖² (one more reduction over the vocabulary in the pass).
SQ_NORM_ESTIMATORS = ("full", "proportional", "exactpi")


def divergence(stats: PolicyStats, kind: str, info: str) -> Tensor:
    """D(π, μ) [...]: kind "tv" (½Σ|π−μ|) or "kl" (KL(μ‖π)); info "binary" | "topk" | "full"."""
    _check_choice("kind", kind, KINDS)
    _check_choice("info", info, INFOS)
    if info == "full":
        full = _require_full(stats)
        return full.tv if kind == "tv" else full.kl
    if info == "binary":
        pi, mu = stats.pi_a, stats.mu_a
        if kind == "tv":
            return (pi - mu).abs()
        # 1 − π_a summed from the other tokens and 1 − μ_a by expm1: exact for confident tokens.
        others = stats.rest_mass + stats.set_pi.masked_fill(stats.set_ids == stats.set_ids[..., -1:], 0.0).sum(-1)
        return _xlogy_ratio(mu, pi) + _xlogy_ratio(-torch.expm1(stats.rollout_logp), others)
    b = _buckets(stats)
    if kind == "tv":
        return 0.5 * ((b.pi_s - b.mu_s).abs().sum(-1) + (b.pi_r - b.mu_r).abs())
    set_terms = torch.where(b.mu_s > 0, b.mu_s * (b.mu_s.clamp_min(_tiny(b.mu_s)).log() - stats.set_logp), 0.0)
    return set_terms.sum(-1) + _xlogy_ratio(b.mu_r, b.pi_r)


def predicted_change(stats: PolicyStats, kind: str, estimator: str) -> Tensor:
    """G = ⟨∇_z D(π, μ), e_a − π⟩ [...]: the first-order change of D per unit step of token a's update.

    KL: G = (π_a − μ_a) + ⟨μ,π⟩ − ‖π‖².  TV: G = ½[s_a π_a − Σ s_i π_i² + (‖π‖² − π_a) Σ s_i π_i].
    ``full`` sums over the vocabulary. From top-K information (S = TopK(μ) ∪ {a}, T = V − |S| ids off S):
    the paper's ``aggregated`` (aggregated-tail) applies the forms to the K+1 categories S ∪ {R}; the
    paper's ``uniform`` (uniform-tail) spreads both tails evenly, π_j = π_R/T and μ_j = μ_R/T off S;
    pdmask's ``proportional`` keeps the exact ‖π‖² and takes μ's tail proportional to π's; pdmask's
    ``exactpi`` keeps π exact and spreads only μ's tail evenly (μ_j = μ_R/T). ``backbone_full`` and
    ``backbone_topk`` return the backbone-aware G_W instead (``pdmask.backbone.backbone_change``).
    """
    _check_choice("kind", kind, KINDS)
    _check_choice("estimator", estimator, ESTIMATORS)
    if estimator in BACKBONE_ESTIMATORS:
        return backbone_change(stats, kind, estimator)
    pi_a, mu_a = stats.pi_a, stats.mu_a
    if estimator == "full":
        full = _require_full(stats)
        sq = _require_sq_norm(stats, estimator)
        if kind == "kl":
            return (pi_a - mu_a) + full.mu_dot_pi - sq
        return _tv_form(torch.sign(pi_a - mu_a), pi_a, sq, full.sign_pi, full.sign_pi2)
    b = _buckets(stats)
    if estimator == "aggregated":
        sq = b.pi_s.square().sum(-1) + b.pi_r.square()  # the rest bucket counts as one token
    elif estimator == "uniform":
        sq = b.pi_s.square().sum(-1) + _per_tail_id(stats, b.pi_r.square())  # T tail ids of π_R/T each
    else:
        sq = _require_sq_norm(stats, estimator)
    if kind == "kl":
        return (pi_a - mu_a) + (b.mu_s * b.pi_s).sum(-1) + _tail_dot(stats, b, estimator) - sq
    s_set = torch.sign(b.pi_s - b.mu_s)
    tail_sign_pi, tail_sign_pi2 = _tail_sign_sums(stats, b, estimator)
    sign_pi = (s_set * b.pi_s).sum(-1) + tail_sign_pi
    sign_pi2 = (s_set * b.pi_s.square()).sum(-1) + tail_sign_pi2
    return _tv_form(torch.sign(pi_a - mu_a), pi_a, sq, sign_pi, sign_pi2)


def _per_tail_id(stats: PolicyStats, x: Tensor) -> Tensor:
    """x / T [...] (0 where T = 0): a tail quantity spread evenly over the T ids off S."""
    if stats.tail_count is None:
        raise ValueError("the uniform-tail estimator needs the vocabulary size: pass stats_from_set(..., vocab_size=V).")
    t = stats.tail_count
    return torch.where(t > 0, x / t.clamp_min(1), 0.0)


def _tail_dot(stats: PolicyStats, b: _Buckets, estimator: str) -> Tensor:
    """The tail's share of ⟨μ, π⟩ under each estimator's picture of π and μ off S."""
    if estimator == "aggregated":
        return b.mu_r * b.pi_r
    if estimator == "uniform":
        return _per_tail_id(stats, b.mu_r * b.pi_r)
    if estimator == "exactpi":
        return stats.even_tail_mu * b.pi_r
    assert stats.tail_sq is not None
    return torch.where(b.pi_r > 0, b.mu_r / b.pi_r.clamp_min(_tiny(b.pi_r)), 0.0) * stats.tail_sq


def _tail_sign_sums(stats: PolicyStats, b: _Buckets, estimator: str) -> tuple[Tensor, Tensor]:
    """The tail's shares of Σ s_i π_i and Σ s_i π_i² under each estimator's picture of π and μ off S."""
    if estimator == "exactpi":
        sums = stats.exactpi_tail_sums()
        return sums[0], sums[1]
    s_r = torch.sign(b.pi_r - b.mu_r)  # one sign for the whole tail
    if estimator == "aggregated":
        return s_r * b.pi_r, s_r * b.pi_r.square()
    if estimator == "uniform":
        return s_r * b.pi_r, s_r * _per_tail_id(stats, b.pi_r.square())
    assert stats.tail_sq is not None
    return s_r * b.pi_r, s_r * stats.tail_sq


def _tv_form(s_a: Tensor, pi_a: Tensor, sq: Tensor, sign_pi: Tensor, sign_pi2: Tensor) -> Tensor:
    return 0.5 * (s_a * pi_a - sign_pi2 + (sq - pi_a) * sign_pi)


@dataclass
class _Buckets:
    pi_s: Tensor  # [..., K+1], 0 at invalid columns
    mu_s: Tensor  # [..., K+1]
    pi_r: Tensor  # [...]
    mu_r: Tensor  # [...]


def _buckets(stats: PolicyStats) -> _Buckets:
    if not stats.has_topk:
        raise ValueError(
            "this estimate needs top-K information about μ: pass RolloutLogprobs(topk_ids=..., topk_logp=...)."
        )
    mu_s = stats.set_mu
    return _Buckets(stats.set_pi, mu_s, stats.rest_mass, stats.rollout_rest_mass)


def _require_full(stats: PolicyStats) -> FullReductions:
    if stats.full is None:
        raise ValueError("this estimate needs μ over the whole vocabulary: pass RolloutLogprobs(full_logp=...).")
    return stats.full


def _require_sq_norm(stats: PolicyStats, estimator: str) -> Tensor:
    if stats.sq_norm is None:
        raise ValueError(f"estimator {estimator!r} needs ‖π‖²: call policy_stats(..., need_sq_norm=True).")
    return stats.sq_norm


def _tiny(x: Tensor) -> float:
    return torch.finfo(x.dtype).tiny


def _xlogy_ratio(p: Tensor, q: Tensor) -> Tensor:
    """p·log(p/q) with 0·log 0 = 0; q is floored at the smallest normal number so D stays finite."""
    return torch.where(p > 0, p * (p.clamp_min(_tiny(p)).log() - q.clamp_min(_tiny(q)).log()), 0.0)


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}; got {value!r}.")


__all__ = [
    "ESTIMATORS",
    "INFOS",
    "KINDS",
    "PAPER_ESTIMATORS",
    "PAPER_TOPK_ESTIMATORS",
    "SQ_NORM_ESTIMATORS",
    "divergence",
    "predicted_change",
]
