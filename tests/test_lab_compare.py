"""The sweep and its report: statistics, verdicts, files, reuse of finished runs, the smoke preset."""

import json
import math

import pytest

from pdmask.cli import main
from pdmask.lab.intervals import compare_methods, mean_ci
from pdmask.lab.presets import Sweep
from pdmask.lab.report import write_report
from pdmask.lab.sweep import estimate_seconds, run_sweep

from conftest import TINY


@pytest.fixture(autouse=True)
def _cache(monkeypatch, tmp_path_factory):
    monkeypatch.setenv("PDMASK_CACHE", str(tmp_path_factory.getbasetemp() / "pdmask-cache"))


def _reject(literal):
    raise ValueError(f"non-standard JSON literal {literal}")


def test_mean_ci():
    ci = mean_ci([1.0, 2.0, 3.0])
    assert ci.mean == 2.0 and math.isclose(ci.high - ci.mean, 4.303 / math.sqrt(3), rel_tol=1e-6)
    one = mean_ci([0.5])
    assert one.low == one.high == 0.5 and one.n == 1


def test_compare_methods_pairs_seeds():
    per_seed = {
        "a": {0: 0.9, 1: 0.8, 2: 0.7},
        "b": {0: 0.5, 1: 0.4, 2: 0.35},  # behind on every seed by a steady margin
        "c": {0: 0.95, 1: 0.6, 2: 0.74},  # noisy: behind on average, not clearly
    }
    out = compare_methods(per_seed)
    assert out["leader"] == "a" and out["order"] == ["a", "c", "b"]
    assert out["diff_to_leader"]["b"]["clear"] and not out["diff_to_leader"]["c"]["clear"]


def test_sweep_report_and_reuse(tmp_path):
    base = TINY.replace(steps=2, eval_every=1)
    sweep = Sweep(base, ("pg_is", "pdm_proportional_tv"), (0, 1), ("tiny",), ("bf16",), "test sweep")
    info = run_sweep(sweep, tmp_path, workers=1, progress=False)
    assert info["failed"] == [] and info["reused"] == 0 and info["cpu_time_s"] > 0
    report = write_report(sweep, tmp_path, "test", info | {"workers": 1})
    setting = report["settings"]["tiny-bf16"]
    assert set(setting["methods"]) == {"pg_is", "pdm_proportional_tv"}
    assert setting["methods"]["pg_is"]["final_accuracy"]["n"] == 2
    assert "tiny-bf16" in setting["verdict"]
    for rel in setting["plots"]:
        assert (tmp_path / rel).stat().st_size > 1000
    md = (tmp_path / "report.md").read_text()
    assert "| method |" in md and "Summary" in md and "Did the trust region matter?" in md and "CPU seconds" in md
    assert "top-K masks differ" in md and "aggregated ≠ DPPO-TopK masks" in md and "tiny-bf16: the SFT start" not in md
    profile = {"positions": 10, "runner_up_ge_0.1": 0.5, "not_mode": 0.25, "top1_median": 0.6, "entropy": 1.0,
               "entropy_topk": 0.8, "entropy_rest": 0.2}  # fmt: skip
    write_report(sweep, tmp_path, "test", info | {"workers": 1}, forks={"tiny-bf16": profile})
    md = (tmp_path / "report.md").read_text()
    assert "## Fork profile" in md and "| tiny-bf16: the SFT start | 10 | 50.0% | 25.0% | 0.600 | 1.000 | 0.800 | 0.200 |" in md
    assert setting["questions"]["trust_region"]["best_masked"] == "pdm_proportional_tv"
    assert json.loads((tmp_path / "report.json").read_text())["run"]["runs_analysed"] == 4
    # Every JSON file the lab writes is strict JSON (no NaN/Infinity literals), even with undefined numbers.
    write_report(sweep, tmp_path, "test", info | {"workers": 1, "wall_time_s": float("nan")})
    files = [*tmp_path.rglob("*.json"), *tmp_path.rglob("*.jsonl")]
    assert {f.name for f in files} >= {"report.json", "config.json", "metrics.jsonl"}
    for f in files:
        for line in f.read_text().splitlines() if f.suffix == ".jsonl" else [f.read_text()]:
            json.loads(line, parse_constant=_reject)
    again = run_sweep(sweep, tmp_path, workers=1, progress=False)
    assert again["reused"] == 4
    assert 0 < estimate_seconds(sweep, workers=2) < math.inf  # a number, not a timing target
    # Runs made with another config in the same folder are never reported as this sweep's.
    changed = Sweep(base.replace(lr=5e-3), ("pg_is", "pdm_proportional_tv"), (0, 1), ("tiny",), ("bf16",), "changed")
    assert write_report(changed, tmp_path, "test", info | {"workers": 1})["run"]["runs_analysed"] == 0


@pytest.mark.slow
def test_smoke_preset_writes_its_report(tmp_path):
    # Its time is measured in the docs, not asserted here: this machine is shared and noisy.
    assert main(["compare", "--preset", "smoke", "--out", str(tmp_path), "--workers", "2"]) == 0
    assert (tmp_path / "report.md").exists() and (tmp_path / "report.json").exists()


def _methods(per_seed_final: dict[str, dict[int, float]], start: float = 0.5) -> dict:
    """Per-method summaries as analyse() builds them, from final accuracies (start the same for every seed)."""
    out = {}
    for m, finals in per_seed_final.items():
        per_seed = {
            "final_accuracy": finals,
            "mean_accuracy": finals,
            "initial_accuracy": {s: start for s in finals},
            "accuracy_gain": {s: v - start for s, v in finals.items()},
            "mismatch_growth": {s: 0.0 for s in finals},
        }
        out[m] = {"per_seed": per_seed} | {k: mean_ci(list(v.values())).as_dict() for k, v in per_seed.items()}
    return out


def test_verdicts_are_checked_on_disjoint_halves_of_the_seeds():
    from pdmask.lab.verdicts import Questions, ask, replication

    seeds = range(8)
    # A clear gain over the start and over pg_is on every seed; PDM ahead of DPPO only on the first half.
    methods = _methods(
        {
            "pg_is": {s: 0.40 + 0.01 * (s % 2) for s in seeds},
            "dppo_topk_kl": {s: 0.60 + 0.01 * (s % 3) for s in seeds},
            "pdm_aggregated_kl": {s: 0.60 + 0.01 * (s % 3) + (0.05 if s < 4 else 0.0) for s in seeds},
        }
    )
    questions = ask(methods)
    assert questions.learning is not None and questions.learning.answer == "yes"
    assert questions.trust_region is not None and questions.trust_region.answer == "yes"
    # The best masked method is chosen once, for both questions that use it.
    assert questions.learning.best_masked == questions.trust_region.best_masked == "pdm_aggregated_kl"
    rep = replication(methods, questions)
    assert rep is not None and rep.halves == [[0, 1, 2, 3], [4, 5, 6, 7]]
    rows = rep.verdicts
    assert rows["learning"].replicates and rows["trust_region"].replicates
    pdm = rows["pdm_vs_dppo:pdm_aggregated_kl"]
    assert pdm.all == "pdm ahead" and pdm.halves == ["pdm ahead", "identical"] and not pdm.replicates
    assert replication(_methods({"pg_is": {0: 0.1, 1: 0.2}}), Questions(None, None, None)) is None  # fewer than 4 seeds
