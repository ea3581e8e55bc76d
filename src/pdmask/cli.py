"""The `pdmask` command: one subcommand per module, imported only when it runs.

Each subcommand module exposes ``HELP: str``, ``add_arguments(parser)`` and ``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS: dict[str, str] = {
    "compare": "pdmask.lab.compare_cli",
    "train": "pdmask.lab.train_cli",
    "analyze": "pdmask.analysis.cli",
    "bench": "pdmask.tools.bench",
    "demo": "pdmask.tools.demo",
    "backbone-scale": "pdmask.tools.backbone_scale",
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="pdmask", description="Predictive divergence masks for trust-region RL.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    # Only the chosen subcommand's module is imported, so one command never pays another's imports.
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, module_name in COMMANDS.items():
        if name == chosen:
            module = importlib.import_module(module_name)
            p = sub.add_parser(name, help=module.HELP, description=module.HELP)
            module.add_arguments(p)
            p.set_defaults(_run=module.run)
        else:
            sub.add_parser(name, help=f"(see `pdmask {name} --help`)")
    args = parser.parse_args(argv)
    if not hasattr(args, "_run"):
        parser.print_help()
        return 0 if args.command is None else 2
    return int(args._run(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
