"""TopKCapture on a real async vLLM engine: requests that ask for logprobs=0 (as verl's server does) come
back with μ's top K, equal to a float32 full softmax of the same weights."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
from vllm.logprobs import Logprob

from pdmask.integrations.vllm import rollout_from_outputs

from conftest import K

SCRIPT = Path(__file__).parent / "capture_topk.py"


def as_output(request: dict) -> SimpleNamespace:
    """A RequestOutput with one completion, rebuilt from the script's JSON."""
    positions = [{i: Logprob(logprob=lp, rank=rank) for i, lp, rank in entries} for entries in request["entries"]]
    completion = SimpleNamespace(token_ids=request["token_ids"], logprobs=positions)
    return SimpleNamespace(outputs=[completion])


def test_capture_returns_the_top_k_of_logprobs_0_requests(tmp_path) -> None:
    out = tmp_path / "capture.json"
    subprocess.run([sys.executable, str(SCRIPT), str(out)], check=True, timeout=900)
    requests = json.loads(out.read_text())["requests"]
    got = rollout_from_outputs([as_output(r) for r in requests], K)
    inside = outside = 0
    for row, request in enumerate(requests):
        length = len(request["token_ids"])
        sizes = {len(entries) for entries in request["entries"]}
        assert sizes <= {K, K + 1}  # raised from logprobs=0 to K (plus the sampled token when outside)
        ids = got.rollout.topk_ids[row, :length]
        assert ids.tolist() == request["reference_topk_ids"]
        torch.testing.assert_close(
            got.rollout.topk_logp[row, :length], torch.tensor(request["reference_topk_logps"]), atol=1e-3, rtol=0
        )
        torch.testing.assert_close(
            got.rollout.logp[row, :length], torch.tensor(request["reference_logp"]), atol=1e-3, rtol=0
        )
        in_top = (ids == got.tokens[row, :length, None]).any(-1)
        inside, outside = inside + int(in_top.sum()), outside + int((~in_top).sum())
    assert inside > 0 and outside > 0
