"""The rollout side of trainer_mode=pdmask_sync, from a real vLLM engine's answers to the actor's batch.

``data/vllm_topk.json`` holds the answers of a real async vLLM 0.32 engine (CPU) to requests sent as
verl's server sends them (``logprobs=0``), raised to K by ``TopKCapture``, with a float32 full-softmax
reference of the same weights; ``tests_vllm/capture_topk.py`` writes it and ``tests_vllm/test_capture.py``
checks that script on every CI run. Here those answers go through the server's conversion, verl's
single-turn agent loop, verl's TransferQueue stacking and ``PDMLoss``'s reading of the batch.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from pdmask.integrations.verl.rollout import TOP_K_KEY, rollout_top_k, topk_lists
from pdmask.integrations.verl.topk import TOPK_IDS, TOPK_LOGP, rollout_from_batch
from pdmask.methods import get_method

agent_loop = pytest.importorskip(
    "pdmask.integrations.verl.agent_loop", reason="verl's agent loop needs its rollout stack (.ci/verl.sh)"
)

DATA = json.loads((Path(__file__).parent / "data" / "vllm_topk.json").read_text())
K = DATA["meta"]["top_k"]
REQUESTS = DATA["requests"]


@pytest.fixture
def tiny_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    from pdmask.integrations.verl.cpu import save_tiny_llama

    return AutoTokenizer.from_pretrained(save_tiny_llama(str(tmp_path), vocab_size=512))


def completion(request: dict) -> SimpleNamespace:
    """vLLM's CompletionOutput as the engine returned it: token ids and one {id: Logprob-like} per position."""
    positions = [{i: SimpleNamespace(logprob=lp, rank=rank) for i, lp, rank in entries} for entries in request["entries"]]
    return SimpleNamespace(token_ids=request["token_ids"], logprobs=positions)


def token_output(request: dict):
    """What TopKvLLMHttpServer.generate returns for the request."""
    from verl.workers.rollout.replica import TokenOutput

    sampled = [dict((i, lp) for i, lp, _ in entries)[t] for t, entries in zip(request["token_ids"], request["entries"])]
    extra = {"global_steps": 0, **topk_lists(completion(request), K)}
    return TokenOutput(token_ids=request["token_ids"], log_probs=sampled, stop_reason="completed", extra_fields=extra)


def test_topk_lists_equal_the_full_softmax_reference() -> None:
    inside = outside = 0
    for request in REQUESTS:
        got = topk_lists(completion(request), K)
        assert got[TOPK_IDS] == request["reference_topk_ids"]
        torch.testing.assert_close(torch.tensor(got[TOPK_LOGP]), torch.tensor(request["reference_topk_logps"]), atol=1e-3, rtol=0)
        for token, ids in zip(request["token_ids"], got[TOPK_IDS]):
            inside, outside = inside + (token in ids), outside + (token not in ids)
    assert inside > 0 and outside > 0  # the sampled token inside and outside the top K


def test_agent_loop_outputs_stack_into_the_batch_pdm_loss_reads() -> None:
    """TopKAgentLoopOutput.as_dict per sample -> verl's list_of_dict_to_tensordict (the TransferQueue put) ->
    rollout_from_batch: μ's top K [B, R, K] and log μ(a) [B, R] equal the reference on every response token."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict

    rows = []
    for request in REQUESTS:
        out = token_output(request)
        length = len(out.token_ids)
        plain = AgentLoopOutput(
            prompt_ids=request["prompt"],
            response_ids=out.token_ids,
            response_mask=[1] * length,
            response_logprobs=out.log_probs,
            metrics=AgentLoopMetrics(),
            extra_fields=dict(out.extra_fields),
        )
        rows.append(agent_loop.TopKAgentLoopOutput.from_output(plain).as_dict())
    data = list_of_dict_to_tensordict(rows)
    assert data[TOPK_IDS].is_nested  # ragged responses stack like rollout_log_probs
    mu = rollout_from_batch(data, get_method("pdm_tail_tv"), top_k=K)
    for row, request in enumerate(REQUESTS):
        n = len(request["token_ids"])
        assert mu.topk_ids[row, :n].tolist() == request["reference_topk_ids"]
        torch.testing.assert_close(mu.topk_logp[row, :n], torch.tensor(request["reference_topk_logps"]), atol=1e-3, rtol=0)
        torch.testing.assert_close(mu.logp[row, :n], torch.tensor(request["reference_logp"]), atol=1e-3, rtol=0)
    with pytest.raises(ValueError, match="K = 5 columns but PDMLoss was built with top_k=8"):
        rollout_from_batch(data, get_method("pdm_tail_tv"), top_k=8)


def test_a_server_without_topk_is_refused() -> None:
    from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput

    plain = AgentLoopOutput(prompt_ids=[1], response_ids=[2], response_mask=[1], metrics=AgentLoopMetrics())
    with pytest.raises(ValueError, match="trainer.v1.trainer_mode=pdmask_sync"):
        agent_loop.TopKAgentLoopOutput.from_output(plain)


def rollout_config(**overrides):
    fields = {
        "name": "vllm",
        "temperature": 0.8,
        "calculate_log_probs": True,
        "logprobs_mode": "processed_logprobs",
        "agent": {"default_agent_loop": agent_loop.TOPK_AGENT_LOOP},
        "disaggregation": {"enabled": False},
        "custom": {TOP_K_KEY: K},
    }
    return OmegaConf.create(fields | overrides)


def test_rollout_config_checks_name_each_fix() -> None:
    from pdmask.integrations.verl.trainer import check_topk_rollout

    check_topk_rollout(rollout_config())
    assert rollout_top_k(rollout_config()) == K
    with pytest.raises(ValueError, match=r"\+actor_rollout_ref.rollout.custom.pdmask_top_k=K"):
        rollout_top_k(rollout_config(custom=None))
    with pytest.raises(ValueError, match="top_k must be an int >= 1"):
        rollout_top_k(rollout_config(custom={TOP_K_KEY: 0}))
    cases = {
        "rollout.name=vllm": {"name": "sglang"},
        "calculate_log_probs=True": {"calculate_log_probs": False},
        "default_agent_loop=pdmask_topk_single_turn": {"agent": {"default_agent_loop": "single_turn_agent"}},
        "disaggregation.enabled=False": {"disaggregation": {"enabled": True}},
        "logprobs_mode='processed_logprobs'": {"logprobs_mode": "processed_logits"},
    }
    for fix, override in cases.items():
        with pytest.raises(ValueError, match=fix.replace("(", r"\(").replace(".", r"\.")):
            check_topk_rollout(rollout_config(**override))


def test_the_single_turn_agent_loop_carries_the_servers_topk(tiny_tokenizer) -> None:
    """verl's own SingleTurnAgentLoop.run (chat template, token merge, truncation to response_length) under
    TopKSingleTurnAgentLoop, against a server stub that answers with a recorded vLLM answer."""
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap

    request = REQUESTS[1]
    response_length = len(request["token_ids"]) - 3  # verl cuts the response: the top K must follow

    class Server:
        async def generate(self, **kwargs):
            return token_output(request)

    config = OmegaConf.create(
        {
            "actor_rollout_ref": {"rollout": {"prompt_length": 64, "response_length": response_length}},
            "data": {},
        }
    )
    agent = agent_loop.TopKSingleTurnAgentLoop(
        trainer_config=DictConfigWrap(config),
        server_manager=Server(),
        tokenizer=tiny_tokenizer,
        processor=None,
        dataset_cls=None,
        data_config=DictConfigWrap(config.data),
    )
    prompt = [{"role": "user", "content": "t7 t8"}]
    out = agent.loop.run_until_complete(agent.run({"temperature": 0.8, "logprobs": True}, raw_prompt=prompt))
    assert isinstance(out, agent_loop.TopKAgentLoopOutput)
    assert out.response_ids == request["token_ids"][:response_length]
    assert out.rollout_topk_ids == request["reference_topk_ids"][:response_length]
    assert TOPK_IDS not in out.extra_fields and TOPK_LOGP not in out.extra_fields
    fields = out.as_dict()
    assert fields[TOPK_IDS].shape == (response_length, K) and fields[TOPK_LOGP].dtype == torch.float32
