"""pytest-benchmark cases (run with --benchmark-enable) and a check that `pdmask bench` measures and prints."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from pdmask.cli import main
from pdmask.tools import bench
from pdmask.tools.bench import PATHS, Row, measure, paths, render
from pdmask.tools.bench_common import make_inputs
from pdmask.tools.bench_hidden import HIDDEN_PATHS, HiddenConfig, measure_hidden, render_hidden
from pdmask.tools.bench_sharded import ShardedConfig


@pytest.fixture(scope="module")
def inputs():
    return make_inputs(32_000, 256, torch.bfloat16)


@pytest.mark.parametrize("path", ["plain", "dppo_torch", "dppo_topk", "pdm_proportional"])
def test_benchmark_statistics(benchmark, inputs, path):
    fn = paths(*inputs)[path]
    with torch.no_grad():
        out = benchmark(fn)
    logits = inputs[0]
    for t in out if isinstance(out, tuple) else (out,):
        assert t.shape[0] == logits.shape[0]
        assert t.dtype == torch.bool or bool(torch.isfinite(t).all()), path


def _finite_numbers(x) -> list[float]:
    """Every number of a JSON value (None, the 'no such ratio' of a row, is skipped)."""
    if isinstance(x, dict):
        return [v for item in x.values() for v in _finite_numbers(item)]
    if isinstance(x, list):
        return [v for item in x for v in _finite_numbers(item)]
    return [x] if isinstance(x, (int, float)) and not isinstance(x, bool) else []


def test_bench_report_has_every_path_with_finite_positive_numbers(tmp_path, monkeypatch, capsys):
    """`pdmask bench --json` on a small grid: one row per grid entry, every path timed and measured, all finite."""
    monkeypatch.setattr(bench, "QUICK_GRID", [(4_000, 64, "float32"), (4_000, 64, "bfloat16")])
    monkeypatch.setattr(bench, "QUICK_HIDDEN_GRID", [HiddenConfig(4_000, 32, 64, "float32")])
    monkeypatch.setattr(bench, "QUICK_SHARDED_GRID", [ShardedConfig(4_000, 64)])
    report = tmp_path / "bench.json"
    assert main(["bench", "--quick", "--repeats", "1", "--json", str(report)]) == 0
    data = json.loads(report.read_text())
    assert set(data) == {"logits", "hidden", "sharded"} and len(data["logits"]) == 2
    assert len(data["hidden"]) == len(data["sharded"]) == 1
    for row in data["logits"]:
        assert (row["vocab"], row["positions"]) == (4_000, 64)
        assert set(row["ms"]) == set(row["peak_mib"]) == set(PATHS)
        assert all(v > 0 for v in row["ms"].values()) and row["logits_mib"] > 0 and row["proportional_vs_dppo_topk"] > 0
    hidden = data["hidden"][0]
    assert set(hidden["ms"]) == set(hidden["cpu_ms"]) == set(hidden["extra_mib"]) == set(HIDDEN_PATHS)
    assert all(v > 0 for v in hidden["ms"].values())
    sharded = data["sharded"][0]
    assert (sharded["vocab"], sharded["positions"], sharded["tp"]) == (4_000, 64, 2)
    assert sharded["sharded_ms"] > 0 and sharded["unsharded_ms"] > 0
    assert 0 < sharded["bytes_per_position"] < sharded["gather_bytes_per_position"]
    numbers = _finite_numbers(data)
    assert numbers and all(math.isfinite(v) and v >= 0 for v in numbers)
    out = capsys.readouterr().out
    assert "pdmask bench" in out
    # Every targeted ratio is marked met or missed, with its target, whatever this machine's load made it.
    assert len(re.findall("[✓✗]≤1.15", out)) == 2 and len(re.findall("[✓✗]≤10", out)) == 2  # prop/dppo_topk, prop's memory
    assert re.search("[✓✗]≤1.3", out) and re.search("[✓✗]≤1.5", out)  # fused/matmul_stats, backbone/fused
    assert "…" not in out and max(map(len, out.splitlines())) <= 100  # headers wrap, never cut, in 100 columns


def test_measure_reports_every_path():
    row = measure(32_000, 256, "float32", repeats=1)
    assert isinstance(row, Row) and set(row.ms) == set(row.peak_mib)
    assert all(v > 0 for v in row.ms.values())
    # The chunked path allocates less than the plain log-softmax, which materialises [N, V] float32.
    assert row.peak_mib["pdm_proportional"] < row.peak_mib["plain"]
    render([row])


def test_hidden_rows_measure_every_path_and_the_fused_path_holds_no_logits():
    row = measure_hidden(HiddenConfig(16_000, 32, 2_048, "float32"), 1)
    assert set(row.ms) == set(row.extra_mib) == set(HIDDEN_PATHS)
    # matmul + policy_stats holds the [N, V] logits and their gradient; the fused path holds blocks of them.
    assert row.extra_mib["fused"] < 0.5 * row.logits_mib < row.extra_mib["matmul_stats"]
    render_hidden([row, measure_hidden(HiddenConfig(8_000, 64, 128, "bfloat16", ("fused",)), 0)])


def test_demo_command_runs(capsys):
    assert main(["demo", "--vocab", "512"]) == 0
    out = capsys.readouterr().out
    assert "pdm_proportional_tv" in out and "dppo_binary_kl" in out


def test_cli_without_command_prints_help(capsys):
    assert main([]) == 0
    assert "compare" in capsys.readouterr().out


def test_device_bench_runs_every_path_on_the_cpu(tmp_path, monkeypatch, capsys):
    import json

    import pdmask.tools.bench_device as bench_device

    monkeypatch.setattr(bench_device.torch, "compile", lambda fn: fn)  # the CPU has no minute to spare for inductor
    out = tmp_path / "device.json"
    args = ["bench", "--device", "cpu", "--vocab", "600", "--positions", "8", "--hidden-dim", "16", "--repeats", "1"]
    assert main([*args, "--json", str(out)]) == 0
    rows = {r["path"]: r for r in json.loads(out.read_text())["device"]}
    assert set(rows) == set(bench_device.BASELINE)
    assert rows["pdm_proportional"]["vs_floor"] > 0 and rows["pdm_proportional"]["vs_compiled"] > 0
    assert rows["hidden"]["vs_floor"] > 0 and rows["backward"]["vs_plain"] is None
    assert re.search("[✓✗]≤1.3", capsys.readouterr().out)  # the targeted ratios are marked


def test_counts_part_reports_launches_and_syncs(tmp_path):
    import json

    out = tmp_path / "counts.json"
    assert main(["bench", "--part", "counts", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    by_path = {(r["path"], r["exactpi"]): r for r in data["launches"]}
    cpu, cuda = by_path[("torch (cpu chunks)", False)], by_path[("torch (cuda chunks)", False)]
    assert cpu["chunks"] > 10 * cuda["chunks"] and cpu["forward"] > cuda["forward"]
    if ("fused triton", False) in by_path:  # Triton installed: its launches do not grow with the shape
        assert by_path[("fused triton", False)]["forward"] < cuda["forward"]
    syncs = {r["call"]: r["syncs"] for r in data["syncs"]}
    assert syncs["policy_loss(validate=False)"] == 1 and syncs["policy_loss(validate=False, tensor_metrics=True)"] == 0
