#!/usr/bin/env bash
# CI for pdmask.integrations.verl: its own virtual environment (verl pins transformers), the verl tests, the CPU smoke.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=disabled
python3 -m venv .venv-verl
. .venv-verl/bin/activate
pip install -q torch==2.13.0
pip install -q -e ".[verl,test]"
# verl's v1 trainer (trainer_mode=pdmask_sync) imports its rollout stack, which verl's base requirements omit.
pip install -q "TransferQueue>=0.1.10" pyzmq msgspec cachetools uvicorn fastapi torchtitan
python -m pytest -q -p no:cacheprovider tests_verl
python examples/verl_cpu_smoke.py
