"""log π(a) and the mask statistics straight from the hidden states and the LM head, never holding the logits.

Logits are made block by block, [block_rows, block_vocab] at a time, and reduced with an online
log-sum-exp by the same per-block reductions as ``policy_stats`` (``pdmask.vocab_pass``); the backward
of log π(a) makes the blocks again instead of keeping them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from pdmask.rollout import RolloutLogprobs
from pdmask.stats import PolicyStats, assemble
from pdmask.vocab_pass import Accumulators, Block, Buffers, Prepared, exactpi_pass, prepare, row_slices, shifted_sums

#: Default block of logits: rows × vocabulary ids (8 MiB of float32) ...
BLOCK_ROWS = 1024
BLOCK_VOCAB = 2048
#: ... and on CUDA (256 MiB), where each block costs ~55 launches whatever its size: 40 blocks for a
#: sweep of 16,384 positions × 151,936 ids instead of 1,200. An estimate from launch counts, not yet tuned on a GPU.
CUDA_BLOCK_ROWS = 4096
CUDA_BLOCK_VOCAB = 16384


def policy_stats_from_hidden(
    hidden: Tensor,
    weight: Tensor,
    tokens: Tensor,
    rollout: RolloutLogprobs,
    *,
    bias: Tensor | None = None,
    temperature: float = 1.0,
    need_sq_norm: bool = True,
    need_exactpi: bool = False,
    response_mask: Tensor | None = None,
    need_backbone: bool = False,
    block_rows: int | None = None,
    block_vocab: int | None = None,
    validate: bool = True,
    tp_group: ProcessGroup | None = None,
    vocab_size: int | None = None,
    reduce_hidden_grad: bool = True,
) -> PolicyStats:
    """``policy_stats(hidden @ weight.T (+ bias) / temperature, ...)`` without the [..., V] logits.

    Args:
        hidden: [..., d] hidden states (packed [N, d] or [B, T, d]), any float dtype.
        weight: [V, d] LM head, the hidden states' dtype and device; bias: [V] or None.
        tokens, rollout, need_sq_norm, need_exactpi, response_mask: as for ``policy_stats``.
        temperature: the sampling temperature the logits are divided by (> 0).
        need_backbone: also sum Wᵀπ (and with a full μ, Wᵀμ and Σ sign(π − μ)·π·w) for the backbone-aware
            ``pdm_backbone_*`` masks: one more [rows, cols] × [cols, d] product per block.
        block_rows, block_vocab: the block of logits made at once (default 1024 × 2048; 4096 × 16384 on CUDA).
        validate: as for ``policy_stats`` (``False``: shapes only, no host-device sync).
        tp_group, vocab_size: as for ``policy_stats``; ``weight`` (and ``bias``) are then this rank's rows
            [V/tp, d] of a column-parallel LM head and ``hidden`` the same on every rank.
        reduce_hidden_grad: with ``tp_group``, whether the backward all-reduces the hidden states' gradient over
            the group (True: hidden.grad equals the unsharded call's on every rank). Pass False when ``hidden``
            already went through the host's region whose backward does that sum (Megatron's
            ``copy_to_tensor_model_parallel_region``, or its sequence-parallel gather): hidden.grad is then this
            rank's share Σ_{j on this rank} G_j w_j, and summing it twice would multiply it by tp.
    Each block of logits is made in float32 (float64 for float64 inputs) from the inputs' values, so bf16
    hidden states and head give the statistics of their float32 copies without those copies: on CUDA by a
    bf16/fp16 matmul with float32 output, elsewhere from the block's operands upcast; then reduced alike.
    log π(a) is differentiable with respect to hidden, weight and bias; its backward makes the blocks again.
    Working memory is a few blocks, plus the weight gradient of one vocabulary block, plus for non-float32
    hidden states a float32 [N, d] accumulator of their gradient.
    """
    if tp_group is not None or vocab_size is not None:
        from pdmask.sharded import sharded_policy_stats_from_hidden

        return sharded_policy_stats_from_hidden(
            hidden, weight, tokens, rollout, tp_group=tp_group, vocab_size=vocab_size,
            reduce_hidden_grad=reduce_hidden_grad, bias=bias, temperature=temperature, need_sq_norm=need_sq_norm,
            need_exactpi=need_exactpi, response_mask=response_mask, need_backbone=need_backbone, block_rows=block_rows,
            block_vocab=block_vocab, validate=validate,
        )
    head = _Head.checked(hidden, weight, bias, temperature, block_rows, block_vocab)
    shape = tuple(hidden.shape[:-1])
    prep = prepare(tokens, rollout, response_mask, shape, weight.shape[0], head.dtype, "hidden states", validate)
    flat = hidden.detach().reshape(-1, hidden.shape[-1])
    acc = Accumulators.empty(prep, need_sq_norm, need_exactpi, head.weight if need_backbone else None)
    with torch.no_grad():
        bufs = head.buffers(min(head.rows, max(prep.n, 1)), need_exactpi)
        for sl in head.row_blocks(prep.n):
            _first_sweep(head, flat[sl], sl, prep, acc, bufs)
            if acc.full is not None or acc.exactpi is not None:
                # The sums that need the rows' final lse (full-μ reductions, exactpi sums), block by block again.
                acc.add_normalised_blocks(prep, head.blocks(flat, [sl], prep.set_ids, bufs), bufs, prep.full_logp)
    logp = _HiddenLogProb.apply(hidden, weight, bias, acc.set_logp[:, -1], prep.flat_tokens, acc.lse, head)
    if validate:
        acc.check_finite("hidden @ weight.T logits", logp)
    stats = assemble(prep, acc, logp)
    if stats.exactpi_sums is None and stats.has_topk:

        def second_pass() -> Tensor:
            second = head.buffers(min(head.rows, max(prep.n, 1)), True)
            return exactpi_pass(prep, acc, second, head.blocks(flat, head.row_blocks(prep.n), prep.set_ids, second))

        stats.exactpi_pass = second_pass
    return stats


@dataclass(frozen=True)
class _Head:
    """The LM head as blocks of logits z = (h @ W[v].T + b[v]) / temperature in the compute dtype."""

    weight: Tensor
    bias: Tensor | None
    temperature: float
    rows: int
    cols: int
    dtype: torch.dtype

    @staticmethod
    def checked(
        hidden: Tensor, weight: Tensor, bias: Tensor | None, temperature: float, rows: int | None, cols: int | None
    ) -> _Head:
        if not isinstance(hidden, Tensor) or not hidden.is_floating_point() or hidden.dim() < 1:
            raise TypeError("hidden must be a floating-point torch.Tensor of shape [..., d].")
        if not isinstance(weight, Tensor) or weight.dim() != 2 or weight.shape[0] < 2:
            raise ValueError(
                f"weight must be the LM head's [V, d] tensor with V >= 2, got {_shape_of(weight)}."
            )
        if weight.shape[1] != hidden.shape[-1]:
            raise ValueError(
                f"weight has shape {tuple(weight.shape)} but hidden has d = {hidden.shape[-1]}; weight must be [V, d]."
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
        dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        default_rows, default_cols = (CUDA_BLOCK_ROWS, CUDA_BLOCK_VOCAB) if hidden.is_cuda else (BLOCK_ROWS, BLOCK_VOCAB)
        return _Head(
            weight.detach(), None if bias is None else bias.detach(), float(temperature),
            rows or default_rows, min(cols or default_cols, weight.shape[0]), dtype,
        )

    def row_blocks(self, n: int) -> list[slice]:
        return row_slices(n, self.rows)

    def vocab_blocks(self) -> list[slice]:
        vocab = self.weight.shape[0]
        return [slice(s, min(s + self.cols, vocab)) for s in range(0, vocab, self.cols)]

    def buffers(self, rows: int, need_sign: bool) -> Buffers:
        bufs = Buffers.empty(rows * self.cols, self.dtype, self.weight.device, need_sign)
        if self.weight.dtype != self.dtype:
            bufs.upcast = torch.empty_like(bufs.exp)
        return bufs

    def logits(self, h: Tensor, v: slice, bufs: Buffers) -> Tensor:
        """z [rows, |v|] for the hidden states h [rows, d] and vocabulary ids v, in the compute dtype.

        Low-precision inputs give the compute dtype's logits of their values, never logits rounded to their
        dtype: on CUDA by a matmul with float32 output (``out_dtype``), elsewhere from the block's operands upcast."""
        w, b = self.weight[v], None if self.bias is None else self.bias[v]
        if bufs.upcast is None:
            z = torch.nn.functional.linear(h, w, b)
        else:
            z = Buffers.block(bufs.upcast, h.shape[0], w.shape[0])
            if h.is_cuda and MM_OUT_DTYPE:
                torch.mm(h, w.T, out_dtype=self.dtype, out=z)
            else:
                torch.mm(h.to(self.dtype), w.to(self.dtype).T, out=z)
            if b is not None:
                z += b
        return z if self.temperature == 1.0 else z.div_(self.temperature)

    def blocks(self, flat: Tensor, rows: Iterable[slice], set_ids: Tensor, bufs: Buffers) -> Iterator[Block]:
        """Every vocabulary block of the logits of each row block of flat [n, d]; set_ids [n, C] are S's ids."""
        for sl in rows:
            for v in self.vocab_blocks():
                yield sl, self.logits(flat[sl], v, bufs), _block_cols(set_ids[sl], v), v


def _block_cols(ids: Tensor, v: slice) -> Tensor:
    """Columns of ids [r, k] in the vocabulary block v; ids outside it get the spare column |v|."""
    local = ids - v.start
    width = v.stop - v.start
    return torch.where((local >= 0) & (local < width), local, width)


def _first_sweep(head: _Head, h: Tensor, sl: slice, prep: Prepared, acc: Accumulators, bufs: Buffers) -> None:
    """lse, log π at S, π_R, Q (and Σ_{j∉S} π_j w_j) of rows sl by an online log-sum-exp over the vocabulary blocks."""
    acc.finish_rows(sl, *sweep_sums(head, h, prep.set_ids[sl], acc, bufs))


def sweep_sums(
    head: _Head, h: Tensor, set_ids: Tensor, acc: Accumulators, bufs: Buffers
) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor, Tensor | None]:
    """(m, Σ e, Σ_{j∉S} e, Σ_{j∉S} e² (if ``acc`` keeps Q), z at S [r, C] (0 at ids outside the head),
    Σ_{j∉S} e_j w_j [r, d] (if ``acc`` has a head)) of the hidden states h [r, d] with e = exp(z − m), m the
    rows' max, by an online log-sum-exp over the vocabulary blocks; set_ids [r, C] are S's ids."""
    r = h.shape[0]
    m = torch.full((r,), -torch.inf, dtype=head.dtype, device=h.device)
    total, rest = torch.zeros_like(m), torch.zeros_like(m)
    tail_sq = torch.zeros_like(m) if acc.tail_sq is not None else None
    head_tail = None if acc.head is None else torch.zeros(r, h.shape[1], dtype=head.dtype, device=h.device)
    set_z = torch.zeros(set_ids.shape, dtype=head.dtype, device=h.device)
    for v in head.vocab_blocks():
        z = head.logits(h, v, bufs)
        cols = _block_cols(set_ids, v)
        width = z.shape[1]
        set_z = torch.where(cols < width, z.gather(-1, cols.clamp(max=width - 1)), set_z)
        m_new = torch.maximum(m, z.amax(-1))
        shift = torch.where(m_new > -torch.inf, m_new, 0.0)  # rows that are all -inf so far sum to 0
        scale = (m - shift).exp()
        block_total, block_rest, block_sq = shifted_sums(z, shift, cols, bufs, tail_sq is not None)
        total = total * scale + block_total
        rest = rest * scale + block_rest
        if tail_sq is not None and block_sq is not None:
            tail_sq = tail_sq * scale.square() + block_sq
        block_head = acc.tail_product(bufs, r, width, v)
        if head_tail is not None and block_head is not None:
            head_tail = head_tail * scale[:, None] + block_head
        m = m_new
    return m, total, rest, tail_sq, set_z, head_tail


class _HiddenLogProb(torch.autograd.Function):
    """log π(a) [N] (computed by the sweep) with a backward that makes the logit blocks again.

    With z = (h Wᵀ + b)/t, ∂ log π(a)/∂(h Wᵀ + b) = (e_a − π)/t, so for upstream g [N]:
    ∂h = G W, ∂W = Gᵀ h, ∂b = Σ_n G_n with G = g·(e_a − π)/t [N, V], one block at a time.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, hidden: Tensor, weight: Tensor, bias: Tensor | None, logp: Tensor, tokens: Tensor, lse: Tensor, head: _Head
    ) -> Tensor:
        ctx.save_for_backward(hidden, tokens, lse)
        ctx.head = head
        return logp.clone()

    @staticmethod
    def backward(ctx, grad_out: Tensor):  # type: ignore[override]
        hidden, tokens, lse = ctx.saved_tensors
        head: _Head = ctx.head
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        flat = hidden.reshape(-1, hidden.shape[-1])
        g = grad_out.to(head.dtype) / head.temperature
        weight = head.weight
        # Non-float32 hidden gradients accumulate over the vocabulary blocks in float32, not in their dtype.
        grad_h = torch.zeros(flat.shape, dtype=_wider(hidden.dtype), device=flat.device) if need_h else None
        grad_w = torch.empty_like(weight) if need_w else None
        grad_b = torch.empty_like(head.bias) if need_b and head.bias is not None else None
        bufs = head.buffers(min(head.rows, max(flat.shape[0], 1)), False)
        for v in head.vocab_blocks():
            width = v.stop - v.start
            gw = torch.zeros(width, weight.shape[1], dtype=_wider(weight.dtype), device=weight.device) if need_w else None
            gb = torch.zeros(width, dtype=head.dtype, device=weight.device) if grad_b is not None else None
            for sl in head.row_blocks(flat.shape[0]):
                z = head.logits(flat[sl], v, bufs)
                r = z.shape[0]
                gz = torch.sub(z, lse[sl, None], out=Buffers.block(bufs.exp, r, width)).exp_().mul_(-g[sl, None])
                cols = _block_cols(tokens[sl, None], v).squeeze(-1)
                at_a = torch.where(cols < width, torch.arange(r, device=z.device) * width + cols, r * width)
                bufs.exp.index_add_(0, at_a, g[sl])  # + g at a, when a is in this block
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
        dh = None if grad_h is None else grad_h.to(hidden.dtype).reshape(hidden.shape)
        return dh, grad_w, grad_b, None, None, None, None


def _add_product(out: Tensor, g: Tensor, x: Tensor) -> None:
    """out += g @ x for g in out's dtype and x in the inputs' dtype, without rounding the product to x's dtype
    (summing per-block products rounded to bf16 biases the gradient)."""
    if x.dtype == out.dtype:
        out.addmm_(g, x)
    elif x.is_cuda and MM_OUT_DTYPE:
        torch.addmm(out, g.to(x.dtype), x, out_dtype=out.dtype, out=out)
    else:
        out.addmm_(g, x.to(out.dtype))


#: Whether this torch has the matmuls with a wider output dtype (``aten::mm.dtype_out``, ``aten::addmm.dtype_out``,
#: CUDA kernels only); without them the operands are upcast instead.
MM_OUT_DTYPE = "dtype_out" in torch.ops.aten.mm.overloads() and "dtype_out" in torch.ops.aten.addmm.overloads()


def _wider(dtype: torch.dtype) -> torch.dtype:
    return dtype if dtype == torch.float64 else torch.float32


def _shape_of(x: object) -> str:
    return f"shape {tuple(x.shape)}" if isinstance(x, Tensor) else type(x).__name__


__all__ = ["BLOCK_ROWS", "BLOCK_VOCAB", "CUDA_BLOCK_ROWS", "CUDA_BLOCK_VOCAB", "policy_stats_from_hidden"]
