"""pytest-benchmark cases (run with --benchmark-enable) and a check that `pdmask bench` measures and prints."""

from __future__ import annotations

import pytest
import torch

from pdmask.bench import Row, make_inputs, measure, paths, render
from pdmask.cli import main


@pytest.fixture(scope="module")
def inputs():
    return make_inputs(32_000, 256, torch.bfloat16)


@pytest.mark.parametrize("path", ["plain", "dppo_torch", "dppo_topk", "pdm_tail"])
def test_benchmark_statistics(benchmark, inputs, path):
    fn = paths(*inputs)[path]
    with torch.no_grad():
        benchmark(fn)


def test_measure_reports_every_path():
    row = measure(32_000, 256, "float32", repeats=1)
    assert isinstance(row, Row) and set(row.ms) == set(row.peak_mib)
    assert all(v > 0 for v in row.ms.values())
    # The chunked path allocates less than the plain log-softmax, which materialises [N, V] float32.
    assert row.peak_mib["pdm_tail"] < row.peak_mib["plain"]
    render([row])


def test_demo_command_runs(capsys):
    assert main(["demo", "--vocab", "512"]) == 0
    out = capsys.readouterr().out
    assert "pdm_tail_tv" in out and "dppo_binary_kl" in out


def test_cli_without_command_prints_help(capsys):
    assert main([]) == 0
    assert "compare" in capsys.readouterr().out
