#!/usr/bin/env bash
# GPU check of pdmask's verl integration on ONE GPU, sized for under 8 minutes (not yet run on a GPU).
# Needs verl's GPU stack next to pdmask: pip install -e ".[verl,test]" 'verl[vllm]==0.9.1' megatron-core
# (and, for the Megatron engine check, Transformer Engine and Megatron-Bridge; a missing module is SKIP, not FAIL).
#   bash scripts/gpu_check_verl.sh
# 1. the CPU-reference tests of the new settings (Megatron hook at tp = 1 and cp = 2, Ulysses size 2 vs 1);
# 2. scripts/gpu_check_verl.py: verl's FSDP2 engine and verl's Megatron engine path on cuda with PDMLoss, losses
#    equal to the float32 CPU reference. Ulysses and tensor parallelism > 1 on GPUs need two or more: not here.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false
start=$SECONDS
timeout 240 python -m pytest -q -p no:cacheprovider tests_verl/test_megatron.py tests_verl/test_sequence_parallel.py
timeout 240 python scripts/gpu_check_verl.py
echo "gpu_check_verl: $((SECONDS - start)) s"
