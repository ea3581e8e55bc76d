#!/usr/bin/env bash
# GPU check of pdmask's verl integration on ONE GPU, sized for under 8 minutes (not yet run on a GPU).
# Needs verl's GPU stack installed on the machine next to pdmask: verl 0.9.1 with ray and vLLM, and megatron-core:
#   pip install -e ".[verl,test]" 'verl[vllm]==0.9.1' megatron-core
# (and, for the Megatron engine check, Transformer Engine and Megatron-Bridge; a missing one of those is SKIP, not FAIL).
# A one-GPU machine without a package registry cannot run it: verl needs ray, whose wheel alone (67-79 MB) is more
# than such a machine can be sent (the lent GPU machines take at most 64 MiB a call). It stops at once, saying what
# is missing, where verl, ray or vllm does not import.
#   bash scripts/gpu_check_verl.sh
# 1. the CPU-reference tests of the new settings (Megatron hook at tp = 1 and cp = 2, Ulysses size 2 vs 1);
# 2. scripts/gpu_check_verl.py: verl's FSDP2 engine and verl's Megatron engine path on cuda with PDMLoss, losses
#    equal to the float32 CPU reference. Ulysses and tensor parallelism > 1 on GPUs need two or more: not here.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
python3 - <<'PY'
import importlib.util, sys
missing = [m for m in ("verl", "ray", "vllm") if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"gpu_check_verl: {', '.join(missing)} not installed: pip install -e '.[verl,test]' 'verl[vllm]==0.9.1' "
             "megatron-core (a machine without a package registry cannot run this check).")
PY
start=$SECONDS
timeout 240 python3 -u -m pytest -q -p no:cacheprovider tests_verl/test_megatron.py tests_verl/test_sequence_parallel.py
timeout 240 python3 -u scripts/gpu_check_verl.py
echo "gpu_check_verl: $((SECONDS - start)) s"
