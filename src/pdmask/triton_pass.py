"""The logits pass of ``policy_stats`` as fused Triton kernels, behind ``torch.library`` custom ops.

Forward, one program per position and one read of its logits: an online log-sum-exp (running max m,
Σ e^{z−m}) that also sums the tail off S, Σ_{j∉S} e^{z_j−m} and Σ_{j∉S} e^{2(z_j−m)} (π_R and Q); the
``exactpi`` estimator's thresholded sums Σ_{j∉S} s_j π_j, Σ_{j∉S} s_j π_j² (s_j = sign(π_j − u)) need
the final lse and take a second read. Backward of log π(a): ∂/∂z = g·(e_a − softmax(z)), one read and
one write. The chunked torch pass (``pdmask.stats``) stays the reference and the fallback.

Opt-in wherever Triton runs (CUDA logits; CPU tensors under ``TRITON_INTERPRET=1``, as the tests do):
``PDMASK_TRITON=1`` in the environment, read once when this module is imported, or ``fused_kernels(True)`` around
the calls; the compiled kernels have not run on a GPU yet (scripts/gpu_check.sh is their check).
"""

from __future__ import annotations

import contextlib
import functools
import os
import warnings
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any, NamedTuple

import torch
from torch import Tensor

from pdmask.backends.accumulators import Accumulators
from pdmask.backends.inputs import Prepared

#: The environment variable read once, when this module is imported: "1" turns the fused kernels on wherever
#: Triton runs; anything else leaves the chunked torch pass.
ENV = "PDMASK_TRITON"
#: Logit dtypes the kernels read (they accumulate in float32; float64 logits take the torch pass).
DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_FROM_ENV = os.environ.get(ENV, "") == "1"
_ASKED = f"The fused Triton kernels are asked for ({ENV}=1 or fused_kernels(True))"
_override: ContextVar[bool | None] = ContextVar("pdmask_fused_kernels", default=None)


def fused_requested() -> bool:
    """Whether the fused kernels are asked for: ``fused_kernels``' setting inside one, else ``PDMASK_TRITON=1`` at import."""
    override = _override.get()
    return _FROM_ENV if override is None else override


@contextlib.contextmanager
def fused_kernels(on: bool) -> Iterator[None]:
    """The fused kernels asked for (True) or not (False) inside the block, whatever ``PDMASK_TRITON`` says."""
    token = _override.set(on)
    try:
        yield
    finally:
        _override.reset(token)


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def use_fused(logits: Tensor, prep: Prepared, head_weight: Tensor | None) -> bool:
    """Whether ``policy_stats`` takes the fused kernels for these logits: only when they are asked for
    (``fused_requested``; opt-in until scripts/gpu_check.sh has passed on a GPU, where the compiled kernels have
    run on none yet), and only for the statistics they cover (no full μ, no LM head sums, logits whose positions
    are rows of one stride); otherwise the chunked torch pass runs, with a warning when the kernels were asked for."""
    if not fused_requested():
        return False
    if not triton_available():
        raise RuntimeError(f"{_ASKED}, but triton does not import: pip install 'pdmask[gpu]'.")
    if not kernels_run_on(logits.device):
        raise RuntimeError(
            f"{_ASKED} on {logits.device.type} logits, where they run in Triton's interpreter: set TRITON_INTERPRET=1 "
            "before triton is imported (or do not ask for them)."
        )
    why = (
        f"{logits.dtype} logits" if logits.dtype not in DTYPES else "a full μ" if prep.full_logp is not None
        else "head_weight (the backbone-aware sums)" if head_weight is not None
        else "logits whose positions are not rows of one stride" if _as_rows(logits) is None else None
    )
    if why is not None:
        warnings.warn(f"{_ASKED}, but they do not cover {why}: the chunked torch pass runs.", stacklevel=3)
    return why is None and prep.n > 0


def kernels_run_on(device: torch.device) -> bool:
    """Whether the fused kernels can run on ``device``: compiled on CUDA, in Triton's interpreter elsewhere."""
    return triton_available() and (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")


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


class Launch(NamedTuple):
    """One kernel launch: ``kernel[grid](*args, **constants)``; ``pdmask bench --part compiled`` compiles the same."""

    kernel: Any  # a triton.JITFunction
    grid: tuple[int]
    args: tuple[Any, ...]
    constants: dict[str, Any]  # constexpr parameters and launch options (num_warps)

    def __call__(self) -> None:
        self.kernel[self.grid](*self.args, **self.constants)


#: Launch options: 4 warps (2,048 ids a step is 16 per thread: registers for several blocks per SM); FP fusion
#: stated, not left to Triton's default (which Triton 3.10 turns off).
_OPTIONS = {"num_warps": 4, "enable_fp_fusion": True}


def _block(vocab: int, device: torch.device) -> int:
    """Vocabulary ids per program step: the whole row when it is short, else 2,048 where the kernels compile
    (CUDA, or a meta tensor standing for it) and 1,024 in the interpreter (on the CPU, whose cost grows with the block)."""
    import triton

    return min(triton.next_power_of_2(vocab), 1024 if device.type == "cpu" else 2048)


def stats_launch(logits: Tensor, set_ids: Tensor, even_mu: Tensor, out: Tensor, need_sq: bool, need_exactpi: bool) -> Launch:
    """The launch of the statistics kernel on logits [n, V] (unit stride along V) into out [5, n]."""
    from pdmask._triton_kernels import stats_kernel

    n, vocab = logits.shape
    c = set_ids.shape[1]
    return Launch(stats_kernel, (n,), (logits, logits.stride(0), set_ids, even_mu, out, n, vocab), dict(
        C=c, CP=max(2, 1 << (c - 1).bit_length()), BLOCK=_block(vocab, logits.device), NEED_SQ=need_sq,
        NEED_EXACTPI=need_exactpi, **_OPTIONS,
    ))  # fmt: skip


def grad_launch(logits: Tensor, tokens: Tensor, lse: Tensor, grad: Tensor, out: Tensor) -> Launch:
    """The launch of the log π(a) backward kernel on logits [n, V] into out [n, V] (contiguous)."""
    from pdmask._triton_kernels import logprob_grad_kernel

    n, vocab = logits.shape
    return Launch(logprob_grad_kernel, (n,), (logits, logits.stride(0), tokens, lse, grad, out, vocab),
                  dict(BLOCK=_block(vocab, logits.device), **_OPTIONS))  # fmt: skip


@torch.library.custom_op("pdmask::logits_stats", mutates_args=())
def logits_stats(
    logits: Tensor, set_ids: Tensor, even_mu: Tensor, need_sq: bool, need_exactpi: bool
) -> Tensor:
    """[5, n] = (lse, π_R, Q, then the exactpi sums Σ_{j∉S} s_j π_j, Σ_{j∉S} s_j π_j²) of logits [n, V] (unit
    stride along V) with S's ids [n, C] and u = μ_R/T [n]; Q is 0 unless ``need_sq``, the sums unless ``need_exactpi``."""
    out = torch.empty(5, logits.shape[0], dtype=torch.float32, device=logits.device)  # the kernel writes every entry
    if logits.shape[0]:
        stats_launch(logits, set_ids.contiguous(), even_mu.contiguous(), out, need_sq, need_exactpi)()
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
    out = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    if logits.shape[0]:
        grad_launch(logits, tokens.contiguous(), lse.contiguous(), grad.float().contiguous(), out)()
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

__all__ = [
    "DTYPES", "ENV", "Launch", "fused_kernels", "fused_logits_pass", "fused_requested", "grad_launch", "kernels_run_on",
    "stats_launch", "triton_available", "use_fused",
]
