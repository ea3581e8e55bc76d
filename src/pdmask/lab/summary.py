"""From run directories to numbers and plain words: per-run summaries, per-method intervals, verdicts.

Each run is summarised by one number per metric (final held-out accuracy, mean dropped share, ...);
a setting (model × rollout precision) compares its methods over seeds, paired seed by seed. The
verdict answers three questions in words: did the trust region matter (``pg_is`` against the best
masked method), did PDM differ from DPPO (each ``pdm_*`` against the DPPO mask with the same
divergence and information), and how often the top-K predictive estimators' masks differed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pdmask import get_method
from pdmask.lab.intervals import compare_methods, mean_ci, paired, pooled_sd
from pdmask.lab.presets import Sweep
from pdmask.lab.sweep import run_dir, setting_name

CURVES = (
    "eval/accuracy",
    "eval/sampled_accuracy",
    "reward/mean",
    "mask/dropped_frac_pos",
    "mask/dropped_frac_neg",
    "mismatch/tv_mean",
    "div/mean",
    "tail/masks_differ_frac",
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
        "tail_masks_differ_frac": _mean_of(train_rows, "tail/masks_differ_frac"),
        "pi_rest_mean": _mean_of(train_rows, "tail/pi_rest_mean"),
        "entropy_final": _mean_of(last, "policy/entropy"),
        "grad_norm": _mean_of(train_rows, "grad/norm"),
        "step_time_s": _mean_of(train_rows, "time/step"),
    }
    other_series = _series(rows, other)
    if other_series:
        out["other_final_accuracy"] = other_series[-1][1]
        out["other_accuracy_gain"] = other_series[-1][1] - other_series[0][1]
    return out


def _curve(runs: list[list[dict[str, Any]]], key: str) -> dict[str, list[float]]:
    """Per-step mean and 95% band over seeds of one metric (steps present in every run)."""
    per_run = [dict(_series(rows, key)) for rows in runs]
    steps = sorted(set.intersection(*(set(p) for p in per_run)))
    cis = [mean_ci([p[s] for p in per_run]) for s in steps]
    return {"step": steps, "mean": [c.mean for c in cis], "low": [c.low for c in cis], "high": [c.high for c in cis]}


def analyse(sweep: Sweep, out: Path) -> dict[str, dict[str, Any]]:
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
            summaries = {seed: run_summary(rows, sweep.accuracy) for seed, rows in runs.items()}
            keys = next(iter(summaries.values())).keys()
            entry["per_seed"] = {k: {seed: s[k] for seed, s in summaries.items()} for k in keys}
            for k in keys:
                entry[k] = mean_ci(list(entry["per_seed"][k].values())).as_dict()
            entry["curves"] = {k: _curve(list(runs.values()), k) for k in CURVES}
        setting["accuracy"] = sweep.accuracy
        setting["comparison"], setting["verdict"], setting["questions"] = verdict(name, setting["methods"])
        setting["replication"] = replication(setting["methods"], setting["questions"])
    return settings


# ----------------------------------------------------------------------------- words


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
        return comp, words + (
            f" {leader} has the highest mean, but its lead over every other method is within the seed-to-seed spread "
            f"(seed standard deviation about {pooled_sd(per_seed):.3f}; every paired 95% interval of the difference includes 0)."
        )
    behind = ", ".join(
        f"{m} ({diffs[m]['mean']:+.3f}, 95% CI [{diffs[m]['low']:+.3f}, {diffs[m]['high']:+.3f}])" for m in clear
    )
    words += f" {leader} is ahead; clearly behind it, beyond the seed-to-seed spread (paired over seeds): {behind}."
    if tied:
        words += f" Not distinguishable from {leader} at this number of seeds: {', '.join(tied)}."
    return comp, words


def learning_question(methods: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """Did RL learn? The best masked method's final held-out accuracy against its own SFT start, paired by seed.

    Yes if the paired 95% interval of (final − start) excludes 0 and is positive; "it fell" if it excludes 0
    and is negative. pg_is's own change is reported beside.
    """
    masked = [m for m in methods if m != "pg_is"]
    if not masked:
        return None
    best = max(masked, key=lambda m: methods[m]["final_accuracy"]["mean"])
    gain = mean_ci(list(methods[best]["per_seed"]["accuracy_gain"].values()))
    answer = "yes" if gain.excludes_zero and gain.mean > 0 else "fell" if gain.excludes_zero else "not measurably"
    start = methods[best]["initial_accuracy"]["mean"]
    words = (
        f"Did RL learn? {dict(yes='Yes', fell='No, it fell', **{'not measurably': 'Not measurably'})[answer]}: the best "
        f"masked method, {best}, ends {gain.fmt(signed=True)} in held-out accuracy against its SFT start of {start:.3f} "
        f"(paired 95% CI over {gain.n} seeds, {'excluding' if gain.excludes_zero else 'including'} 0)"
    )
    if "pg_is" in methods:
        pg_gain = mean_ci(list(methods["pg_is"]["per_seed"]["accuracy_gain"].values()))
        words += f"; pg_is (no trust region) changes by {pg_gain.fmt(signed=True)}"
    other = methods[best]["per_seed"].get("other_accuracy_gain")
    if other:
        words += f". By the other held-out accuracy, {best} changes by {mean_ci(list(other.values())).fmt(signed=True)}"
    return {"best_masked": best, "gain": gain.as_dict(), "answer": answer, "words": words + "."}


def trust_region_question(methods: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """Did the trust region matter? pg_is against the masked method with the best final accuracy, paired.

    It mattered if pg_is ends clearly behind (the paired 95% interval of best − pg_is excludes 0 and is
    positive) or if pg_is's mismatch grows clearly more than that method's over the run (the criterion
    fixed before the calibration); the gap in mean accuracy over the run (learning speed) is reported beside.
    """
    masked = [m for m in methods if m != "pg_is"]
    if "pg_is" not in methods or not masked:
        return None
    acc = lambda m: methods[m]["per_seed"]["final_accuracy"]
    best = max(masked, key=lambda m: methods[m]["final_accuracy"]["mean"])
    gap = paired(acc(best), acc("pg_is"))
    speed = paired(methods[best]["per_seed"]["mean_accuracy"], methods["pg_is"]["per_seed"]["mean_accuracy"])
    growth = paired(methods["pg_is"]["per_seed"]["mismatch_growth"], methods[best]["per_seed"]["mismatch_growth"])
    behind, grows = gap.excludes_zero and gap.mean > 0, growth.excludes_zero and growth.mean > 0
    mattered = behind or grows
    words = (
        f"Did the trust region matter? {'Yes' if mattered else 'Not measurably'}: the best masked method, {best}, "
        f"ends {gap.fmt(signed=True)} in final held-out accuracy against pg_is (no trust region; paired 95% CI over "
        f"{gap.n} seeds, {'excluding' if gap.excludes_zero else 'including'} 0) and {speed.fmt(signed=True)} in mean "
        f"held-out accuracy over the run ({'excluding' if speed.excludes_zero else 'including'} 0); pg_is's mismatch TV grows "
        f"{growth.fmt(4, signed=True)} more than {best}'s from the first to the last tenth of the run "
        f"({'excluding' if growth.excludes_zero else 'including'} 0)."
    )
    return {
        "best_masked": best,
        "accuracy_gap": gap.as_dict(),
        "mean_accuracy_gap": speed.as_dict(),
        "mismatch_growth_gap": growth.as_dict(),
        "mattered": mattered,
        "answer": "yes" if mattered else "not measurably",
        "words": words,
    }


def pdm_question(methods: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """Did PDM differ from DPPO? Each pdm_* against its DPPO twin: final accuracy paired, masks identical or not."""
    twins = {m: get_method(m).dppo_counterpart for m in methods if m.startswith("pdm_")}
    pairs = [(m, dppo) for m, dppo in twins.items() if dppo in methods]
    if not pairs:
        return None
    rows, parts = {}, []
    for pdm, dppo in pairs:
        d = paired(methods[pdm]["per_seed"]["final_accuracy"], methods[dppo]["per_seed"]["final_accuracy"])
        same = _strip(methods[pdm]["per_seed"]) == _strip(methods[dppo]["per_seed"])
        answer = "identical" if same else "within spread" if not d.excludes_zero else "pdm ahead" if d.mean > 0 else "dppo ahead"
        rows[pdm] = {"dppo": dppo, "accuracy_diff": d.as_dict(), "identical_runs": same, "answer": answer}
        if same:
            parts.append(f"{pdm} and {dppo} gave identical runs on every seed (their masks never differed)")
        else:
            clear = "beyond" if d.excludes_zero else "within"
            parts.append(f"{pdm} − {dppo} = {d.fmt(signed=True)} in final held-out accuracy, {clear} the seed spread")
    differed = any(not r["identical_runs"] and r["accuracy_diff"]["n"] >= 2 and _excludes(r) for r in rows.values())
    words = (
        f"Did PDM differ from DPPO? {'Yes' if differed else 'Not measurably'} (paired 95% CIs over seeds): "
        + "; ".join(parts)
        + "."
    )
    return {"pairs": rows, "differed": differed, "words": words}


def _excludes(row: dict[str, Any]) -> bool:
    d = row["accuracy_diff"]
    return d["low"] > 0 or d["high"] < 0


def _strip(per_seed: dict[str, dict[int, float]]) -> str:
    return json.dumps({k: v for k, v in per_seed.items() if k != "step_time_s"}, sort_keys=True)


def tail_words(methods: dict[str, dict[str, Any]]) -> str:
    """How often the top-K predictive estimators' masks differed, and the mass off TopK(μ) ∪ {a}."""
    differ = sum(e["tail_masks_differ_frac"]["mean"] for e in methods.values()) / len(methods)
    rest = sum(e["pi_rest_mean"]["mean"] for e in methods.values()) / len(methods)
    return (
        "The top-K predictive estimators' masks (the paper's aggregated and uniform tails, pdmask's proportional "
        f"and exactpi) differed on {differ:.3%} of "
        f"response tokens on average; π kept {rest:.2%} of its mass outside TopK(μ) ∪ {{a}}."
    )


def verdict(name: str, methods: dict[str, dict[str, Any]]) -> tuple[dict[str, Any], str, dict[str, Any]]:
    """(comparison on final held-out accuracy, the setting's summary in plain words, the questions answered)."""
    comp, final_words = _ranking_words(methods, "final_accuracy", "final held-out accuracy")
    _, speed_words = _ranking_words(methods, "mean_accuracy", "mean held-out accuracy over the run (learning speed)")
    mean = lambda m, k: methods[m][k]["mean"]
    by_drop = sorted(methods, key=lambda m: mean(m, "dropped_frac"))
    unstable = max(methods, key=lambda m: mean(m, "peak_to_final_drop"))
    mismatch = sum(mean(m, "mismatch_tv_mean") for m in methods) / len(methods)
    mismatch_max = max(mean(m, "mismatch_tv_max") for m in methods)
    start = sum(mean(m, "initial_accuracy") for m in methods) / len(methods)
    questions = ask(methods)
    answers = " ".join(q["words"] for q in questions.values() if q is not None)
    facts = (
        f"Held-out accuracy at the start (after SFT): {start:.3f}. "
        f"Tokens masked: from {mean(by_drop[0], 'dropped_frac'):.2%} ({by_drop[0]}) "
        f"to {mean(by_drop[-1], 'dropped_frac'):.2%} ({by_drop[-1]}). "
        + (
            f"Largest fall from a run's best held-out accuracy to its final one: {unstable} "
            f"({mean(unstable, 'peak_to_final_drop'):.3f} on average). "
            if mean(unstable, "peak_to_final_drop") > 0
            else "No run fell below its best held-out accuracy. "
        )
        + f"Mismatch between the trainer and the rollout engine: TV {mismatch:.4f} on average per token, {mismatch_max:.3f} at most. "
        + tail_words(methods)
    )
    twins = _identical_groups(methods)
    if twins:
        facts += " " + " ".join(f"{' and '.join(g)} gave identical metrics on every seed." for g in twins)
    return comp, f"**{name}.** {answers} {final_words} {speed_words} {facts}", questions


def ask(methods: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any] | None]:
    """The setting's questions: did RL learn, did the trust region matter, did PDM differ from DPPO."""
    return {
        "learning": learning_question(methods),
        "trust_region": trust_region_question(methods),
        "pdm_vs_dppo": pdm_question(methods),
    }


def answers(questions: dict[str, dict[str, Any] | None]) -> dict[str, str]:
    """Each verdict as one short answer: "learning", "trust_region" and "pdm_vs_dppo:<pdm method>"."""
    out = {k: q["answer"] for k, q in questions.items() if q is not None and "answer" in q}
    if questions.get("pdm_vs_dppo"):
        out |= {f"pdm_vs_dppo:{m}": r["answer"] for m, r in questions["pdm_vs_dppo"]["pairs"].items()}
    return out


def restrict(methods: dict[str, dict[str, Any]], seeds: list[int]) -> dict[str, dict[str, Any]]:
    """The methods' per-seed summaries on a subset of the seeds, with their intervals recomputed."""
    out = {}
    for m, e in methods.items():
        per_seed = {k: {s: v for s, v in vals.items() if s in seeds} for k, vals in e["per_seed"].items()}
        out[m] = {"per_seed": per_seed} | {k: mean_ci(list(v.values())).as_dict() for k, v in per_seed.items() if v}
    return out


def replication(methods: dict[str, dict[str, Any]], questions: dict[str, dict[str, Any] | None]) -> dict[str, Any] | None:
    """Each verdict again on two disjoint halves of the seeds (first half, second half of the sorted seeds).

    A verdict replicates when both halves give the answer all seeds give. A half has fewer seeds, so a
    real but small difference can read "within spread" there: a verdict that does not replicate is weak.
    """
    seeds = sorted(set.intersection(*(set(e["per_seed"]["final_accuracy"]) for e in methods.values())))
    if len(seeds) < 4:
        return None
    halves = [seeds[: len(seeds) // 2], seeds[len(seeds) // 2 :]]
    full = answers(questions)
    per_half = [answers(ask(restrict(methods, h))) for h in halves]
    rows = {
        key: {"all": full[key], "halves": [h.get(key) for h in per_half], "replicates": all(h.get(key) == full[key] for h in per_half)}
        for key in full
    }
    return {"halves": halves, "verdicts": rows}


def _identical_groups(methods: dict[str, dict[str, Any]]) -> list[list[str]]:
    """Groups of methods whose runs summarise identically on every seed (timings aside)."""
    groups: dict[str, list[str]] = {}
    for m, e in methods.items():
        groups.setdefault(_strip(e["per_seed"]), []).append(m)
    return [g for g in groups.values() if len(g) > 1]
