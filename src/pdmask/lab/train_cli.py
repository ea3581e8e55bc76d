"""`pdmask train CONFIG`: one RL run from a .json/.toml config (fields: pdmask.lab.config.Config)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pdmask.lab.config import add_set_option

HELP = "Run one small-scale RL run (policy, task, rollout precision and mask from a config file)."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", help="a .json or .toml file of Config fields (omit to use the defaults)")
    add_set_option(parser, "override a config field (repeatable)")
    parser.add_argument("--out", default=None, help="run directory (default: runs/train/<method>-seed<seed>)")
    parser.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")


def run(args: argparse.Namespace) -> int:
    from pdmask.lab.config import ConfigError, config_from, load_config, parse_overrides

    try:
        cfg = load_config(args.config, args.overrides) if args.config else config_from(parse_overrides(args.overrides))
        out = Path(args.out or f"runs/train/{cfg.method}-seed{cfg.seed}")
        from pdmask.lab.train import Run

        run_ = Run(cfg, out, resume=args.resume)
    except ConfigError as e:
        print(f"pdmask train: config error: {e}", file=sys.stderr)
        return 2
    from rich.progress import Progress

    with Progress() as bar:
        task = bar.add_task(f"{cfg.method} seed {cfg.seed}", total=cfg.steps, completed=run_.step)

        def on_step(step: int, m: dict[str, float]) -> None:
            acc = f" held-out {m['eval/accuracy']:.3f}" if "eval/accuracy" in m else ""
            bar.update(
                task, completed=step, description=f"{cfg.method} seed {cfg.seed} reward {m['reward/mean']:.3f}{acc}"
            )

        rows = run_.run(on_step)
    final = rows[-1]
    print(
        f"{out}: step {final['step']}, held-out accuracy {final.get('eval/accuracy', float('nan')):.3f}, metrics in {out / 'metrics.jsonl'}"
    )
    return 0
