"""`pdmask bench --part counts`: kernel launches and host-device syncs of ``policy_stats`` and ``policy_loss``.

Counted on the CPU (``pdmask.tools.counts``: the same ops a GPU would launch), on a small case; the
launches of the chunked torch pass are fixed + per chunk, so they are measured with one and two chunks
and carried to a real shape (V = 151,936, N = 16,384 bf16 by default) with the chunk size each device
gets (``pdmask.backends.dense.chunk_rows``). The fused Triton pass launches the same kernels whatever the shape.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdmask.backends.dense import chunk_rows
from pdmask.loss import policy_loss
from pdmask.stats import policy_stats
from pdmask.tools.bench_common import print_table
from pdmask.tools.counts import count
from pdmask.triton_pass import fused_kernels, kernels_run_on

#: The small case the counts are taken on: positions, vocabulary, K.
SMALL = (16, 300, 20)


@dataclass
class LaunchRow:
    path: str  # "torch (cpu chunks)", "torch (cuda chunks)", "fused triton"
    exactpi: bool  # the exactpi sums in the pass
    forward_fixed: int
    forward_per_chunk: int
    backward_fixed: int
    backward_per_chunk: int
    chunks: int  # at the real shape
    forward: int  # launches of one policy_stats call at the real shape
    backward: int  # of its log π(a) backward


@dataclass
class SyncRow:
    call: str
    syncs: int
    launches: int


def _small_case(seed: int = 0):
    n, vocab, k = SMALL
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, vocab, generator=g) * 2).bfloat16().requires_grad_(True)
    logmu = torch.log_softmax(logits.detach().float() + torch.randn(n, vocab, generator=g), -1)
    tokens = torch.multinomial(logmu.exp(), 1, generator=g).squeeze(-1)
    top = logmu.topk(k, -1)
    from pdmask.rollout import RolloutLogprobs

    rollout = RolloutLogprobs(logmu.gather(-1, tokens[:, None]).squeeze(-1), top.indices, top.values)
    return logits, tokens, rollout, torch.randn(n, generator=g)


def _fwd_bwd(chunk: int | None, exactpi: bool) -> tuple[int, int]:
    logits, tokens, rollout, _ = _small_case()
    fwd = lambda: policy_stats(logits, tokens, rollout, chunk_size=chunk, need_exactpi=exactpi, validate=False)
    forward = count(fwd)[1]
    stats = fwd()
    backward = count(lambda: torch.autograd.grad(stats.logp.sum(), logits))[1]
    return forward, backward


def launch_rows(vocab: int, positions: int, dtype: torch.dtype) -> list[LaunchRow]:
    """Launches per call of ``policy_stats`` (validate=False) and of its backward at [positions, vocab] logits."""
    n = SMALL[0]
    logit_bytes = positions * vocab * torch.tensor([], dtype=dtype).element_size()
    rows = []
    with fused_kernels(False):
        for exactpi in (False, True):
            (f1, b1), (f2, b2) = _fwd_bwd(n, exactpi), _fwd_bwd(n // 2, exactpi)
            fixed_f, per_f, fixed_b, per_b = 2 * f1 - f2, f2 - f1, 2 * b1 - b2, b2 - b1
            for device in ("cpu", "cuda"):
                chunks = math.ceil(positions / chunk_rows(logit_bytes, vocab, torch.float32, 3 if exactpi else 2, device))
                rows.append(LaunchRow(f"torch ({device} chunks)", exactpi, fixed_f, per_f, fixed_b, per_b, chunks,
                                      fixed_f + per_f * chunks, fixed_b + per_b * chunks))  # fmt: skip
    if kernels_run_on(torch.device("cpu")):  # the small case's logits are on the CPU: Triton's interpreter
        with fused_kernels(True):
            for exactpi in (False, True):
                f, b = _fwd_bwd(None, exactpi)
                rows.append(LaunchRow("fused triton", exactpi, f, 0, b, 0, 1, f, b))
    return rows


def sync_rows() -> list[SyncRow]:
    """Syncs and launches of one call on the small case (torch pass), with and without the value checks."""
    logits, tokens, rollout, adv = _small_case()
    method = "pdm_proportional_tv"
    calls: dict[str, Callable[[], object]] = {
        "policy_stats": lambda: policy_stats(logits, tokens, rollout),
        "policy_stats(validate=False)": lambda: policy_stats(logits, tokens, rollout, validate=False),
        "policy_loss": lambda: policy_loss(method, logits, tokens, rollout, adv, torch.ones_like(adv)),
        "policy_loss(validate=False)": lambda: policy_loss(method, logits, tokens, rollout, adv, torch.ones_like(adv), validate=False),
        "policy_loss(validate=False, tensor_metrics=True)": lambda: policy_loss(
            method, logits, tokens, rollout, adv, torch.ones_like(adv), validate=False, tensor_metrics=True
        ),
    }
    return [SyncRow(name, *count(fn)) for name, fn in calls.items()]


def render_counts(launches: list[LaunchRow], syncs: list[SyncRow], vocab: int, positions: int) -> None:
    n, v, k = SMALL
    print_table(
        f"launches per policy_stats call at V = {vocab:,}, N = {positions:,} (counted at N = {n}, V = {v}, K = {k})",
        ("path", "exactpi sums", "fwd fixed + per chunk", "bwd fixed + per chunk", "chunks", "forward", "backward"),
        ((r.path, "yes" if r.exactpi else "no", f"{r.forward_fixed} + {r.forward_per_chunk}",
          f"{r.backward_fixed} + {r.backward_per_chunk}", f"{r.chunks:,}", f"{r.forward:,}", f"{r.backward:,}") for r in launches),
    )  # fmt: skip
    print_table(
        "host-device syncs per call (pdm_proportional_tv, top-K rollout, torch pass)", ("call", "syncs", "launches"),
        ((r.call, str(r.syncs), str(r.launches)) for r in syncs),
    )


__all__ = ["LaunchRow", "SyncRow", "launch_rows", "render_counts", "sync_rows"]
