"""μ sliced along the sequence like the host slices its sequence (verl's Ulysses, Megatron's context parallelism)."""

from __future__ import annotations

import torch
from torch import Tensor

from pdmask.rollout import RolloutLogprobs

#: How a host splits a sequence over its context/sequence-parallel ranks: ``contiguous`` (verl's Ulysses:
#: rank r holds chunk r of world equal chunks) or ``load_balanced`` (Megatron's context parallelism: the
#: sequence in 2·world chunks, rank r holding chunks r and 2·world − 1 − r, for causal attention's balance).
SEQUENCE_LAYOUTS = ("contiguous", "load_balanced")


def sequence_shard(x: Tensor, rank: int, world: int, *, dim: int = 1, layout: str = "contiguous") -> Tensor:
    """This rank's part of x along its sequence dimension ``dim``, as the host slices its sequence (SEQUENCE_LAYOUTS).

    The length must be a multiple of world (contiguous) or 2·world (load_balanced): pad it as the host does first."""
    if layout not in SEQUENCE_LAYOUTS:
        raise ValueError(f"layout must be one of {SEQUENCE_LAYOUTS}, got {layout!r}.")
    if not (isinstance(world, int) and world >= 1 and isinstance(rank, int) and 0 <= rank < world):
        raise ValueError(f"need an int world >= 1 and 0 <= rank < world, got rank={rank!r}, world={world!r}.")
    chunks = world if layout == "contiguous" else 2 * world
    length = x.shape[dim]
    if length % chunks:
        raise ValueError(
            f"the sequence dimension {dim} has length {length}, not a multiple of {chunks} ({layout} over {world} ranks): "
            "pad the sequence as the host does before slicing."
        )
    parts = x.chunk(chunks, dim)
    return parts[rank] if layout == "contiguous" else torch.cat([parts[rank], parts[chunks - 1 - rank]], dim)


def shard_rollout(rollout: RolloutLogprobs, rank: int, world: int, *, dim: int = 1, layout: str = "contiguous") -> RolloutLogprobs:
    """The rollout's log-probs (log μ(a), top-K, full μ) on this rank's part of the sequence, sliced as
    ``sequence_shard`` slices the tokens and the logits; ``dim`` counts the per-token dimensions ([B, T]: 1, packed [N]: 0)."""
    if not isinstance(rollout, RolloutLogprobs):
        raise TypeError(f"rollout must be a pdmask.RolloutLogprobs, got {type(rollout).__name__}.")
    if not -rollout.logp.dim() <= dim < rollout.logp.dim():
        raise ValueError(f"dim {dim} is not a dimension of the per-token shape {tuple(rollout.logp.shape)}.")
    dim %= rollout.logp.dim()
    cut = lambda x: None if x is None else sequence_shard(x, rank, world, dim=dim, layout=layout)
    return RolloutLogprobs(cut(rollout.logp), cut(rollout.topk_ids), cut(rollout.topk_logp), cut(rollout.full_logp))  # type: ignore[arg-type]


__all__ = ["SEQUENCE_LAYOUTS", "sequence_shard", "shard_rollout"]
