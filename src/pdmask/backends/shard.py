"""A vocabulary split over the ranks of a tensor-parallel group: this rank's shard, its collectives, and the
ranks' agreement on their inputs. One rank holding the whole vocabulary is the shard of a group of one."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

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
    """This rank's ``VocabShard`` of floating-point logits [..., V] (under tensor parallelism its shard [..., V/tp])."""
    if not isinstance(logits, Tensor) or not logits.is_floating_point() or logits.dim() < 1:
        what = "[..., V/tp] (this rank's shard)" if group is not None else "[..., V]"
        raise TypeError(f"logits must be a floating-point torch.Tensor of shape {what}.")
    if group is None and vocab_size is None and logits.shape[-1] < 2:
        raise ValueError(f"logits has shape {tuple(logits.shape)}; expected [..., V] with V >= 2.")
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


__all__ = ["VocabShard", "agreed", "count_traffic", "shard_of"]
