#!/usr/bin/env bash
# Issue 30's GPU checks on one CUDA GPU, with the machine's own PyTorch and Triton (nothing is downloaded), in
# well under 8 minutes: the gpu-marked tests (the fused kernels against the torch pass, no sync under
# torch.cuda.set_sync_debug_mode, bf16 hidden states with float32-output matmuls), and `pdmask bench --device cuda` at
# V = 151,936, N = 16,384, bf16. Results go to $OUT (or a temporary folder).
#   bash scripts/gpu_check.sh              # on the GPU machine
#   DEVICE=cpu bash scripts/gpu_check.sh   # the dry run: the same steps on the CPU at a tiny shape
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
DEVICE="${DEVICE:-cuda}"
export PDMASK_TRITON=1  # the fused kernels are opt-in until this script has passed on a GPU
out="${OUT:-$(mktemp -d)}"
mkdir -p "$out"
if [ "$DEVICE" = cuda ]; then
    unset TRITON_INTERPRET  # compiled kernels, not the interpreter
    shape=(--vocab 151936 --positions 16384 --dtype bfloat16 --hidden-dim 2048 --repeats 5)
else
    export TRITON_INTERPRET=1
    shape=(--vocab 2000 --positions 32 --dtype bfloat16 --hidden-dim 64 --repeats 1)
fi
python - <<'PY'
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU")
try:
    import triton
    print("triton", triton.__version__)
except ImportError:
    print("triton: not installed (the fused kernels are off; the torch pass runs)")
PY
if python -c "import pytest" 2>/dev/null; then
    tests=(tests/test_triton.py tests/test_syncs.py)
    python -c "import hypothesis" 2>/dev/null && tests+=(tests/test_hidden.py)  # its module imports hypothesis
    timeout 240 python -m pytest -q -p no:cacheprovider -m gpu "${tests[@]}" 2>&1 | tee "$out/gpu_tests.txt"
else
    echo "pytest is not installed: the gpu-marked tests are skipped" | tee "$out/gpu_tests.txt"
fi
timeout 300 python -m pdmask.tools.bench_device --device "$DEVICE" "${shape[@]}" --json "$out/bench_$DEVICE.json" 2>&1 \
    | tee "$out/bench_$DEVICE.txt"
echo "results in $out"
