"""One memory-lean pass over the vocabulary: log π(a) with its gradient, and every statistic the masks need.

The per-block reductions (``shifted_sums``, ``normalised_sums``) serve both this module's pass over
materialised logits, where a block is a chunk of rows with the whole vocabulary, and
``pdmask.hidden``'s pass over blocks of rows × vocabulary computed from the hidden states.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from pdmask.rollout import RolloutLogprobs, as_bool_mask, check_tokens

#: Default budget for the float32 temporaries of one chunk, as a fraction of the logits' size ...
CHUNK_FRACTION = 0.04
#: ... but never less than this (small inputs go in one chunk) nor more than the cap.
CHUNK_MIN_BYTES = 1 << 20
CHUNK_MAX_BYTES = 64 << 20


@dataclass
class FullReductions:
    """Reductions over the whole vocabulary against a full μ, each [...]."""

    tv: Tensor  # ½ Σ|π_i − μ_i|
    kl: Tensor  # Σ μ_i (log μ_i − log π_i)
    mu_dot_pi: Tensor  # ⟨μ, π⟩
    sign_pi: Tensor  # Σ s_i π_i,   s_i = sign(π_i − μ_i)
    sign_pi2: Tensor  # Σ s_i π_i²


@dataclass
class PolicyStats:
    """Per-position statistics of π (from the trainer's logits) and μ (from the rollout).

    Only ``logp`` carries a gradient. S is the set of tokens whose μ is known: TopK(μ) ∪ {a} with
    top-K information ({a} with binary information), stored as columns with a last; a column is
    invalid when it repeats a (a among the top-K ids). Masses off S are summed exactly in the pass,
    not as 1 − Σ_S π, so peaked distributions keep their tails in float32.
    """

    logp: Tensor  # [...] log π(a), differentiable
    rollout_logp: Tensor  # [...] log μ(a)
    has_topk: bool  # the rollout gave μ's top-K (otherwise S = {a})
    has_full: bool  # the rollout gave μ over the whole vocabulary
    set_ids: Tensor  # [..., C] token ids of S (C = K+1, or 1 for binary), a last
    set_logp: Tensor  # [..., C] log π at S
    set_mu: Tensor  # [..., C] μ at S, 0 at invalid columns
    set_valid: Tensor  # [..., C] bool
    rest_mass: Tensor  # [...] π_R = Σ_{j∉S} π_j
    tail_sq: Tensor | None = None  # [...] Q = Σ_{j∉S} π_j²
    sq_norm: Tensor | None = None  # [...] ‖π‖² = Σ_S π_j² + Q
    full: FullReductions | None = None
    tail_count: Tensor | None = None  # [...] T = V − |S|, the number of distinct ids off S
    #: [2, ...] Σ_{j∉S} s_j π_j and Σ_{j∉S} s_j π_j² with s_j = sign(π_j − u), u = ``even_tail_mu``;
    #: filled by the pass when asked for, else on first use by ``uniform_pass`` (a second pass).
    uniform_sums: Tensor | None = None
    uniform_pass: Callable[[], Tensor] | None = field(default=None, repr=False, compare=False)

    @property
    def pi_a(self) -> Tensor:
        """π(a) [...], detached."""
        return self.logp.detach().exp()

    @property
    def mu_a(self) -> Tensor:
        """μ(a) [...]."""
        return self.rollout_logp.exp()

    @property
    def ratio(self) -> Tensor:
        """r = π(a)/μ(a) [...], detached."""
        return (self.logp.detach() - self.rollout_logp).exp()

    @property
    def info(self) -> str:
        """The richest information about μ: "full", "topk" or "binary"."""
        return "full" if self.has_full else "topk" if self.has_topk else "binary"

    @property
    def set_pi(self) -> Tensor:
        """π at S [..., C], 0 at invalid columns."""
        return self.set_logp.exp().masked_fill(~self.set_valid, 0.0)

    @property
    def rollout_rest_mass(self) -> Tensor:
        """μ_R = 1 − Σ_S μ [...], clamped at 0."""
        return _rest_of(self.set_mu)

    @property
    def even_tail_mu(self) -> Tensor:
        """u = μ_R / T [...]: μ's unseen tail spread evenly over the T ids off S (0 when T = 0)."""
        if self.tail_count is None:
            raise ValueError("the exactpi estimator needs the vocabulary size: pass stats_from_set(..., vocab_size=V).")
        return _even_mu(self.set_mu, self.tail_count)

    def uniform_tail_sums(self) -> Tensor:
        """[2, ...] Σ_{j∉S} sign(π_j − u)·π_j and ·π_j², computed by a second pass when the first did not."""
        if self.uniform_sums is None:
            if self.uniform_pass is None:
                raise ValueError(
                    "the exactpi estimator's TV needs sums over the vocabulary off S, which stats_from_set cannot "
                    "give: compute the statistics with pdmask.policy_stats or pdmask.policy_stats_from_hidden."
                )
            self.uniform_sums = self.uniform_pass()
        return self.uniform_sums


def policy_stats(
    logits: Tensor,
    tokens: Tensor,
    rollout: RolloutLogprobs,
    *,
    chunk_size: int | None = None,
    need_sq_norm: bool = True,
    need_uniform: bool = False,
    response_mask: Tensor | None = None,
) -> PolicyStats:
    """Statistics of π = softmax(logits) at the sampled tokens, in one chunked pass.

    Args:
        logits: [..., V], any float dtype; computed in float32, or float64 when given float64.
        tokens: [...] sampled token ids.
        rollout: what is known of μ at each position.
        chunk_size: positions per chunk; by default the chunk's float32 temporaries stay within
            ``CHUNK_FRACTION`` of the logits' size (between 1 MiB and 64 MiB).
        need_sq_norm: compute ‖π‖² = Σ exp(2·log π) (needed by the ``proportional``, ``exactpi`` and ``full`` estimators).
        need_uniform: also sum sign(π_j − u)·π_j and ·π_j² off S in this pass (the ``exactpi`` estimator's
            TV); otherwise a second pass over the retained logits computes them if they are ever used.
        response_mask: [...] 0/1; positions outside it may hold any padding in ``tokens`` and ``rollout``
            (they are replaced by a neutral token before validation; their statistics are meaningless).
    """
    if not isinstance(logits, Tensor) or not logits.is_floating_point():
        raise TypeError("logits must be a floating-point torch.Tensor of shape [..., V].")
    if logits.dim() < 1 or logits.shape[-1] < 2:
        raise ValueError(f"logits has shape {tuple(logits.shape)}; expected [..., V] with V >= 2.")
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    prep = prepare(tokens, rollout, response_mask, tuple(logits.shape[:-1]), logits.shape[-1], dtype, "logits")
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}.")
    rows = chunk_size or _default_chunk(logits, dtype, 3 if need_uniform else 2)
    acc = Accumulators.empty(prep, need_sq_norm, need_uniform)
    source = logits.detach()
    flat_u = prep.flat_even_mu
    with torch.no_grad():
        bufs = Buffers.empty(min(rows, prep.n) * prep.vocab, dtype, logits.device, need_uniform)
        for sl, z in _upcast_chunks(source, rows, bufs):
            m = z.amax(-1)
            sums = shifted_sums(z, m, prep.set_ids[sl], bufs, acc.tail_sq is not None)
            acc.finish_rows(sl, m, *sums, z.gather(-1, prep.set_ids[sl]))
            acc.add_normalised(sl, z, bufs, prep.set_ids[sl], flat_u, prep.full_logp)
    acc.check_finite("logits")
    logp = _GatherLogProb.apply(logits, prep.flat_tokens, acc.lse, rows)
    stats = acc.assemble(prep, logp)
    if stats.uniform_sums is None and stats.has_topk:
        stats.uniform_pass = lambda: _uniform_pass(source, rows, prep, acc)
    return stats


def _uniform_pass(logits: Tensor, rows: int, prep: Prepared, acc: Accumulators) -> Tensor:
    """[2, ...] the exactpi estimator's sums by a second pass over the logits."""
    only = replace(acc, full=None, uniform=torch.zeros(2, prep.n, dtype=acc.lse.dtype, device=acc.lse.device))
    flat_u = prep.flat_even_mu
    with torch.no_grad():
        bufs = Buffers.empty(min(rows, prep.n) * prep.vocab, acc.lse.dtype, logits.device, True)
        for sl, z in _upcast_chunks(logits, rows, bufs):
            only.add_normalised(sl, z, bufs, prep.set_ids[sl], flat_u, None)
    assert only.uniform is not None
    return only.uniform.reshape((2,) + prep.shape)


def stats_from_set(
    logp: Tensor,
    tokens: Tensor,
    rollout: RolloutLogprobs,
    set_logp: Tensor,
    *,
    sq_norm: Tensor | None = None,
    vocab_size: int | None = None,
) -> PolicyStats:
    """PolicyStats from what a trainer's own forward already has, with no pass over the vocabulary here.

    Args:
        logp: log π(a) [...], as the trainer computed it (keeps its gradient).
        tokens: a [...]; rollout: μ, already ``validated`` against the tokens (binary or top-K).
        set_logp: log π at S [..., C], the columns of ``rollout.topk_ids`` then a (C = 1 for binary).
        sq_norm: ‖π‖² [...] if the trainer's forward reduced it (needed by ``proportional`` and ``exactpi``).
        vocab_size: V, for the tails spread over the T = V − |S| ids off S: the paper's ``uniform``
            estimator and the KL form of ``exactpi`` (its TV form needs sums over the vocabulary that
            only a pass gives).
    Off S nothing is summed, so π_R = 1 − π(S) (by expm1) and Q = ‖π‖² − Σ_S π² (clamped into
    [0, π_R²], the range the true value lies in): less precise than ``policy_stats`` when π_R < ~1e-6.
    """
    set_valid, set_mu = _set_columns(tokens, rollout)
    set_ids = tokens.unsqueeze(-1) if rollout.topk_ids is None else torch.cat([rollout.topk_ids, tokens.unsqueeze(-1)], -1)
    if set_logp.shape != set_ids.shape:
        raise ValueError(f"set_logp has shape {tuple(set_logp.shape)}; expected {tuple(set_ids.shape)} (top-K ids, then a).")
    if vocab_size is not None and (not isinstance(vocab_size, int) or vocab_size < set_ids.shape[-1]):
        raise ValueError(f"vocab_size must be an int >= {set_ids.shape[-1]} (the columns of S), got {vocab_size!r}.")
    in_set = torch.logsumexp(set_logp.detach().masked_fill(~set_valid, -torch.inf), -1)
    stats = PolicyStats(
        logp=logp,
        rollout_logp=rollout.logp,
        has_topk=rollout.topk_ids is not None,
        has_full=False,
        set_ids=set_ids,
        set_logp=set_logp.detach(),
        set_mu=set_mu,
        set_valid=set_valid,
        rest_mass=(-torch.expm1(in_set)).clamp_min(0.0),
        tail_count=None if vocab_size is None else _tail_count(set_valid, vocab_size, set_mu.dtype),
    )
    if sq_norm is not None:
        set_sq = stats.set_pi.square().sum(-1)
        stats.tail_sq = torch.minimum((sq_norm.detach() - set_sq).clamp_min(0.0), stats.rest_mass.square())
        stats.sq_norm = set_sq + stats.tail_sq
    return stats


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
        return _even_mu(self.set_mu, self.tail_count).reshape(self.n)


def prepare(
    tokens: Tensor,
    rollout: RolloutLogprobs,
    response_mask: Tensor | None,
    shape: tuple[int, ...],
    vocab: int,
    dtype: torch.dtype,
    source: str,
) -> Prepared:
    """Checks tokens and rollout against the leading ``shape`` and vocabulary of ``source`` (for errors);
    positions outside ``response_mask`` become the neutral token 0 with μ(0) = 1."""
    if not isinstance(rollout, RolloutLogprobs):
        raise TypeError(f"rollout must be a pdmask.RolloutLogprobs, got {type(rollout).__name__}.")
    if response_mask is not None:
        valid = as_bool_mask(response_mask, shape)
        if not valid.all():
            tokens = torch.where(valid, check_tokens(tokens, None, shape, source), 0)
            rollout = rollout.masked(valid)
    tokens = check_tokens(tokens, vocab, shape, source)
    rollout = rollout.validated(tokens, vocab, dtype)
    n = tokens.numel()
    flat_tokens = tokens.reshape(n)
    set_ids = flat_tokens[:, None] if rollout.topk_ids is None else torch.cat(
        [rollout.topk_ids.reshape(n, -1), flat_tokens[:, None]], -1
    )
    set_valid, set_mu = _set_columns(tokens, rollout)
    return Prepared(
        shape, vocab, tokens, rollout, set_ids, set_valid, set_mu, _tail_count(set_valid, vocab, dtype),
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
class Accumulators:
    """Flat [n] (or [k, n]) results of a pass."""

    lse: Tensor
    set_logp: Tensor
    rest: Tensor
    tail_sq: Tensor | None
    full: Tensor | None  # [5, n]
    uniform: Tensor | None  # [2, n]

    @staticmethod
    def empty(prep: Prepared, need_sq_norm: bool, need_uniform: bool) -> Accumulators:
        def zeros(*size: int) -> Tensor:
            return torch.zeros(*size, dtype=prep.set_mu.dtype, device=prep.tokens.device)

        return Accumulators(
            zeros(prep.n), zeros(*prep.set_ids.shape), zeros(prep.n), zeros(prep.n) if need_sq_norm else None,
            None if prep.full_logp is None else zeros(5, prep.n),
            zeros(2, prep.n) if need_uniform and prep.rollout.topk_ids is not None else None,
        )

    def finish_rows(
        self, sl: slice, m: Tensor, total: Tensor, rest: Tensor, tail_sq: Tensor | None, set_z: Tensor
    ) -> None:
        """Stores rows ``sl`` from their sums relative to the shift m: e.g. lse = m + log Σ exp(z − m)."""
        self.lse[sl] = m + total.log()
        self.set_logp[sl] = set_z - self.lse[sl, None]
        self.rest[sl] = rest / total
        if self.tail_sq is not None and tail_sq is not None:
            self.tail_sq[sl] = tail_sq / total.square()

    def add_normalised(
        self, sl: slice, z: Tensor, bufs: Buffers, set_cols: Tensor, flat_u: Tensor, full_logp: Tensor | None,
        vocab: slice = slice(None),
    ) -> None:
        """Adds one block's full-μ reductions and uniform sums (those asked for); the block z [r, c] holds
        rows ``sl`` and vocabulary ids ``vocab``, the rows' lse is final."""
        u = None if self.uniform is None else flat_u[sl]
        logq = None if self.full is None or full_logp is None else full_logp[sl, vocab]
        if u is None and logq is None:
            return
        full, uniform = normalised_sums(z, self.lse[sl], set_cols, bufs, u, logq)
        if full is not None and self.full is not None:
            self.full[:, sl] += full
        if uniform is not None and self.uniform is not None:
            self.uniform[:, sl] += uniform

    def check_finite(self, source: str) -> None:
        if not torch.isfinite(self.lse).all():
            raise ValueError(
                f"{source} contain NaN or +inf (or a row of only -inf); the trainer's logits must be finite."
            )

    def assemble(self, prep: Prepared, logp: Tensor) -> PolicyStats:
        if not torch.isfinite(logp).all():
            raise ValueError("logits are -inf at a sampled token: the trainer gives that token probability zero.")
        shape = prep.shape
        stats = PolicyStats(
            logp=logp.reshape(shape),
            rollout_logp=prep.rollout.logp,
            has_topk=prep.rollout.topk_ids is not None,
            has_full=prep.rollout.full_logp is not None,
            set_ids=prep.set_ids.reshape(shape + (-1,)),
            set_logp=self.set_logp.reshape(shape + (-1,)),
            set_mu=prep.set_mu,
            set_valid=prep.set_valid,
            rest_mass=self.rest.reshape(shape),
            tail_count=prep.tail_count,
            uniform_sums=None if self.uniform is None else self.uniform.reshape((2,) + shape),
        )
        if self.tail_sq is not None:
            stats.tail_sq = self.tail_sq.reshape(shape)
            stats.sq_norm = stats.set_pi.square().sum(-1) + stats.tail_sq
        if self.full is not None:
            stats.full = FullReductions(*(r.reshape(shape) for r in self.full))
        return stats


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
    z: Tensor, lse: Tensor, set_cols: Tensor, bufs: Buffers, u: Tensor | None, logq: Tensor | None
) -> tuple[Tensor | None, Tensor | None]:
    """For one block z [r, c] with the rows' final lse and p = exp(z − lse): the full-μ reductions [5, r]
    against log μ = logq [r, c] (if given), and Σ_{j∉S} s_j p_j, Σ_{j∉S} s_j p_j² [2, r] with
    s_j = sign(p_j − u) (if u [r] is given). set_cols as in ``shifted_sums``."""
    r, c = z.shape
    p = torch.sub(z, lse[:, None], out=Buffers.block(bufs.exp, r, c)).exp_()
    full = None if logq is None else _full_reductions(z, p, lse, logq.to(z.dtype))
    if u is None:
        return full, None
    assert bufs.sign is not None
    Buffers.zero_at(bufs.exp, set_cols, r, c)
    sp = torch.sub(p, u[:, None], out=Buffers.block(bufs.sign, r, c)).sign_().mul_(p)
    return full, torch.stack([sp.sum(-1), torch.linalg.vecdot(sp, p)])


def _upcast_chunks(logits: Tensor, rows: int, bufs: Buffers) -> Iterator[tuple[slice, Tensor]]:
    """(flat positions, [rows, V] chunk in the compute dtype), upcast into a reused buffer when needed."""
    dtype = bufs.exp.dtype
    if logits.dtype != dtype and bufs.upcast is None:
        bufs.upcast = torch.empty_like(bufs.exp)
    for sl, chunk in _row_chunks(logits, rows):
        yield sl, chunk if bufs.upcast is None else Buffers.block(bufs.upcast, *chunk.shape).copy_(chunk)


def _set_columns(tokens: Tensor, rollout: RolloutLogprobs) -> tuple[Tensor, Tensor]:
    """(set_valid, set_mu) [..., C] for S = TopK ∪ {a} (or {a}); a's own column is invalid when a ∈ TopK."""
    if rollout.topk_ids is None or rollout.topk_logp is None:
        return torch.ones(tokens.shape + (1,), dtype=torch.bool, device=tokens.device), rollout.logp.exp().unsqueeze(-1)
    a_in_topk = torch.eq(rollout.topk_ids, tokens.unsqueeze(-1)).any(-1, keepdim=True)
    set_valid = torch.cat([torch.ones_like(rollout.topk_ids, dtype=torch.bool), ~a_in_topk], -1)
    set_mu = torch.cat([rollout.topk_logp.exp(), rollout.logp.exp().unsqueeze(-1)], -1).masked_fill(~set_valid, 0.0)
    return set_valid, set_mu


def _tail_count(set_valid: Tensor, vocab: int, dtype: torch.dtype) -> Tensor:
    return (vocab - set_valid.sum(-1)).to(dtype)


def _rest_of(set_mu: Tensor) -> Tensor:
    return (1 - set_mu.sum(-1)).clamp_min(0.0)


def _even_mu(set_mu: Tensor, tail_count: Tensor) -> Tensor:
    return torch.where(tail_count > 0, _rest_of(set_mu) / tail_count.clamp_min(1), 0.0)


def _full_reductions(z: Tensor, p: Tensor, lse: Tensor, logq: Tensor) -> Tensor:
    """[5, n] = (TV, KL(μ‖π), ⟨μ,π⟩, Σ sπ, Σ sπ²) for one block; p = softmax(z) there, logq = log μ."""
    q = logq.exp()
    diff = p - q
    tv = 0.5 * diff.abs().sum(-1)
    s = diff.sign_()
    kl_terms = torch.where(q > 0, q * (logq - (z - lse[:, None])), 0.0)
    sp = s.mul_(p)
    return torch.stack([tv, kl_terms.sum(-1), (q * p).sum(-1), sp.sum(-1), torch.linalg.vecdot(sp, p)])


def _default_chunk(logits: Tensor, dtype: torch.dtype, temporaries: int) -> int:
    budget = min(max(CHUNK_FRACTION * logits.numel() * logits.element_size(), CHUNK_MIN_BYTES), CHUNK_MAX_BYTES)
    # Temporaries of the compute dtype per row: the upcast logits, their exponentials (and the signs).
    per_row = temporaries * logits.shape[-1] * torch.finfo(dtype).bits // 8
    return max(1, int(budget // per_row))


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


class _GatherLogProb(torch.autograd.Function):
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


__all__ = ["FullReductions", "PolicyStats", "policy_stats", "stats_from_set"]
