#!/usr/bin/env bash
# The fused kernels' checks on one CUDA GPU, with the machine's own Python, PyTorch and Triton (nothing is installed:
# the machine it is for has Python 3.12, torch 2.11, Triton 3.6, pytest and hypothesis, and no package registry),
# in well under 8 minutes:
#   1. the gpu-marked tests: the fused kernels against the torch pass (tolerances from the error analysis in
#      tests/test_triton.py), no sync under torch.cuda.set_sync_debug_mode, bf16 hidden states with float32 outputs;
#   2. the kernels compiled for sm_90 (registers, spills, SASS per logit: `pdmask bench --part compiled`);
#   3. `pdmask bench --device cuda` at V = 151,936, N = 16,384, bf16.
# Every step runs and reports even when an earlier one fails; the script exits 1 if any failed. Output, unbuffered,
# goes to the terminal and to $OUT (or a temporary folder).
#   bash scripts/gpu_check.sh              # on the GPU machine
#   DEVICE=cpu bash scripts/gpu_check.sh   # the dry run: the same steps on the CPU at a tiny shape (interpreter)
set -uo pipefail  # no -e: a failed step is recorded, and the next one runs
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export PDMASK_TRITON=1  # the fused kernels are opt-in until this script has passed on a GPU
DEVICE="${DEVICE:-cuda}"
out="${OUT:-$(mktemp -d)}"
mkdir -p "$out"
if [ "$DEVICE" = cuda ]; then
    unset TRITON_INTERPRET  # compiled kernels, not the interpreter
    shape=(--vocab 151936 --positions 16384 --dtype bfloat16 --hidden-dim 2048 --repeats 5)
else
    export TRITON_INTERPRET=1
    shape=(--vocab 2000 --positions 32 --dtype bfloat16 --hidden-dim 64 --repeats 1)
fi
failed=()
# step NAME SECONDS COMMAND...: runs the command under a time limit, its output to the terminal and $out/NAME.txt.
step() {
    local name=$1 limit=$2
    shift 2
    echo "== $name: $*"
    timeout "$limit" "$@" 2>&1 | tee "$out/$name.txt"
    local status=${PIPESTATUS[0]}
    echo "== $name: exit $status"
    [ "$status" -eq 0 ] || failed+=("$name ($status)")
}
step versions 60 python3 -u -c '
import sys, torch
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU")
try:
    import triton
    print("triton", triton.__version__)
except ImportError:
    print("triton: not installed (the fused kernels are off; the torch pass runs)")
'
if python3 -c "import pytest" 2>/dev/null; then
    tests=(tests/test_triton.py tests/test_syncs.py)
    python3 -c "import hypothesis" 2>/dev/null && tests+=(tests/test_hidden.py)  # its module imports hypothesis
    step gpu_tests 240 python3 -u -m pytest -q -p no:cacheprovider -m gpu "${tests[@]}"
else
    echo "pytest is not installed: the gpu-marked tests are skipped" | tee "$out/gpu_tests.txt"
fi
# Compiled, never interpreted: the dry run's TRITON_INTERPRET would make every kernel an interpreted function.
step compiled 120 env -u TRITON_INTERPRET python3 -u -m pdmask.tools.bench_compiled --json "$out/compiled.json"
step "bench_$DEVICE" 300 python3 -u -m pdmask.tools.bench_device --device "$DEVICE" "${shape[@]}" --json "$out/bench_$DEVICE.json"
echo "results in $out"
if [ "${#failed[@]}" -gt 0 ]; then
    echo "FAILED: ${failed[*]}"
    exit 1
fi
echo "all steps passed"
