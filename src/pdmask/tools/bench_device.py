"""`pdmask bench --device cuda`: each path of the statistics as ratios to what moving the bytes costs, at one shape.

Logits [N, V] (bf16 by default), K = 20, each path timed alone (CUDA events on a GPU, the wall clock on the
CPU) after a warm-up, median of the repeats, with its peak memory above the inputs:

  R          one read of the logits (``logits.amax(-1)``): the floor of any forward pass
  RW         one read and one write (``logits.clone()``): the floor of a backward that writes ∂/∂z
  P          ``log_softmax(logits.float())`` + gather of log π(a): what a trainer runs without pdmask
  C          ``torch.compile`` of the same statistics as dense torch (lse, log π at S, π_R, Q)
  dppo_topk / pdm_proportional / pdm_exactpi   ``pdmask.policy_stats`` as each method calls it (forward;
             the fused Triton kernels when Triton runs there), and pdm_proportional_torch: the chunked torch pass
  backward   forward + backward of Σ g·log π(a) through ``policy_stats`` (ratio to RW); backward_torch: torch pass
and from hidden states h [N, d] with the LM head W [V, d]:
  M          one ``h @ W.T`` in the inputs' dtype
  hidden     ``pdmask.policy_stats_from_hidden`` (forward), and forward + backward (``hidden_backward``)
Targets (issue 30): forward ≤ 1.3 R (≤ 2.3 R with the exactpi sums), backward ≤ 1.3 RW, forward ≤ 0.15 P,
hidden forward ≤ 1.3 M.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from torch import Tensor

from pdmask.jsonio import dumps
from pdmask.rollout import RolloutLogprobs
from pdmask.stats import policy_stats, policy_stats_from_hidden
from pdmask.tools.bench_common import make_inputs, marked, peak_mib
from pdmask.triton_pass import fused_kernels, kernels_run_on

#: Which floor each path is a ratio to.
BASELINE = {
    "R": None, "RW": None, "P": "R", "C": "R", "dppo_topk": "R", "pdm_proportional": "R", "pdm_exactpi": "R",
    "pdm_proportional_torch": "R", "backward": "RW", "backward_torch": "RW", "M": None, "hidden": "M", "hidden_backward": "M",
}  # fmt: skip
#: Upper targets of the ratio to the floor (issue 30); the torch-pass rows are references, without one.
TARGETS = {"dppo_topk": 1.3, "pdm_proportional": 1.3, "pdm_exactpi": 2.3, "backward": 1.3, "hidden": 1.3}


@dataclass
class DeviceRow:
    path: str
    ms: float
    peak_mib: float
    vs_floor: float | None  # ms over its floor's ms (BASELINE)
    vs_plain: float | None  # ms over P's (forward paths)
    vs_compiled: float | None  # ms over C's (forward paths)


def dense_stats(logits: Tensor, set_ids: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(lse, log π at S, π_R, Q) by dense torch over the whole [N, V] (the path ``torch.compile`` fuses: C)."""
    z = logits.float()
    lse = torch.logsumexp(z, -1)
    p = torch.exp(z - lse[:, None])
    tail = p.scatter(-1, set_ids, 0.0)
    return lse, z.gather(-1, set_ids) - lse[:, None], tail.sum(-1), tail.square().sum(-1)


def logits_paths(logits: Tensor, tokens: Tensor, rollout: RolloutLogprobs) -> dict[str, Callable[[], object]]:
    assert rollout.topk_ids is not None
    set_ids = torch.cat([rollout.topk_ids, tokens[:, None]], -1)
    compiled = torch.compile(dense_stats)
    grad_in = logits.detach().requires_grad_(True)
    weights = torch.randn(tokens.shape, device=logits.device)

    # The fused kernels where they can run (CUDA, or Triton's interpreter); the torch pass otherwise.
    fused = kernels_run_on(logits.device)

    def backward():
        stats = policy_stats(grad_in, tokens, rollout, validate=False)
        return torch.autograd.grad((weights * stats.logp).sum(), grad_in)

    return {
        "R": lambda: logits.amax(-1),
        "RW": lambda: logits.clone(),
        "P": lambda: torch.log_softmax(logits.float(), -1).gather(-1, tokens[:, None]),
        "C": lambda: compiled(logits, set_ids),
        "dppo_topk": lambda: _on(fused, lambda: policy_stats(logits, tokens, rollout, need_sq_norm=False, validate=False)),
        "pdm_proportional": lambda: _on(fused, lambda: policy_stats(logits, tokens, rollout, validate=False)),
        "pdm_exactpi": lambda: _on(fused, lambda: policy_stats(logits, tokens, rollout, need_exactpi=True, validate=False)),
        "pdm_proportional_torch": lambda: _on(False, lambda: policy_stats(logits, tokens, rollout, validate=False)),
        "backward": lambda: _on(fused, backward),
        "backward_torch": lambda: _on(False, backward),
    }


def _on(fused: bool, fn: Callable[[], object]) -> object:
    """fn() with the fused Triton kernels (True) or the chunked torch pass (False)."""
    with fused_kernels(fused):
        return fn()


def hidden_paths(
    vocab: int, n: int, dim: int, dtype: torch.dtype, rollout: RolloutLogprobs, tokens: Tensor
) -> dict[str, Callable[[], object]]:
    device = tokens.device
    g = torch.Generator(device=device).manual_seed(1)
    h = (torch.randn(n, dim, generator=g, device=device)).to(dtype).requires_grad_(True)
    w = (torch.randn(vocab, dim, generator=g, device=device) / dim**0.5).to(dtype).requires_grad_(True)

    def hidden_backward():
        stats = policy_stats_from_hidden(h, w, tokens, rollout, validate=False)
        return torch.autograd.grad(stats.logp.sum(), (h, w))

    return {
        "M": lambda: h.detach() @ w.detach().T,
        "hidden": lambda: policy_stats_from_hidden(h.detach(), w.detach(), tokens, rollout, validate=False),
        "hidden_backward": hidden_backward,
    }


def time_ms(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median milliseconds of ``fn`` after one warm-up call: CUDA events on a GPU, the wall clock on the CPU."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            fn()
            stop.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(stop))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def measure_device(args: argparse.Namespace) -> list[DeviceRow]:
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    logits, tokens, rollout, _ = make_inputs(args.vocab, args.positions, dtype, device)
    paths = logits_paths(logits, tokens, rollout)
    if args.hidden_dim:
        paths |= hidden_paths(args.vocab, args.positions, args.hidden_dim, dtype, rollout, tokens)
    ms = {name: time_ms(fn, device, args.repeats) for name, fn in paths.items()}
    rows = []
    for name, fn in paths.items():
        floor = BASELINE[name]
        forward = floor == "R"
        rows.append(DeviceRow(
            name, ms[name], peak_mib(fn, device),
            ms[name] / ms[floor] if floor else None,
            ms[name] / ms["P"] if forward and name != "P" else None,
            ms[name] / ms["C"] if forward and name not in ("P", "C") else None,
        ))  # fmt: skip
    return rows


def render_device(rows: list[DeviceRow], args: argparse.Namespace) -> None:
    """Prints the rows as a plain table (no rich: the GPU check runs in an image that has torch and Triton only)."""
    name = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"pdmask bench --device {args.device} ({name}, torch {torch.__version__}): V = {args.vocab:,}, "
          f"N = {args.positions:,}, {args.dtype}, K = 20, median of {args.repeats}")  # fmt: skip
    fmt = lambda x: "-" if x is None else f"{x:.2f}x"
    lines = [("path", "ms", "x floor", "target", "x P", "x C", "peak MiB")]
    for r in rows:
        floor = BASELINE[r.path]
        target = marked(r.vs_floor, TARGETS[r.path], "").strip() if r.path in TARGETS else "-"  # "✓≤1.3"
        lines.append((r.path, f"{r.ms:.3f}", fmt(r.vs_floor) + (f" ({floor})" if floor else ""), target, fmt(r.vs_plain),
                      fmt(r.vs_compiled), f"{r.peak_mib:.1f}"))  # fmt: skip
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    for line in lines:
        print("  ".join(cell.rjust(w) for cell, w in zip(line, widths)))
    print("target: ✓ met or ✗ missed, as measured (x floor against its upper bound; on a loaded machine a ratio can miss).")


def add_device_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="one shape, every path as ratios to R, RW, P, C (and M); see --vocab, --positions")  # fmt: skip
    p.add_argument("--vocab", type=int, default=151_936, help="V for --device (default 151,936)")
    p.add_argument("--positions", type=int, default=16_384, help="N for --device (default 16,384)")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16", help="logits dtype for --device")
    p.add_argument("--hidden-dim", type=int, default=2048, help="d of the hidden-state paths for --device (0: none)")


def run_device(args: argparse.Namespace) -> int:
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device.")
    args.repeats = args.repeats or 5
    rows = measure_device(args)
    render_device(rows, args)
    if args.json:
        with open(args.json, "w") as f:
            settings = {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, type(None)))}
            f.write(dumps({"device": [asdict(r) for r in rows], "args": settings}, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m pdmask.tools.bench_device``: the same as ``pdmask bench --device``, with torch alone installed."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_device_arguments(p)
    p.add_argument("--repeats", type=int, default=None, help="timed repeats per path (default 5)")
    p.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    args = p.parse_args(argv)
    args.device = args.device or "cuda"
    return run_device(args)


if __name__ == "__main__":
    raise SystemExit(main())

__all__ = ["BASELINE", "TARGETS", "DeviceRow", "add_device_arguments", "dense_stats", "measure_device", "run_device"]
