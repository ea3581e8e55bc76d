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

from pdmask.integrations.verl.rollout import ENTRIES, TOP_K_KEY, entries_field, topk_tensors
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

    from pdmask.testing.verl import save_tiny_llama

    return AutoTokenizer.from_pretrained(save_tiny_llama(str(tmp_path), vocab_size=512))


def completion(request: dict) -> SimpleNamespace:
    """vLLM's CompletionOutput as the engine returned it: token ids and one {id: Logprob-like} per position."""
    positions = [{i: SimpleNamespace(logprob=lp, rank=rank) for i, lp, rank in entries} for entries in request["entries"]]
    return SimpleNamespace(token_ids=request["token_ids"], logprobs=positions)


def token_output(request: dict):
    """What TopKvLLMHttpServer.generate returns for the request."""
    from verl.workers.rollout.replica import TokenOutput

    sampled = [dict((i, lp) for i, lp, _ in entries)[t] for t, entries in zip(request["token_ids"], request["entries"])]
    extra = {"global_steps": 0, ENTRIES: entries_field(completion(request))}
    return TokenOutput(token_ids=request["token_ids"], log_probs=sampled, stop_reason="completed", extra_fields=extra)


def agent_loop_output(request: dict, length: int | None = None):
    """verl's AgentLoopOutput of a single-turn rollout answered by token_output(request), cut to ``length``."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput

    out = token_output(request)
    n = len(out.token_ids) if length is None else length
    return AgentLoopOutput(
        prompt_ids=request["prompt"],
        response_ids=out.token_ids[:n],
        response_mask=[1] * n,
        response_logprobs=out.log_probs[:n],
        metrics=AgentLoopMetrics(),
        extra_fields=dict(out.extra_fields),
    )


def test_topk_tensors_equal_the_full_softmax_reference() -> None:
    inside = outside = 0
    for request in REQUESTS:
        ids, logps = topk_tensors(entries_field(completion(request)), K, request["token_ids"])
        assert ids.tolist() == request["reference_topk_ids"]
        torch.testing.assert_close(logps, torch.tensor(request["reference_topk_logps"]), atol=1e-3, rtol=0)
        for token, row in zip(request["token_ids"], ids.tolist()):
            inside, outside = inside + (token in row), outside + (token not in row)
    assert inside > 0 and outside > 0  # the sampled token inside and outside the top K
    with pytest.raises(ValueError, match="do not line up with the response"):
        topk_tensors(entries_field(completion(REQUESTS[0])), K, REQUESTS[1]["token_ids"])


@pytest.mark.parametrize("cut", [None, 3], ids=["ragged", "equal-lengths"])
def test_agent_loop_outputs_stack_into_the_batch_pdm_loss_reads(cut) -> None:
    """TopKAgentLoopOutput.as_dict per sample -> verl's list_of_dict_to_tensordict (the TransferQueue put) ->
    rollout_from_batch: μ's top K [B, R, K] and log μ(a) [B, R] equal the reference on every response token,
    whether verl stacks the samples as a jagged tensor (ragged responses) or a dense one (equal lengths)."""
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict

    rows = [agent_loop.TopKAgentLoopOutput.from_output(agent_loop_output(r, cut), K).as_dict() for r in REQUESTS]
    data = list_of_dict_to_tensordict(rows)
    assert data[TOPK_IDS].is_nested == (cut is None)
    mu = rollout_from_batch(data, get_method("pdm_proportional_tv"), top_k=K)
    for row, request in enumerate(REQUESTS):
        n = len(request["token_ids"]) if cut is None else cut
        assert mu.topk_ids[row, :n].tolist() == request["reference_topk_ids"][:n]
        torch.testing.assert_close(
            mu.topk_logp[row, :n], torch.tensor(request["reference_topk_logps"][:n]), atol=1e-3, rtol=0
        )
        torch.testing.assert_close(mu.logp[row, :n], torch.tensor(request["reference_logp"][:n]), atol=1e-3, rtol=0)
    with pytest.raises(ValueError, match="K = 5 columns but PDMLoss was built with top_k=8"):
        rollout_from_batch(data, get_method("pdm_proportional_tv"), top_k=8)


def test_jagged_fields_are_padded_to_their_longest_row() -> None:
    """Jagged fields can reach the actor with a cached max length larger than their longest row (seen in verl's
    trainer, where TransferQueue's fields came with max length = all rows' tokens); to_padded_tensor pads to that
    cache, PDMLoss pads to the rows, as wide as the response mask."""
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict

    rows = [agent_loop.TopKAgentLoopOutput.from_output(agent_loop_output(r), K).as_dict() for r in REQUESTS]
    data = list_of_dict_to_tensordict(rows)
    for key in (TOPK_IDS, TOPK_LOGP, "rollout_log_probs"):
        field = data[key]
        data[key] = torch.nested.nested_tensor_from_jagged(
            field.values(), field.offsets(), max_seqlen=field.values().shape[0]
        )
        assert field.to_padded_tensor(0).shape[1] < data[key].to_padded_tensor(0).shape[1]
    mu = rollout_from_batch(data, get_method("pdm_proportional_tv"), top_k=K)
    longest = max(len(r["token_ids"]) for r in REQUESTS)
    assert mu.topk_ids.shape == (len(REQUESTS), longest, K) and mu.logp.shape == (len(REQUESTS), longest)


def test_an_empty_response_has_an_empty_top_k() -> None:
    """An aborted request answers with no tokens and no entries: [0, K] tensors, which stack with the rest."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput

    empty = AgentLoopOutput(prompt_ids=[1], response_ids=[], response_mask=[], metrics=AgentLoopMetrics())
    fields = agent_loop.TopKAgentLoopOutput.from_output(empty, K).as_dict()
    assert fields[TOPK_IDS].shape == (0, K) and fields[TOPK_LOGP].shape == (0, K)


def test_a_server_without_topk_is_refused() -> None:
    from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput

    plain = AgentLoopOutput(prompt_ids=[1], response_ids=[2], response_mask=[1], metrics=AgentLoopMetrics())
    with pytest.raises(ValueError, match="trainer.v1.trainer_mode=pdmask_sync"):
        agent_loop.TopKAgentLoopOutput.from_output(plain, K)


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
            "actor_rollout_ref": {
                "rollout": {"prompt_length": 64, "response_length": response_length, "custom": {TOP_K_KEY: K}}
            },
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
    assert out.rollout_topk_ids.tolist() == request["reference_topk_ids"][:response_length]
    assert ENTRIES not in out.extra_fields
    fields = out.as_dict()
    assert fields[TOPK_IDS].shape == (response_length, K) and fields[TOPK_LOGP].dtype == torch.float32
