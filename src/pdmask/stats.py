"""The one dispatcher of the statistics: ``policy_stats`` (logits) and ``policy_stats_from_hidden`` (hidden states)
check their arguments, agree on them over a tensor-parallel group, and choose the backend (docs/architecture.md):
the fused Triton kernels (``pdmask.triton_pass``), the dense chunks of logits or the hidden-state blocks
(``pdmask.backends``); ``stats_from_set`` builds the statistics from what a trainer's forward already has.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from pdmask.backends.dense import DenseLogits
from pdmask.backends.driver import assemble, check_finite, run_pass
from pdmask.backends.from_set import stats_from_set
from pdmask.backends.hidden import HiddenBlocks
from pdmask.backends.inputs import Prepared, compute_dtype, prepare
from pdmask.backends.shard import VocabShard, agreed, shard_of
from pdmask.rollout import RolloutLogprobs
from pdmask.triton_pass import fused_logits_pass, use_fused
from pdmask.types import PolicyStats


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
        logits: [..., V], any float dtype; computed in float32, or float64 when given float64. ``logits[..., t, :]``
            scores ``tokens[..., t]``: they are already shifted (for a causal LM, ``logits = model(ids).logits[:, :-1]``
            with ``tokens = ids[:, 1:]``).
        tokens: [...] sampled token ids: the reference shape that every other per-token input is checked against.
        rollout: what is known of μ at each position.
        chunk_size: positions per chunk; by default the chunk's float32 temporaries stay within
            ``pdmask.backends.dense.CHUNK_FRACTION`` of the logits' size (between 1 MiB and 64 MiB; on CUDA
            ``CUDA_CHUNK_FRACTION``, up to 2 GiB). With ``PDMASK_TRITON=1`` the fused Triton kernels
            (``pdmask.triton_pass``) run instead and need no chunks.
        need_sq_norm: compute ‖π‖² = Σ exp(2·log π) (needed by the ``proportional``, ``exactpi`` and ``full`` estimators).
        need_exactpi: also sum sign(π_j − u)·π_j and ·π_j² off S in this pass (the ``exactpi`` estimator's
            TV, which raises without them; ``MaskMethod.needs_exactpi`` says which methods need them).
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
            in its own shard (docs/sharded.md). Every rank must call with the same positions.
        vocab_size: the real vocabulary V when the logits are padded (Megatron pads to a multiple of 128·tp):
            padded ids never enter π and ids >= V are refused. Default: every column is real.
    """

    def check() -> tuple[VocabShard, Prepared]:
        shard = shard_of(logits, tp_group, vocab_size)
        prep = prepare(tokens, rollout, response_mask, "logits", tuple(logits.shape), shard, compute_dtype(logits.dtype), validate)
        check_chunk_size(chunk_size)
        check_head_weight(head_weight, shard.width, logits.device, rows="V" if tp_group is None else "V/tp")
        return shard, prep

    d = head_weight.shape[1] if isinstance(head_weight, Tensor) and head_weight.dim() == 2 else None
    shard, prep = agreed(tp_group, check, lambda r: signature(*r, need_sq_norm, need_exactpi, d), logits)
    if tp_group is None and vocab_size is None and use_fused(logits, prep, head_weight):
        acc, logp = fused_logits_pass(logits, prep, need_sq_norm, need_exactpi)
        if validate:
            check_finite(prep, acc, "logits")
        return assemble(prep, acc, logp)
    backend = DenseLogits(logits, prep, shard, chunk_size, need_exactpi, head_weight)
    return run_pass(backend, prep, shard, need_sq_norm, need_exactpi, validate)


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
        hidden: [..., d] hidden states (packed [N, d] or [B, T, d]), any float dtype; ``hidden[..., t, :]`` gives the
            logits that score ``tokens[..., t]`` (for a causal LM, the states before the last position).
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

    def check() -> tuple[VocabShard, Prepared, tuple[float, int, int]]:
        rows = "V" if tp_group is None else "V/tp"
        options = HiddenBlocks.checked(hidden, weight, bias, temperature, block_rows, block_vocab, rows)
        shard = VocabShard.of(tp_group, weight.shape[0], vocab_size)
        prep = prepare(tokens, rollout, response_mask, "hidden states", tuple(hidden.shape), shard, compute_dtype(hidden.dtype), validate)
        return shard, prep, options

    d = hidden.shape[-1] if need_backbone and isinstance(hidden, Tensor) else None
    shard, prep, (t, rows, cols) = agreed(tp_group, check, lambda r: signature(r[0], r[1], need_sq_norm, need_exactpi, d), hidden)
    backend = HiddenBlocks.of(hidden, weight, bias, t, rows, cols, prep, shard, need_backbone, reduce_hidden_grad)
    return run_pass(backend, prep, shard, need_sq_norm, need_exactpi, validate)


def signature(shard: VocabShard, prep: Prepared, need_sq_norm: bool, need_exactpi: bool, head_dim: int | None) -> list[int]:
    """The sizes and options the ranks' collectives depend on, for ``agreed``."""
    return [shard.width, prep.n, prep.set_ids.shape[1], prep.vocab, int(prep.full_logp is not None), int(need_sq_norm),
            int(need_exactpi), -1 if head_dim is None else head_dim, torch.finfo(prep.dtype).bits]  # fmt: skip


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


__all__ = ["policy_stats", "policy_stats_from_hidden", "stats_from_set"]
