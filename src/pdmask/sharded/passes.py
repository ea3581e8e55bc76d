"""The sharded passes: ``policy_stats`` on a logits shard, ``policy_stats_from_hidden`` on the LM head's rows."""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import Tensor

from pdmask.hidden import _Head, _HiddenLogProb, sweep_sums
from pdmask.rollout import RolloutLogprobs
from pdmask.sharded.shard import (
    VocabShard,
    _accumulators,
    _lazy_exactpi,
    _Partial,
    _prepare,
    _reduce_normalised,
    _signature,
    agreed,
    shard_of,
)
from pdmask.stats import PolicyStats, assemble, check_chunk_size, check_head_weight
from pdmask.vocab_pass import (
    Block,
    Buffers,
    Prepared,
    default_chunk,
    exactpi_pass,
    shifted_sums,
)


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
    validate: bool,
) -> PolicyStats:
    """``pdmask.policy_stats`` on this rank's logits shard [..., w] (see there and the module's docstring)."""

    def check() -> tuple[VocabShard, Prepared, torch.dtype]:
        shard = shard_of(logits, tp_group, vocab_size)
        dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
        prep = _prepare(shard, tokens, rollout, response_mask, tuple(logits.shape[:-1]), dtype, "logits", validate)
        check_chunk_size(chunk_size)
        check_head_weight(head_weight, shard.width, logits.device, rows="V/tp")
        return shard, prep, dtype

    d = None if not isinstance(head_weight, Tensor) or head_weight.dim() != 2 else head_weight.shape[1]
    shard, prep, dtype = agreed(tp_group, check, lambda r: _signature(r[0], r[1], need_sq_norm, need_exactpi, d, r[2]), logits)
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
        if validate:  # log π(a), before its autograd node; the values are the same on every rank
            acc.check_finite("logits", acc.set_logp[:, -1])
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
    validate: bool,
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
        prep = _prepare(shard, tokens, rollout, response_mask, tuple(hidden.shape[:-1]), head.dtype, "hidden states", validate)
        return shard, head, prep

    d = hidden.shape[-1] if need_backbone and isinstance(hidden, Tensor) else None
    shard, head, prep = agreed(tp_group, check, lambda r: _signature(r[0], r[2], need_sq_norm, need_exactpi, d, r[1].dtype), hidden)
    flat = hidden.detach().reshape(-1, hidden.shape[-1])
    acc = _accumulators(prep, shard, need_sq_norm, need_exactpi, head.weight if need_backbone else None)
    local_ids = shard.local(prep.set_ids, -1)
    with torch.no_grad():
        bufs = head.buffers(min(head.rows, max(prep.n, 1)), need_exactpi)
        part = _Partial.empty(acc)
        for sl in head.row_blocks(prep.n):
            part.store(sl, *sweep_sums(head, flat[sl], local_ids[sl], acc, bufs))
        part.combine(shard, acc)
        if validate:
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


__all__ = ["sharded_policy_stats", "sharded_policy_stats_from_hidden"]
