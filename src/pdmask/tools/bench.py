"""`pdmask bench`: time and peak memory of the mask statistics at real vocabulary sizes, as ratios in one run.

Paths, each on the same logits [N, V] (no gradient), K = 20:
  plain       log_softmax(logits.float()) + gather of log π(a)          (what every trainer already does)
  dppo_torch  log_softmax(logits.float()) + gathers at a and the top-K  (DPPO's statistics, plain torch)
  dppo_topk   pdmask.policy_stats without ‖π‖² + the dppo_topk_tv mask  (DPPO's statistics, chunked)
  pdm_proportional    pdmask.policy_stats with ‖π‖² + the pdm_proportional_tv mask      (PDM's statistics, chunked)
and the hidden-state rows of ``pdmask.tools.bench_hidden`` (forward + backward from hidden states and the LM head),
and the sharded rows of ``pdmask.tools.bench_sharded`` (the vocabulary split over tp = 2 gloo processes).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch
from torch import Tensor

from pdmask.jsonio import dumps
from pdmask.methods import trust_region_mask
from pdmask.rollout import RolloutLogprobs
from pdmask.stats import policy_stats
from pdmask.tools.bench_common import make_inputs, marked, peak_bytes, print_table
from pdmask.tools.bench_counts import launch_rows, render_counts, sync_rows
from pdmask.tools.bench_device import add_device_arguments, run_device
from pdmask.tools.bench_hidden import FULL_HIDDEN_GRID, QUICK_HIDDEN_GRID, HiddenRow, measure_hidden, render_hidden
from pdmask.tools.bench_sharded import FULL_SHARDED_GRID, QUICK_SHARDED_GRID, ShardedRow, measure_sharded, render_sharded

HELP = (
    "Benchmark time and peak memory of the PDM statistics (pdm_proportional) against the plain pass and DPPO's top-K statistics, "
    "of the statistics straight from hidden states against matmul + policy_stats and a published fused log-prob, "
    "and of the statistics on a vocabulary split over tp = 2 gloo processes against the unsharded pass."
)

FULL_GRID = [(v, n, d) for v in (32_000, 151_936) for n in (1_024, 4_096) for d in ("float32", "bfloat16")]
QUICK_GRID = [(32_000, 1_024, "float32"), (32_000, 1_024, "bfloat16"), (151_936, 1_024, "bfloat16")]
PATHS = ("plain", "dppo_torch", "dppo_topk", "pdm_proportional")


@dataclass
class Row:
    vocab: int
    positions: int
    dtype: str
    ms: dict[str, float]
    peak_mib: dict[str, float]
    logits_mib: float

    @property
    def proportional_vs_dppo(self) -> float:
        return self.ms["pdm_proportional"] / self.ms["dppo_topk"]


def paths(logits: Tensor, tokens: Tensor, rollout: RolloutLogprobs, adv: Tensor) -> dict[str, Callable[[], object]]:
    def plain():
        return torch.log_softmax(logits.float(), -1).gather(-1, tokens[:, None])

    def dppo_torch():
        lsm = torch.log_softmax(logits.float(), -1)
        return lsm.gather(-1, tokens[:, None]), lsm.gather(-1, rollout.topk_ids)

    def dppo_topk():
        return trust_region_mask("dppo_topk_tv", policy_stats(logits, tokens, rollout, need_sq_norm=False), adv)

    def pdm_proportional():
        return trust_region_mask("pdm_proportional_tv", policy_stats(logits, tokens, rollout), adv)

    return {"plain": plain, "dppo_torch": dppo_torch, "dppo_topk": dppo_topk, "pdm_proportional": pdm_proportional}


def measure(vocab: int, n: int, dtype: str, repeats: int) -> Row:
    logits, tokens, rollout, adv = make_inputs(vocab, n, getattr(torch, dtype))
    fns = paths(logits, tokens, rollout, adv)
    times: dict[str, list[float]] = {p: [] for p in PATHS}
    with torch.no_grad():
        for fn in fns.values():
            fn()  # warm-up
        for _ in range(repeats):
            for name, fn in fns.items():  # interleaved, so that machine noise hits every path alike
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
        peaks = {name: peak_bytes(fn) / 2**20 for name, fn in fns.items()}
    return Row(
        vocab, n, dtype, {p: 1e3 * statistics.median(t) for p, t in times.items()}, peaks,
        logits.numel() * logits.element_size() / 2**20,
    )


#: Upper targets of the logits rows: pdm_proportional / dppo_topk time, and its extra memory in % of the logits.
TIME_TARGET, MEMORY_TARGET_PCT = 1.15, 10.0


def render(rows: list[Row]) -> None:
    threads = torch.get_num_threads()
    print_table(
        f"pdmask bench: policy_stats + mask, K = 20, median ms of the repeats, {threads} threads",
        ("V", "N", "logits", *(f"{p} ms" for p in PATHS)),
        ((f"{r.vocab:,}", f"{r.positions:,}", r.dtype, *(f"{r.ms[p]:.1f}" for p in PATHS)) for r in rows),
    )
    print_table(
        "pdm_proportional (prop) against the other paths; extra mem = peak bytes allocated above the logits",
        ("V", "N", "logits", "prop/dppo_topk", "prop/dppo_torch", "prop/plain", "prop extra mem", "dppo_torch extra mem"),
        ((
            f"{r.vocab:,}", f"{r.positions:,}", r.dtype, marked(r.proportional_vs_dppo, TIME_TARGET),
            f"{r.ms['pdm_proportional'] / r.ms['dppo_torch']:.2f}x", f"{r.ms['pdm_proportional'] / r.ms['plain']:.2f}x",
            marked(pct := 100 * r.peak_mib["pdm_proportional"] / r.logits_mib, MEMORY_TARGET_PCT,
                   f"{r.peak_mib['pdm_proportional']:.1f} MiB ({pct:.1f}%)"),
            f"{r.peak_mib['dppo_torch']:.0f} MiB ({100 * r.peak_mib['dppo_torch'] / r.logits_mib:.0f}%)",
        ) for r in rows),
        f"Targets: prop/dppo_topk <= {TIME_TARGET}x; prop extra memory <= {MEMORY_TARGET_PCT:g}% of the logits (✓ met, "
        "✗ missed, as measured: on a loaded machine a time ratio can miss). 'extra mem' from the profiler's memory events.",
    )  # fmt: skip


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="three logits rows, one hidden-state row and one sharded row (N <= 1,024)")
    p.add_argument(
        "--part", choices=("all", "logits", "hidden", "sharded", "counts", "compiled"), default="all",
        help="which rows to run (counts: kernel launches and host-device syncs per call, no timing; compiled: the fused "
        "Triton kernels compiled for sm_90 without a GPU, registers, spills and SASS per logit, exit 1 on a missed target)",
    )
    p.add_argument(
        "--repeats", type=int, default=None,
        help="timed repeats per path (default 5, quick 3; hidden rows 2, none for the memory-only rows)",
    )
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    add_device_arguments(p)


def run(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.repeats is not None and args.repeats < 1:
        raise SystemExit("--repeats must be >= 1")
    if args.device:
        return run_device(args)
    if args.part == "compiled":
        from pdmask.tools.bench_compiled import run_compiled

        return run_compiled(args.json)
    if args.part == "counts":
        launches, syncs = launch_rows(args.vocab, args.positions, getattr(torch, args.dtype)), sync_rows()
        render_counts(launches, syncs, args.vocab, args.positions)
        if args.json:
            with open(args.json, "w") as f:
                f.write(dumps({"launches": [asdict(r) for r in launches], "syncs": [asdict(r) for r in syncs]}, indent=1))
        return 0
    repeats = args.repeats or (3 if args.quick else 5)
    from rich.progress import track

    rows: list[Row] = []
    hidden_rows: list[HiddenRow] = []
    if args.part in ("all", "logits"):
        grid = QUICK_GRID if args.quick else FULL_GRID
        rows = [measure(v, n, d, repeats) for v, n, d in track(grid, description="benchmarking", transient=True)]
        render(rows)
    if args.part in ("all", "hidden"):
        hidden_grid = QUICK_HIDDEN_GRID if args.quick else FULL_HIDDEN_GRID
        hidden_repeats = args.repeats or 2
        for cfg in track(hidden_grid, description="hidden-state rows", transient=True):
            hidden_rows.append(measure_hidden(cfg, hidden_repeats if "matmul_stats" in cfg.paths else 0))
            _write_json(args.json, rows, hidden_rows)  # row by row: a long grid keeps what it has measured
        render_hidden(hidden_rows)
    sharded_rows: list[ShardedRow] = []
    if args.part in ("all", "sharded"):
        sharded_grid = QUICK_SHARDED_GRID if args.quick else FULL_SHARDED_GRID
        sharded_rows = [measure_sharded(cfg, repeats) for cfg in track(sharded_grid, description="sharded rows", transient=True)]
        render_sharded(sharded_rows)
    _write_json(args.json, rows, hidden_rows, sharded_rows)
    return 0


def _write_json(path: str | None, rows: list[Row], hidden_rows: list[HiddenRow], sharded_rows: Sequence[ShardedRow] = ()) -> None:
    if path:
        with open(path, "w") as f:
            f.write(dumps({
                "logits": [asdict(r) | {"proportional_vs_dppo_topk": r.proportional_vs_dppo} for r in rows],
                "hidden": [asdict(r) for r in hidden_rows],
                "sharded": [asdict(r) | {"time_ratio": r.time_ratio} for r in sharded_rows],
            }, indent=1))
