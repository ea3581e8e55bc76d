"""`pdmask bench`'s sharded row: the statistics on a vocabulary split over tp gloo processes on this machine.

On the same logits [N, V] (K = 20, no gradient), each of tp processes runs ``policy_stats(shard, ...,
tp_group=...)`` + the ``pdm_proportional_tv`` mask on its [N, V/tp] shard, and rank 0 also runs the unsharded
``policy_stats`` + mask on the whole logits, interleaved (median of the repeats). Reported: both times, their
ratio, and the bytes each rank all-reduces per position (``pdmask.sharded.count_traffic``) against the
4·V·(tp − 1)/tp bytes per position that gathering the float32 logits would move. On one machine the processes
share its cores and gloo's latency counts, so the time ratio is only indicative; the bytes are what a real group moves.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pdmask.methods import trust_region_mask
from pdmask.sharded import count_traffic
from pdmask.stats import policy_stats
from pdmask.tools.bench_common import make_inputs, print_table
from pdmask.tools.gloo import run_gloo


@dataclass(frozen=True)
class ShardedConfig:
    vocab: int
    positions: int
    tp: int = 2


FULL_SHARDED_GRID = [ShardedConfig(32_000, 1_024), ShardedConfig(151_936, 1_024)]
QUICK_SHARDED_GRID = [ShardedConfig(32_000, 256)]


@dataclass
class ShardedRow:
    vocab: int
    positions: int
    tp: int
    sharded_ms: float  # the slowest rank's median
    unsharded_ms: float
    bytes_per_position: float  # all-reduced by each rank in one call
    gather_bytes_per_position: float  # what gathering the float32 logits would move per rank

    @property
    def time_ratio(self) -> float:
        return self.sharded_ms / self.unsharded_ms


def _rank(rank: int, world: int, cfg: ShardedConfig, repeats: int) -> tuple[float, float, int]:
    logits, tokens, rollout, adv = make_inputs(cfg.vocab, cfg.positions, torch.float32)
    width = -(-cfg.vocab // world)  # Megatron pads the vocabulary to tp·width; the last shard holds the padding
    shard = torch.nn.functional.pad(logits, (0, world * width - cfg.vocab))[:, rank * width : (rank + 1) * width].contiguous()

    def sharded() -> object:
        stats = policy_stats(shard, tokens, rollout, tp_group=dist.group.WORLD, vocab_size=cfg.vocab)
        return trust_region_mask("pdm_proportional_tv", stats, adv)

    def unsharded() -> object:
        return trust_region_mask("pdm_proportional_tv", policy_stats(logits, tokens, rollout), adv)

    with torch.no_grad(), count_traffic() as traffic:
        sharded()  # warm-up, and the bytes of one call
    sent = sum(traffic)
    times: dict[str, list[float]] = {"sharded": [], "unsharded": []}
    with torch.no_grad():
        unsharded() if rank == 0 else None
        for _ in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            sharded()
            times["sharded"].append(time.perf_counter() - t0)
            dist.barrier()
            if rank == 0:  # alone: the other ranks wait at the barrier
                t0 = time.perf_counter()
                unsharded()
                times["unsharded"].append(time.perf_counter() - t0)
    return statistics.median(times["sharded"]), statistics.median(times["unsharded"]) if rank == 0 else 0.0, sent


def measure_sharded(cfg: ShardedConfig, repeats: int, threads: int = 1) -> ShardedRow:
    """One row: tp spawned gloo processes with ``threads`` torch threads each."""
    results = run_gloo(cfg.tp, _rank, cfg, repeats, timeout=600.0, threads=threads)
    return ShardedRow(
        cfg.vocab, cfg.positions, cfg.tp, 1e3 * max(r[0] for r in results), 1e3 * results[0][1],
        results[0][2] / cfg.positions, 4 * cfg.vocab * (cfg.tp - 1) / cfg.tp,
    )


def render_sharded(rows: list[ShardedRow]) -> None:
    print_table(
        "pdmask bench: policy_stats + pdm_proportional_tv on a vocabulary split over tp gloo processes, float32, K = 20",
        ("V", "N", "tp", "sharded ms", "unsharded ms", "sharded/unsharded", "bytes/position", "gather logits bytes/position",
         "bytes/gather"),
        ((f"{r.vocab:,}", f"{r.positions:,}", str(r.tp), f"{r.sharded_ms:.1f}", f"{r.unsharded_ms:.1f}", f"{r.time_ratio:.2f}x",
          f"{r.bytes_per_position:.0f}", f"{r.gather_bytes_per_position:,.0f}",
          f"{100 * r.bytes_per_position / r.gather_bytes_per_position:.2f}%") for r in rows),
        "No target: the tp processes (one thread each) share this machine's cores and the unsharded pass runs alone on "
        "rank 0, so the time ratio includes the processes' contention and gloo's latency; read it from a quiet run. "
        "bytes/position: all-reduced by each rank in one call; gather: moving the float32 logits instead.",
    )  # fmt: skip


__all__ = ["FULL_SHARDED_GRID", "QUICK_SHARDED_GRID", "ShardedConfig", "ShardedRow", "measure_sharded", "render_sharded"]
