"""One memory-lean pass over the vocabulary: log π(a) with its gradient, and every statistic the masks need."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

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


def policy_stats(
    logits: Tensor,
    tokens: Tensor,
    rollout: RolloutLogprobs,
    *,
    chunk_size: int | None = None,
    need_sq_norm: bool = True,
    response_mask: Tensor | None = None,
) -> PolicyStats:
    """Statistics of π = softmax(logits) at the sampled tokens, in one chunked pass.

    Args:
        logits: [..., V], any float dtype; computed in float32, or float64 when given float64.
        tokens: [...] sampled token ids.
        rollout: what is known of μ at each position.
        chunk_size: positions per chunk; by default the chunk's float32 temporaries stay within
            ``CHUNK_FRACTION`` of the logits' size (between 1 MiB and 64 MiB).
        need_sq_norm: compute ‖π‖² = Σ exp(2·log π) (needed by the ``tail`` and ``full`` estimators).
        response_mask: [...] 0/1; positions outside it may hold any padding in ``tokens`` and ``rollout``
            (they are replaced by a neutral token before validation; their statistics are meaningless).
    """
    if not isinstance(logits, Tensor) or not logits.is_floating_point():
        raise TypeError("logits must be a floating-point torch.Tensor of shape [..., V].")
    if logits.dim() < 1 or logits.shape[-1] < 2:
        raise ValueError(f"logits has shape {tuple(logits.shape)}; expected [..., V] with V >= 2.")
    if not isinstance(rollout, RolloutLogprobs):
        raise TypeError(f"rollout must be a pdmask.RolloutLogprobs, got {type(rollout).__name__}.")
    vocab = logits.shape[-1]
    shape = tuple(logits.shape[:-1])
    if response_mask is not None:
        valid = as_bool_mask(response_mask, shape)
        if not valid.all():
            tokens = torch.where(valid, check_tokens(tokens, None, shape), 0)
            rollout = rollout.masked(valid)
    tokens = check_tokens(tokens, vocab, shape)
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    rollout = rollout.validated(tokens, vocab, dtype)
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}.")

    n = tokens.numel()
    flat_tokens = tokens.reshape(n)
    set_ids = flat_tokens[:, None] if rollout.topk_ids is None else torch.cat(
        [rollout.topk_ids.reshape(n, -1), flat_tokens[:, None]], -1
    )
    full_logp = None if rollout.full_logp is None else rollout.full_logp.reshape(n, vocab)
    rows = chunk_size or _default_chunk(logits, dtype)

    lse = torch.empty(n, dtype=dtype, device=logits.device)
    set_logp = torch.empty(set_ids.shape, dtype=dtype, device=logits.device)
    rest = torch.empty_like(lse)
    tail_sq = torch.empty_like(lse) if need_sq_norm else None
    full_red = None if full_logp is None else torch.empty(5, n, dtype=dtype, device=logits.device)
    with torch.no_grad():
        # Reused buffers: fresh [rows, V] allocations per chunk cost page faults comparable to the exp itself.
        exp_buf = torch.empty(min(rows, n), vocab, dtype=dtype, device=logits.device)
        up_buf = None if logits.dtype == dtype else torch.empty_like(exp_buf)
        for sl, chunk in _row_chunks(logits.detach(), rows):
            rows_here = sl.stop - sl.start
            z = chunk if up_buf is None else up_buf[:rows_here].copy_(chunk)
            m = z.amax(-1, keepdim=True)
            e = torch.sub(z, m, out=exp_buf[:rows_here]).exp_()
            s1 = e.sum(-1)
            lse[sl] = m.squeeze(-1) + s1.log()
            set_logp[sl] = z.gather(-1, set_ids[sl]) - lse[sl, None]
            if full_logp is not None and full_red is not None:
                full_red[:, sl] = _full_reductions(z, e / s1[:, None], lse[sl], full_logp[sl].to(dtype))
            e.scatter_(-1, set_ids[sl], 0.0)  # what is left is the tail off S
            rest[sl] = e.sum(-1) / s1
            if tail_sq is not None:
                tail_sq[sl] = torch.linalg.vector_norm(e, dim=-1).square() / s1.square()
    if not torch.isfinite(lse).all():
        raise ValueError("logits contain NaN or +inf (or a row of only -inf); the trainer's logits must be finite.")

    logp = _GatherLogProb.apply(logits, flat_tokens, lse, rows)
    if not torch.isfinite(logp).all():
        raise ValueError("logits are -inf at a sampled token: the trainer gives that token probability zero.")
    set_valid, set_mu = _set_columns(tokens, rollout)
    stats = PolicyStats(
        logp=logp.reshape(shape),
        rollout_logp=rollout.logp,
        has_topk=rollout.topk_ids is not None,
        has_full=rollout.full_logp is not None,
        set_ids=set_ids.reshape(shape + (-1,)),
        set_logp=set_logp.reshape(shape + (-1,)),
        set_mu=set_mu,
        set_valid=set_valid,
        rest_mass=rest.reshape(shape),
    )
    if tail_sq is not None:
        stats.tail_sq = tail_sq.reshape(shape)
        stats.sq_norm = stats.set_pi.square().sum(-1) + stats.tail_sq
    if full_red is not None:
        stats.full = FullReductions(*(r.reshape(shape) for r in full_red))
    return stats


def stats_from_set(
    logp: Tensor, tokens: Tensor, rollout: RolloutLogprobs, set_logp: Tensor, *, sq_norm: Tensor | None = None
) -> PolicyStats:
    """PolicyStats from what a trainer's own forward already has, with no pass over the vocabulary here.

    Args:
        logp: log π(a) [...], as the trainer computed it (keeps its gradient).
        tokens: a [...]; rollout: μ, already ``validated`` against the tokens (binary or top-K).
        set_logp: log π at S [..., C], the columns of ``rollout.topk_ids`` then a (C = 1 for binary).
        sq_norm: ‖π‖² [...] if the trainer's forward reduced it (needed by ``tail``).
    Off S nothing is summed, so π_R = 1 − π(S) (by expm1) and Q = ‖π‖² − Σ_S π² (clamped into
    [0, π_R²], the range the true value lies in): less precise than ``policy_stats`` when π_R < ~1e-6.
    """
    set_valid, set_mu = _set_columns(tokens, rollout)
    set_ids = tokens.unsqueeze(-1) if rollout.topk_ids is None else torch.cat([rollout.topk_ids, tokens.unsqueeze(-1)], -1)
    if set_logp.shape != set_ids.shape:
        raise ValueError(f"set_logp has shape {tuple(set_logp.shape)}; expected {tuple(set_ids.shape)} (top-K ids, then a).")
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
    )
    if sq_norm is not None:
        set_sq = stats.set_pi.square().sum(-1)
        stats.tail_sq = torch.minimum((sq_norm.detach() - set_sq).clamp_min(0.0), stats.rest_mass.square())
        stats.sq_norm = set_sq + stats.tail_sq
    return stats


def _set_columns(tokens: Tensor, rollout: RolloutLogprobs) -> tuple[Tensor, Tensor]:
    """(set_valid, set_mu) [..., C] for S = TopK ∪ {a} (or {a}); a's own column is invalid when a ∈ TopK."""
    if rollout.topk_ids is None or rollout.topk_logp is None:
        return torch.ones(tokens.shape + (1,), dtype=torch.bool, device=tokens.device), rollout.logp.exp().unsqueeze(-1)
    a_in_topk = torch.eq(rollout.topk_ids, tokens.unsqueeze(-1)).any(-1, keepdim=True)
    set_valid = torch.cat([torch.ones_like(rollout.topk_ids, dtype=torch.bool), ~a_in_topk], -1)
    set_mu = torch.cat([rollout.topk_logp.exp(), rollout.logp.exp().unsqueeze(-1)], -1).masked_fill(~set_valid, 0.0)
    return set_valid, set_mu


def _full_reductions(z: Tensor, p: Tensor, lse: Tensor, logq: Tensor) -> Tensor:
    """[5, n] = (TV, KL(μ‖π), ⟨μ,π⟩, Σ sπ, Σ sπ²) for one chunk; p = softmax(z), logq = log μ."""
    q = logq.exp()
    diff = p - q
    tv = 0.5 * diff.abs().sum(-1)
    s = diff.sign_()
    kl_terms = torch.where(q > 0, q * (logq - (z - lse[:, None])), 0.0)
    sp = s.mul_(p)
    return torch.stack([tv, kl_terms.sum(-1), (q * p).sum(-1), sp.sum(-1), torch.linalg.vecdot(sp, p)])


def _default_chunk(logits: Tensor, dtype: torch.dtype) -> int:
    budget = min(max(CHUNK_FRACTION * logits.numel() * logits.element_size(), CHUNK_MIN_BYTES), CHUNK_MAX_BYTES)
    # Two temporaries of the compute dtype per row: the upcast logits and their exponentials.
    per_row = 2 * logits.shape[-1] * torch.finfo(dtype).bits // 8
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
