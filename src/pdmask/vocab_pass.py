"""The toolkit of a pass over the vocabulary: validated inputs, reused buffers, per-block reductions, accumulators.

A block is some rows × some vocabulary ids of the logits. ``pdmask.stats.policy_stats`` passes over
materialised logits (a block is a chunk of rows with the whole vocabulary) and
``pdmask.hidden.policy_stats_from_hidden`` over blocks of rows × vocabulary made from the hidden
states; both reduce their blocks with ``shifted_sums`` and ``normalised_sums`` into ``Accumulators``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from pdmask.rollout import Checks, RolloutLogprobs, as_bool_mask, check_tokens

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

#: One block of logits: (flat rows, z [r, c] in the compute dtype, S's columns in the block [r, C] with c
#: for ids outside it, the block's vocabulary ids).
Block = tuple[slice, Tensor, Tensor, slice]


def set_columns(tokens: Tensor, rollout: RolloutLogprobs) -> tuple[Tensor, Tensor]:
    """(set_valid, set_mu) [..., C] for S = TopK ∪ {a} (or {a}); a's own column is invalid when a ∈ TopK."""
    if rollout.topk_ids is None or rollout.topk_logp is None:
        return torch.ones(tokens.shape + (1,), dtype=torch.bool, device=tokens.device), rollout.logp.exp().unsqueeze(-1)
    a_in_topk = torch.eq(rollout.topk_ids, tokens.unsqueeze(-1)).any(-1, keepdim=True)
    set_valid = torch.cat([torch.ones_like(rollout.topk_ids, dtype=torch.bool), ~a_in_topk], -1)
    set_mu = torch.cat([rollout.topk_logp.exp(), rollout.logp.exp().unsqueeze(-1)], -1).masked_fill(~set_valid, 0.0)
    return set_valid, set_mu


def tail_count(set_valid: Tensor, vocab: int, dtype: torch.dtype) -> Tensor:
    """T = V − |S| [...], the number of distinct ids off S."""
    return (vocab - set_valid.sum(-1)).to(dtype)


def rest_of(set_mu: Tensor) -> Tensor:
    """μ_R = 1 − Σ_S μ [...], clamped at 0."""
    return (1 - set_mu.sum(-1)).clamp_min(0.0)


def even_mu(set_mu: Tensor, count: Tensor) -> Tensor:
    """u = μ_R / T [...] for T = ``count`` (0 when T = 0)."""
    return torch.where(count > 0, rest_of(set_mu) / count.clamp_min(1), 0.0)


@dataclass
class Prepared:
    """Validated inputs of a pass: flat [n] positions, S's ids [n, C] and what is known of μ there."""

    shape: tuple[int, ...]
    vocab: int
    tokens: Tensor  # [...]
    rollout: RolloutLogprobs  # validated, in the compute dtype
    set_ids: Tensor  # [n, C], a last
    set_valid: Tensor  # [..., C]
    set_mu: Tensor  # [..., C]
    tail_count: Tensor  # [...]
    full_logp: Tensor | None  # [n, V]

    @property
    def n(self) -> int:
        return self.tokens.numel()

    @property
    def flat_tokens(self) -> Tensor:
        return self.tokens.reshape(self.n)

    @property
    def flat_even_mu(self) -> Tensor:
        """u [n] of the exactpi estimator."""
        return even_mu(self.set_mu, self.tail_count).reshape(self.n)


def prepare(
    tokens: Tensor,
    rollout: RolloutLogprobs,
    response_mask: Tensor | None,
    shape: tuple[int, ...],
    vocab: int,
    dtype: torch.dtype,
    source: str,
    validate: bool = True,
) -> Prepared:
    """Checks tokens and rollout against the leading ``shape`` and vocabulary of ``source`` (for errors);
    positions outside ``response_mask`` become the neutral token 0 with μ(0) = 1. The value checks are read
    back in one transfer; ``validate=False`` checks shapes only and reads nothing back from the device."""
    if not isinstance(rollout, RolloutLogprobs):
        raise TypeError(f"rollout must be a pdmask.RolloutLogprobs, got {type(rollout).__name__}.")
    checks = Checks() if validate else False  # every value check read back at once, before the pass
    if response_mask is not None:
        valid = as_bool_mask(response_mask, shape, checks)
        tokens = torch.where(valid, check_tokens(tokens, None, shape, source), 0)
        rollout = rollout.masked(valid)
    tokens = check_tokens(tokens, vocab, shape, source, checks)
    rollout = rollout.validated(tokens, vocab, dtype, checks)
    if isinstance(checks, Checks):
        checks.read()
    n = tokens.numel()
    flat_tokens = tokens.reshape(n)
    set_ids = flat_tokens[:, None] if rollout.topk_ids is None else torch.cat(
        [rollout.topk_ids.reshape(n, -1), flat_tokens[:, None]], -1
    )
    set_valid, set_mu = set_columns(tokens, rollout)
    return Prepared(
        shape, vocab, tokens, rollout, set_ids, set_valid, set_mu, tail_count(set_valid, vocab, dtype),
        None if rollout.full_logp is None else rollout.full_logp.reshape(n, vocab),
    )


@dataclass
class Buffers:
    """Reused flat temporaries for blocks of up to ``size`` elements (fresh allocations per block cost page
    faults comparable to the exp itself), with one spare element that takes the writes meant for S's ids
    outside a block of the vocabulary."""

    exp: Tensor
    sign: Tensor | None
    upcast: Tensor | None = None

    @staticmethod
    def empty(size: int, dtype: torch.dtype, device: torch.device, need_sign: bool) -> Buffers:
        exp = torch.empty(size + 1, dtype=dtype, device=device)
        return Buffers(exp, torch.empty_like(exp) if need_sign else None)

    @staticmethod
    def block(buf: Tensor, rows: int, cols: int) -> Tensor:
        """A contiguous [rows, cols] view of a flat buffer."""
        return buf[: rows * cols].view(rows, cols)

    @staticmethod
    def zero_at(buf: Tensor, set_cols: Tensor, rows: int, cols: int) -> None:
        """Zeroes S's entries of the [rows, cols] block view; set_cols [rows, C] holds cols for ids outside it."""
        row_start = torch.arange(rows, device=buf.device)[:, None] * cols
        buf.index_fill_(0, torch.where(set_cols < cols, row_start + set_cols, rows * cols).reshape(-1), 0.0)


@dataclass
class HeadMeans:
    """Sums over the unembedding's rows w_j for the backbone-aware direction (``pdmask.backbone``): flat [n, d]
    in a pass, [..., d] in ``PolicyStats.head``."""

    weight: Tensor  # W [V, d] (detached), the LM head: logits = (h Wᵀ + b) / temperature
    tail: Tensor  # Σ_{j∉S} π_j w_j, summed in the pass (Wᵀπ is this plus S's rows, formed where it is used)
    mu: Tensor | None = None  # Wᵀμ (full μ)
    sign_pi: Tensor | None = None  # Σ_j s_j π_j w_j, s_j = sign(π_j − μ_j) (full μ)

    def block(self, vocab: slice, dtype: torch.dtype) -> Tensor:
        """The rows W[vocab] [c, d] in the compute dtype."""
        return self.weight[vocab].to(dtype)

    def rows_dot(self, set_ids: Tensor, coef: Tensor) -> Tensor:
        """Σ_c coef[..., n, c] · w_{set_ids[n, c]} [..., n, d] (``set_rows_dot``; summed over the shards of a
        vocabulary split over ranks in ``pdmask.sharded``)."""
        return set_rows_dot(self.weight, set_ids, coef)


@dataclass
class Accumulators:
    """Flat [n] (or [k, n]) results of a pass."""

    lse: Tensor
    set_logp: Tensor
    rest: Tensor
    tail_sq: Tensor | None
    full: Tensor | None  # [5, n]
    exactpi: Tensor | None  # [2, n]
    head: HeadMeans | None = None

    @staticmethod
    def empty(prep: Prepared, need_sq_norm: bool, need_exactpi: bool, head_weight: Tensor | None = None) -> Accumulators:
        def zeros(*size: int) -> Tensor:
            return torch.zeros(*size, dtype=prep.set_mu.dtype, device=prep.tokens.device)

        head = None
        if head_weight is not None:
            d, full = head_weight.shape[1], prep.full_logp is not None
            head = HeadMeans(head_weight.detach(), zeros(prep.n, d), zeros(prep.n, d) if full else None,
                            zeros(prep.n, d) if full else None)  # fmt: skip
        return Accumulators(
            zeros(prep.n), zeros(*prep.set_ids.shape), zeros(prep.n), zeros(prep.n) if need_sq_norm else None,
            None if prep.full_logp is None else zeros(5, prep.n),
            zeros(2, prep.n) if need_exactpi and prep.rollout.topk_ids is not None else None,
            head,
        )

    def finish_rows(
        self, sl: slice, m: Tensor, total: Tensor, rest: Tensor, tail_sq: Tensor | None, set_z: Tensor,
        head_tail: Tensor | None = None,
    ) -> None:
        """Stores rows ``sl`` from their sums relative to the shift m: e.g. lse = m + log Σ exp(z − m)."""
        self.lse[sl] = m + total.log()
        self.set_logp[sl] = set_z - self.lse[sl, None]
        self.rest[sl] = rest / total
        if self.tail_sq is not None and tail_sq is not None:
            self.tail_sq[sl] = tail_sq / total.square()
        if self.head is not None and head_tail is not None:
            self.head.tail[sl] = head_tail / total[:, None]

    def tail_product(self, bufs: Buffers, r: int, c: int, vocab: slice = slice(None)) -> Tensor | None:
        """Σ_{j∉S} e_j w_j [r, d] of the block whose tail e [r, c] ``shifted_sums`` left in ``bufs``
        (None without a head)."""
        if self.head is None:
            return None
        return Buffers.block(bufs.exp, r, c) @ self.head.block(vocab, bufs.exp.dtype)

    def add_normalised(
        self, sl: slice, z: Tensor, bufs: Buffers, set_cols: Tensor, flat_u: Tensor, full_logp: Tensor | None,
        vocab: slice = slice(None),
    ) -> None:
        """Adds one block's full-μ reductions and exactpi sums (those asked for); the block z [r, c] holds
        rows ``sl`` and vocabulary ids ``vocab``, the rows' lse is final."""
        u = None if self.exactpi is None else flat_u[sl]
        logq = None if self.full is None or full_logp is None else full_logp[sl, vocab]
        if u is None and logq is None:
            return
        rows = None if self.head is None or logq is None else self.head.block(vocab, z.dtype)
        full, exactpi, head = normalised_sums(z, self.lse[sl], set_cols, bufs, u, logq, rows)
        if full is not None and self.full is not None:
            self.full[:, sl] += full
        if head is not None and self.head is not None and self.head.mu is not None and self.head.sign_pi is not None:
            self.head.mu[sl] += head[0]
            self.head.sign_pi[sl] += head[1]
        if exactpi is not None and self.exactpi is not None:
            self.exactpi[:, sl] += exactpi

    def add_normalised_blocks(self, prep: Prepared, blocks: Iterable[Block], bufs: Buffers, full_logp: Tensor | None) -> None:
        """``add_normalised`` for each of ``blocks`` (made in ``bufs``), whose rows' lse is final."""
        flat_u = prep.flat_even_mu
        for sl, z, set_cols, vocab in blocks:
            self.add_normalised(sl, z, bufs, set_cols, flat_u, full_logp, vocab)

    def check_finite(self, source: str, logp: Tensor) -> None:
        """Raises unless every lse and log π(a) [n] of the pass is finite (one read of both verdicts)."""
        checks = Checks()
        checks.add(
            ~torch.isfinite(self.lse).all(),
            lambda: f"{source} contain NaN or +inf (or a row of only -inf); the trainer's logits must be finite.",
        )
        checks.add(
            ~torch.isfinite(logp).all(),
            lambda: f"{source} are -inf at a sampled token: the trainer gives that token probability zero.",
        )
        checks.read()


def shifted_sums(
    z: Tensor, shift: Tensor, set_cols: Tensor, bufs: Buffers, need_sq: bool
) -> tuple[Tensor, Tensor, Tensor | None]:
    """For one block z [r, c] and e = exp(z − shift): Σ e, Σ_{j∉S} e and (if need_sq) Σ_{j∉S} e² per row.

    set_cols [r, C] are S's columns in the block, c for ids outside it.
    """
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


def exactpi_pass(prep: Prepared, acc: Accumulators, bufs: Buffers, blocks: Iterable[Block]) -> Tensor:
    """[2, ...] the exactpi estimator's sums by a second pass over ``blocks`` (made in ``bufs``, which has
    signs), for a first pass that did not ask for them; ``acc`` holds that pass's final lse."""
    only = replace(acc, full=None, exactpi=torch.zeros(2, prep.n, dtype=acc.lse.dtype, device=acc.lse.device))
    with torch.no_grad():
        only.add_normalised_blocks(prep, blocks, bufs, None)
    assert only.exactpi is not None
    return only.exactpi.reshape((2,) + prep.shape)


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


def row_slices(n: int, step: int) -> list[slice]:
    """[0, n) in consecutive slices of at most ``step`` rows."""
    return [slice(start, min(start + step, n)) for start in range(0, n, step)]


#: Elements of the [rows, C, d] gather of unembedding rows at S made at once.
GATHER_ELEMENTS = 1 << 22


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


def logit_blocks(logits: Tensor, rows: int, set_ids: Tensor, bufs: Buffers) -> Iterator[Block]:
    """Chunks of ``rows`` positions × the whole vocabulary of [..., V] logits, in the compute dtype of
    ``bufs`` (upcast into a reused buffer when needed); set_ids [n, C] are S's ids."""
    dtype = bufs.exp.dtype
    if logits.dtype != dtype and bufs.upcast is None:
        bufs.upcast = torch.empty_like(bufs.exp)
    for sl, chunk in _row_chunks(logits, rows):
        z = chunk if bufs.upcast is None else Buffers.block(bufs.upcast, *chunk.shape).copy_(chunk)
        yield sl, z, set_ids[sl], slice(None)


def _row_chunks(logits: Tensor, rows: int) -> Iterator[tuple[slice, Tensor]]:
    """Yields (slice of flat positions, [rows, V] view) without copying non-contiguous logits."""
    vocab = logits.shape[-1]
    try:
        flat = logits.view(-1, vocab)
    except RuntimeError:
        # e.g. logits[:, :-1] of a [B, T+1, V] tensor: each leading index is still a contiguous block.
        per = logits[0].numel() // vocab if logits.dim() > 1 else 1
        for i in range(logits.shape[0]):
            for sl, chunk in _row_chunks(logits[i], rows):
                yield slice(i * per + sl.start, i * per + sl.stop), chunk
        return
    for start in range(0, flat.shape[0], rows):
        stop = min(start + rows, flat.shape[0])
        yield slice(start, stop), flat[start:stop]


class GatherLogProb(torch.autograd.Function):
    """log π(a) = z_a − lse(z) [N] with a chunked backward: ∂/∂z = g·(e_a − softmax(z)), no [N, V] float32 copy."""

    @staticmethod
    def forward(ctx, logits: Tensor, tokens: Tensor, lse: Tensor, rows: int) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(logits, tokens, lse)
        ctx.rows = rows
        picked = logits.gather(-1, tokens.reshape(logits.shape[:-1] + (1,))).reshape(-1)
        return picked.to(lse.dtype) - lse

    @staticmethod
    def backward(ctx, grad_out: Tensor):  # type: ignore[override]
        logits, tokens, lse = ctx.saved_tensors
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        flat_grad = grad.view(-1, logits.shape[-1])
        buf = torch.empty(min(ctx.rows, lse.numel()), logits.shape[-1], dtype=lse.dtype, device=logits.device)
        for sl, chunk in _row_chunks(logits, ctx.rows):
            g = grad_out[sl].to(lse.dtype)
            p = buf[: sl.stop - sl.start].copy_(chunk).sub_(lse[sl, None]).exp_().mul_(-g[:, None])
            p.scatter_add_(-1, tokens[sl, None], g[:, None])
            flat_grad[sl] = p
        return grad, None, None, None


__all__ = [
    "CHUNK_FRACTION",
    "CHUNK_MAX_BYTES",
    "CHUNK_MIN_BYTES",
    "CUDA_CHUNK_FRACTION",
    "CUDA_CHUNK_MAX_BYTES",
    "Accumulators",
    "Block",
    "Buffers",
    "GATHER_ELEMENTS",
    "GatherLogProb",
    "HeadMeans",
    "Prepared",
    "chunk_rows",
    "default_chunk",
    "even_mu",
    "logit_blocks",
    "normalised_sums",
    "prepare",
    "rest_of",
    "row_slices",
    "set_columns",
    "set_rows_dot",
    "shifted_sums",
    "tail_count",
    "exactpi_pass",
]
