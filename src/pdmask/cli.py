"""The `pdmask` command: one subcommand per module, imported only when it runs.

Each subcommand module exposes ``HELP: str`` (its description), ``add_arguments(parser)`` and ``run(args) -> int``;
the one-line summaries of ``pdmask --help`` live here, so that listing the commands imports none of them.
"""

from __future__ import annotations

import argparse
import importlib
import sys

#: Subcommand: (module, one-line summary for ``pdmask --help``).
COMMANDS: dict[str, tuple[str, str]] = {
    "compare": ("pdmask.lab.compare_cli", "compare the masks in small RL runs; writes a report"),
    "train": ("pdmask.lab.train_cli", "one small RL run from a config file"),
    "analyze": ("pdmask.analysis.cli", "how well each direction signal predicts the change of D"),
    "bench": ("pdmask.tools.bench", "time, memory, launches and compiled SASS of the statistics"),
    "demo": ("pdmask.tools.demo", "every method's mask side by side on a synthetic batch"),
    "backbone-scale": ("pdmask.tools.backbone_scale", "the backbone's kernel scale κ against the LM head's ‖h‖²"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="pdmask", description="Predictive divergence masks for trust-region RL.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    # Only the chosen subcommand's module is imported, so one command never pays another's imports.
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (module_name, summary) in COMMANDS.items():
        p = sub.add_parser(name, help=summary)
        if name == chosen:
            module = importlib.import_module(module_name)
            p.description = module.HELP
            module.add_arguments(p)
            p.set_defaults(_run=module.run)
    args = parser.parse_args(argv)
    if not hasattr(args, "_run"):
        parser.print_help()
        return 0 if args.command is None else 2
    return int(args._run(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
