"""The sweep behind ``pdmask compare``: run every config of a Sweep in worker processes, then write
``report.md``, ``report.json`` and PNG plots comparing the masks.

Layout of ``--out DIR``: ``runs/<model>-<rollout_dtype>/<method>/seed<k>/`` (one run directory each),
``report.md``, ``report.json``, ``plots/*.png``. Finished runs with the same config are reused and
unfinished ones resumed, so a killed sweep continues where it stopped.

Statistics: each run gives one number per metric (its final held-out accuracy, its mean dropped
fraction, ...); methods are compared over seeds with a t-based 95% interval, and two methods with a
paired interval of their per-seed differences (every method sees the same seeds and data).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from pdmask.lab.config import Config, Sweep
from pdmask.lab.models import is_pretrained
from pdmask.lab.sft import sft_path

# Two-sided 97.5% quantiles of Student's t for df = 1..30 (no scipy dependency); 1.96 beyond.
_T975 = [
    12.706,
    4.303,
    3.182,
    2.776,
    2.571,
    2.447,
    2.365,
    2.306,
    2.262,
    2.228,
    2.201,
    2.179,
    2.160,
    2.145,
    2.131,
    2.120,
    2.110,
    2.101,
    2.093,
    2.086,
    2.080,
    2.074,
    2.069,
    2.064,
    2.060,
    2.056,
    2.052,
    2.048,
    2.045,
    2.042,
]


@dataclass(frozen=True)
class Interval:
    mean: float
    low: float
    high: float
    n: int

    def fmt(self, digits: int = 3) -> str:
        if self.n < 2:
            return f"{self.mean:.{digits}f}"
        return f"{self.mean:.{digits}f} [{self.low:.{digits}f}, {self.high:.{digits}f}]"


def mean_ci(values: Sequence[float]) -> Interval:
    """Mean and t-based 95% confidence interval over seeds (the interval collapses for n = 1)."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return Interval(mean, mean, mean, n)
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = (_T975[n - 2] if n - 1 <= len(_T975) else 1.96) * sd / math.sqrt(n)
    return Interval(mean, mean - half, mean + half, n)


def run_dir(out: Path, cfg: Config) -> Path:
    return out / "runs" / setting_name(cfg) / cfg.method / f"seed{cfg.seed}"


def setting_name(cfg: Config) -> str:
    return f"{cfg.model}-{cfg.rollout_dtype}"


# ----------------------------------------------------------------------------- running


def _sft_job(cfg: Config) -> str:
    import torch

    from pdmask.lab.models import build_policy
    from pdmask.lab.sft import warm_start
    from pdmask.lab.tasks import build_task

    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    policy = build_policy(cfg.model, vocab_size=cfg.vocab_size, block_size=cfg.block_size())
    return str(warm_start(cfg, policy, build_task(cfg.task, **cfg.task_kwargs())))


def _run_job(cfg: Config, path: str) -> str:
    from pdmask.lab.train import train

    train(cfg, path, resume=True)
    return path


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
    """Run (or finish) every run of the sweep in ``out``; returns {"wall_time_s", "reused", "failed"}."""
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
    todo = [c for c in configs if not is_complete(run_dir(out, c), c)]
    sft_todo = {}
    for c in todo:
        if not is_pretrained(c.model) and c.sft_steps > 0 and not sft_path(c).exists():
            sft_todo.setdefault(c.sft_key(), c)
    t0 = time.perf_counter()
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
        if sft_todo:
            t_sft = bar.add_task("SFT warm starts", total=len(sft_todo))
            for fut in [pool.submit(_sft_job, c) for c in sft_todo.values()]:
                fut.result()
                bar.advance(t_sft)
        t_runs = bar.add_task(f"RL steps ({len(todo)} runs)", total=sum(c.steps for c in todo))
        futures: dict[Future, Config] = {pool.submit(_run_job, c, str(run_dir(out, c))): c for c in todo}
        while futures:
            for fut in [f for f in futures if f.done()]:
                cfg = futures.pop(fut)
                if fut.exception() is not None:
                    failed.append(f"{run_dir(out, cfg)}: {fut.exception()!r}")
            bar.update(t_runs, completed=sum(min(_count_rows(run_dir(out, c)), c.steps) for c in todo))
            time.sleep(0.25)
    return {
        "wall_time_s": time.perf_counter() - t0,
        "runs": len(configs),
        "reused": len(configs) - len(todo),
        "failed": failed,
    }


# ----------------------------------------------------------------------------- analysis


def _series(rows: list[dict[str, Any]], key: str) -> list[tuple[int, float]]:
    return [(r["step"], float(r[key])) for r in rows if key in r]


def _mean_of(rows: list[dict[str, Any]], key: str) -> float:
    values = [v for _, v in _series(rows, key)]
    return sum(values) / len(values) if values else float("nan")


def run_summary(rows: list[dict[str, Any]]) -> dict[str, float]:
    """One number per metric for one run."""
    evals = [v for s, v in _series(rows, "eval/accuracy") if s > 0]
    train_rows = [r for r in rows if r["step"] > 0]
    last = train_rows[-max(1, len(train_rows) // 10) :]  # final train reward: the last tenth of the steps
    return {
        "final_accuracy": _series(rows, "eval/accuracy")[-1][1],
        "mean_accuracy": sum(evals) / len(evals),
        "initial_accuracy": _series(rows, "eval/accuracy")[0][1],
        "peak_to_final_drop": max(evals) - evals[-1],
        "final_train_reward": _mean_of(last, "reward/mean"),
        "dropped_frac": _mean_of(train_rows, "mask/dropped_frac"),
        "dropped_frac_pos": _mean_of(train_rows, "mask/dropped_frac_pos"),
        "dropped_frac_neg": _mean_of(train_rows, "mask/dropped_frac_neg"),
        "div_mean": _mean_of(train_rows, "div/mean"),
        "div_max": max(v for _, v in _series(train_rows, "div/max")),
        "mismatch_tv_mean": _mean_of(train_rows, "mismatch/tv_mean"),
        "mismatch_tv_max": max(v for _, v in _series(train_rows, "mismatch/tv_max")),
        "direction_disagree_frac": _mean_of(train_rows, "mask/direction_disagree_frac"),
        "entropy_final": _mean_of(last, "policy/entropy"),
        "grad_norm": _mean_of(train_rows, "grad/norm"),
        "step_time_s": _mean_of(train_rows, "time/step"),
    }


def _curve(runs: list[list[dict[str, Any]]], key: str) -> dict[str, list[float]]:
    """Per-step mean and 95% band over seeds of one metric (steps present in every run)."""
    per_run = [dict(_series(rows, key)) for rows in runs]
    steps = sorted(set.intersection(*(set(p) for p in per_run)))
    cis = [mean_ci([p[s] for p in per_run]) for s in steps]
    return {"step": steps, "mean": [c.mean for c in cis], "low": [c.low for c in cis], "high": [c.high for c in cis]}


def compare_methods(per_seed: dict[str, dict[int, float]], higher_is_better: bool = True) -> dict[str, Any]:
    """Leader by mean, and each method's paired difference to the leader over the common seeds."""
    means = {m: sum(v.values()) / len(v) for m, v in per_seed.items()}
    order = sorted(means, key=lambda m: means[m], reverse=higher_is_better)
    leader = order[0]
    diffs = {}
    for m in order[1:]:
        seeds = sorted(set(per_seed[m]) & set(per_seed[leader]))
        d = mean_ci([per_seed[m][s] - per_seed[leader][s] for s in seeds])
        diffs[m] = {
            "mean": d.mean,
            "low": d.low,
            "high": d.high,
            "n": d.n,
            "clear": d.n >= 2 and (d.high < 0 if higher_is_better else d.low > 0),
        }
    return {"order": order, "leader": leader, "diff_to_leader": diffs}


def _ranking_words(methods: dict[str, dict[str, Any]], metric: str, label: str) -> tuple[dict[str, Any], str]:
    """Paired comparison of one per-run metric (higher is better) and its plain-words summary."""
    per_seed = {m: e["per_seed"][metric] for m, e in methods.items()}
    comp = compare_methods(per_seed)
    order, leader, diffs = comp["order"], comp["leader"], comp["diff_to_leader"]
    n = methods[leader][metric]["n"]
    words = (
        f"{label.capitalize()} over {n} seed{'s' if n > 1 else ''}: "
        + ", ".join(f"{m} {methods[m][metric]['mean']:.3f}" for m in order)
        + "."
    )
    if len({tuple(v.values()) for v in per_seed.values()}) == 1:
        return comp, words + " Identical for every method on every seed: no mask changed it."
    if n < 2:
        return (
            comp,
            words
            + f" {leader} is ahead, but with one seed there is no seed-to-seed spread to judge the difference against.",
        )
    clear = [m for m in order[1:] if diffs[m]["clear"]]
    tied = [m for m in order[1:] if not diffs[m]["clear"]]
    if not clear:
        sd = _pooled_sd(per_seed)
        return comp, words + (
            f" {leader} has the highest mean, but its lead over every other method is within the seed-to-seed spread "
            f"(seed standard deviation about {sd:.3f}; every paired 95% interval of the difference includes 0)."
        )
    behind = ", ".join(
        f"{m} ({diffs[m]['mean']:+.3f}, 95% CI [{diffs[m]['low']:+.3f}, {diffs[m]['high']:+.3f}])" for m in clear
    )
    words += f" {leader} is ahead; clearly behind it, beyond the seed-to-seed spread (paired over seeds): {behind}."
    if tied:
        words += f" Not distinguishable from {leader} at this number of seeds: {', '.join(tied)}."
    return comp, words


def _pooled_sd(per_seed: dict[str, dict[int, float]]) -> float:
    variances = []
    for values in map(list, (v.values() for v in per_seed.values())):
        if len(values) > 1:
            mean = sum(values) / len(values)
            variances.append(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
    return math.sqrt(sum(variances) / len(variances)) if variances else 0.0


def verdict(name: str, methods: dict[str, dict[str, Any]]) -> tuple[dict[str, Any], str]:
    """(comparison on final held-out accuracy, the setting's summary in plain words)."""
    comp, final_words = _ranking_words(methods, "final_accuracy", "final held-out accuracy")
    _, speed_words = _ranking_words(methods, "mean_accuracy", "mean held-out accuracy over the run (learning speed)")
    mean = lambda m, k: methods[m][k]["mean"]
    by_drop = sorted(methods, key=lambda m: mean(m, "dropped_frac"))
    unstable = max(methods, key=lambda m: mean(m, "peak_to_final_drop"))
    mismatch = sum(mean(m, "mismatch_tv_mean") for m in methods) / len(methods)
    mismatch_max = max(mean(m, "mismatch_tv_max") for m in methods)
    start = sum(mean(m, "initial_accuracy") for m in methods) / len(methods)
    facts = (
        f"Held-out accuracy at the start (after SFT): {start:.3f}. "
        f"Tokens masked: from {mean(by_drop[0], 'dropped_frac'):.2%} ({by_drop[0]}) to {mean(by_drop[-1], 'dropped_frac'):.2%} ({by_drop[-1]}). "
        + (
            f"Largest fall from a run's best held-out accuracy to its final one: {unstable} ({mean(unstable, 'peak_to_final_drop'):.3f} on average). "
            if mean(unstable, "peak_to_final_drop") > 0
            else "No run fell below its best held-out accuracy. "
        )
        + f"Training–inference mismatch at the same weights: TV {mismatch:.4f} on average per token, {mismatch_max:.3f} at most."
    )
    twins = _identical_groups(methods)
    if twins:
        facts += " " + " ".join(f"{' and '.join(g)} gave identical metrics on every seed." for g in twins)
    return comp, f"**{name}.** {final_words} {speed_words} {facts}"


def _identical_groups(methods: dict[str, dict[str, Any]]) -> list[list[str]]:
    """Groups of methods whose runs summarise identically on every seed (timings aside)."""
    groups: dict[str, list[str]] = {}
    for m, e in methods.items():
        key = json.dumps({k: v for k, v in e["per_seed"].items() if k != "step_time_s"}, sort_keys=True)
        groups.setdefault(key, []).append(m)
    return [g for g in groups.values() if len(g) > 1]


def analyse(sweep: Sweep, out: Path) -> dict[str, Any]:
    """Per setting and method: per-seed summaries, intervals, curves, the paired comparison and its verdict."""
    from pdmask.lab.train import is_complete, read_metrics

    settings: dict[str, dict[str, Any]] = {}
    for cfg in sweep.configs():
        if not is_complete(run_dir(out, cfg), cfg):
            continue  # failed, unfinished or made with another config: left out, and counted in the report
        rows = read_metrics(run_dir(out, cfg))
        methods = settings.setdefault(setting_name(cfg), {"methods": {}})["methods"]
        methods.setdefault(cfg.method, {"runs": {}})["runs"][cfg.seed] = rows
    for name, setting in settings.items():
        for entry in setting["methods"].values():
            runs = entry.pop("runs")
            summaries = {seed: run_summary(rows) for seed, rows in runs.items()}
            keys = next(iter(summaries.values())).keys()
            entry["per_seed"] = {k: {seed: s[k] for seed, s in summaries.items()} for k in keys}
            for k in keys:
                ci = mean_ci(list(entry["per_seed"][k].values()))
                entry[k] = {"mean": ci.mean, "low": ci.low, "high": ci.high, "n": ci.n}
            rows_list = list(runs.values())
            entry["curves"] = {
                k: _curve(rows_list, k)
                for k in (
                    "eval/accuracy",
                    "reward/mean",
                    "mask/dropped_frac_pos",
                    "mask/dropped_frac_neg",
                    "mismatch/tv_mean",
                    "div/mean",
                )
            }
        methods = setting["methods"]
        setting["comparison"], setting["verdict"] = verdict(name, methods)
    return settings


# ----------------------------------------------------------------------------- report


def _plots(settings: dict[str, Any], out: Path) -> dict[str, list[str]]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plot_dir = out / "plots"
    plot_dir.mkdir(parents=True, exist_ok=True)
    files: dict[str, list[str]] = {}

    def curves(ax, setting, key, title, smooth: int = 1) -> None:
        for m, e in setting["methods"].items():
            c = e["curves"][key]
            ax.plot(c["step"], _smooth(c["mean"], smooth), label=m, lw=1.4)
            ax.fill_between(c["step"], _smooth(c["low"], smooth), _smooth(c["high"], smooth), alpha=0.15)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)

    for name, setting in settings.items():
        paths = []
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        curves(axes[0], setting, "eval/accuracy", "held-out accuracy (greedy), mean ± 95% CI")
        curves(axes[1], setting, "reward/mean", "train reward (5-step average), mean ± 95% CI", smooth=5)
        axes[0].legend(fontsize=8)
        paths.append(_save(fig, plot_dir / f"learning_curves_{name}.png"))

        fig, ax = plt.subplots(figsize=(7, 4))
        ms = list(setting["comparison"]["order"])
        acc = [setting["methods"][m]["final_accuracy"] for m in ms]
        ax.bar(
            range(len(ms)),
            [a["mean"] for a in acc],
            yerr=[[a["mean"] - a["low"] for a in acc], [a["high"] - a["mean"] for a in acc]],
            capsize=4,
            color="tab:blue",
            alpha=0.7,
        )
        for i, m in enumerate(ms):
            ax.scatter(
                [i] * len(setting["methods"][m]["per_seed"]["final_accuracy"]),
                list(setting["methods"][m]["per_seed"]["final_accuracy"].values()),
                color="k",
                s=10,
                zorder=3,
            )
        ax.set_xticks(range(len(ms)), ms, rotation=30, ha="right", fontsize=8)
        ax.set_title(f"final held-out accuracy, {name} (bars: 95% CI, dots: seeds)", fontsize=10)
        paths.append(_save(fig, plot_dir / f"final_accuracy_{name}.png"))

        fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
        curves(axes[0], setting, "mask/dropped_frac_pos", "dropped fraction, A > 0 (5-step average)", smooth=5)
        curves(axes[1], setting, "mask/dropped_frac_neg", "dropped fraction, A < 0 (5-step average)", smooth=5)
        axes[0].legend(fontsize=8)
        paths.append(_save(fig, plot_dir / f"dropped_{name}.png"))

        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        curves(
            axes[0],
            setting,
            "mismatch/tv_mean",
            "training–inference mismatch: TV(trainer, engine), same weights",
            smooth=5,
        )
        curves(axes[1], setting, "div/mean", "method's divergence D(π, μ) during updates", smooth=5)
        axes[0].legend(fontsize=8)
        paths.append(_save(fig, plot_dir / f"mismatch_{name}.png"))
        files[name] = [str(p.relative_to(out)) for p in paths]
    return files


def _smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average (shorter at the start), same length as values."""
    return [sum(values[max(0, i - window + 1) : i + 1]) / (i + 1 - max(0, i - window + 1)) for i in range(len(values))]


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def summary_table(setting: dict[str, Any]) -> str:
    """Markdown table, methods in order of final held-out accuracy."""
    head = (
        "| method | final held-out acc [95% CI] | mean held-out acc | final train reward | dropped A>0 / A<0 | "
        "mismatch TV mean / max | D mean / max | dir. disagree | Δ acc vs leader [paired 95% CI] |"
    )
    lines = [head, "|" + "---|" * 9]
    comp = setting["comparison"]
    for m in comp["order"]:
        e = setting["methods"][m]
        d = comp["diff_to_leader"].get(m)
        delta = (
            "—"
            if d is None
            else (f"{d['mean']:+.3f} [{d['low']:+.3f}, {d['high']:+.3f}]" if d["n"] > 1 else f"{d['mean']:+.3f}")
        )
        lines.append(
            f"| {m} | {_fmt(e['final_accuracy'])} | {e['mean_accuracy']['mean']:.3f} | {e['final_train_reward']['mean']:.3f} | "
            f"{e['dropped_frac_pos']['mean']:.3%} / {e['dropped_frac_neg']['mean']:.3%} | "
            f"{e['mismatch_tv_mean']['mean']:.4f} / {e['mismatch_tv_max']['mean']:.3f} | {e['div_mean']['mean']:.4f} / {e['div_max']['mean']:.3f} | "
            f"{e['direction_disagree_frac']['mean']:.1%} | {delta} |"
        )
    return "\n".join(lines)


def _fmt(ci: dict[str, float]) -> str:
    return Interval(ci["mean"], ci["low"], ci["high"], ci["n"]).fmt()


def write_report(sweep: Sweep, out: Path, preset: str, run_info: dict[str, Any]) -> dict[str, Any]:
    """Analyse the runs in ``out`` and write report.md, report.json and plots; returns the report dict."""
    settings = analyse(sweep, out)
    plots = _plots(settings, out)
    base = sweep.base.to_dict()
    for k in ("method", "seed", "model", "rollout_dtype"):
        base.pop(k)
    expected = len(sweep.configs())
    done = sum(len(next(iter(e["per_seed"].values()))) for s in settings.values() for e in s["methods"].values())
    report = {
        "preset": preset,
        "description": sweep.description,
        "grid": {
            "methods": list(sweep.methods),
            "seeds": list(sweep.seeds),
            "models": list(sweep.models),
            "rollout_dtypes": list(sweep.rollout_dtypes),
        },
        "shared_config": base,
        "run": run_info | {"runs_analysed": done, "runs_expected": expected, "cpu_count": os.cpu_count()},
        "settings": {
            name: {k: v for k, v in s.items()} | {"plots": plots.get(name, [])} for name, s in settings.items()
        },
    }
    (out / "report.json").write_text(json.dumps(report, indent=1, default=float))
    (out / "report.md").write_text(_markdown(report, settings, plots))
    return report


def _thresholds_words(cfg: dict[str, Any]) -> str:
    """The thresholds every run used: the config's, or the methods' defaults."""
    from pdmask import METHODS

    tv, kl, ppo = METHODS["dppo_binary_tv"].defaults, METHODS["dppo_binary_kl"].defaults, METHODS["ppo_clip"].defaults
    pick = lambda key, default: default if cfg[key] is None else cfg[key]
    return (
        f"δ_TV = {pick('delta_tv', tv['delta_high'])}, δ_KL = {pick('delta_kl', kl['delta_high'])}, "
        f"PPO ε = {pick('eps_low', ppo['eps_low'])}/{pick('eps_high', ppo['eps_high'])}, ratio cap {pick('ratio_cap', ppo['ratio_cap'])}"
    )


READING_GUIDE = """## How to read this

- *final held-out acc*: exact-match accuracy of greedy decoding on the fixed held-out prompts after the last step;
  *mean held-out acc*: its average over the evaluation points (a learning-speed measure).
- Intervals are t-based 95% confidence intervals over seeds; *Δ vs leader* pairs each method with the leader seed by
  seed (same data and rollouts up to the first mask decision that differs). An interval that includes 0 means the
  difference is within the seed-to-seed spread. The intervals are not corrected for the several comparisons made, so
  with few seeds an interval that only just excludes 0 is weak evidence.
- *dropped*: share of response tokens the mask removed, by advantage sign, averaged over all updates. *mismatch TV*:
  TV between the float32 trainer and the rollout engine at the same weights, on the sampled positions. *D*: the
  method's own divergence (TV at top-K for ppo_clip and pg_is) between the current policy and μ during the updates.
  *dir. disagree*: among tokens beyond the TV threshold, the share where DPPO's direction sign(π_a − μ_a) and the
  predictive sign(G) differ.
"""


def _markdown(report: dict[str, Any], settings: dict[str, Any], plots: dict[str, list[str]]) -> str:
    info = report["run"]
    g = report["grid"]
    cfg = report["shared_config"]
    lines = [
        f"# pdmask compare — preset `{report['preset']}`",
        "",
        report["description"],
        "",
        (
            f"- Grid: {len(g['methods'])} methods × seeds {g['seeds']} × models {g['models']} × rollout precisions {g['rollout_dtypes']} "
            f"({info['runs_expected']} runs; {info['runs_analysed']} finished and analysed; {info['reused']} reused from an earlier invocation)."
        ),
        f"- Wall time of this invocation: {info['wall_time_s']:.0f} s with {info['workers']} worker process(es) on {info['cpu_count']} CPUs.",
        (
            f"- Shared by every run: task `{cfg['task']}` (length {cfg['task_length']}, {cfg['num_symbols']} symbols, {cfg['reward']} reward), "
            f"vocabulary {cfg['vocab_size']}, {cfg['steps']} RL steps of {cfg['prompts_per_step']} prompts × {cfg['group_size']} samples, "
            f"{cfg['epochs']} epoch(s) × {cfg['minibatches']} minibatches per rollout batch, Adam lr {cfg['lr']}, grad clip {cfg['grad_clip']}, "
            f"top-K = {cfg['top_k']}, μ = {cfg['mu']}, SFT warm start {cfg['sft_steps']} steps, thresholds {_thresholds_words(cfg)}. "
            "Only the mask differs between methods."
        ),
    ]
    if info["failed"]:
        lines += [
            "",
            f"**{len(info['failed'])} run(s) failed** and are left out:",
            *[f"- `{f}`" for f in info["failed"]],
        ]
    lines += ["", "## Summary", ""]
    for name in settings:
        lines += [settings[name]["verdict"], ""]
    for name, setting in settings.items():
        lines += [f"## {name}", "", summary_table(setting), ""]
        lines += [f"![{Path(p).stem}]({p})" for p in plots[name]]
        lines.append("")
    lines.append(READING_GUIDE)
    return "\n".join(lines) + "\n"
