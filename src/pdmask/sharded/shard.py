"""A vocabulary shard, the ranks' agreement on their inputs, and the partial sums the sharded passes all-reduce."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

from pdmask.rollout import Checks, RolloutLogprobs, _check_no_nan_or_pos_inf, as_bool_mask
from pdmask.stats import PolicyStats
from pdmask.vocab_pass import (
    Accumulators,
    HeadMeans,
    Prepared,
    prepare,
    set_rows_dot,
)

T = TypeVar("T")


@dataclass(frozen=True)
class VocabShard:
    """This rank's part of a vocabulary split over ``group``: ids [rank·width, (rank+1)·width), of which the
    first ``real`` are real (ids < vocab), the rest padding. ``group=None`` is one rank holding it all."""

    group: dist.ProcessGroup | None
    rank: int
    world: int
    width: int
    vocab: int

    @staticmethod
    def of(group: dist.ProcessGroup | None, width: int, vocab_size: int | None) -> VocabShard:
        rank, world = (0, 1) if group is None else (dist.get_rank(group), dist.get_world_size(group))
        vocab = width * world if vocab_size is None else vocab_size
        if isinstance(vocab, bool) or not isinstance(vocab, int) or not (width * (world - 1) + 2 <= vocab <= width * world):
            raise ValueError(
                f"vocab_size must be the real vocabulary V, an int with {width * (world - 1) + 2} <= V <= {width * world} "
                f"for {world} shards of {width} ids (padded ids at the end, each rank holding at least 2 real ids), "
                f"got {vocab_size!r}."
            )
        return VocabShard(group, rank, world, width, vocab)

    @property
    def start(self) -> int:
        return self.rank * self.width

    @property
    def real(self) -> int:
        """The real ids this rank holds (its first columns; padding is a suffix of the vocabulary)."""
        return min(self.width, self.vocab - self.start)

    def owned(self, ids: Tensor) -> Tensor:
        return (ids >= self.start) & (ids < self.start + self.real)

    def local(self, ids: Tensor, outside: int) -> Tensor:
        """ids as columns of this shard; ``outside`` for ids it does not hold."""
        return torch.where(self.owned(ids), ids - self.start, outside)

    def all_reduce(self, x: Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> Tensor:
        """x reduced over the group, in place (a no-op on one rank); counted by ``count_traffic``."""
        if self.group is not None:
            for log in _TRAFFIC:
                log.append(x.numel() * x.element_size())
            dist.all_reduce(x, op=op, group=self.group)
        return x


_TRAFFIC: list[list[int]] = []


def shard_of(logits: object, group: dist.ProcessGroup | None, vocab_size: int | None) -> VocabShard:
    """This rank's ``VocabShard`` of floating-point logits [..., V/tp] (raises on anything else)."""
    if not isinstance(logits, Tensor) or not logits.is_floating_point() or logits.dim() < 1:
        raise TypeError("logits must be a floating-point torch.Tensor of shape [..., V/tp] (this rank's shard).")
    return VocabShard.of(group, logits.shape[-1], vocab_size)


@contextlib.contextmanager
def count_traffic() -> Iterator[list[int]]:
    """Records the bytes of every all-reduce pdmask's sharded functions make in this process (a list of sizes)."""
    log: list[int] = []
    _TRAFFIC.append(log)
    try:
        yield log
    finally:
        _TRAFFIC.remove(log)


def agreed(
    group: dist.ProcessGroup | None, check: Callable[[], T], signature: Callable[[T], Sequence[int]], like: object
) -> T:
    """``check()`` on every rank; if it raises on any rank, every rank raises the first failing rank's error
    (a ValueError, TypeError or RuntimeError as raised, other exceptions as RuntimeError naming them). The ranks
    also agree on ``signature(result)`` (the sizes the collectives depend on), so mismatched arguments fail with
    an error instead of a hang. One all-reduce of 33 integers, on the device of ``like`` (the input tensor; NCCL
    groups reduce device tensors), whose flag is read back: one host-device sync, whatever ``validate`` says."""
    try:
        out, error = check(), None
    except Exception as e:  # any error on one rank: the others must not wait in the collective below
        out, error = None, e
    if group is None:
        if error is not None:
            raise error
        return out  # type: ignore[return-value]
    sig = [0] * 16 if error is not None else list(signature(out))  # type: ignore[arg-type]
    sig = sig + [0] * (16 - len(sig))
    device = like.device if isinstance(like, Tensor) else None
    flags = torch.tensor([int(error is not None)] + sig + [-v for v in sig], dtype=torch.long, device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    if flags[0] > 0:
        errors: list[tuple[str, str] | None] = [None] * dist.get_world_size(group)
        dist.all_gather_object(errors, None if error is None else (type(error).__name__, str(error)), group=group)
        rank, (kind, message) = next((r, e) for r, e in enumerate(errors) if e is not None)
        known = {"ValueError": ValueError, "TypeError": TypeError, "RuntimeError": RuntimeError}
        if kind not in known:
            message = f"{kind}: {message}"
        raise known.get(kind, RuntimeError)(f"{message} (on rank {rank} of tp_group)")
    high, low = flags[1:17], -flags[17:]
    if not torch.equal(high, low):
        raise ValueError(
            "the ranks of tp_group were given inputs of different sizes or options (shard width, positions, |S|, d, "
            "full μ, dtype, need_sq_norm, need_exactpi, head): every rank must pass the same positions and options, "
            "and every shard must be equally wide (Megatron pads the vocabulary so that they are)."
        )
    return out  # type: ignore[return-value]


def _signature(
    shard: VocabShard, prep: Prepared, need_sq_norm: bool, need_exactpi: bool, head_dim: int | None, dtype: torch.dtype
) -> list[int]:
    return [shard.width, prep.n, prep.set_ids.shape[1], prep.vocab, int(prep.full_logp is not None), int(need_sq_norm),
            int(need_exactpi), -1 if head_dim is None else head_dim, torch.finfo(dtype).bits]  # fmt: skip


def _prepare(
    shard: VocabShard, tokens: Tensor, rollout: RolloutLogprobs, response_mask: Tensor | None,
    shape: tuple[int, ...], dtype: torch.dtype, source: str, validate: bool = True,
) -> Prepared:
    """``prepare`` against the real vocabulary, with a full μ (``rollout.full_logp`` [..., V] or this rank's
    shard [..., width]) cut to this rank's real columns."""
    full = rollout.full_logp if isinstance(rollout, RolloutLogprobs) else None
    prep = prepare(tokens, rollout if full is None else replace(rollout, full_logp=None), response_mask, shape,
                   shard.vocab, dtype, source, validate)  # fmt: skip
    if full is None:
        return prep
    if tuple(full.shape) not in (shape + (shard.vocab,), shape + (shard.width,)):
        raise ValueError(
            f"rollout.full_logp has shape {tuple(full.shape)}; expected {shape + (shard.vocab,)} (the whole vocabulary) "
            f"or {shape + (shard.width,)} (this rank's shard)."
        )
    cols = slice(0, shard.real) if full.shape[-1] == shard.width else slice(shard.start, shard.start + shard.real)
    local = full[..., cols].to(device=prep.tokens.device)
    if response_mask is not None:  # outside the response: the neutral token 0 with μ(0) = 1, as RolloutLogprobs.masked
        neutral = torch.full((shard.real,), -torch.inf, dtype=local.dtype, device=local.device)
        neutral[0] = 0.0 if shard.start == 0 else -torch.inf
        local = torch.where(as_bool_mask(response_mask, shape).unsqueeze(-1), local, neutral)
    with Checks.using(validate) as checks:
        if checks is not None:
            _check_no_nan_or_pos_inf("rollout.full_logp", local, checks)
            owned = shard.owned(prep.tokens)
            at_a = local.gather(-1, shard.local(prep.tokens, 0).unsqueeze(-1)).squeeze(-1).to(dtype)
            gap = torch.where(owned, (at_a - prep.rollout.logp).abs(), 0.0)
            checks.add(
                (gap > 1e-3).any(),
                lambda: f"rollout.logp disagrees with rollout.full_logp at the sampled token by up to {gap.max().item():.3g}; "
                "both must come from the same distribution μ.",
            )
    return replace(prep, rollout=replace(prep.rollout, full_logp=local), full_logp=local.reshape(prep.n, shard.real))


@dataclass
class ShardedHeadMeans(HeadMeans):
    """``HeadMeans`` whose ``weight`` is this rank's real rows of the LM head; S's rows are summed over the shards."""

    shard: VocabShard | None = None

    def rows_dot(self, set_ids: Tensor, coef: Tensor) -> Tensor:
        assert self.shard is not None
        owned = self.shard.owned(set_ids)
        local = set_rows_dot(self.weight, self.shard.local(set_ids, 0), coef.masked_fill(~owned, 0.0))
        return self.shard.all_reduce(local)


def _accumulators(
    prep: Prepared, shard: VocabShard, need_sq_norm: bool, need_exactpi: bool, head_weight: Tensor | None
) -> Accumulators:
    acc = Accumulators.empty(prep, need_sq_norm, need_exactpi, head_weight)
    if acc.head is not None:
        h = acc.head
        acc.head = ShardedHeadMeans(h.weight, h.tail, h.mu, h.sign_pi, shard)
    return acc


@dataclass
class _Partial:
    """One rank's sums of a pass relative to its own row max m [n] (``finish_rows``'s arguments)."""

    m: Tensor
    total: Tensor
    rest: Tensor
    tail_sq: Tensor | None
    set_z: Tensor  # [n, C], 0 at the ids other ranks hold
    head_tail: Tensor | None  # [n, d]

    @staticmethod
    def empty(acc: Accumulators) -> _Partial:
        like = acc.lse
        return _Partial(torch.full_like(like, -torch.inf), torch.zeros_like(like), torch.zeros_like(like),
                        None if acc.tail_sq is None else torch.zeros_like(like), torch.zeros_like(acc.set_logp),
                        None if acc.head is None else torch.zeros_like(acc.head.tail))  # fmt: skip

    def store(self, sl: slice, m: Tensor, total: Tensor, rest: Tensor, tail_sq: Tensor | None, set_z: Tensor,
              head_tail: Tensor | None) -> None:  # fmt: skip
        """Keeps rows ``sl`` of one rank's sums (``finish_rows``'s arguments, before the ranks combine them)."""
        self.m[sl], self.total[sl], self.rest[sl], self.set_z[sl] = m, total, rest, set_z
        if self.tail_sq is not None and tail_sq is not None:
            self.tail_sq[sl] = tail_sq
        if self.head_tail is not None and head_tail is not None:
            self.head_tail[sl] = head_tail

    def combine(self, shard: VocabShard, acc: Accumulators) -> None:
        """The whole vocabulary's sums into ``acc``: all-reduce MAX of m, then one all-reduce SUM of the sums
        rescaled to the global max (a rank whose row is all -inf contributes 0; NaN propagates to every rank)."""
        m = shard.all_reduce(self.m.clone(), dist.ReduceOp.MAX)
        scale = torch.where(torch.isneginf(self.m), 0.0, (self.m - m).exp())
        parts = [self.total * scale, self.rest * scale]
        if self.tail_sq is not None:
            parts.append(self.tail_sq * scale.square())
        packed = torch.cat([torch.stack(parts, 1), self.set_z]
                           + ([] if self.head_tail is None else [self.head_tail * scale[:, None]]), 1)  # fmt: skip
        shard.all_reduce(packed)
        k, c = len(parts), self.set_z.shape[1]
        sums = packed[:, :k].unbind(1)
        tail_sq = sums[2] if self.tail_sq is not None else None
        head_tail = None if self.head_tail is None else packed[:, k + c :]
        acc.finish_rows(slice(None), m, sums[0], sums[1], tail_sq, packed[:, k : k + c], head_tail)


def _reduce_normalised(shard: VocabShard, acc: Accumulators) -> None:
    """Sums the second pass's partial full-μ reductions, exactpi sums and head sums over the shards, in one all-reduce."""
    parts = [x for x in (acc.full, acc.exactpi) if x is not None]
    if acc.head is not None and acc.head.mu is not None and acc.head.sign_pi is not None:
        parts += [acc.head.mu, acc.head.sign_pi]
    if not parts:
        return
    packed = shard.all_reduce(torch.cat([x.reshape(-1) for x in parts]))
    offset = 0
    for x in parts:
        x.copy_(packed[offset : offset + x.numel()].view_as(x))
        offset += x.numel()


def _lazy_exactpi(stats: PolicyStats, shard: VocabShard, run: Callable[[], Tensor]) -> None:
    """The exactpi TV sums by a second pass when first used: a collective, so every rank must ask (the same masks)."""
    if stats.exactpi_sums is None and stats.has_topk:
        stats.exactpi_pass = lambda: shard.all_reduce(run())


__all__ = ["VocabShard", "agreed", "count_traffic", "shard_of"]
