"""The dense backend: materialised logits [..., V] (or this rank's shard [..., V/tp]) by chunks of positions,
each chunk spanning the vocabulary; the backward of log π(a) reads the logits again, a chunk at a time."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

from pdmask.backends.accumulators import Accumulators, Partial
from pdmask.backends.inputs import Prepared
from pdmask.backends.shard import VocabShard
from pdmask.backends.sums import Block, Buffers, logprob_grad, set_logits, shifted_sums

#: Default budget for the float32 temporaries of one chunk, as a fraction of the logits' size ...
CHUNK_FRACTION = 0.04
#: ... but never less than this (small inputs go in one chunk) nor more than the cap (tuned on the CPU,
#: where a chunk that stays in cache is faster).
CHUNK_MIN_BYTES = 1 << 20
CHUNK_MAX_BYTES = 64 << 20
#: On CUDA each chunk costs the same ~25 kernel launches whatever its size, so the torch pass takes bigger
#: chunks there: up to a quarter of the logits' size, at most 2 GiB (16 chunks for 16,384 × 151,936 bf16 logits).
#: An estimate from launch counts, not yet tuned on a GPU (scripts/gpu_check.sh measures it).
CUDA_CHUNK_FRACTION = 0.25
CUDA_CHUNK_MAX_BYTES = 2 << 30


def default_chunk(logits: Tensor, dtype: torch.dtype, temporaries: int) -> int:
    """Rows per chunk of [..., V] logits whose ``temporaries`` [rows, V] copies in ``dtype`` fit the budget."""
    return chunk_rows(logits.numel() * logits.element_size(), logits.shape[-1], dtype, temporaries, logits.device.type)


def chunk_rows(logit_bytes: int, vocab: int, dtype: torch.dtype, temporaries: int, device_type: str) -> int:
    """``default_chunk`` for logits of ``logit_bytes`` bytes and V = ``vocab`` on a device of ``device_type``."""
    fraction, cap = (CUDA_CHUNK_FRACTION, CUDA_CHUNK_MAX_BYTES) if device_type == "cuda" else (CHUNK_FRACTION, CHUNK_MAX_BYTES)
    budget = min(max(fraction * logit_bytes, CHUNK_MIN_BYTES), cap)
    # Temporaries of the compute dtype per row: the upcast logits, their exponentials (and the signs).
    per_row = temporaries * vocab * torch.finfo(dtype).bits // 8
    return max(1, int(budget // per_row))


class DenseLogits:
    """Chunks of ``rows`` positions × this rank's real vocabulary columns of the logits."""

    source = "logits"

    def __init__(
        self, logits: Tensor, prep: Prepared, shard: VocabShard, rows: int | None, need_exactpi: bool,
        head_weight: Tensor | None,
    ) -> None:
        self.logits, self.prep, self.shard, self.dtype = logits, prep, shard, prep.dtype
        self.rows = rows or default_chunk(logits, self.dtype, 3 if need_exactpi else 2)
        # Cast once: every chunk spans the whole shard.
        self.head_weight = None if head_weight is None else head_weight.detach()[: shard.real].to(self.dtype)
        self.cols = shard.local(prep.set_ids, shard.real)

    def buffers(self, need_sign: bool) -> Buffers:
        size = min(self.rows, max(self.prep.n, 1)) * self.shard.real
        return Buffers(size, self.dtype, self.logits.device, need_sign, self.logits.dtype != self.dtype)

    def blocks(self, bufs: Buffers) -> Iterator[Block]:
        vocab = slice(0, self.shard.real)
        for sl, chunk in row_chunks(self.logits.detach(), self.rows):
            yield sl, bufs.upcast_of(chunk[:, vocab]), self.cols[sl], vocab

    def sweep(self, part: Partial, acc: Accumulators, bufs: Buffers) -> None:
        for sl, z, cols, vocab in self.blocks(bufs):
            m = z.amax(-1)
            sums = shifted_sums(z, torch.where(torch.isneginf(m), 0.0, m), cols, bufs, part.tail_sq is not None)
            part.store(sl, m, *sums, set_logits(z, cols), acc.tail_product(bufs, *z.shape, vocab))

    def log_prob(self, acc: Accumulators) -> Tensor:
        a_cols = self.shard.local(self.prep.flat_tokens, self.shard.real)
        return LogitsLogProb.apply(self.logits, a_cols, acc.lse, acc.set_logp[:, -1], self.rows, self.shard.real)


def row_chunks(logits: Tensor, rows: int) -> Iterator[tuple[slice, Tensor]]:
    """Yields (slice of flat positions, [rows, V] view) without copying non-contiguous logits."""
    vocab = logits.shape[-1]
    try:
        flat = logits.view(-1, vocab)
    except RuntimeError:
        # e.g. logits[:, :-1] of a [B, T+1, V] tensor: each leading index is still a contiguous block.
        per = logits[0].numel() // vocab if logits.dim() > 1 else 1
        for i in range(logits.shape[0]):
            for sl, chunk in row_chunks(logits[i], rows):
                yield slice(i * per + sl.start, i * per + sl.stop), chunk
        return
    for start in range(0, flat.shape[0], rows):
        stop = min(start + rows, flat.shape[0])
        yield slice(start, stop), flat[start:stop]


class LogitsLogProb(torch.autograd.Function):
    """log π(a) [N] (from the pass) whose backward puts g·(1[a here]·e_a − π) into this rank's logits (0 at padded
    columns), a chunk of rows at a time, with no [N, V] float32 copy and no collective (as Megatron's cross entropy)."""

    @staticmethod
    def forward(ctx, logits: Tensor, a_cols: Tensor, lse: Tensor, logp: Tensor, rows: int, real: int) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(logits, a_cols, lse)
        ctx.rows, ctx.real = rows, real
        return logp.clone()

    @staticmethod
    def backward(ctx, grad_out: Tensor):  # type: ignore[override]
        logits, a_cols, lse = ctx.saved_tensors
        width = logits.shape[-1]
        grad = (torch.empty if ctx.real == width else torch.zeros)(logits.shape, dtype=logits.dtype, device=logits.device)
        flat_grad = grad.view(-1, width)
        buf = torch.empty(min(ctx.rows, lse.numel()) * ctx.real + 1, dtype=lse.dtype, device=logits.device)
        for sl, chunk in row_chunks(logits.detach(), ctx.rows):
            flat_grad[sl, : ctx.real] = logprob_grad(chunk[:, : ctx.real], lse[sl], grad_out[sl].to(lse.dtype), a_cols[sl], buf)
        return grad, None, None, None, None, None


__all__ = [
    "CHUNK_FRACTION",
    "CHUNK_MAX_BYTES",
    "CHUNK_MIN_BYTES",
    "CUDA_CHUNK_FRACTION",
    "CUDA_CHUNK_MAX_BYTES",
    "DenseLogits",
    "LogitsLogProb",
    "chunk_rows",
    "default_chunk",
    "row_chunks",
]
