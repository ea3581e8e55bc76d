"""Run a function on several CPU processes joined in a gloo process group (the sharded tests, peer checks and bench)."""

from __future__ import annotations

import os
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run_gloo(world: int, fn: Callable[..., Any], *args: Any, timeout: float = 120.0, threads: int = 1) -> list[Any]:
    """fn(rank, world, *args) on ``world`` spawned processes in one gloo group (dist.group.WORLD); each rank's
    return value (saved with torch.save). Raises RuntimeError with the traceback of a rank that raised, and
    TimeoutError (after killing the processes) when a rank still runs after ``timeout`` seconds: a hang.
    ``fn`` must be importable by the spawned processes (a module-level function)."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_worker, args=(rank, world, tmp, threads, fn, args)) for rank in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [rank for rank, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        if hung:
            raise TimeoutError(f"ranks {hung} still ran after {timeout} s (a collective that never completes?)")
        results = []
        for rank in range(world):
            path = os.path.join(tmp, f"{rank}.pt")
            if not os.path.exists(path):
                raise RuntimeError(f"rank {rank} exited with code {procs[rank].exitcode} before returning.")
            ok, value = torch.load(path, weights_only=False)
            if not ok:
                raise RuntimeError(f"rank {rank} raised:\n{value}")
            results.append(value)
        return results


def _worker(rank: int, world: int, tmp: str, threads: int, fn: Callable[..., Any], args: tuple) -> None:
    torch.set_num_threads(threads)
    store = f"file://{os.path.join(tmp, 'store')}"
    dist.init_process_group("gloo", init_method=store, rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        result = (True, fn(rank, world, *args))
    except Exception:  # noqa: BLE001 - handed to the parent, which raises it
        result = (False, traceback.format_exc())
    torch.save(result, os.path.join(tmp, f"{rank}.pt"))
    dist.destroy_process_group()


__all__ = ["run_gloo"]
