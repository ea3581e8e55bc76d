"""Requests as verl's vLLM server sends them (``logprobs=0``), to a real async vLLM engine wrapped in
``TopKCapture``; writes the captured entries and a float32 full-softmax reference to JSON.

    python tests_vllm/capture_topk.py OUT.json

``tests_vllm/test_capture.py`` runs it; its output is also ``tests_verl/data/vllm_topk.json``, the real
engine answers that the verl tests carry through verl's agent loop output and batch (verl and vLLM pin
different transformers, so no one environment holds both). ``AsyncLLM`` runs its engine core in a
spawned process, hence a script rather than an in-process test.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import torch

sys.path.insert(0, str(Path(__file__).parent))
from conftest import K, tiny_llama  # noqa: E402

PROMPTS = [[1, 5, 6, 7], [1, 9], [1, 40, 41, 42, 43, 44], [1, 3]]
LENGTHS = (7, 12, 4, 9)  # ragged responses, as verl's batch holds them
TEMPERATURE = 0.8


async def _generate(capture) -> list:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    finals = []
    for i, (prompt, length) in enumerate(zip(PROMPTS, LENGTHS, strict=True)):
        # What verl's vLLMHttpServer.generate builds: logprobs=0 (the sampled token's only) when log-probs are wanted.
        params = SamplingParams(
            max_tokens=length, temperature=TEMPERATURE, logprobs=0, seed=20 + i, ignore_eos=True, detokenize=False
        )
        async for output in capture.generate(
            prompt=TokensPrompt(prompt_token_ids=prompt), sampling_params=params, request_id=f"req-{i}"
        ):
            final = output
        assert final.outputs[0].logprobs is not None
        finals.append(capture.pop(f"req-{i}"))
        assert capture.pop(f"req-{i}") is None  # handed out once
    return finals


def record(completion) -> dict:
    """A vLLM CompletionOutput as JSON: token ids and, per position, [token id, log-prob, rank] entries."""
    entries = [[[i, e.logprob, e.rank] for i, e in position.items()] for position in completion.logprobs]
    return {"token_ids": list(completion.token_ids), "entries": entries}


def reference(model_dir: str, prompt: list[int], tokens: list[int]) -> dict:
    """log μ(a) [R] and μ's top K (ids, log-probs) [R][K] from a float32 full softmax at TEMPERATURE."""
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
    full = torch.log_softmax(logits / TEMPERATURE, -1)
    top = full.topk(K, -1)
    return {
        "reference_logp": full.gather(-1, torch.tensor(tokens)[:, None])[:, 0].tolist(),
        "reference_topk_ids": top.indices.tolist(),
        "reference_topk_logps": top.values.tolist(),
    }


def main(out: str) -> None:
    import vllm
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from pdmask.integrations.vllm import TopKCapture, engine_kwargs

    model_dir = tempfile.mkdtemp()
    tiny_llama().save_pretrained(model_dir)
    args = AsyncEngineArgs(
        model=model_dir, dtype="float32", max_model_len=512, enforce_eager=True, skip_tokenizer_init=True, seed=0,
        **engine_kwargs(K),
    )
    engine = AsyncLLM.from_engine_args(args)
    try:
        finals = asyncio.run(_generate(TopKCapture(engine, K)))
    finally:
        engine.shutdown()

    requests = [
        dict(prompt=prompt, **record(final.outputs[0]), **reference(model_dir, prompt, list(final.outputs[0].token_ids)))
        for prompt, final in zip(PROMPTS, finals, strict=True)
    ]
    meta = {"vllm": vllm.__version__, "top_k": K, "temperature": TEMPERATURE, "command": " ".join(sys.argv)}
    Path(out).write_text(json.dumps({"meta": meta, "requests": requests}) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
