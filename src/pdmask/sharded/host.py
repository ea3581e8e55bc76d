"""Statistics from what a host already computed on its vocabulary shard (log π(a), ‖π‖²), plus the logits at S:
the from-a-set backend over the ranks, for the methods it can serve (the registry says which)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor

from pdmask.backends.from_set import stats_from_set
from pdmask.backends.inputs import compute_dtype, prepare
from pdmask.backends.shard import VocabShard, agreed, shard_of
from pdmask.methods import get_method
from pdmask.rollout import RolloutLogprobs
from pdmask.types import PolicyStats

#: The methods whose statistics need only π at S, π_R, ‖π‖² and V: what ``stats_from_shard`` (a host that
#: already has log π(a) and ‖π‖²) can serve. The others need sums over the vocabulary (``policy_stats``).
HOST_REFUSED_ESTIMATORS = ("full", "backbone_full", "backbone_topk")


def gather_set_logits(logits: Tensor, set_ids: Tensor, *, tp_group: dist.ProcessGroup | None, vocab_size: int | None = None) -> Tensor:
    """The logits at the ids set_ids [..., C] from each rank's shard logits [..., V/tp], summed over ``tp_group``
    (each id is held by one rank): [..., C] in float32 (float64 for float64 logits), one all-reduce of N·C floats.
    Every rank must call it with the same set_ids; ids must lie in [0, vocab_size)."""

    def check() -> VocabShard:
        shard = shard_of(logits, tp_group, vocab_size)
        if tuple(set_ids.shape[:-1]) != tuple(logits.shape[:-1]):
            lead = tuple(logits.shape[:-1])
            raise ValueError(f"set_ids has shape {tuple(set_ids.shape)}; expected the logits' leading shape {lead} + (C,).")
        if set_ids.numel() and (set_ids.min() < 0 or set_ids.max() >= shard.vocab):
            raise ValueError(f"set_ids holds an id outside the vocabulary [0, {shard.vocab}).")
        return shard

    shard = agreed(tp_group, check, lambda s: [s.width, set_ids.numel(), s.vocab], logits)
    dtype = compute_dtype(logits.dtype)
    owned = shard.owned(set_ids)
    z = logits.detach().gather(-1, shard.local(set_ids, 0)).to(dtype)
    return shard.all_reduce(torch.where(owned, z, 0.0))


def stats_from_shard(
    logits: Tensor,
    tokens: Tensor,
    rollout: RolloutLogprobs,
    logp: Tensor,
    *,
    tp_group: dist.ProcessGroup | None,
    vocab_size: int | None = None,
    sq_norm: Tensor | None = None,
    methods: Iterable[str] = (),
    response_mask: Tensor | None = None,
) -> PolicyStats:
    """PolicyStats for a trainer that already has log π(a) (e.g. ``-vocab_parallel_cross_entropy``) and ‖π‖²
    (verl's ``calculate_sum_pi_squared`` / ``vocab_parallel_sum_pi_squared``): the logits at S gathered from the
    shards (``gather_set_logits``, one all-reduce of N·(K+1) floats) and ``stats_from_set``; no pass over the
    vocabulary. The normaliser is lse = z_a − log π(a).

    Args:
        logits: this rank's shard [..., V/tp] of the logits log π(a) came from (after the temperature).
        tokens, rollout: a [...] and μ (binary or top-K; not full).
        logp: log π(a) [...], with the trainer's gradient. sq_norm: ‖π‖² [...] (``proportional``, ``exactpi``).
        vocab_size: the real V (default tp·V/tp: no padding); ids of S must lie below it.
        methods: the mask methods the caller will use; raises naming those this mode cannot serve: the ones that
            sum over the vocabulary (``*_full_*``, ``pdm_backbone_*``, ``pdm_exactpi_tv``): use ``policy_stats``.
        response_mask: [...] 0/1, as for ``policy_stats``: positions outside it may hold any padding.
    """
    def check() -> tuple[VocabShard, RolloutLogprobs, Tensor]:
        refused = [m for m in (get_method(x) for x in methods)
                   if m.info == "full" or m.estimator in HOST_REFUSED_ESTIMATORS or m.needs_exactpi]  # fmt: skip
        if refused:
            raise ValueError(
                f"stats_from_shard serves the methods that need only π at S, π_R and ‖π‖²; {', '.join(m.name for m in refused)} "
                "sum over the vocabulary: compute them with pdmask.policy_stats(logits, ..., tp_group=...)."
            )
        shard = shard_of(logits, tp_group, vocab_size)
        if not isinstance(rollout, RolloutLogprobs) or rollout.full_logp is not None:
            raise ValueError("stats_from_shard takes a binary or top-K RolloutLogprobs (no full_logp).")
        shape = tuple(logits.shape[:-1])
        if not isinstance(logp, Tensor) or tuple(logp.shape) != shape:
            raise ValueError(f"logp must be log π(a) of shape {shape}.")
        prep = prepare(tokens, rollout, response_mask, "logits", tuple(logits.shape), shard, compute_dtype(logits.dtype))
        return shard, prep.rollout, prep.tokens

    shard, checked, a = agreed(tp_group, check, lambda r: [r[0].width, r[2].numel(), r[1].k, r[0].vocab], logits)
    set_ids = a.unsqueeze(-1) if checked.topk_ids is None else torch.cat([checked.topk_ids, a.unsqueeze(-1)], -1)
    set_z = gather_set_logits(logits, set_ids, tp_group=tp_group, vocab_size=shard.vocab)
    lse = set_z[..., -1] - logp.detach().to(set_z.dtype)
    return stats_from_set(logp, a, checked, set_z - lse.unsqueeze(-1), sq_norm=sq_norm, vocab_size=shard.vocab)


__all__ = ["HOST_REFUSED_ESTIMATORS", "gather_set_logits", "stats_from_shard"]
