"""`pdmask bench`'s hidden-state rows: forward + backward of log π(a) and the statistics from hidden states.

Paths, each on the same hidden states h [N, d] and LM head W [V, d] (both requiring grad), K = 20,
forward and backward of Σ g·M·log π(a) with the ``pdm_proportional_tv`` mask M (Σ g·log π(a) where no mask):
  fused         pdmask.policy_stats_from_hidden (log π(a), ‖π‖², top-K statistics) + mask
  backbone      the same with need_backbone=True and the ``pdm_backbone_topk_tv`` mask     (target: ≤ 1.5× fused)
  matmul_stats  logits = h @ W.T, then pdmask.policy_stats + mask                   (target (a))
  matmul_plain  logits = h @ W.T, then log_softmax(logits.float()) + gather        (target (b))
  trl_sq        TRL's chunked fused log π(a) (trl.kernels.chunked_logprob), then a   (target (c))
                second no-grad sweep of it for ‖π‖² (log_sum_sq_probs)
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from pdmask.methods import trust_region_mask
from pdmask.rollout import RolloutLogprobs
from pdmask.stats import policy_stats, policy_stats_from_hidden
from pdmask.tools.bench_common import marked, peak_bytes, print_table, sample_rollout

HIDDEN_PATHS = ("fused", "backbone", "matmul_stats", "matmul_plain", "trl_sq")
RATIO_PATHS = HIDDEN_PATHS[2:]


@dataclass(frozen=True)
class HiddenConfig:
    vocab: int
    dim: int
    positions: int
    dtype: str
    paths: tuple[str, ...] = HIDDEN_PATHS


#: Time ratios at N = 1,024 (every path), and the memory targets at V = 151,936 (the fused path alone at
#: N = 4,096 and 8,192, memory only: the [N, V] paths would need 5-10 GB there).
FULL_HIDDEN_GRID = [
    HiddenConfig(32_000, 896, 1_024, "float32"),
    HiddenConfig(32_000, 896, 1_024, "bfloat16"),
    HiddenConfig(32_000, 2_048, 1_024, "float32"),
    HiddenConfig(151_936, 896, 1_024, "float32"),
    HiddenConfig(151_936, 896, 4_096, "float32", ("fused", "backbone")),
    HiddenConfig(151_936, 896, 8_192, "float32", ("fused", "backbone")),
    HiddenConfig(151_936, 896, 8_192, "bfloat16", ("fused", "backbone")),
]
QUICK_HIDDEN_GRID = [HiddenConfig(32_000, 256, 256, "float32")]


@dataclass
class HiddenRow:
    vocab: int
    dim: int
    positions: int
    dtype: str
    ms: dict[str, float]  # median wall time
    cpu_ms: dict[str, float]  # median process CPU time (all threads): robust to other jobs on a shared machine
    extra_mib: dict[str, float]  # peak bytes allocated above the inputs and the gradients it returns
    logits_mib: float  # the float32 [N, V] logits the fused path avoids

    def ratio(self, other: str, cpu: bool = False) -> float | None:
        ms = self.cpu_ms if cpu else self.ms
        return ms["fused"] / ms[other] if "fused" in ms and other in ms else None

    def backbone_ratio(self, cpu: bool = False) -> float | None:
        """backbone / fused: what the backbone-aware sums add to the hidden-state pass."""
        ms = self.cpu_ms if cpu else self.ms
        return ms["backbone"] / ms["fused"] if "fused" in ms and "backbone" in ms else None


def hidden_inputs(vocab: int, dim: int, n: int, dtype: torch.dtype, k: int = 20, seed: int = 0):
    """h [n, d], W [V, d] with logits of scale ~3, sampled tokens and a top-K rollout μ (a perturbed π)."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, dim, generator=g).to(dtype)
    w = (torch.randn(vocab, dim, generator=g) * (3 / dim**0.5)).to(dtype)
    tokens = torch.empty(n, dtype=torch.long)
    logp, ids, vals = torch.empty(n), torch.empty(n, k, dtype=torch.long), torch.empty(n, k)
    for s in range(0, n, 256):  # chunked so that setup stays small next to what is measured
        tokens[s : s + 256], logp[s : s + 256], ids[s : s + 256], vals[s : s + 256] = sample_rollout((h[s : s + 256] @ w.T).float(), g, k)
    return h, w, tokens, RolloutLogprobs(logp, ids, vals), torch.randn(n, generator=g), torch.randn(n, generator=g)


def hidden_paths(
    h: Tensor, w: Tensor, tokens: Tensor, rollout: RolloutLogprobs, adv: Tensor, g: Tensor
) -> dict[str, Callable[[], object]]:
    """Each path's forward + backward; the gradients land in h.grad and w.grad."""

    def masked_backward(stats, method: str = "pdm_proportional_tv"):
        keep = trust_region_mask(method, stats, adv)
        (stats.logp * g * keep).sum().backward()

    def fused():
        masked_backward(policy_stats_from_hidden(h, w, tokens, rollout))

    def backbone():
        masked_backward(policy_stats_from_hidden(h, w, tokens, rollout, need_backbone=True), "pdm_backbone_topk_tv")

    def matmul_stats():
        masked_backward(policy_stats(h @ w.T, tokens, rollout))

    def matmul_plain():
        logp = torch.log_softmax((h @ w.T).float(), -1).gather(-1, tokens[:, None]).squeeze(-1)
        (logp * g).sum().backward()

    def trl_sq():
        from trl.kernels.chunked_logprob import ChunkedLogProbFunction
        from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE as chunk

        logp = ChunkedLogProbFunction.apply(h, w, None, tokens, 1.0, chunk, None, 1.0, ())[0]
        (logp * g).sum().backward()
        with torch.no_grad():
            ChunkedLogProbFunction.apply(h, w, None, tokens, 1.0, chunk, None, 1.0, ("log_sum_sq_probs",))

    return {"fused": fused, "backbone": backbone, "matmul_stats": matmul_stats, "matmul_plain": matmul_plain, "trl_sq": trl_sq}


def trl_available() -> bool:
    """Whether TRL's chunked log-prob imports (done here, so that no measured run pays for the import)."""
    try:
        import trl.kernels.chunked_logprob  # noqa: F401
        import trl.trainer.utils  # noqa: F401  (its backward imports this)
    except ImportError:
        return False
    return True


def measure_hidden(cfg: HiddenConfig, repeats: int) -> HiddenRow:
    """Peak memory of each path from one run under the memory profiler (which also warms up), then the median
    time of ``repeats`` runs without it, interleaved so that machine noise hits every path alike."""
    h, w, tokens, rollout, adv, g = hidden_inputs(cfg.vocab, cfg.dim, cfg.positions, getattr(torch, cfg.dtype))
    h.requires_grad_(True)
    w.requires_grad_(True)
    fns = hidden_paths(h, w, tokens, rollout, adv, g)
    names = [p for p in cfg.paths if p != "trl_sq" or trl_available()]
    grads_bytes = h.numel() * h.element_size() + w.numel() * w.element_size()
    extra: dict[str, float] = {}
    for name in names:
        h.grad = w.grad = None  # freed before the measurement, not inside it
        extra[name] = (peak_bytes(fns[name]) - grads_bytes) / 2**20
    wall: dict[str, list[float]] = {p: [] for p in names}
    cpu: dict[str, list[float]] = {p: [] for p in names}
    for _ in range(repeats):
        for name in names:
            h.grad = w.grad = None
            t0, c0 = time.perf_counter(), time.process_time()
            fns[name]()
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    return HiddenRow(
        cfg.vocab, cfg.dim, cfg.positions, cfg.dtype, _medians_ms(wall), _medians_ms(cpu), extra,
        cfg.positions * cfg.vocab * 4 / 2**20,
    )


def _medians_ms(times: dict[str, list[float]]) -> dict[str, float]:
    return {p: 1e3 * statistics.median(t) for p, t in times.items() if t}


#: Upper targets: fused / each path (wall time), backbone / fused, and the fused paths' extra memory in % of the
#: float32 logits at the shape it is set for.
RATIO_TARGETS = {"matmul_stats": 1.3, "trl_sq": 1.0}
BACKBONE_TARGET = 1.5
MEMORY_TARGET_PCT, MEMORY_TARGET_SHAPE = 2.0, (151_936, 8_192)


def render_hidden(rows: list[HiddenRow]) -> None:
    shape = lambda r: (f"{r.vocab:,}", f"{r.dim:,}", f"{r.positions:,}", r.dtype)
    print_table(
        f"pdmask bench: hidden states -> log π(a) + statistics, forward + backward, K = 20, median ms, "
        f"{torch.get_num_threads()} threads",
        ("V", "d", "N", "dtype", *HIDDEN_PATHS),
        ((*shape(r), *(f"{r.ms[p]:.0f}" if p in r.ms else "-" for p in HIDDEN_PATHS)) for r in rows),
    )
    print_table(
        "ratios of median wall times (in brackets: of process CPU times)",
        ("V", "d", "N", "dtype", "backbone/fused", *(f"fused/{p}" for p in RATIO_PATHS)),
        ((*shape(r), _ratio_cell(r.backbone_ratio(), r.backbone_ratio(cpu=True), BACKBONE_TARGET),
          *(_ratio_cell(r.ratio(p), r.ratio(p, cpu=True), RATIO_TARGETS.get(p)) for p in RATIO_PATHS)) for r in rows),
    )  # fmt: skip
    print_table(
        "extra memory: peak bytes allocated above the inputs and the returned gradients, % of the float32 [N, V] logits",
        ("V", "d", "N", "dtype", *HIDDEN_PATHS),
        ((*shape(r), *(_memory_cell(r, p) for p in HIDDEN_PATHS)) for r in rows),
        f"Targets (✓ met, ✗ missed, as measured; on a loaded machine a time ratio can miss): fused/matmul_stats <= 1.3x, "
        f"fused <= trl_sq, backbone/fused <= {BACKBONE_TARGET}x (wall times); fused and backbone extra memory <= "
        f"{MEMORY_TARGET_PCT:g}% of the float32 logits at V = {MEMORY_TARGET_SHAPE[0]:,}, N = {MEMORY_TARGET_SHAPE[1]:,}, "
        "and not growing with N.",
    )


def _ratio_cell(wall: float | None, cpu: float | None, target: float | None) -> str:
    if wall is None or cpu is None:
        return "-"
    text = f"{wall:.2f}x ({cpu:.2f}x)"
    return text if target is None else marked(wall, target, text)


def _memory_cell(r: HiddenRow, path: str) -> str:
    if path not in r.extra_mib:
        return "-"
    pct = 100 * r.extra_mib[path] / r.logits_mib
    text = f"{r.extra_mib[path]:.0f} MiB ({pct:.1f}%)"
    targeted = path in ("fused", "backbone") and (r.vocab, r.positions) == MEMORY_TARGET_SHAPE
    return marked(pct, MEMORY_TARGET_PCT, text) if targeted else text


__all__ = ["FULL_HIDDEN_GRID", "HiddenConfig", "HiddenRow", "QUICK_HIDDEN_GRID", "hidden_paths", "measure_hidden"]
