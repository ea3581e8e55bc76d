"""`pdmask analyze --preset smoke` end to end: report files, strict JSON, check 5 on a real run.

Its time is measured in docs/analysis.md, not asserted here (timings belong to benchmarks, not unit tests).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest

from pdmask.cli import main


def _no_constant(name: str) -> None:
    raise ValueError(f"non-standard JSON literal {name}")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> tuple[Path, str]:
    """One smoke run from a fresh clone (the SFT warm start is trained): (run folder, stdout)."""
    root = tmp_path_factory.mktemp("smoke")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PDMASK_CACHE", str(root / "cache"))
        capture = root / "stdout.txt"
        with capture.open("w") as f, contextlib.redirect_stdout(f):
            assert main(["analyze", "--preset", "smoke", "--out", str(root / "analyze")]) == 0
    return root, capture.read_text()


def test_smoke_preset_writes_the_report(smoke) -> None:
    root, printed = smoke
    out = root / "analyze"
    for name in ("analysis.json", "report.md", "agreement.png", "by_pi_a.png", "topk.png", "masks.png"):
        assert (out / name).stat().st_size > 0
    data = json.loads((out / "analysis.json").read_text())
    assert data["config"]["model"] == "tiny"
    for kind in ("tv", "kl"):
        head = data["agreement"][kind]["head"]["pdm_full"]["all"]
        assert head["n"] > 0 and head["k"] == head["n"]  # method.md check 5 on the real model
        assert set(data["topk_tracking"][kind]) >= {"aggregated@1", "uniform@1", "proportional@20", "backbone_topk@20"}
        # Check 5 for the mask: against the output layer alone, pdm_full never keeps unsafely nor drops in vain.
        view = data["mask_view"][f"pdm_full_{kind}"]["head"]
        assert view["unsafe_keep"]["k"] == 0 and view["wasted_drop"]["k"] == 0
    assert {v["rule"] for v in data["mask_view"].values()} == {"dppo", "pdm"}
    # The smoke thresholds put tokens with autograd truth beyond δ, so the mask view counts something.
    assert any(sum(v["own_sgd"]["counts"].values()) > 0 for v in data["mask_view"].values())
    assert "Verdict" in printed and "pdm_full" in printed and "unsafe keep" in printed
    assert "Mask view" in (out / "report.md").read_text()


def test_smoke_writes_strict_json_only(smoke) -> None:
    """Every JSON file of the run parses without NaN/Infinity literals; undefined rates are null."""
    root, _ = smoke
    files = sorted(root.rglob("*.json"))
    assert root / "analyze" / "analysis.json" in files
    for path in files:
        json.loads(path.read_text(), parse_constant=_no_constant)
    data = json.loads((root / "analyze" / "analysis.json").read_text())
    # The smoke run has empty subsets (no token beyond δ in some π(a) buckets): their rates are null, not 0.
    cells = [c for per_truth in data["agreement"].values() for per_signal in per_truth.values()
             for cells in per_signal.values() for c in cells["by_pi_a"].values()]
    empty = [c for c in cells if c["n"] == 0]
    assert empty and all(c["rate"] is None and c["lo"] is None and c["hi"] is None for c in empty)


@pytest.mark.parametrize("flags", [["--stale-steps", "0"], ["--model", "nope"], ["--advantages", "grpo", "--ks", "1,600"]])
def test_bad_settings_fail_cleanly(tmp_path, monkeypatch, flags) -> None:
    monkeypatch.setenv("PDMASK_CACHE", str(tmp_path / "cache"))
    assert main(["analyze", "--preset", "smoke", "--out", str(tmp_path / "o"), *flags]) == 2


def test_a_rerun_continues_after_the_finished_rounds(smoke) -> None:
    """Rounds are written as they finish: a rerun loads them, runs only the missing ones, refuses other settings."""
    root, _ = smoke
    out = root / "analyze"
    first = out / "rounds" / "round_00000.pt"
    stamp = first.stat().st_mtime_ns
    before = json.loads((out / "analysis.json").read_text())["counts"]["tv"]["tokens"]
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(None):
        mp.setenv("PDMASK_CACHE", str(root / "cache"))
        assert main(["analyze", "--preset", "smoke", "--out", str(out), "--rounds", "2"]) == 0
        assert main(["analyze", "--preset", "smoke", "--out", str(out), "--lr", "0.5"]) == 2
    assert first.stat().st_mtime_ns == stamp  # loaded, not recomputed
    assert (out / "rounds" / "round_00001.pt").exists()
    assert json.loads((out / "analysis.json").read_text())["counts"]["tv"]["tokens"] > before


def test_shards_compute_only_their_rounds(smoke) -> None:
    """``--shard I/N`` skips the other shards' unfinished rounds and leaves the report to a call without it."""
    root, _ = smoke
    out = root / "analyze"
    had_round_1 = (out / "rounds" / "round_00001.pt").exists()
    report = (out / "report.md").stat().st_mtime_ns
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(None):
        mp.setenv("PDMASK_CACHE", str(root / "cache"))
        assert main(["analyze", "--preset", "smoke", "--out", str(out), "--rounds", "3", "--shard", "2/2"]) == 2
        assert main(["analyze", "--preset", "smoke", "--out", str(out), "--rounds", "3", "--shard", "0/2"]) == 0
    assert (out / "rounds" / "round_00002.pt").exists()
    assert (out / "rounds" / "round_00001.pt").exists() == had_round_1
    assert (out / "report.md").stat().st_mtime_ns == report


def test_rounds_of_another_version_are_refused(smoke, tmp_path, capsys) -> None:
    """A round file that records other quantities than the run's earlier rounds is not mixed in."""
    import shutil

    import torch

    root, _ = smoke
    out = tmp_path / "analyze"
    shutil.copytree(root / "analyze", out)
    saved = torch.load(out / "rounds" / "round_00000.pt", weights_only=True)
    saved["tokens"].pop("mask/pdm_full_tv/keep")
    torch.save(saved, out / "rounds" / "round_00001.pt")
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(None):
        mp.setenv("PDMASK_CACHE", str(root / "cache"))
        assert main(["analyze", "--preset", "smoke", "--out", str(out), "--rounds", "2"]) == 2
    assert "another version of pdmask" in " ".join(capsys.readouterr().err.split())  # rich wraps long lines


def test_a_round_of_another_version_is_not_written_into_the_run(smoke, tmp_path, monkeypatch) -> None:
    """A computed round that records other quantities than the run's earlier rounds is refused before it is saved."""
    import shutil

    import torch

    from pdmask.analysis import run

    root, _ = smoke
    out = tmp_path / "analyze"
    shutil.copytree(root / "analyze", out)
    (out / "rounds" / "round_00001.pt").unlink(missing_ok=True)
    other = torch.load(out / "rounds" / "round_00000.pt", weights_only=True)
    other["tokens"].pop("mask/pdm_full_tv/keep")
    monkeypatch.setattr(run, "run_round", lambda *args, **kwargs: (other["tokens"], other["timing"]))
    monkeypatch.setenv("PDMASK_CACHE", str(root / "cache"))
    with contextlib.redirect_stdout(None):
        assert main(["analyze", "--preset", "smoke", "--out", str(out), "--rounds", "2"]) == 2
    assert not (out / "rounds" / "round_00001.pt").exists()


def test_a_run_continues_from_its_packed_rounds(smoke, tmp_path) -> None:
    """A run whose rounds are packed into rounds.tar.xz (as results/ keeps them) is continued and reported from
    them as if they were unpacked: the packed rounds are unpacked, not recomputed."""
    import shutil
    import tarfile

    from pdmask.analysis.run import ROUNDS_ARCHIVE

    root, _ = smoke
    out = tmp_path / "analyze"
    shutil.copytree(root / "analyze", out)
    first = (out / "rounds" / "round_00000.pt").read_bytes()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(None):
        mp.setenv("PDMASK_CACHE", str(root / "cache"))
        assert main(["analyze", "--preset", "smoke", "--out", str(out), "--rounds", "1"]) == 0
        expected = json.loads((out / "analysis.json").read_text())["counts"]
        with tarfile.open(out / ROUNDS_ARCHIVE, "w:xz") as tar:
            tar.add(out / "rounds" / "round_00000.pt", "rounds/round_00000.pt")
        shutil.rmtree(out / "rounds")
        assert main(["analyze", "--preset", "smoke", "--out", str(out), "--rounds", "1"]) == 0
    assert (out / "rounds" / "round_00000.pt").read_bytes() == first
    assert json.loads((out / "analysis.json").read_text())["counts"] == expected
    with tarfile.open(out / ROUNDS_ARCHIVE, "w:xz") as tar:
        tar.add(out / "run.json", "run.json")  # an archive holds round files only
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(None):
        mp.setenv("PDMASK_CACHE", str(root / "cache"))
        assert main(["analyze", "--preset", "smoke", "--out", str(out), "--rounds", "1"]) == 2


def test_fork_profile_writes_only_the_profile(smoke) -> None:
    root, _ = smoke
    out = root / "forks"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PDMASK_CACHE", str(root / "cache"))  # the smoke run's warm start
        assert main(["analyze", "--preset", "smoke", "--fork-profile", "--out", str(out)]) == 0
    record = json.loads((out / "forks.json").read_text(), parse_constant=_no_constant)
    assert record["model"] == "tiny" and record["prompts"] == 8 and record["samples"] == 4
    profile = record["profile"]
    assert profile["positions"] > 0 and 0 <= profile["runner_up_ge_0.1"] <= 1 and 0 <= profile["not_mode"] <= 1
    assert profile["entropy"] == pytest.approx(profile["entropy_topk"] + profile["entropy_rest"])
    assert sorted(p.name for p in out.iterdir()) == ["forks.json"]  # no rounds, no report: only the profile
