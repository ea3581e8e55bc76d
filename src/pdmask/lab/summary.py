"""From run directories to a compare report's settings: the numbers of each run and method
(``run_summary``), the typed verdicts (``verdicts``) and their words (``verdict_words``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pdmask.lab.intervals import mean_ci
from pdmask.lab.presets import Sweep
from pdmask.lab.run_summary import CURVES, curve, run_summary
from pdmask.lab.sweep import run_dir, setting_name
from pdmask.lab.verdict_words import questions_json, replication_json, setting_words
from pdmask.lab.verdicts import ask, facts, ranking, replication


def analyse(sweep: Sweep, out: Path) -> dict[str, dict[str, Any]]:
    """Per setting and method: per-seed summaries, intervals, curves, the paired comparison and its verdict
    (as report.json holds them: ``methods``, ``accuracy``, ``comparison``, ``verdict``, ``questions``,
    ``replication``)."""
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
            entry["curves"] = {k: curve(list(runs.values()), k) for k in CURVES}
        methods = setting["methods"]
        final, speed, questions = ranking(methods, "final_accuracy"), ranking(methods, "mean_accuracy"), ask(methods)
        setting["accuracy"] = sweep.accuracy
        setting["comparison"] = final.comparison
        setting["verdict"] = setting_words(name, methods, final, speed, questions, facts(methods))
        setting["questions"] = questions_json(questions)
        setting["replication"] = replication_json(replication(methods, questions))
    return settings
