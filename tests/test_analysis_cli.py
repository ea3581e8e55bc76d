"""`pdmask analyze --preset smoke` end to end: report files, check 5 on a real run, time budget."""

from __future__ import annotations

import json
import time

import pytest

from pdmask.cli import main


def test_smoke_preset_writes_the_report(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("PDMASK_CACHE", str(tmp_path / "cache"))  # a fresh clone: the SFT warm start is trained
    out = tmp_path / "analyze"
    start = time.perf_counter()
    assert main(["analyze", "--preset", "smoke", "--out", str(out)]) == 0
    assert time.perf_counter() - start < 60
    for name in ("analysis.json", "report.md", "agreement.png", "by_pi_a.png", "topk.png"):
        assert (out / name).stat().st_size > 0
    data = json.loads((out / "analysis.json").read_text())
    assert data["config"]["model"] == "tiny"
    for kind in ("tv", "kl"):
        head = data["agreement"][kind]["head"]["pdm_full"]["all"]
        assert head["n"] > 0 and head["k"] == head["n"]  # method.md check 5 on the real model
        assert set(data["topk_tracking"][kind]) >= {"bucket@1", "tail@20", "gw_tail@20"}
    printed = capsys.readouterr().out
    assert "Verdict" in printed and "pdm_full" in printed


@pytest.mark.parametrize("flags", [["--stale-steps", "0"], ["--model", "nope"], ["--advantages", "grpo", "--ks", "1,600"]])
def test_bad_settings_fail_cleanly(tmp_path, monkeypatch, flags) -> None:
    monkeypatch.setenv("PDMASK_CACHE", str(tmp_path / "cache"))
    assert main(["analyze", "--preset", "smoke", "--out", str(tmp_path / "o"), *flags]) == 2
