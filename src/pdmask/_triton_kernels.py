"""Triton kernels of ``pdmask.triton_pass`` (imported only when they run: Triton is an optional dependency).

One program per position (row of the logits), stepping over its vocabulary BLOCK ids at a time, in float32.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _off_set(cols, ids_row, C: tl.constexpr):
    """True where a column id is not among the row's C ids of S (unrolled: C = K+1 compares per id)."""
    off = cols >= 0
    for c in tl.static_range(C):
        off = off & (cols != tl.load(ids_row + c))
    return off


@triton.jit
def stats_kernel(
    z_ptr, row_stride, ids_ptr, u_ptr, out_ptr, n, V,
    C: tl.constexpr, BLOCK: tl.constexpr, NEED_SQ: tl.constexpr, NEED_EXACTPI: tl.constexpr,
):
    """out[:, row] = (lse, π_R, Q, Σ_{j∉S} s_j π_j, Σ_{j∉S} s_j π_j²) of one row: one read of the logits for the
    first three (online log-sum-exp with the tail sums rescaled alike), a second for the last two."""
    row = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + row * row_stride
    ids_row = ids_ptr + row * C
    lanes = tl.arange(0, BLOCK)
    zero = tl.sum(tl.zeros([BLOCK], tl.float32), 0)
    m = zero - float("inf")
    total = zero
    rest = zero
    tail_sq = zero
    for start in range(0, V, BLOCK):
        cols = start + lanes
        z = tl.load(z_row + cols, mask=cols < V, other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(z, 0))
        shift = tl.where(m_new > -float("inf"), m_new, 0.0)  # a row that is all -inf so far sums to 0
        scale = tl.exp(m - shift)
        e = tl.exp(z - shift)
        tail = tl.where(_off_set(cols, ids_row, C), e, 0.0)
        total = total * scale + tl.sum(e, 0)
        rest = rest * scale + tl.sum(tail, 0)
        if NEED_SQ:
            tail_sq = tail_sq * scale * scale + tl.sum(tail * tail, 0)
        m = m_new
    lse = m + tl.log(total)
    tl.store(out_ptr + row, lse)
    tl.store(out_ptr + n + row, rest / total)
    tl.store(out_ptr + 2 * n + row, tail_sq / (total * total))  # 0 unless NEED_SQ
    sign_pi = zero
    sign_pi2 = zero
    if NEED_EXACTPI:
        u = tl.load(u_ptr + row)
        for start in range(0, V, BLOCK):
            cols = start + lanes
            z = tl.load(z_row + cols, mask=cols < V, other=-float("inf")).to(tl.float32)
            p = tl.exp(z - lse)
            sign = tl.where(p > u, 1.0, tl.where(p < u, -1.0, 0.0))
            sp = tl.where(_off_set(cols, ids_row, C) & (cols < V), sign * p, 0.0)
            sign_pi += tl.sum(sp, 0)
            sign_pi2 += tl.sum(sp * p, 0)
    tl.store(out_ptr + 3 * n + row, sign_pi)
    tl.store(out_ptr + 4 * n + row, sign_pi2)


@triton.jit
def logprob_grad_kernel(z_ptr, row_stride, tok_ptr, lse_ptr, g_ptr, out_ptr, V, BLOCK: tl.constexpr):
    """out[row] = g·(e_a − exp(z − lse)) in out's dtype: one read of the row's logits and one write."""
    row = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + row * row_stride
    a = tl.load(tok_ptr + row)
    lse = tl.load(lse_ptr + row)
    g = tl.load(g_ptr + row)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inside = cols < V
        z = tl.load(z_row + cols, mask=inside, other=0.0).to(tl.float32)
        grad = tl.where(cols == a, g, 0.0) - g * tl.exp(z - lse)
        tl.store(out_ptr + row * V + cols, grad.to(out_ptr.dtype.element_ty), mask=inside)
