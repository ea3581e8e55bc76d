"""The statistics the masks read (``PolicyStats``), from logits or from what a trainer's forward already has.

``policy_stats`` makes one memory-lean pass over materialised logits: log π(a) with its gradient and
every statistic the masks need; ``stats_from_set`` builds them from what a trainer's forward already
has. The pass's toolkit, shared with ``pdmask.hidden``, is ``pdmask.vocab_pass``; ``assemble`` turns
a finished pass of either into ``PolicyStats``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from pdmask.rollout import RolloutLogprobs
from pdmask.triton_pass import fused_logits_pass, use_fused
from pdmask.vocab_pass import (
    Accumulators,
    Buffers,
    GatherLogProb,
    HeadMeans,
    Prepared,
    default_chunk,
    even_mu,
    exactpi_pass,
    logit_blocks,
    prepare,
    rest_of,
    set_columns,
    shifted_sums,
    tail_count,
)


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
    #: filled by the pass when asked for, else on first use by ``exactpi_pass`` (a second pass).
    exactpi_sums: Tensor | None = None
    exactpi_pass: Callable[[], Tensor] | None = field(default=None, repr=False, compare=False)
    head: HeadMeans | None = field(default=None, repr=False)  # with the unembedding W (backbone-aware masks)

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
        return rest_of(self.set_mu)

    @property
    def even_tail_mu(self) -> Tensor:
        """u = μ_R / T [...]: μ's unseen tail spread evenly over the T ids off S (0 when T = 0)."""
        if self.tail_count is None:
            raise ValueError("the exactpi estimator needs the vocabulary size: pass stats_from_set(..., vocab_size=V).")
        return even_mu(self.set_mu, self.tail_count)

    def exactpi_tail_sums(self) -> Tensor:
        """[2, ...] Σ_{j∉S} sign(π_j − u)·π_j and ·π_j², computed by a second pass when the first did not."""
        if self.exactpi_sums is None:
            if self.exactpi_pass is None:
                raise ValueError(
                    "the exactpi estimator's TV needs sums over the vocabulary off S, which stats_from_set cannot "
                    "give: compute the statistics with pdmask.policy_stats or pdmask.policy_stats_from_hidden."
                )
            self.exactpi_sums = self.exactpi_pass()
        return self.exactpi_sums


def policy_stats(
    logits: Tensor,
    tokens: Tensor,
    rollout: RolloutLogprobs,
    *,
    chunk_size: int | None = None,
    need_sq_norm: bool = True,
    need_exactpi: bool = False,
    response_mask: Tensor | None = None,
    head_weight: Tensor | None = None,
    validate: bool = True,
    tp_group: ProcessGroup | None = None,
    vocab_size: int | None = None,
) -> PolicyStats:
    """Statistics of π = softmax(logits) at the sampled tokens, in one chunked pass.

    Args:
        logits: [..., V], any float dtype; computed in float32, or float64 when given float64.
        tokens: [...] sampled token ids.
        rollout: what is known of μ at each position.
        chunk_size: positions per chunk; by default the chunk's float32 temporaries stay within
            ``pdmask.vocab_pass.CHUNK_FRACTION`` of the logits' size (between 1 MiB and 64 MiB; on CUDA
            ``CUDA_CHUNK_FRACTION``, up to 2 GiB). With ``PDMASK_TRITON=1`` the fused Triton kernels
            (``pdmask.triton_pass``) run instead and need no chunks.
        need_sq_norm: compute ‖π‖² = Σ exp(2·log π) (needed by the ``proportional``, ``exactpi`` and ``full`` estimators).
        need_exactpi: also sum sign(π_j − u)·π_j and ·π_j² off S in this pass (the ``exactpi`` estimator's
            TV); otherwise a second pass over the retained logits computes them if they are ever used.
        response_mask: [...] 0/1; positions outside it may hold any padding in ``tokens`` and ``rollout``
            (they are replaced by a neutral token before validation; their statistics are meaningless).
        head_weight: the LM head W [V, d] the logits came from (logits = (h Wᵀ + b)/T); given, the pass
            also sums Wᵀπ (and Wᵀμ, Σ sign(π − μ)·π·w with a full μ) for the backbone-aware ``pdm_backbone_*`` masks.
        validate: check the values of tokens, rollout and response_mask and the finiteness of the logits
            (each check reads a value back from the device); ``False`` checks shapes only, for a caller who
            validated the same inputs once: no host-device sync.
        tp_group: a tensor-parallel process group: ``logits`` is then this rank's shard [..., V/tp] of the vocabulary
            (Megatron's: rank r holds ids [r·V/tp, (r+1)·V/tp)), ``head_weight`` its [V/tp, d] rows, ``full_logp``
            [..., V] or the shard; every rank gets the unsharded call's statistics, with the gradient of log π(a)
            in its own shard (``pdmask.sharded``, docs/sharded.md). Every rank must call with the same positions.
        vocab_size: the real vocabulary V when the logits are padded (Megatron pads to a multiple of 128·tp):
            padded ids never enter π and ids >= V are refused. Default: every column is real.
    """
    if tp_group is not None or vocab_size is not None:
        from pdmask.sharded import sharded_policy_stats

        return sharded_policy_stats(
            logits, tokens, rollout, tp_group=tp_group, vocab_size=vocab_size, chunk_size=chunk_size,
            need_sq_norm=need_sq_norm, need_exactpi=need_exactpi, response_mask=response_mask, head_weight=head_weight,
            validate=validate,
        )
    if not isinstance(logits, Tensor) or not logits.is_floating_point():
        raise TypeError("logits must be a floating-point torch.Tensor of shape [..., V].")
    if logits.dim() < 1 or logits.shape[-1] < 2:
        raise ValueError(f"logits has shape {tuple(logits.shape)}; expected [..., V] with V >= 2.")
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    prep = prepare(tokens, rollout, response_mask, tuple(logits.shape[:-1]), logits.shape[-1], dtype, "logits", validate)
    check_chunk_size(chunk_size)
    rows = chunk_size or default_chunk(logits, dtype, 3 if need_exactpi else 2)
    check_head_weight(head_weight, logits.shape[-1], logits.device)
    source = logits.detach()
    if use_fused(logits, prep, head_weight):
        acc, logp = fused_logits_pass(logits, prep, need_sq_norm, need_exactpi)
    else:
        acc, logp = _chunked_pass(logits, prep, rows, dtype, need_sq_norm, need_exactpi, head_weight)
    if validate:
        acc.check_finite("logits", logp)
    stats = assemble(prep, acc, logp)
    if stats.exactpi_sums is None and stats.has_topk:

        def second_pass() -> Tensor:
            second = Buffers.empty(min(rows, prep.n) * prep.vocab, dtype, source.device, True)
            return exactpi_pass(prep, acc, second, logit_blocks(source, rows, prep.set_ids, second))

        stats.exactpi_pass = second_pass
    return stats


def _chunked_pass(
    logits: Tensor, prep: Prepared, rows: int, dtype: torch.dtype, need_sq_norm: bool, need_exactpi: bool,
    head_weight: Tensor | None,
) -> tuple[Accumulators, Tensor]:
    """(accumulators, log π(a) [n] with its gradient) of [..., V] logits by chunks of ``rows`` positions in torch."""
    if head_weight is not None:  # cast once: every chunk spans the whole vocabulary
        head_weight = head_weight.detach().to(dtype)
    acc = Accumulators.empty(prep, need_sq_norm, need_exactpi, head_weight)
    flat_u = prep.flat_even_mu
    with torch.no_grad():
        bufs = Buffers.empty(min(rows, prep.n) * prep.vocab, dtype, logits.device, need_exactpi)
        for sl, z, set_cols, _ in logit_blocks(logits.detach(), rows, prep.set_ids, bufs):
            m = z.amax(-1)
            sums = shifted_sums(z, m, set_cols, bufs, acc.tail_sq is not None)
            acc.finish_rows(sl, m, *sums, z.gather(-1, set_cols), acc.tail_product(bufs, *z.shape))
            acc.add_normalised(sl, z, bufs, set_cols, flat_u, prep.full_logp)
    return acc, GatherLogProb.apply(logits, prep.flat_tokens, acc.lse, rows)


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
    set_valid, set_mu = set_columns(tokens, rollout)
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
        tail_count=None if vocab_size is None else tail_count(set_valid, vocab_size, set_mu.dtype),
    )
    if sq_norm is not None:
        set_sq = stats.set_pi.square().sum(-1)
        stats.tail_sq = torch.minimum((sq_norm.detach() - set_sq).clamp_min(0.0), stats.rest_mass.square())
        stats.sq_norm = set_sq + stats.tail_sq
    return stats


def assemble(prep: Prepared, acc: Accumulators, logp: Tensor) -> PolicyStats:
    """PolicyStats from a finished pass: its inputs, its accumulators and log π(a) [n] (with its gradient)."""
    shape = prep.shape
    stats = PolicyStats(
        logp=logp.reshape(shape),
        rollout_logp=prep.rollout.logp,
        has_topk=prep.rollout.topk_ids is not None,
        has_full=prep.rollout.full_logp is not None,
        set_ids=prep.set_ids.reshape(shape + (-1,)),
        set_logp=acc.set_logp.reshape(shape + (-1,)),
        set_mu=prep.set_mu,
        set_valid=prep.set_valid,
        rest_mass=acc.rest.reshape(shape),
        tail_count=prep.tail_count,
        exactpi_sums=None if acc.exactpi is None else acc.exactpi.reshape((2,) + shape),
    )
    if acc.tail_sq is not None:
        stats.tail_sq = acc.tail_sq.reshape(shape)
        stats.sq_norm = stats.set_pi.square().sum(-1) + stats.tail_sq
    if acc.full is not None:
        stats.full = FullReductions(*(r.reshape(shape) for r in acc.full))
    if acc.head is not None:
        h = acc.head
        at = lambda x: None if x is None else x.reshape(shape + (-1,))
        stats.head = replace(h, tail=h.tail.reshape(shape + (-1,)), mu=at(h.mu), sign_pi=at(h.sign_pi))  # the pass's, shaped
    return stats


def check_chunk_size(chunk_size: object) -> None:
    """Raises unless ``chunk_size`` is None or a positive int."""
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}.")


def check_head_weight(weight: Tensor | None, vocab: int, device: torch.device, rows: str = "V") -> None:
    """Raises unless ``weight`` is None or the [rows, d] floating-point LM head (its rows for the logits' ``vocab``
    columns: the whole vocabulary, or under tensor parallelism this rank's shard) on ``device``."""
    if weight is None:
        return
    if not isinstance(weight, Tensor) or not weight.is_floating_point() or weight.dim() != 2 or weight.shape[0] != vocab:
        shape = tuple(weight.shape) if isinstance(weight, Tensor) else type(weight).__name__
        raise ValueError(f"head_weight must be the LM head's floating-point [{rows}, d] weight with {rows} = {vocab}, got {shape}.")
    if weight.device != device:
        raise ValueError(f"head_weight is on {weight.device} but the logits are on {device}; put them on one device.")


__all__ = ["FullReductions", "HeadMeans", "PolicyStats", "policy_stats", "stats_from_set"]
