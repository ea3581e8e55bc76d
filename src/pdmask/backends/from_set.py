"""The from-a-set backend: ``PolicyStats`` from what a trainer's forward already has (log π(a), log π at S,
maybe ‖π‖²), with no pass over the vocabulary."""

from __future__ import annotations

import torch
from torch import Tensor

from pdmask.backends.inputs import set_columns, tail_count
from pdmask.rollout import RolloutLogprobs
from pdmask.types import PolicyStats


def stats_from_set(
    logp: Tensor,
    tokens: Tensor,
    rollout: RolloutLogprobs,
    set_logp: Tensor,
    *,
    sq_norm: Tensor | None = None,
    vocab_size: int | None = None,
) -> PolicyStats:
    """PolicyStats from what a trainer's own forward already has, with no pass over the vocabulary here.

    Args:
        logp: log π(a) [...], as the trainer computed it (keeps its gradient).
        tokens: a [...]; rollout: μ, already ``validated`` against the tokens (binary or top-K).
        set_logp: log π at S [..., C], the columns of ``rollout.topk_ids`` then a (C = 1 for binary).
        sq_norm: ‖π‖² [...] if the trainer's forward reduced it (needed by ``proportional`` and ``exactpi``).
        vocab_size: V, for the tails spread over the T = V − |S| ids off S: the paper's ``uniform``
            estimator and the KL form of ``exactpi`` (its TV form needs sums over the vocabulary that
            only a pass gives).
    Off S nothing is summed, so π_R = 1 − π(S) (by expm1) and Q = ‖π‖² − Σ_S π² (clamped into
    [0, π_R²], the range the true value lies in): less precise than ``policy_stats`` when π_R < ~1e-6.
    """
    set_valid, set_mu = set_columns(tokens, rollout)
    set_ids = tokens.unsqueeze(-1) if rollout.topk_ids is None else torch.cat([rollout.topk_ids, tokens.unsqueeze(-1)], -1)
    if set_logp.shape != set_ids.shape:
        raise ValueError(f"set_logp has shape {tuple(set_logp.shape)}; expected {tuple(set_ids.shape)} (top-K ids, then a).")
    if vocab_size is not None and (not isinstance(vocab_size, int) or vocab_size < set_ids.shape[-1]):
        raise ValueError(f"vocab_size must be an int >= {set_ids.shape[-1]} (the columns of S), got {vocab_size!r}.")
    in_set = torch.logsumexp(set_logp.detach().masked_fill(~set_valid, -torch.inf), -1)
    stats = PolicyStats(
        logp=logp,
        rollout_logp=rollout.logp,
        has_topk=rollout.topk_ids is not None,
        has_full=False,
        set_ids=set_ids,
        set_logp=set_logp.detach(),
        set_mu=set_mu,
        set_valid=set_valid,
        rest_mass=(-torch.expm1(in_set)).clamp_min(0.0),
        tail_count=None if vocab_size is None else tail_count(set_valid, vocab_size, set_mu.dtype),
    )
    if sq_norm is not None:
        set_sq = stats.set_pi.square().sum(-1)
        stats.tail_sq = torch.minimum((sq_norm.detach() - set_sq).clamp_min(0.0), stats.rest_mass.square())
        stats.sq_norm = set_sq + stats.tail_sq
    return stats


__all__ = ["stats_from_set"]
