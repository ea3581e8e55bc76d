"""`pdmask compare`: a sweep of masks x seeds x sizes x rollout precisions, with report.md/json and plots."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from pdmask.lab.config import add_set_option

HELP = "Compare the masks in small RL runs under precision mismatch and staleness; writes a report."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--preset",
        default="default",
        help="smoke (CI check), default (the paper's comparison where the masks differ), sort (the earlier default), tv, long, "
        "collapse, sizes, vllm or grid (every method x size x precision, more than a day); times: docs/lab.md#times; "
        "rerun the same command to resume",
    )
    parser.add_argument("--out", default="runs/compare", help="output folder (report.md, report.json, plots/, runs/)")
    parser.add_argument("--methods", help="comma-separated methods (overrides the preset)")
    parser.add_argument(
        "--seeds",
        help="seeds: N (0..N-1), a range A-B (inclusive) or a list 3,5,8 (overrides the preset; a disjoint set checks a verdict)",
    )
    parser.add_argument("--models", help="comma-separated model sizes (overrides the preset)")
    parser.add_argument(
        "--rollout-dtypes", help="comma-separated rollout precisions fp32,bf16,fp16,fp8 (overrides the preset)"
    )
    add_set_option(parser, "override a shared config field (repeatable)")
    parser.add_argument(
        "--workers",
        type=int,
        default=min(os.cpu_count() or 1, 8),
        help="parallel runs (one torch thread each; default: CPU count, at most 8)",
    )
    parser.add_argument(
        "--fresh", action="store_true", help="delete earlier runs in --out instead of reusing/resuming them"
    )
    parser.add_argument("--estimate", action="store_true", help="print the estimated run time and exit")


def build_sweep(args: argparse.Namespace):
    from dataclasses import replace

    from pdmask.lab.config import ConfigError, config_from, parse_overrides, parse_seeds
    from pdmask.lab.presets import PRESETS

    if args.preset not in PRESETS:
        raise ConfigError(f"--preset: unknown preset {args.preset!r}; choose one of {', '.join(PRESETS)}")
    sweep = PRESETS[args.preset]
    changes = {}
    split = lambda s: tuple(x.strip() for x in s.split(",") if x.strip())
    if args.methods:
        changes["methods"] = split(args.methods)
    if args.seeds is not None:
        changes["seeds"] = parse_seeds(args.seeds)
    if args.models:
        changes["models"] = split(args.models)
    if args.rollout_dtypes:
        changes["rollout_dtypes"] = split(args.rollout_dtypes)
    if args.overrides:
        overrides = parse_overrides(args.overrides)
        swept = {"method": "--methods", "seed": "--seeds", "model": "--models", "rollout_dtype": "--rollout-dtypes"}
        for key in overrides.keys() & swept.keys():
            raise ConfigError(f"--set {key}=...: {key} is swept by the preset; use {swept[key]} instead")
        changes["base"] = config_from(overrides, base=sweep.base)
        # --set wins over the preset's per-model settings too.
        changes["model_overrides"] = {
            m: {k: v for k, v in o.items() if k not in overrides} for m, o in sweep.model_overrides.items()
        }
    return replace(sweep, **changes).validate()


def starting_profiles(sweep) -> dict[str, dict[str, float] | None]:
    """The fork profile of each setting's starting policy (its first run's warm start, cached by the sweep)."""
    from pdmask.lab.forks import warm_start_profile
    from pdmask.lab.sweep import setting_name

    firsts = {}
    for cfg in sweep.configs():
        firsts.setdefault(setting_name(cfg), cfg)
    return {name: warm_start_profile(cfg) for name, cfg in firsts.items()}


def run(args: argparse.Namespace) -> int:
    from pdmask.lab.config import ConfigError
    from pdmask.lab.report import write_report
    from pdmask.lab.sweep import estimate_seconds, run_sweep

    try:
        sweep = build_sweep(args)
    except ConfigError as e:
        print(f"pdmask compare: config error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    n = len(sweep.configs())
    print(f"pdmask compare: preset {args.preset!r}, {n} runs, {args.workers} worker(s), output {out}")
    if args.preset == "grid" or args.estimate:
        est = estimate_seconds(sweep, args.workers)
        print(
            f"estimated run time: {est / 60:.1f} min ({est / 3600:.2f} h) with {args.workers} worker(s); "
            "resumable: rerun the same command to continue"
        )
        if args.estimate:
            return 0
    out.mkdir(parents=True, exist_ok=True)
    info = run_sweep(sweep, out, args.workers, fresh=args.fresh)
    report = write_report(sweep, out, args.preset, info | {"workers": args.workers}, starting_profiles(sweep))
    print()
    for s in report["settings"].values():
        print(s["verdict"].replace("**", ""))
    forks, reference = report["fork_profile"]["settings"], report["fork_profile"]["reference"]
    for name, profile in forks.items():
        if profile is not None:
            print(
                f"Fork profile of {name}'s SFT start: runner-up π ≥ 0.1 at {profile['runner_up_ge_0.1']:.1%} of positions, "
                f"sampled token not the mode at {profile['not_mode']:.1%}"
                + (
                    f" (SmolLM2-135M: {reference['profile']['runner_up_ge_0.1']:.1%} and {reference['profile']['not_mode']:.1%})."
                    if reference
                    else "."
                )
            )
    print(f"\nwall time {info['wall_time_s']:.0f} s; report: {out / 'report.md'}")
    if info["failed"]:
        print(f"{len(info['failed'])} run(s) failed:", *info["failed"], sep="\n  ", file=sys.stderr)
        return 1
    return 0
