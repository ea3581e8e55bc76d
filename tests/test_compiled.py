"""`pdmask bench --part compiled`: the fused kernels compiled for sm_90 without a GPU, and how their SASS is counted."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pdmask.tools.bench_compiled import TARGET_PER_ELEMENT, vocabulary_loops
from pdmask.triton_pass import triton_available

#: A loop over the vocabulary as nvdisasm prints one: a vector load, a rare branch into a nested loop, the back-edge.
SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/                   LDG.E.128 R4, desc[UR4][R2.64] ;
        /*0020*/                   FFMA R5, R4, 1.44, -R6 ;
        /*0030*/              @!P0 BRA `(.L_x_1) ;
.L_x_2:
        /*0040*/                   FSEL R5, R5, RZ, P1 ;
        /*0050*/                   REDUX.MIN.S32 UR5, R7 ;
        /*0060*/               @P2 BRA `(.L_x_2) ;
.L_x_1:
        /*0070*/                   FADD R8, R8, R5 ;
        /*0080*/               @P3 BRA `(.L_x_0) ;
.L_x_3:
        /*0090*/                   LDG.E.U16 R9, desc[UR4][R2.64] ;
        /*00a0*/               @P4 BRA `(.L_x_3) ;
        /*00b0*/                   EXIT ;
.L_x_4:
        /*00c0*/                   BRA `(.L_x_4);
"""


def test_a_loop_is_counted_on_its_fast_and_slow_paths():
    # The outer loop: load, FFMA, branch, FADD, back-edge (5) past the nested loop; through it once, 8. The scalar
    # loop (no vector load) and the trap at the end are no loops over the vocabulary.
    assert vocabulary_loops(SASS) == [(5, 8)]


@pytest.mark.skipif(not triton_available(), reason="triton is not installed (pip install 'pdmask[gpu]')")
def test_compiled_report_puts_every_kernel_within_the_target(tmp_path):
    report = tmp_path / "compiled.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compiled, not interpreted
    run = subprocess.run([sys.executable, "-m", "pdmask.cli", "bench", "--part", "compiled", "--json", str(report)],
                         env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    data = json.loads(report.read_text())
    assert data["target"] == "sm_90" and data["triton"]
    names = [k["name"] for k in data["kernels"]]
    assert len(names) == 4 and any("backward" in n for n in names)
    for kernel in data["kernels"]:
        assert {"name", "registers", "spill_bytes", "shared_bytes", "sass_per_element"} <= set(kernel)
        assert kernel["spill_bytes"] == 0 and 0 < kernel["sass_per_element"] <= TARGET_PER_ELEMENT, kernel
        assert 0 < kernel["registers"] <= 255
    rows = [line for line in run.stdout.splitlines() if line.startswith(tuple(names))]
    assert len(rows) == 4 and all("✓" in row and "✗" not in row for row in rows)
