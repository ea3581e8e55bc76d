"""Triton kernels of ``pdmask.triton_pass`` (imported only when they run: Triton is an optional dependency).

One program per position (row of the logits), stepping over its vocabulary BLOCK ids at a time, in float32.
Built to stay memory-bound on an H100 (≤ 12 SASS instructions per logit element in each loop over the
vocabulary; ``pdmask bench --part compiled`` counts them):

- exponentials as one FFMA and ``exp2`` (``tl.fma(z, log₂e, −shift·log₂e)``, fused whatever Triton's FP-fusion
  default; ``tl.exp`` costs ~6 instructions);
- S's ids zeroed only in the blocks that hold them: the ids are visited in increasing order, and a block
  below the next one pays one scalar compare instead of C compares per element;
- per-lane accumulators (one reduction at the end of the row instead of one per block); the sum over the
  whole vocabulary is the tail plus S's own terms, added at the end: no subtraction, so the tail mass
  keeps its precision on rows where S holds nearly all of π;
- full blocks unmasked, the last partial block peeled off with a masked load;
- ``while`` loops over the blocks (Triton 3.6's interpreter fails on ``range`` of a runtime bound under numpy ≥ 2.4).
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
#: Above every vocabulary id: "no further id of S".
NONE = tl.constexpr(2147483647)


@triton.jit
def _next_id(ids, after):
    """The smallest id of S above ``after`` (NONE when there is none); ids [CP] int32."""
    return tl.min(tl.where(ids > after, ids, NONE), 0)


@triton.jit
def _off_set(x, cols, end, nxt, ids):
    """(x with S's ids among ``cols`` zeroed, the next id of S at or past ``end``): one compare when none is below end."""
    while nxt < end:
        x = tl.where(cols == nxt, 0.0, x)
        nxt = _next_id(ids, nxt)
    return x, nxt


@triton.jit
def _load(z_row, cols, V, LAST: tl.constexpr):
    """A block of logits in float32; only the last, partial block is masked (−inf past V)."""
    if LAST:
        return tl.load(z_row + cols, mask=cols < V, other=-float("inf")).to(tl.float32)
    return tl.load(z_row + cols).to(tl.float32)


@triton.jit
def _row_ids(ids_ptr, row, C: tl.constexpr, CP: tl.constexpr):
    """The row's C ids of S as int32 [CP] (CP = C rounded up to a power of two, padded with NONE)."""
    c = tl.arange(0, CP)
    return tl.load(ids_ptr + row * C + c, mask=c < C, other=NONE).to(tl.int32)


@triton.jit
def _sums_step(z_row, start, V, m, rest, sq, nxt, ids, BLOCK: tl.constexpr, NEED_SQ: tl.constexpr, LAST: tl.constexpr):
    """One block of the first read: running max m, and per lane Σ_{∉S} e^{z−m} and Σ_{∉S} e^{2(z−m)}."""
    cols = start + tl.arange(0, BLOCK)
    z = _load(z_row, cols, V, LAST)
    m_new = tl.maximum(m, tl.max(z, 0))
    shift = tl.where(m_new > -float("inf"), m_new, 0.0) * LOG2E  # a row that is all −inf so far sums to 0
    scale = tl.exp2(tl.fma(m, LOG2E, -shift))
    e, nxt = _off_set(tl.exp2(tl.fma(z, LOG2E, -shift)), cols, start + BLOCK, nxt, ids)
    rest = tl.fma(rest, scale, e)
    if NEED_SQ:
        sq = tl.fma(e, e, sq * (scale * scale))
    return m_new, rest, sq, nxt


@triton.jit
def _signed_step(z_row, start, V, lse2, u, sp1, sp2, nxt, ids, BLOCK: tl.constexpr, LAST: tl.constexpr):
    """One block of the second read: per lane Σ_{∉S} s π and Σ_{∉S} s π², s = sign(π − u)."""
    cols = start + tl.arange(0, BLOCK)
    p = tl.exp2(tl.fma(_load(z_row, cols, V, LAST), LOG2E, -lse2))
    sp = tl.where(p > u, p, tl.where(p < u, -p, 0.0))
    sp, nxt = _off_set(sp, cols, start + BLOCK, nxt, ids)
    return sp1 + sp, tl.fma(sp, p, sp2), nxt


@triton.jit
def stats_kernel(
    z_ptr, row_stride, ids_ptr, u_ptr, out_ptr, n, V,
    C: tl.constexpr, CP: tl.constexpr, BLOCK: tl.constexpr, NEED_SQ: tl.constexpr, NEED_EXACTPI: tl.constexpr,
):
    """out[:, row] = (lse, π_R, Q, Σ_{j∉S} s_j π_j, Σ_{j∉S} s_j π_j²) of one row: one read of the logits for the
    first three (online log-sum-exp with the tail sums rescaled alike), a second for the last two."""
    row = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + row * row_stride
    ids = _row_ids(ids_ptr, row, C, CP)
    full = V // BLOCK * BLOCK  # the ids in full blocks
    # −inf as a block's max: with tl.full([], ...) instead ptxas took 72 and 95 registers, not 64 and 80 (Triton 3.9).
    m = tl.max(tl.full([BLOCK], -float("inf"), tl.float32), 0)
    rest = tl.zeros([BLOCK], tl.float32)
    sq = tl.zeros([BLOCK], tl.float32)
    nxt = _next_id(ids, -1)
    start = 0
    while start < full:
        m, rest, sq, nxt = _sums_step(z_row, start, V, m, rest, sq, nxt, ids, BLOCK, NEED_SQ, False)
        start += BLOCK
    if full < V:
        m, rest, sq, nxt = _sums_step(z_row, full, V, m, rest, sq, nxt, ids, BLOCK, NEED_SQ, True)
    # Σ over the whole row = the tail + S's distinct ids, each read once.
    shift = tl.where(m > -float("inf"), m, 0.0) * LOG2E
    in_set = tl.zeros([], tl.float32)
    nxt = _next_id(ids, -1)
    while nxt < V:
        in_set += tl.exp2(tl.fma(tl.load(z_row + nxt).to(tl.float32), LOG2E, -shift))
        nxt = _next_id(ids, nxt)
    tail = tl.sum(rest, 0)
    total = tail + in_set
    lse = m + tl.log(total)
    tl.store(out_ptr + row, lse)
    tl.store(out_ptr + n + row, tail / total)
    tl.store(out_ptr + 2 * n + row, tl.sum(sq, 0) / (total * total))  # 0 unless NEED_SQ
    sp1 = tl.zeros([BLOCK], tl.float32)
    sp2 = tl.zeros([BLOCK], tl.float32)
    if NEED_EXACTPI:
        u = tl.load(u_ptr + row)
        lse2 = lse * LOG2E
        nxt = _next_id(ids, -1)
        start = 0
        while start < full:
            sp1, sp2, nxt = _signed_step(z_row, start, V, lse2, u, sp1, sp2, nxt, ids, BLOCK, False)
            start += BLOCK
        if full < V:
            sp1, sp2, nxt = _signed_step(z_row, full, V, lse2, u, sp1, sp2, nxt, ids, BLOCK, True)
    tl.store(out_ptr + 3 * n + row, tl.sum(sp1, 0))
    tl.store(out_ptr + 4 * n + row, tl.sum(sp2, 0))


@triton.jit
def _grad_step(z_row, out_row, start, V, a, g, lse2, BLOCK: tl.constexpr, LAST: tl.constexpr):
    """One block of g·(e_a − exp(z − lse)); only the block that holds a adds g at a."""
    cols = start + tl.arange(0, BLOCK)
    grad = -g * tl.exp2(tl.fma(_load(z_row, cols, V, LAST), LOG2E, -lse2))
    if (a >= start) & (a < start + BLOCK):
        grad = tl.where(cols == a, grad + g, grad)
    grad = grad.to(out_row.dtype.element_ty)
    if LAST:
        tl.store(out_row + cols, grad, mask=cols < V)
    else:
        tl.store(out_row + cols, grad)


@triton.jit
def logprob_grad_kernel(z_ptr, row_stride, tok_ptr, lse_ptr, g_ptr, out_ptr, V, BLOCK: tl.constexpr):
    """out[row] = g·(e_a − exp(z − lse)) in out's dtype: one read of the row's logits and one write."""
    row = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + row * row_stride
    out_row = out_ptr + row * V
    a = tl.load(tok_ptr + row).to(tl.int32)
    lse2 = tl.load(lse_ptr + row) * LOG2E
    g = tl.load(g_ptr + row)
    full = V // BLOCK * BLOCK  # the ids in full blocks
    start = 0
    while start < full:
        _grad_step(z_row, out_row, start, V, a, g, lse2, BLOCK, False)
        start += BLOCK
    if full < V:
        _grad_step(z_row, out_row, full, V, a, g, lse2, BLOCK, True)
