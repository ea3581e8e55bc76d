"""The statistics on a vocabulary split over the ranks of a tensor-parallel group (docs/sharded.md).

Megatron's convention: rank r of ``tp_group`` holds the logits (and the LM head's rows) of the ids
[r·w, (r+1)·w), w the shard width; the padded vocabulary tp·w may exceed the real one V (``vocab_size=``),
and padded ids never enter π (each rank reduces only its real columns). A pass is the unsharded pass on
each shard, relative to the shard's own row max m_r, followed by

1. one all-reduce MAX of m_r [N] and one all-reduce SUM of the rescaled partial sums
   (Σ e, Σ_{j∉S} e, Σ_{j∉S} e², the logits at S's ids, 0 on the ranks that do not own them) [N, 3 + C],
   plus Σ_{j∉S} e_j w_j [N, d] for the backbone-aware masks;
2. only for the sums that need the final log-normaliser, one more all-reduce SUM: the full-μ reductions
   [N, 5] (with a sharded full μ), the ``exactpi`` estimator's TV sums [N, 2], and with a full μ the
   backbone-aware Wᵀμ and Σ sign(π − μ)·π·w [N, 2d].

So a call communicates 4·(C + 4) bytes per position in float32 (C = K + 1; 100 bytes at K = 20), never
O(V). The backbone-aware masks add 4·d bytes per position in the pass and 4·2d (``backbone_full``) or 4·3d
(``backbone_topk``) each time G_W is formed (sums of S's rows of W, over the shards). Before any of this,
every rank checks its inputs and the ranks agree on the outcome with one small collective, so a bad
input on one rank raises the same error on all of them.

Each rank reduces with its own max and the ranks rescale afterwards (instead of reducing the max first):
the same two collectives, and the hidden-state path keeps its single online-log-sum-exp sweep.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

from pdmask.hidden import _Head, _HiddenLogProb, sweep_sums
from pdmask.rollout import Checks, RolloutLogprobs, _check_no_nan_or_pos_inf, as_bool_mask
from pdmask.stats import PolicyStats, assemble, stats_from_set
from pdmask.vocab_pass import (
    Accumulators,
    Block,
    Buffers,
    HeadMeans,
    Prepared,
    default_chunk,
    exactpi_pass,
    prepare,
    set_rows_dot,
    shifted_sums,
)

T = TypeVar("T")

#: The methods whose statistics need only π at S, π_R, ‖π‖² and V: what ``stats_from_shard`` (a host that
#: already has log π(a) and ‖π‖²) can serve. The others need sums over the vocabulary (``policy_stats``).
HOST_REFUSED_ESTIMATORS = ("full", "backbone_full", "backbone_topk")


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
    """``check()`` on every rank; if it raises ValueError/TypeError on any rank, every rank raises the first
    failing rank's error. The ranks also agree on ``signature(result)`` (the sizes the collectives depend on),
    so mismatched arguments fail with an error instead of a hang. One all-reduce of 33 integers, on the device
    of ``like`` (the input tensor; NCCL groups reduce device tensors)."""
    try:
        out, error = check(), None
    except (ValueError, TypeError) as e:
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
        raise (TypeError if kind == "TypeError" else ValueError)(f"{message} (on rank {rank} of tp_group)")
    high, low = flags[1:17], -flags[17:]
    if not torch.equal(high, low):
        raise ValueError(
            "the ranks of tp_group were given inputs of different sizes or options (positions, |S|, d, full μ, "
            "dtype, need_sq_norm, need_exactpi, head): every rank must pass the same positions and options."
        )
    return out  # type: ignore[return-value]


def _signature(prep: Prepared, need_sq_norm: bool, need_exactpi: bool, head_dim: int | None, dtype: torch.dtype) -> list[int]:
    return [prep.n, prep.set_ids.shape[1], prep.vocab, int(prep.full_logp is not None), int(need_sq_norm),
            int(need_exactpi), -1 if head_dim is None else head_dim, torch.finfo(dtype).bits]  # fmt: skip


def _prepare(
    shard: VocabShard, tokens: Tensor, rollout: RolloutLogprobs, response_mask: Tensor | None,
    shape: tuple[int, ...], dtype: torch.dtype, source: str,
) -> Prepared:
    """``prepare`` against the real vocabulary, with a full μ (``rollout.full_logp`` [..., V] or this rank's
    shard [..., width]) cut to this rank's real columns."""
    full = rollout.full_logp if isinstance(rollout, RolloutLogprobs) else None
    prep = prepare(tokens, rollout if full is None else replace(rollout, full_logp=None), response_mask, shape,
                   shard.vocab, dtype, source)  # fmt: skip
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
    with Checks.using(True) as checks:
        _check_no_nan_or_pos_inf("rollout.full_logp", local, checks)
    owned = shard.owned(prep.tokens)
    at_a = local.gather(-1, shard.local(prep.tokens, 0).unsqueeze(-1)).squeeze(-1).to(dtype)
    gap = torch.where(owned, (at_a - prep.rollout.logp).abs(), 0.0)
    if (gap > 1e-3).any():
        raise ValueError(
            f"rollout.logp disagrees with rollout.full_logp at the sampled token by up to {gap.max().item():.3g}; "
            "both must come from the same distribution μ."
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


def sharded_policy_stats(
    logits: Tensor,
    tokens: Tensor,
    rollout: RolloutLogprobs,
    *,
    tp_group: dist.ProcessGroup | None,
    vocab_size: int | None,
    chunk_size: int | None,
    need_sq_norm: bool,
    need_exactpi: bool,
    response_mask: Tensor | None,
    head_weight: Tensor | None,
) -> PolicyStats:
    """``pdmask.policy_stats`` on this rank's logits shard [..., w] (see there and the module's docstring)."""

    def check() -> tuple[VocabShard, Prepared, torch.dtype]:
        if not isinstance(logits, Tensor) or not logits.is_floating_point() or logits.dim() < 1:
            raise TypeError("logits must be a floating-point torch.Tensor of shape [..., V/tp] (this rank's shard).")
        shard = VocabShard.of(tp_group, logits.shape[-1], vocab_size)
        dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
        prep = _prepare(shard, tokens, rollout, response_mask, tuple(logits.shape[:-1]), dtype, "logits")
        if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
            raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}.")
        if head_weight is not None:
            if not isinstance(head_weight, Tensor) or not head_weight.is_floating_point() or head_weight.dim() != 2 \
                    or head_weight.shape[0] != shard.width:  # fmt: skip
                got = tuple(head_weight.shape) if isinstance(head_weight, Tensor) else type(head_weight).__name__
                raise ValueError(f"head_weight must be this rank's [V/tp, d] rows of the LM head with V/tp = {shard.width}, got {got}.")
            if head_weight.device != logits.device:
                raise ValueError(f"head_weight is on {head_weight.device} but the logits are on {logits.device}.")
        return shard, prep, dtype

    d = None if not isinstance(head_weight, Tensor) or head_weight.dim() != 2 else head_weight.shape[1]
    shard, prep, dtype = agreed(tp_group, check, lambda r: _signature(r[1], need_sq_norm, need_exactpi, d, r[2]), logits)
    rows = chunk_size or default_chunk(logits, dtype, 3 if need_exactpi else 2)
    weight = None if head_weight is None else head_weight.detach()[: shard.real].to(dtype)
    acc = _accumulators(prep, shard, need_sq_norm, need_exactpi, weight)
    source = logits.detach().reshape(-1, shard.width)[:, : shard.real]
    cols = shard.local(prep.set_ids, shard.real)
    size = min(rows, max(prep.n, 1)) * shard.real

    def blocks(bufs: Buffers) -> Iterator[Block]:
        for start in range(0, prep.n, rows):
            sl = slice(start, min(start + rows, prep.n))
            chunk = source[sl]
            z = chunk if chunk.dtype == dtype else Buffers.block(bufs.upcast, *chunk.shape).copy_(chunk)  # type: ignore[arg-type]
            yield sl, z, cols[sl], slice(0, shard.real)

    def buffers(need_sign: bool) -> Buffers:
        bufs = Buffers.empty(size, dtype, logits.device, need_sign)
        if source.dtype != dtype:
            bufs.upcast = torch.empty_like(bufs.exp)
        return bufs

    with torch.no_grad():
        bufs = buffers(need_exactpi)
        part = _Partial.empty(acc)
        for sl, z, c, v in blocks(bufs):
            m = z.amax(-1)
            sums = shifted_sums(z, torch.where(torch.isneginf(m), 0.0, m), c, bufs, part.tail_sq is not None)
            set_z = torch.where(c < z.shape[1], z.gather(-1, c.clamp(max=z.shape[1] - 1)), 0.0)
            part.store(sl, m, *sums, set_z, acc.tail_product(bufs, *z.shape, v))
        part.combine(shard, acc)
        acc.check_finite("logits", acc.set_logp[:, -1])  # log π(a), before its autograd node
        if acc.full is not None or acc.exactpi is not None:
            acc.add_normalised_blocks(prep, blocks(bufs), bufs, prep.full_logp)
            _reduce_normalised(shard, acc)
    a_cols = shard.local(prep.flat_tokens, -1)
    logp = _ShardLogProb.apply(logits, a_cols, acc.lse, acc.set_logp[:, -1], rows, shard.real)
    stats = assemble(prep, acc, logp)

    def second_pass() -> Tensor:
        second = buffers(True)
        return exactpi_pass(prep, acc, second, blocks(second))

    _lazy_exactpi(stats, shard, second_pass)
    return stats


class _ShardLogProb(torch.autograd.Function):
    """log π(a) [N] (from the combined pass) whose backward puts g·(1[a here]·e_a − π) into this rank's
    logits shard (0 at padded columns), a chunk of rows at a time; no collective (as Megatron's cross entropy)."""

    @staticmethod
    def forward(ctx, logits: Tensor, a_cols: Tensor, lse: Tensor, logp: Tensor, rows: int, real: int) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(logits, a_cols, lse)
        ctx.rows, ctx.real = rows, real
        return logp.clone()

    @staticmethod
    def backward(ctx, grad_out: Tensor):  # type: ignore[override]
        logits, a_cols, lse = ctx.saved_tensors
        width = logits.shape[-1]
        grad = torch.zeros(logits.shape, dtype=logits.dtype, device=logits.device)
        flat_grad, source = grad.view(-1, width), logits.detach().reshape(-1, width)
        owned = a_cols >= 0
        buf = torch.empty(min(ctx.rows, lse.numel()), ctx.real, dtype=lse.dtype, device=logits.device)
        for start in range(0, lse.numel(), ctx.rows):
            sl = slice(start, min(start + ctx.rows, lse.numel()))
            g = grad_out[sl].to(lse.dtype)
            p = buf[: sl.stop - sl.start].copy_(source[sl, : ctx.real]).sub_(lse[sl, None]).exp_().mul_(-g[:, None])
            p.scatter_add_(-1, a_cols[sl, None].clamp_min(0), torch.where(owned[sl], g, 0.0)[:, None])
            flat_grad[sl, : ctx.real] = p
        return grad, None, None, None, None, None


class _SumGradOverRanks(torch.autograd.Function):
    """Identity forward; backward all-reduces the gradient over the shard's group (Megatron's
    ``copy_to_tensor_model_parallel_region``), so that the hidden states get Σ_r ∂h_r as the unsharded call gives."""

    @staticmethod
    def forward(ctx, x: Tensor, shard: VocabShard) -> Tensor:  # type: ignore[override]
        ctx.shard = shard
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        return ctx.shard.all_reduce(grad.contiguous().clone()), None


def sharded_policy_stats_from_hidden(
    hidden: Tensor,
    weight: Tensor,
    tokens: Tensor,
    rollout: RolloutLogprobs,
    *,
    tp_group: dist.ProcessGroup | None,
    vocab_size: int | None,
    reduce_hidden_grad: bool,
    bias: Tensor | None,
    temperature: float,
    need_sq_norm: bool,
    need_exactpi: bool,
    response_mask: Tensor | None,
    need_backbone: bool,
    block_rows: int | None,
    block_vocab: int | None,
) -> PolicyStats:
    """``pdmask.policy_stats_from_hidden`` with this rank's LM head rows weight [V/tp, d] (bias [V/tp])."""

    def check() -> tuple[VocabShard, _Head, Prepared]:
        if not isinstance(weight, Tensor) or weight.dim() != 2:
            raise ValueError(f"weight must be this rank's [V/tp, d] rows of the LM head, got {type(weight).__name__}.")
        shard = VocabShard.of(tp_group, weight.shape[0], vocab_size)
        if bias is not None and (not isinstance(bias, Tensor) or tuple(bias.shape) != (shard.width,)):
            raise ValueError(f"bias must be this rank's [V/tp] = [{shard.width}] entries of the LM head's bias.")
        real = slice(0, shard.real)
        head = _Head.checked(hidden, weight[real], None if bias is None else bias[real], temperature, block_rows, block_vocab)
        prep = _prepare(shard, tokens, rollout, response_mask, tuple(hidden.shape[:-1]), head.dtype, "hidden states")
        return shard, head, prep

    d = hidden.shape[-1] if need_backbone and isinstance(hidden, Tensor) else None
    shard, head, prep = agreed(tp_group, check, lambda r: _signature(r[2], need_sq_norm, need_exactpi, d, r[1].dtype), hidden)
    flat = hidden.detach().reshape(-1, hidden.shape[-1])
    acc = _accumulators(prep, shard, need_sq_norm, need_exactpi, head.weight if need_backbone else None)
    local_ids = shard.local(prep.set_ids, -1)
    with torch.no_grad():
        bufs = head.buffers(min(head.rows, max(prep.n, 1)), need_exactpi)
        part = _Partial.empty(acc)
        for sl in head.row_blocks(prep.n):
            part.store(sl, *sweep_sums(head, flat[sl], local_ids[sl], acc, bufs))
        part.combine(shard, acc)
        acc.check_finite("hidden @ weight.T logits", acc.set_logp[:, -1])
        if acc.full is not None or acc.exactpi is not None:
            acc.add_normalised_blocks(prep, head.blocks(flat, head.row_blocks(prep.n), local_ids, bufs), bufs, prep.full_logp)
            _reduce_normalised(shard, acc)
    real = slice(0, shard.real)
    source = _SumGradOverRanks.apply(hidden, shard) if reduce_hidden_grad and shard.group is not None else hidden
    logp = _HiddenLogProb.apply(source, weight[real], None if bias is None else bias[real], acc.set_logp[:, -1],
                                shard.local(prep.flat_tokens, -1), acc.lse, head)  # fmt: skip
    stats = assemble(prep, acc, logp)

    def second_pass() -> Tensor:
        second = head.buffers(min(head.rows, max(prep.n, 1)), True)
        return exactpi_pass(prep, acc, second, head.blocks(flat, head.row_blocks(prep.n), local_ids, second))

    _lazy_exactpi(stats, shard, second_pass)
    return stats


def gather_set_logits(logits: Tensor, set_ids: Tensor, *, tp_group: dist.ProcessGroup | None, vocab_size: int | None = None) -> Tensor:
    """The logits at the ids set_ids [..., C] from each rank's shard logits [..., V/tp], summed over ``tp_group``
    (each id is held by one rank): [..., C] in float32 (float64 for float64 logits), one all-reduce of N·C floats.
    Every rank must call it with the same set_ids; ids must lie in [0, vocab_size)."""

    def check() -> VocabShard:
        if not isinstance(logits, Tensor) or not logits.is_floating_point() or logits.dim() < 1:
            raise TypeError("logits must be a floating-point torch.Tensor of shape [..., V/tp] (this rank's shard).")
        shard = VocabShard.of(tp_group, logits.shape[-1], vocab_size)
        if tuple(set_ids.shape[:-1]) != tuple(logits.shape[:-1]):
            lead = tuple(logits.shape[:-1])
            raise ValueError(f"set_ids has shape {tuple(set_ids.shape)}; expected the logits' leading shape {lead} + (C,).")
        if set_ids.numel() and (set_ids.min() < 0 or set_ids.max() >= shard.vocab):
            raise ValueError(f"set_ids holds an id outside the vocabulary [0, {shard.vocab}).")
        return shard

    shard = agreed(tp_group, check, lambda s: [set_ids.numel(), s.vocab], logits)
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
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
    """
    from pdmask.methods import get_method

    refused = [m for m in (get_method(x) for x in methods)
               if m.info == "full" or m.estimator in HOST_REFUSED_ESTIMATORS or m.needs_exactpi]  # fmt: skip
    if refused:
        raise ValueError(
            f"stats_from_shard serves the methods that need only π at S, π_R and ‖π‖²; {', '.join(m.name for m in refused)} "
            "sum over the vocabulary: compute them with pdmask.policy_stats(logits, ..., tp_group=...)."
        )

    def check() -> tuple[VocabShard, RolloutLogprobs, Tensor]:
        if not isinstance(logits, Tensor) or not logits.is_floating_point() or logits.dim() < 1:
            raise TypeError("logits must be a floating-point torch.Tensor of shape [..., V/tp] (this rank's shard).")
        shard = VocabShard.of(tp_group, logits.shape[-1], vocab_size)
        if not isinstance(rollout, RolloutLogprobs) or rollout.full_logp is not None:
            raise ValueError("stats_from_shard takes a binary or top-K RolloutLogprobs (no full_logp).")
        shape = tuple(logits.shape[:-1])
        if not isinstance(logp, Tensor) or tuple(logp.shape) != shape:
            raise ValueError(f"logp must be log π(a) of shape {shape}.")
        dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
        prep = prepare(tokens, rollout, None, shape, shard.vocab, dtype, "logits")
        return shard, prep.rollout, prep.tokens

    shard, checked, a = agreed(tp_group, check, lambda r: [r[2].numel(), r[1].k, r[0].vocab], logits)
    set_ids = a.unsqueeze(-1) if checked.topk_ids is None else torch.cat([checked.topk_ids, a.unsqueeze(-1)], -1)
    set_z = gather_set_logits(logits, set_ids, tp_group=tp_group, vocab_size=shard.vocab)
    lse = set_z[..., -1] - logp.detach().to(set_z.dtype)
    return stats_from_set(logp, a, checked, set_z - lse.unsqueeze(-1), sq_norm=sq_norm, vocab_size=shard.vocab)


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


__all__ = [
    "HOST_REFUSED_ESTIMATORS",
    "SEQUENCE_LAYOUTS",
    "VocabShard",
    "agreed",
    "count_traffic",
    "gather_set_logits",
    "sequence_shard",
    "shard_rollout",
    "sharded_policy_stats",
    "sharded_policy_stats_from_hidden",
    "stats_from_shard",
]
