"""The per-block reductions every backend shares, in the compute dtype, on reused buffers.

A block is some rows × some vocabulary ids of the logits, z [r, c]. ``shifted_sums`` is the first sweep's
(relative to a shift), ``normalised_sums`` the second's (with the rows' final log-normaliser), ``logprob_grad``
the backward of log π(a) on a block, ``set_rows_dot`` the LM head's rows at S.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pdmask.rows import row_slices

#: One block of logits: (flat rows, z [r, c] in the compute dtype, S's columns in the block [r, C] with c
#: for ids outside it, the block's vocabulary ids).
Block = tuple[slice, Tensor, Tensor, slice]
#: Elements of the [rows, C, d] gather of unembedding rows at S made at once.
GATHER_ELEMENTS = 1 << 22


class Buffers:
    """Reused flat temporaries for blocks of up to ``size`` elements (fresh allocations per block cost page
    faults comparable to the exp itself), with one spare element that takes the writes meant for S's ids
    outside a block of the vocabulary; ``upcast`` holds a block of low-precision inputs in the compute dtype."""

    def __init__(self, size: int, dtype: torch.dtype, device: torch.device, need_sign: bool, need_upcast: bool) -> None:
        self.exp = torch.empty(size + 1, dtype=dtype, device=device)
        self.sign = torch.empty_like(self.exp) if need_sign else None
        self.upcast = torch.empty_like(self.exp) if need_upcast else None

    @staticmethod
    def block(buf: Tensor, rows: int, cols: int) -> Tensor:
        """A contiguous [rows, cols] view of a flat buffer."""
        return buf[: rows * cols].view(rows, cols)

    @staticmethod
    def zero_at(buf: Tensor, set_cols: Tensor, rows: int, cols: int) -> None:
        """Zeroes S's entries of the [rows, cols] block view; set_cols [rows, C] holds cols for ids outside it."""
        row_start = torch.arange(rows, device=buf.device)[:, None] * cols
        buf.index_fill_(0, torch.where(set_cols < cols, row_start + set_cols, rows * cols).reshape(-1), 0.0)

    def upcast_of(self, x: Tensor) -> Tensor:
        """x [r, c] in the compute dtype: itself, or copied into the upcast buffer."""
        return x if self.upcast is None else Buffers.block(self.upcast, *x.shape).copy_(x)


def block_cols(ids: Tensor, v: slice) -> Tensor:
    """Columns of ids [r, k] in the vocabulary block v; ids outside it get the spare column |v|."""
    local = ids - v.start
    width = v.stop - v.start
    return torch.where((local >= 0) & (local < width), local, width)


def set_logits(z: Tensor, cols: Tensor) -> Tensor:
    """z at S's columns cols [r, C] of the block z [r, c], 0 at the ids outside it."""
    width = z.shape[1]
    return torch.where(cols < width, z.gather(-1, cols.clamp(max=width - 1)), 0.0)


def shifted_sums(
    z: Tensor, shift: Tensor, set_cols: Tensor, bufs: Buffers, need_sq: bool
) -> tuple[Tensor, Tensor, Tensor | None]:
    """For one block z [r, c] and e = exp(z − shift): Σ e, Σ_{j∉S} e and (if need_sq) Σ_{j∉S} e² per row;
    the tail e off S stays in ``bufs.exp``. set_cols [r, C] are S's columns in the block, c for ids outside it."""
    r, c = z.shape
    e = torch.sub(z, shift[:, None], out=Buffers.block(bufs.exp, r, c)).exp_()
    total = e.sum(-1)
    Buffers.zero_at(bufs.exp, set_cols, r, c)  # what is left is the tail off S
    return total, e.sum(-1), torch.linalg.vector_norm(e, dim=-1).square() if need_sq else None


def normalised_sums(
    z: Tensor, lse: Tensor, set_cols: Tensor, bufs: Buffers, u: Tensor | None, logq: Tensor | None,
    rows: Tensor | None = None,
) -> tuple[Tensor | None, Tensor | None, tuple[Tensor, Tensor] | None]:
    """For one block z [r, c] with the rows' final lse and p = exp(z − lse): the full-μ reductions [5, r]
    against log μ = logq [r, c] (if given), Σ_{j∉S} s_j p_j, Σ_{j∉S} s_j p_j² [2, r] with
    s_j = sign(p_j − u) (if u [r] is given), and with the block's unembedding rows [c, d] (and logq)
    Σ_j μ_j w_j and Σ_j sign(p_j − μ_j) p_j w_j [r, d]. set_cols as in ``shifted_sums``."""
    r, c = z.shape
    p = torch.sub(z, lse[:, None], out=Buffers.block(bufs.exp, r, c)).exp_()
    full, head = (None, None) if logq is None else _full_reductions(z, p, lse, logq.to(z.dtype), rows)
    if u is None:
        return full, None, head
    assert bufs.sign is not None
    Buffers.zero_at(bufs.exp, set_cols, r, c)
    sp = torch.sub(p, u[:, None], out=Buffers.block(bufs.sign, r, c)).sign_().mul_(p)
    return full, torch.stack([sp.sum(-1), torch.linalg.vecdot(sp, p)]), head


def _full_reductions(
    z: Tensor, p: Tensor, lse: Tensor, logq: Tensor, rows: Tensor | None
) -> tuple[Tensor, tuple[Tensor, Tensor] | None]:
    """[5, n] = (TV, KL(μ‖π), ⟨μ,π⟩, Σ sπ, Σ sπ²) for one block, p = softmax(z) there, logq = log μ;
    with the block's unembedding rows [c, d] also (Σ μ_j w_j, Σ s_j π_j w_j) [n, d]."""
    q = logq.exp()
    diff = p - q
    tv = 0.5 * diff.abs().sum(-1)
    s = diff.sign_()
    kl_terms = torch.where(q > 0, q * (logq - (z - lse[:, None])), 0.0)
    sp = s.mul_(p)
    sums = torch.stack([tv, kl_terms.sum(-1), (q * p).sum(-1), sp.sum(-1), torch.linalg.vecdot(sp, p)])
    return sums, None if rows is None else (q @ rows, sp @ rows)


def logprob_grad(z: Tensor, lse: Tensor, g: Tensor, a_cols: Tensor, out: Tensor) -> Tensor:
    """∂(Σ g·log π(a))/∂z = g·(e_a − π) [r, c] of one block z [r, c] into ``out`` (a flat buffer of r·c + 1
    elements); a_cols [r] is a's column in the block, c where a lies outside it (the spare element takes it)."""
    r, c = z.shape
    grad = torch.sub(z, lse[:, None], out=Buffers.block(out, r, c)).exp_().mul_(-g[:, None])
    at_a = torch.where(a_cols < c, torch.arange(r, device=z.device) * c + a_cols, r * c)
    out.index_add_(0, at_a, g)
    return grad


def set_rows_dot(weight: Tensor, set_ids: Tensor, coef: Tensor) -> Tensor:
    """Σ_c coef[..., n, c] · W[set_ids[n, c]] [..., n, d] for W [V, d], ids [n, C] and coef [..., n, C] (several
    coefficient sets share one gather); the rows are gathered a slice of positions at a time (at most
    ``GATHER_ELEMENTS`` elements)."""
    n, width = set_ids.shape
    d = weight.shape[1]
    out = torch.empty(coef.shape[:-1] + (d,), dtype=coef.dtype, device=coef.device)
    for sl in row_slices(n, max(1, GATHER_ELEMENTS // max(width * d, 1))):
        out[..., sl, :] = torch.einsum("...nc,ncd->...nd", coef[..., sl, :], weight[set_ids[sl]].to(coef.dtype))
    return out


__all__ = [
    "GATHER_ELEMENTS",
    "Block",
    "Buffers",
    "block_cols",
    "logprob_grad",
    "normalised_sums",
    "set_logits",
    "set_rows_dot",
    "shifted_sums",
]
