"""The logits pass of ``policy_stats`` as fused Triton kernels, behind ``torch.library`` custom ops.

Forward, one program per position and one read of its logits: an online log-sum-exp (running max m,
Σ e^{z−m}) that also sums the tail off S, Σ_{j∉S} e^{z_j−m} and Σ_{j∉S} e^{2(z_j−m)} (π_R and Q); the
``exactpi`` estimator's thresholded sums Σ_{j∉S} s_j π_j, Σ_{j∉S} s_j π_j² (s_j = sign(π_j − u)) need
the final lse and take a second read. Backward of log π(a): ∂/∂z = g·(e_a − softmax(z)), one read and
one write. The chunked torch pass (``pdmask.stats``) stays the reference and the fallback.

Opt-in with ``PDMASK_TRITON=1`` wherever Triton runs (CUDA logits; CPU tensors under ``TRITON_INTERPRET=1``, as
the tests do): the compiled kernels have not run on a GPU yet (scripts/gpu_check.sh is their check).
"""

from __future__ import annotations

import contextlib
import functools
import os
import warnings
from collections.abc import Iterator

import torch
from torch import Tensor

from pdmask.backends.accumulators import Accumulators
from pdmask.backends.inputs import Prepared

#: "1": use the fused kernels wherever Triton runs; anything else: the chunked torch pass.
ENV = "PDMASK_TRITON"
#: Logit dtypes the kernels read (they accumulate in float32; float64 logits take the torch pass).
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def use_fused(logits: Tensor, prep: Prepared, head_weight: Tensor | None) -> bool:
    """Whether ``policy_stats`` takes the fused kernels for these logits: only when ``PDMASK_TRITON=1`` asks for
    them (opt-in until scripts/gpu_check.sh has passed on a GPU; the compiled kernels have run on none yet), and
    only for the statistics they cover (no full μ, no LM head sums, logits whose positions are rows of one
    stride); otherwise the chunked torch pass runs, with a warning when the kernels were asked for."""
    if os.environ.get(ENV, "") != "1":
        return False
    if not triton_available():
        raise RuntimeError(f"{ENV}=1 asks for the fused Triton kernels, but triton does not import: pip install 'pdmask[gpu]'.")
    if not kernels_run_on(logits.device):
        raise RuntimeError(
            f"{ENV}=1 on {logits.device.type} logits runs the kernels in Triton's interpreter: set TRITON_INTERPRET=1 "
            "before triton is imported (or unset PDMASK_TRITON)."
        )
    why = (
        f"{logits.dtype} logits" if logits.dtype not in DTYPES else "a full μ" if prep.full_logp is not None
        else "head_weight (the backbone-aware sums)" if head_weight is not None
        else "logits whose positions are not rows of one stride" if _as_rows(logits) is None else None
    )
    if why is not None:
        warnings.warn(f"{ENV}=1, but the fused Triton kernels do not cover {why}: the chunked torch pass runs.", stacklevel=3)
    return why is None and prep.n > 0


def kernels_run_on(device: torch.device) -> bool:
    """Whether the fused kernels can run on ``device``: compiled on CUDA, in Triton's interpreter elsewhere."""
    return triton_available() and (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")


@contextlib.contextmanager
def kernels_switched(setting: str) -> Iterator[None]:
    """``PDMASK_TRITON=setting`` inside the block ("1": the fused kernels, "0": the torch pass), as it was after."""
    saved = os.environ.get(ENV)
    os.environ[ENV] = setting
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = saved


def _as_rows(logits: Tensor) -> Tensor | None:
    """logits [..., V] as a [n, V] view with unit stride along V, or None (the torch pass handles any layout)."""
    if logits.stride(-1) != 1:
        return None
    try:
        return logits.view(-1, logits.shape[-1])
    except RuntimeError:
        return None


def fused_logits_pass(logits: Tensor, prep: Prepared, need_sq_norm: bool, need_exactpi: bool) -> tuple[Accumulators, Tensor]:
    """(accumulators, log π(a) [n] with its gradient) of [..., V] logits by the fused kernels."""
    rows = _as_rows(logits)
    assert rows is not None
    need_exactpi = need_exactpi and prep.rollout.topk_ids is not None
    sums = torch.ops.pdmask.logits_stats(rows.detach(), prep.set_ids, prep.flat_even_mu.float(), need_sq_norm, need_exactpi)
    lse, rest, tail_sq, exactpi = sums[0], sums[1], sums[2], sums[3:]
    set_logp = rows.detach().gather(-1, prep.set_ids).float() - lse[:, None]
    acc = Accumulators(lse, set_logp, rest, tail_sq if need_sq_norm else None, None, exactpi if need_exactpi else None)
    return acc, torch.ops.pdmask.gather_logprob(rows, prep.flat_tokens, lse)


def _block(vocab: int, device: torch.device) -> int:
    """Vocabulary ids per program step: the whole row when it is short, else 4,096 on a GPU (1,024 under the
    interpreter, whose cost grows with the block)."""
    import triton

    return min(triton.next_power_of_2(vocab), 4096 if device.type == "cuda" else 1024)


@torch.library.custom_op("pdmask::logits_stats", mutates_args=())
def logits_stats(
    logits: Tensor, set_ids: Tensor, even_mu: Tensor, need_sq: bool, need_exactpi: bool
) -> Tensor:
    """[5, n] = (lse, π_R, Q, then the exactpi sums Σ_{j∉S} s_j π_j, Σ_{j∉S} s_j π_j²) of logits [n, V] (unit
    stride along V) with S's ids [n, C] and u = μ_R/T [n]; Q is 0 unless ``need_sq``, the sums unless ``need_exactpi``."""
    from pdmask._triton_kernels import stats_kernel

    n, vocab = logits.shape
    out = torch.empty(5, n, dtype=torch.float32, device=logits.device)  # the kernel writes every entry
    if n:
        stats_kernel[(n,)](
            logits, logits.stride(0), set_ids.contiguous(), even_mu.contiguous(), out, n, vocab,
            C=set_ids.shape[1], BLOCK=_block(vocab, logits.device), NEED_SQ=need_sq, NEED_EXACTPI=need_exactpi,
        )
    return out


@logits_stats.register_fake
def _(logits, set_ids, even_mu, need_sq, need_exactpi):
    return logits.new_empty(5, logits.shape[0], dtype=torch.float32)


@torch.library.custom_op("pdmask::gather_logprob", mutates_args=())
def gather_logprob(logits: Tensor, tokens: Tensor, lse: Tensor) -> Tensor:
    """log π(a) = z_a − lse [n] of logits [n, V]; differentiable in the logits by the fused backward."""
    return logits.gather(-1, tokens[:, None]).squeeze(-1).to(lse.dtype) - lse


@gather_logprob.register_fake
def _(logits, tokens, lse):
    return torch.empty_like(lse)


@torch.library.custom_op("pdmask::logprob_backward", mutates_args=())
def logprob_backward(logits: Tensor, tokens: Tensor, lse: Tensor, grad: Tensor) -> Tensor:
    """∂/∂z of Σ g·log π(a): g·(e_a − softmax(z)) [n, V] contiguous, in the logits' dtype."""
    from pdmask._triton_kernels import logprob_grad_kernel

    n, vocab = logits.shape
    out = torch.empty(n, vocab, dtype=logits.dtype, device=logits.device)
    if n:
        logprob_grad_kernel[(n,)](
            logits, logits.stride(0), tokens.contiguous(), lse.contiguous(), grad.float().contiguous(), out, vocab,
            BLOCK=_block(vocab, logits.device),
        )
    return out


@logprob_backward.register_fake
def _(logits, tokens, lse, grad):
    return logits.new_empty(logits.shape)


def _setup(ctx, inputs, output) -> None:
    logits, tokens, lse = inputs
    ctx.save_for_backward(logits, tokens, lse)


def _backward(ctx, grad: Tensor):
    logits, tokens, lse = ctx.saved_tensors
    return torch.ops.pdmask.logprob_backward(logits, tokens, lse, grad), None, None


gather_logprob.register_autograd(_backward, setup_context=_setup)

__all__ = ["DTYPES", "ENV", "fused_logits_pass", "triton_available", "use_fused"]
