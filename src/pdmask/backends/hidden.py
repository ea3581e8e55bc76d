"""The hidden-state backend: blocks of logits z = (h Wᵀ + b)/t made from the hidden states and this rank's LM
head rows, [block_rows, block_vocab] at a time, never the [..., V] logits; the first sweep is an online
log-sum-exp over the vocabulary blocks, and the backward of log π(a) makes the blocks again."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from pdmask.backends.accumulators import Accumulators, Partial
from pdmask.backends.inputs import Prepared, compute_dtype
from pdmask.backends.shard import VocabShard
from pdmask.backends.sums import Block, Buffers, block_cols, logprob_grad, set_logits, shifted_sums
from pdmask.rows import row_slices

#: Default block of logits: rows × vocabulary ids (8 MiB of float32) ...
BLOCK_ROWS = 1024
BLOCK_VOCAB = 2048
#: ... and on CUDA (256 MiB), where each block costs ~55 launches whatever its size: 40 blocks for a
#: sweep of 16,384 positions × 151,936 ids instead of 1,200. An estimate from launch counts, not yet tuned on a GPU.
CUDA_BLOCK_ROWS = 4096
CUDA_BLOCK_VOCAB = 16384


class WideMatmul:
    """A matmul of bf16/fp16 operands with a float32 output (``out_dtype=``, CUDA kernels only), used while it
    works: the first call that raises (a torch without it for these operands, e.g. ``addmm`` with a float32
    ``self`` in torch 2.11) switches, once for the process, to the operands upcast instead."""

    def __init__(self, overload: str, devices: tuple[str, ...] = ("cuda",)) -> None:
        self.works: bool | None = None if overload in getattr(torch.ops.aten, overload.split(".")[0]).overloads() else False
        self.devices = devices

    def __call__(self, device: torch.device, wide: Callable[[], object], upcast: Callable[[], object]) -> None:
        if device.type not in self.devices or self.works is False:
            upcast()
            return
        if self.works:
            wide()
            return
        try:
            wide()
        except (TypeError, RuntimeError):
            self.works = False
            upcast()
            return
        self.works = True


MM = WideMatmul("mm.dtype_out")
ADDMM = WideMatmul("addmm.dtype_out")


@dataclass(frozen=True)
class HiddenBlocks:
    """The LM head (this rank's real rows) as blocks of logits z = (h @ W[v].T + b[v]) / temperature in the
    compute dtype, for the hidden states flat [n, d]."""

    flat: Tensor
    weight: Tensor
    bias: Tensor | None
    temperature: float
    rows: int
    cols: int
    dtype: torch.dtype
    local_ids: Tensor  # S's ids as this rank's columns [n, C], -1 for ids it does not hold
    a_cols: Tensor  # a as this rank's column [n], -1 where it does not hold a
    need_backbone: bool
    #: What log π(a) is differentiable in: hidden [..., d] (on several ranks, summing its gradient over them
    #: when asked), this rank's weight rows [real, d] and bias [real].
    grad_inputs: tuple[Tensor, Tensor, Tensor | None]
    source = "hidden @ weight.T logits"

    @staticmethod
    def checked(
        hidden: Tensor, weight: Tensor, bias: Tensor | None, temperature: float, rows: int | None, cols: int | None,
        vocab: str = "V",
    ) -> tuple[float, int, int]:
        """(temperature, block rows, block vocabulary) once the arguments are checked against hidden [..., d]; ``vocab``
        names weight's rows in errors ("V", or "V/tp" for this rank's rows under tensor parallelism)."""
        if not isinstance(hidden, Tensor) or not hidden.is_floating_point() or hidden.dim() < 1:
            raise TypeError("hidden must be a floating-point torch.Tensor of shape [..., d].")
        if not isinstance(weight, Tensor) or weight.dim() != 2 or weight.shape[0] < 2:
            raise ValueError(f"weight must be the LM head's [{vocab}, d] tensor with {vocab} >= 2, got {_shape_of(weight)}.")
        if weight.shape[1] != hidden.shape[-1]:
            raise ValueError(
                f"weight has shape {tuple(weight.shape)} but hidden has d = {hidden.shape[-1]}; weight must be [{vocab}, d]."
            )
        for name, x, want in (("weight", weight, (weight.shape[0], hidden.shape[-1])), ("bias", bias, (weight.shape[0],))):
            if x is None:
                continue
            if not isinstance(x, Tensor) or tuple(x.shape) != want:
                raise ValueError(f"{name} must be a tensor of shape {want}, got {_shape_of(x)}.")
            if x.dtype != hidden.dtype:
                raise TypeError(
                    f"{name} has dtype {x.dtype} but hidden has {hidden.dtype}; pass them in one dtype "
                    f"(e.g. hidden.to({name}.dtype))."
                )
            if x.device != hidden.device:
                raise ValueError(f"{name} is on {x.device} but hidden is on {hidden.device}; put them on one device.")
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not (
            math.isfinite(temperature) and temperature > 0
        ):
            raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}.")
        for name, value in (("block_rows", rows), ("block_vocab", cols)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be a positive int or None, got {value!r}.")
        default_rows, default_cols = (CUDA_BLOCK_ROWS, CUDA_BLOCK_VOCAB) if hidden.is_cuda else (BLOCK_ROWS, BLOCK_VOCAB)
        return float(temperature), rows or default_rows, cols or default_cols

    @staticmethod
    def of(
        hidden: Tensor, weight: Tensor, bias: Tensor | None, temperature: float, rows: int, cols: int,
        prep: Prepared, shard: VocabShard, need_backbone: bool, reduce_hidden_grad: bool,
    ) -> HiddenBlocks:
        """The backend of ``hidden`` with this rank's real rows of ``weight`` and ``bias`` (as ``checked`` them)."""
        real = slice(0, shard.real)
        rows_of = lambda x: None if x is None else x[real]
        source = SumGradOverRanks.apply(hidden, shard) if reduce_hidden_grad and shard.group is not None else hidden
        return HiddenBlocks(
            hidden.detach().reshape(-1, hidden.shape[-1]), weight.detach()[real], rows_of(None if bias is None else bias.detach()),
            temperature, rows, min(cols, shard.real), prep.dtype, shard.local(prep.set_ids, -1),
            shard.local(prep.flat_tokens, -1), need_backbone, (source, weight[real], rows_of(bias)),
        )

    @property
    def head_weight(self) -> Tensor | None:
        return self.weight if self.need_backbone else None

    def row_blocks(self) -> list[slice]:
        return row_slices(self.flat.shape[0], self.rows)

    def vocab_blocks(self) -> list[slice]:
        vocab = self.weight.shape[0]
        return [slice(s, min(s + self.cols, vocab)) for s in range(0, vocab, self.cols)]

    def buffers(self, need_sign: bool) -> Buffers:
        size = min(self.rows, max(self.flat.shape[0], 1)) * self.cols
        return Buffers(size, self.dtype, self.weight.device, need_sign, self.weight.dtype != self.dtype)

    def logits(self, h: Tensor, v: slice, bufs: Buffers) -> Tensor:
        """z [rows, |v|] for the hidden states h [rows, d] and vocabulary ids v, in the compute dtype.

        Low-precision inputs give the compute dtype's logits of their values, never logits rounded to their
        dtype: on CUDA by a matmul with float32 output (``MM``), elsewhere from the block's operands upcast."""
        w, b = self.weight[v], None if self.bias is None else self.bias[v]
        if bufs.upcast is None:
            z = torch.nn.functional.linear(h, w, b)
        else:
            z = Buffers.block(bufs.upcast, h.shape[0], w.shape[0])
            MM(h.device, lambda: torch.mm(h, w.T, out_dtype=self.dtype, out=z),
               lambda: torch.mm(h.to(self.dtype), w.to(self.dtype).T, out=z))  # fmt: skip
            if b is not None:
                z += b
        return z if self.temperature == 1.0 else z.div_(self.temperature)

    def blocks(self, bufs: Buffers, rows: Iterable[slice] | None = None) -> Iterator[Block]:
        """Every vocabulary block of the logits of each row block."""
        for sl in self.row_blocks() if rows is None else rows:
            for v in self.vocab_blocks():
                yield sl, self.logits(self.flat[sl], v, bufs), block_cols(self.local_ids[sl], v), v

    def sweep(self, part: Partial, acc: Accumulators, bufs: Buffers) -> None:
        """Per row block: m, Σ e, Σ_{j∉S} e, Σ_{j∉S} e², z at S (0 at ids elsewhere) and Σ_{j∉S} e_j w_j relative
        to the rows' max m, by an online log-sum-exp over the vocabulary blocks."""
        for sl in self.row_blocks():
            r = sl.stop - sl.start
            m = torch.full((r,), -torch.inf, dtype=self.dtype, device=self.flat.device)
            total, rest = torch.zeros_like(m), torch.zeros_like(m)
            tail_sq = torch.zeros_like(m) if part.tail_sq is not None else None
            head_tail = None if acc.head is None else torch.zeros(r, self.flat.shape[1], dtype=self.dtype, device=m.device)
            set_z = torch.zeros(self.local_ids[sl].shape, dtype=self.dtype, device=m.device)
            for _, z, cols, v in self.blocks(bufs, [sl]):
                set_z = torch.where(cols < z.shape[1], set_logits(z, cols), set_z)
                m_new = torch.maximum(m, z.amax(-1))
                shift = torch.where(m_new > -torch.inf, m_new, 0.0)  # rows that are all -inf so far sum to 0
                scale = (m - shift).exp()
                block_total, block_rest, block_sq = shifted_sums(z, shift, cols, bufs, tail_sq is not None)
                total = total * scale + block_total
                rest = rest * scale + block_rest
                if tail_sq is not None and block_sq is not None:
                    tail_sq = tail_sq * scale.square() + block_sq
                block_head = acc.tail_product(bufs, *z.shape, v)
                if head_tail is not None and block_head is not None:
                    head_tail = head_tail * scale[:, None] + block_head
                m = m_new
            part.store(sl, m, total, rest, tail_sq, set_z, head_tail)

    def log_prob(self, acc: Accumulators) -> Tensor:
        return HiddenLogProb.apply(*self.grad_inputs, acc.set_logp[:, -1], self.a_cols, acc.lse, self)


class HiddenLogProb(torch.autograd.Function):
    """log π(a) [N] (computed by the sweep) with a backward that makes the logit blocks again.

    With z = (h Wᵀ + b)/t, ∂ log π(a)/∂(h Wᵀ + b) = (e_a − π)/t, so for upstream g [N]:
    ∂h = G W, ∂W = Gᵀ h, ∂b = Σ_n G_n with G = g·(e_a − π)/t [N, V], one block at a time.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, hidden: Tensor, weight: Tensor, bias: Tensor | None, logp: Tensor, a_cols: Tensor, lse: Tensor,
        head: HiddenBlocks,
    ) -> Tensor:
        ctx.save_for_backward(a_cols, lse)
        ctx.head, ctx.hidden_shape, ctx.hidden_dtype = head, hidden.shape, hidden.dtype
        return logp.clone()

    @staticmethod
    def backward(ctx, grad_out: Tensor):  # type: ignore[override]
        a_cols, lse = ctx.saved_tensors
        head: HiddenBlocks = ctx.head
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        flat, weight = head.flat, head.weight
        g = grad_out.to(head.dtype) / head.temperature
        # Non-float32 hidden gradients accumulate over the vocabulary blocks in float32, not in their dtype.
        grad_h = torch.zeros(flat.shape, dtype=compute_dtype(flat.dtype), device=flat.device) if need_h else None
        grad_w = torch.empty_like(weight) if need_w else None
        grad_b = torch.empty_like(head.bias) if need_b and head.bias is not None else None
        bufs = head.buffers(False)
        for v in head.vocab_blocks():
            width = v.stop - v.start
            gw = torch.zeros(width, weight.shape[1], dtype=compute_dtype(weight.dtype), device=weight.device) if need_w else None
            gb = torch.zeros(width, dtype=head.dtype, device=weight.device) if grad_b is not None else None
            for sl in head.row_blocks():
                z = head.logits(flat[sl], v, bufs)
                gz = logprob_grad(z, lse[sl], g[sl], block_cols(a_cols[sl, None], v).squeeze(-1), bufs.exp)
                if grad_h is not None:
                    _add_product(grad_h[sl], gz, weight[v])
                if gw is not None:
                    _add_product(gw, gz.T, flat[sl])
                if gb is not None:
                    gb += gz.sum(0)
            if grad_w is not None and gw is not None:
                grad_w[v] = gw
            if grad_b is not None and gb is not None:
                grad_b[v] = gb
        dh = None if grad_h is None else grad_h.to(ctx.hidden_dtype).reshape(ctx.hidden_shape)
        return dh, grad_w, grad_b, None, None, None, None


class SumGradOverRanks(torch.autograd.Function):
    """Identity forward; backward all-reduces the gradient over the shard's group (Megatron's
    ``copy_to_tensor_model_parallel_region``), so that the hidden states get Σ_r ∂h_r as the unsharded call gives."""

    @staticmethod
    def forward(ctx, x: Tensor, shard: VocabShard) -> Tensor:  # type: ignore[override]
        ctx.shard = shard
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        return ctx.shard.all_reduce(grad.contiguous().clone()), None


def _add_product(out: Tensor, g: Tensor, x: Tensor) -> None:
    """out += g @ x for g in out's dtype and x in the inputs' dtype, without rounding the product to x's dtype
    (summing per-block products rounded to bf16 biases the gradient)."""
    if x.dtype == out.dtype:
        out.addmm_(g, x)
    else:
        ADDMM(x.device, lambda: torch.addmm(out, g.to(x.dtype), x, out_dtype=out.dtype, out=out),
              lambda: out.addmm_(g, x.to(out.dtype)))  # fmt: skip


def _shape_of(x: object) -> str:
    return f"shape {tuple(x.shape)}" if isinstance(x, Tensor) else type(x).__name__


__all__ = ["ADDMM", "BLOCK_ROWS", "BLOCK_VOCAB", "CUDA_BLOCK_ROWS", "CUDA_BLOCK_VOCAB", "MM", "HiddenBlocks", "WideMatmul"]
