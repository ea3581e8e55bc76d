"""One number per metric for each run (final held-out accuracy, mean dropped share, ...), and the curves of
a method over its seeds: the numbers the compare report's verdicts and tables are made of."""

from __future__ import annotations

from typing import Any

from pdmask.lab.intervals import mean_ci
from pdmask.lab.train import TAIL_ESTIMATORS

CURVES = (
    "eval/accuracy",
    "eval/sampled_accuracy",
    "reward/mean",
    "mask/dropped_frac_pos",
    "mask/dropped_frac_neg",
    "mismatch/tv_mean",
    "div/mean",
    "topk/masks_differ_frac",
    "topk/vs_dppo_aggregated_frac",
    "policy/entropy",
)


def _series(rows: list[dict[str, Any]], key: str) -> list[tuple[int, float]]:
    return [(r["step"], float(r[key])) for r in rows if r.get(key) is not None]


def _mean_of(rows: list[dict[str, Any]], key: str) -> float:
    values = [v for _, v in _series(rows, key)]
    return sum(values) / len(values) if values else float("nan")


#: The held-out accuracies a sweep can judge by: greedy decoding, or responses sampled at the rollout temperature.
ACCURACY_KEYS = {"greedy": "eval/accuracy", "sampled": "eval/sampled_accuracy"}


def run_summary(rows: list[dict[str, Any]], accuracy: str = "greedy") -> dict[str, float]:
    """One number per metric for one run; ``*_accuracy`` and ``accuracy_gain`` use the chosen held-out
    accuracy (``ACCURACY_KEYS``), ``other_*`` the other one where the run logged it."""
    key = ACCURACY_KEYS[accuracy]
    other = ACCURACY_KEYS["sampled" if accuracy == "greedy" else "greedy"]
    series = _series(rows, key)
    if not series:
        raise ValueError(f"the run logged no {key}: it was made with eval_samples=0; judge it by greedy accuracy.")
    evals = [v for s, v in series if s > 0]
    train_rows = [r for r in rows if r["step"] > 0]
    tenth = max(1, len(train_rows) // 10)
    first, last = train_rows[:tenth], train_rows[-tenth:]  # the first and the last tenth of the steps
    out = {
        "final_accuracy": series[-1][1],
        "mean_accuracy": sum(evals) / len(evals),
        "initial_accuracy": series[0][1],
        "accuracy_gain": series[-1][1] - series[0][1],
        "peak_to_final_drop": max(evals) - evals[-1],
        "final_train_reward": _mean_of(last, "reward/mean"),
        "dropped_frac": _mean_of(train_rows, "mask/dropped_frac"),
        "dropped_frac_pos": _mean_of(train_rows, "mask/dropped_frac_pos"),
        "dropped_frac_neg": _mean_of(train_rows, "mask/dropped_frac_neg"),
        "div_mean": _mean_of(train_rows, "div/mean"),
        "div_max": max(v for _, v in _series(train_rows, "div/max")),
        "div_final": _mean_of(last, "div/mean"),
        "mismatch_tv_mean": _mean_of(train_rows, "mismatch/tv_mean"),
        "mismatch_tv_max": max(v for _, v in _series(train_rows, "mismatch/tv_max")),
        "mismatch_growth": _mean_of(last, "mismatch/tv_mean") - _mean_of(first, "mismatch/tv_mean"),
        "direction_disagree_frac": _mean_of(train_rows, "mask/direction_disagree_frac"),
        "topk_masks_differ_frac": _mean_of(train_rows, "topk/masks_differ_frac"),
        **{f"vs_dppo_{e}": _mean_of(train_rows, f"topk/vs_dppo_{e}_frac") for e in TAIL_ESTIMATORS},
        "entropy_mean": _mean_of(train_rows, "policy/entropy"),
        "pi_rest_mean": _mean_of(train_rows, "topk/pi_rest_mean"),
        "entropy_final": _mean_of(last, "policy/entropy"),
        "grad_norm": _mean_of(train_rows, "grad/norm"),
        "step_time_s": _mean_of(train_rows, "time/step"),
    }
    other_series = _series(rows, other)
    if other_series:
        out["other_final_accuracy"] = other_series[-1][1]
        out["other_accuracy_gain"] = other_series[-1][1] - other_series[0][1]
    return out


def curve(runs: list[list[dict[str, Any]]], key: str) -> dict[str, list[float]]:
    """Per-step mean and 95% band over seeds of one metric (steps present in every run)."""
    per_run = [dict(_series(rows, key)) for rows in runs]
    steps = sorted(set.intersection(*(set(p) for p in per_run)))
    cis = [mean_ci([p[s] for p in per_run]) for s in steps]
    return {"step": steps, "mean": [c.mean for c in cis], "low": [c.low for c in cis], "high": [c.high for c in cis]}
