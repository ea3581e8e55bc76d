"""The compare report: ``report.md`` (plain words, tables, plots) and ``report.json`` (every number, per seed)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pdmask import jsonio
from pdmask.lab.forks import COLUMNS, profile_cells, reference_profile
from pdmask.lab.intervals import Interval, seeds_needed
from pdmask.lab.plots import write_plots
from pdmask.lab.presets import Sweep
from pdmask.lab.summary import analyse


def summary_table(setting: dict[str, Any]) -> str:
    """Markdown table, methods in order of final held-out accuracy."""
    head = (
        "| method | final held-out acc [95% CI] | mean held-out acc | final train reward | dropped A>0 / A<0 | "
        "mismatch TV mean / max / growth | D mean / max | dir. disagree | aggregated ≠ DPPO-TopK masks | top-K masks differ | "
        "Δ acc vs leader [paired 95% CI] | other acc |"
    )
    lines = [head, "|" + "---|" * 12]
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
            f"{e['mismatch_tv_mean']['mean']:.4f} / {e['mismatch_tv_max']['mean']:.3f} / {e['mismatch_growth']['mean']:+.4f} | "
            f"{e['div_mean']['mean']:.4f} / {e['div_max']['mean']:.3f} | "
            f"{e['direction_disagree_frac']['mean']:.1%} | {_share(e.get('vs_dppo_aggregated'))} | "
            f"{e['topk_masks_differ_frac']['mean']:.3%} | {delta} | "
            + (f"{e['other_final_accuracy']['mean']:.3f} |" if "other_final_accuracy" in e else "— |")
        )
    return "\n".join(lines)


def _share(ci: dict[str, float] | None) -> str:
    return "—" if ci is None or ci["mean"] != ci["mean"] else f"{ci['mean']:.2%}"


def power_lines(setting: dict[str, Any]) -> list[str]:
    """Markdown lines: for each PDM-vs-DPPO pair, what its seeds can detect, and the seeds smaller effects need."""
    pdm = (setting["questions"] or {}).get("pdm_vs_dppo")
    rows = [(m, p) for m, p in (pdm or {}).get("pairs", {}).items() if p["accuracy_diff"]["n"] > 1]
    if not rows:
        return []
    lines = [
        "Power of the PDM-vs-DPPO comparison (paired over seeds; a true difference of the size given is detected, its "
        "95% interval excluding 0, with probability 80%: (t₀.₉₇₅ + t₀.₈₀) × SD / √n):",
        "",
        "| pair | seeds n | SD of the per-seed differences | detectable at n | seeds for ±0.02 | seeds for ±0.01 |",
        "|---|---|---|---|---|---|",
    ]
    for m, p in rows:
        need = [seeds_needed(p["paired_sd"], e) for e in (0.02, 0.01)]
        lines.append(
            f"| {m} − {p['dppo']} | {p['accuracy_diff']['n']} | {p['paired_sd']:.4f} | ±{p['detectable_80']:.3f} | "
            + " | ".join("more than 1000" if n is None else str(n) for n in need) + " |"
        )
    return lines + [""]


def fork_lines(forks: dict[str, Any]) -> list[str]:
    """Markdown lines: each setting's starting policy's fork profile beside SmolLM2-135M's (report.json's
    ``fork_profile``: ``settings`` and ``reference``, ``pdmask.lab.forks``)."""
    rows = [(f"{name}: the SFT start", p) for name, p in forks["settings"].items() if p is not None]
    reference = forks["reference"]
    if reference is not None:
        rows.append((f"SmolLM2-135M-Instruct on its analysis prompts ({reference['task']})", reference["profile"]))
    if not rows:
        return []
    lines = [
        "## Fork profile",
        "",
        "Does the policy fork like a language model? Over its own responses (128 held-out prompts × 4 samples at the "
        "rollout temperature; SmolLM2: " + (f"`{reference['command']}`" if reference else "not measured in this clone")
        + "), per response position:",
        "",
        "| policy | " + " | ".join(h for _, h in COLUMNS) + " |",
        "|---|" + "---|" * len(COLUMNS),
    ]
    lines += [f"| {label} | " + " | ".join(profile_cells(p)) + " |" for label, p in rows]
    return lines + [
        "",
        "A fork is a position whose runner-up has π ≥ 0.1; the two direction tests (DPPO's sign(π_a − μ_a), PDM's sign(G)) "
        "can only disagree on a token that is not the mode, where the drift spreads over three or more candidates.",
        "",
    ]


def replication_table(setting: dict[str, Any]) -> list[str]:
    """Markdown lines: each verdict on all seeds and on the two disjoint halves of the seeds."""
    rep = setting.get("replication")
    if rep is None:
        return ["Replication: fewer than 4 seeds, no halves to check the verdicts on.", ""]
    h1, h2 = rep["halves"]
    lines = [
        f"Each verdict again on two disjoint halves of the seeds ({_seed_words(h1)} and {_seed_words(h2)}):",
        "",
        "| verdict | all seeds | first half | second half | replicates |",
        "|---|---|---|---|---|",
    ]
    for key, row in rep["verdicts"].items():
        a, b = row["halves"]
        lines.append(f"| {key.replace(':', ' ')} | {row['all']} | {a} | {b} | {'yes' if row['replicates'] else '**no**'} |")
    return lines + [""]


def _seed_words(seeds: list[int]) -> str:
    contiguous = seeds == list(range(seeds[0], seeds[-1] + 1))
    return f"seeds {seeds[0]}–{seeds[-1]}" if contiguous and len(seeds) > 2 else f"seeds {', '.join(map(str, seeds))}"


def _fmt(ci: dict[str, float]) -> str:
    return Interval(ci["mean"], ci["low"], ci["high"], ci["n"]).fmt()


def write_report(
    sweep: Sweep, out: Path, preset: str, run_info: dict[str, Any], forks: dict[str, dict[str, float] | None] | None = None
) -> dict[str, Any]:
    """Analyse the runs in ``out`` and write report.md, report.json and plots; returns the report dict. ``forks``: the
    fork profile of each setting's starting policy (``pdmask.lab.forks.warm_start_profile``)."""
    settings = analyse(sweep, out)
    plots = write_plots(settings, out)
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
            "accuracy": sweep.accuracy,
            "models": list(sweep.models),
            "rollout_dtypes": list(sweep.rollout_dtypes),
            "per_model": {m: dict(o) for m, o in sweep.model_overrides.items()},
        },
        "shared_config": base,
        "run": run_info | {"runs_analysed": done, "runs_expected": expected, "cpu_count": os.cpu_count()},
        "fork_profile": {"settings": forks or {}, "reference": reference_profile()},
        "settings": {
            name: {k: v for k, v in s.items()} | {"plots": plots.get(name, [])} for name, s in settings.items()
        },
    }
    (out / "report.json").write_text(jsonio.dumps(report, indent=1))
    (out / "report.md").write_text(_markdown(report, settings, plots))
    return report


def _warm_start_words(cfg: dict) -> str:
    seed = cfg.get("sft_seed")
    return "one per seed" if seed is None else f"one, of seed {seed}, shared by every seed"


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

- *final held-out acc*: exact-match accuracy on the fixed held-out prompts after the last step, of greedy decoding
  or (the preset says which) of `eval_samples` responses per prompt sampled at the rollout temperature, the reward
  RL optimises; *other acc*: the other one of the two; *mean held-out acc*: its average over the evaluation points.
- Intervals are t-based 95% confidence intervals over seeds; *Δ vs leader* pairs each method with the leader seed by
  seed (same data and rollouts up to the first mask decision that differs). An interval that includes 0 means the
  difference is within the seed-to-seed spread. The intervals are not corrected for the several comparisons made, so
  with few seeds an interval that only just excludes 0 is weak evidence.
- *dropped*: share of response tokens the mask removed, by advantage sign, averaged over all updates. *mismatch TV*:
  TV between the float32 trainer and the rollout engine at the same weights, on the response positions of each
  step's first minibatch. *D*: the method's own divergence (TV at top-K for ppo_clip and pg_is) between the current
  policy and μ during the updates.
  *dir. disagree*: among tokens beyond the TV threshold, the share where DPPO's direction sign(π_a − μ_a) and the
  predictive sign(G) differ. *growth*: mismatch TV over the last tenth of the steps minus over the first tenth.
- *aggregated ≠ DPPO-TopK masks*: share of response tokens on which the paper's pair, pdm_aggregated and dppo_topk with
  the run's divergence and thresholds, decided differently on that run's updates (same logits and μ). Two methods'
  runs can only differ through these tokens: where the share is near 0, the PDM-vs-DPPO question has no material.
- *top-K masks differ*: share of response tokens on which the masks of the four top-K predictive estimators (the
  paper's pdm_aggregated and pdm_uniform, pdmask's pdm_proportional and pdm_exactpi) with the run's divergence and
  thresholds disagree, on the same logits and μ. They can only differ where π or μ keeps mass outside TopK(μ) ∪ {a}.
- *Did RL learn?* pairs the best masked method's final held-out accuracy with its own start (after SFT) seed by
  seed. *Replicates*: the verdict that all seeds give is also the one each disjoint half of the seeds gives (a half
  has half the seeds, so a small real difference may read "within spread" there).
- *Did the trust region matter?* compares `pg_is` (no mask) with the masked method of highest final accuracy, paired
  by seed; *Did PDM differ from DPPO?* compares each `pdm_*` with the DPPO mask of the same divergence and information.
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
        f"- Judged by held-out accuracy: **{g['accuracy']}**"
        + (
            f" ({cfg['eval_samples']} responses per prompt sampled at temperature {cfg['temperature']})."
            if g["accuracy"] == "sampled"
            else " (greedy decoding)."
        ),
        (
            f"- Grid: {len(g['methods'])} methods × seeds {g['seeds']} × models {g['models']} × rollout precisions {g['rollout_dtypes']} "
            f"({info['runs_expected']} runs; {info['runs_analysed']} finished and analysed; "
            f"{info['reused']} reused from an earlier invocation)."
        ),
        f"- Wall time of this invocation: {info['wall_time_s']:.0f} s with {info['workers']} worker process(es) on {info['cpu_count']} CPUs"
        + (
            f"; the runs used {info['cpu_time_s']:.0f} CPU seconds (about the wall time × workers on an idle machine; "
            "much less than that means other jobs shared the CPUs)."
            if info.get("cpu_time_s") is not None
            else "."
        ),
        (
            f"- Shared by every run: task `{cfg['task']}` (length {cfg['task_length']}, {cfg['num_symbols']} symbols, "
            f"{cfg['reward']} reward), "
            f"vocabulary {cfg['vocab_size']}, {cfg['steps']} RL steps of {cfg['prompts_per_step']} prompts × {cfg['group_size']} samples, "
            f"{cfg['epochs']} epoch(s) × {cfg['minibatches']} minibatches per rollout batch, rollout lag {cfg['rollout_lag']} step(s), "
            f"Adam lr {cfg['lr']}, grad clip {cfg['grad_clip']}, temperature {cfg['temperature']}, "
            f"top-K = {cfg['top_k']}, μ = {cfg['mu']}, SFT warm start {cfg['sft_steps']} steps "
            f"({_warm_start_words(cfg)}), thresholds {_thresholds_words(cfg)}. "
            "Only the mask differs between methods."
        ),
    ]
    for model, changes in g["per_model"].items():
        lines.append(f"- For {model}: " + ", ".join(f"{k} = {v}" for k, v in changes.items()) + ".")
    if info["failed"]:
        lines += [
            "",
            f"**{len(info['failed'])} run(s) failed** and are left out:",
            *[f"- `{f}`" for f in info["failed"]],
        ]
    lines += ["", "## Summary", ""]
    for name in settings:
        lines += [settings[name]["verdict"], ""]
    lines += fork_lines(report["fork_profile"])
    for name, setting in settings.items():
        lines += [f"## {name}", "", summary_table(setting), ""]
        lines += replication_table(setting)
        lines += power_lines(setting)
        lines += [f"![{Path(p).stem}]({p})" for p in plots[name]]
        lines.append("")
    lines.append(READING_GUIDE)
    return "\n".join(lines) + "\n"
