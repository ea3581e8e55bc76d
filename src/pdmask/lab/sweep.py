"""Running a sweep: every config of a Sweep in worker processes, resumable.

Layout of ``--out DIR``: ``runs/<model>-<rollout_dtype>/<method>/seed<k>/`` (one run directory each).
Finished runs with the same config are reused and unfinished ones resumed, so a killed sweep
continues where it stopped. SFT warm starts are trained once per (seed, model, ...) before the runs.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from concurrent.futures import Future, ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from pdmask.lab.config import Config
from pdmask.lab.models import SIZES, is_pretrained
from pdmask.lab.presets import Sweep
from pdmask.lab.sft import sft_path


def run_dir(out: Path, cfg: Config) -> Path:
    return out / "runs" / setting_name(cfg) / cfg.method / f"seed{cfg.seed}"


def setting_name(cfg: Config) -> str:
    return f"{cfg.model}-{cfg.rollout_dtype}"


def _sft_job(cfg: Config) -> str:
    import torch

    from pdmask.lab.sft import initial_policy, warm_start
    from pdmask.lab.tasks import build_task

    torch.set_num_threads(cfg.threads)
    return str(warm_start(cfg, initial_policy(cfg), build_task(cfg.task, **cfg.task_kwargs())))


def _run_job(cfg: Config, path: str) -> str:
    from pdmask.lab.train import train

    train(cfg, path, resume=True)
    return path


def _cost(cfg: Config) -> float:
    """Relative compute of a run: sequences trained x passes x a size proxy (d_model² x layers)."""
    size = SIZES.get(cfg.model)
    proxy = size.d_model**2 * size.n_layer if size is not None else 1e9
    return cfg.steps * cfg.batch_size * (cfg.epochs + 1) * proxy


def _children_cpu() -> float:
    """CPU seconds used by finished worker processes (on a shared machine, the part of the wall time that is ours)."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _count_rows(path: Path) -> int:
    try:
        with open(path / "metrics.jsonl", "rb") as f:
            return max(0, f.read().count(b"\n") - 1)  # minus the step-0 evaluation row
    except FileNotFoundError:
        return 0


def estimate_seconds(sweep: Sweep, workers: int, probe_steps: int = 2) -> float:
    """Wall-time estimate: time ``probe_steps`` RL steps per (model, precision) in this process, then scale."""
    from pdmask.lab.train import Run

    per_step: dict[str, float] = {}
    configs = sweep.configs()
    with tempfile.TemporaryDirectory() as tmp:
        for cfg in configs:
            key = setting_name(cfg)
            if key in per_step:
                continue
            run = Run(cfg.replace(steps=probe_steps, sft_steps=0, tensorboard=False), Path(tmp) / key)
            run.train_step()  # warm-up (first-call allocations)
            t = time.perf_counter()
            for _ in range(probe_steps):
                run.train_step()
            per_step[key] = (time.perf_counter() - t) / probe_steps
    # Evaluation and SFT add roughly a tenth; runs share the workers evenly.
    total = sum(per_step[setting_name(c)] * c.steps for c in configs) * 1.1
    return total / max(1, min(workers, len(configs)))


def run_sweep(sweep: Sweep, out: Path, workers: int, fresh: bool = False, progress: bool = True) -> dict[str, Any]:
    """Run (or finish) every run of the sweep in ``out``; returns {"wall_time_s", "cpu_time_s", "runs", "reused", "failed"}."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    from pdmask.lab.train import is_complete

    sweep.validate()
    if fresh and (out / "runs").exists():
        shutil.rmtree(out / "runs")
    configs = sweep.configs()
    # Longest runs first: with fewer workers than runs, the sweep then ends with short runs, not one long one.
    todo = sorted((c for c in configs if not is_complete(run_dir(out, c), c)), key=lambda c: -_cost(c))
    sft_todo = {}
    for c in todo:
        if not is_pretrained(c.model) and c.sft_steps > 0 and not sft_path(c).exists():
            sft_todo.setdefault(c.sft_key(), c)
    t0, cpu0 = time.perf_counter(), _children_cpu()
    failed: list[str] = []
    ctx = get_context("spawn")  # fork would copy torch's thread pools
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )
    with (
        Progress(*columns, disable=not progress, transient=False) as bar,
        ProcessPoolExecutor(max(1, workers), mp_context=ctx) as pool,
    ):
        # Without a terminal (a log file, CI) the bar draws nothing until the end: one plain line per finished job.
        lines = progress and not bar.console.is_terminal
        say = lambda text: print(f"[{time.perf_counter() - t0:5.0f} s] {text}", flush=True) if lines else None
        if sft_todo:
            t_sft = bar.add_task("SFT warm starts", total=len(sft_todo))
            for i, fut in enumerate([pool.submit(_sft_job, c) for c in sft_todo.values()], 1):
                fut.result()
                bar.advance(t_sft)
                say(f"SFT warm start {i}/{len(sft_todo)} ready")
        total_steps = sum(c.steps for c in todo)
        t_runs = bar.add_task(f"RL steps ({len(todo)} runs)", total=total_steps)
        futures: dict[Future, Config] = {pool.submit(_run_job, c, str(run_dir(out, c))): c for c in todo}
        while futures:
            steps = sum(min(_count_rows(run_dir(out, c)), c.steps) for c in todo)
            for fut in [f for f in futures if f.done()]:
                cfg = futures.pop(fut)
                if fut.exception() is not None:
                    failed.append(f"{run_dir(out, cfg)}: {fut.exception()!r}")
                say(
                    f"run {len(todo) - len(futures)}/{len(todo)} {'failed' if fut.exception() else 'done'}: "
                    f"{setting_name(cfg)} {cfg.method} seed {cfg.seed} ({steps}/{total_steps} RL steps)"
                )
            bar.update(t_runs, completed=steps)
            time.sleep(0.25)
    return {
        "wall_time_s": time.perf_counter() - t0,
        "cpu_time_s": _children_cpu() - cpu0,
        "runs": len(configs),
        "reused": len(configs) - len(todo),
        "failed": failed,
    }
