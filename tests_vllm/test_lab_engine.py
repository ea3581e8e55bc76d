"""The lab's vLLM engine: Rollouts that match the trainer's float32 softmax, weights synced before each batch."""

from __future__ import annotations

import pytest
import torch

from pdmask.lab.models import HFPolicy
from pdmask.lab.vllm_engine import VLLMEngine

from conftest import VOCAB, K, tiny_llama

PROMPTS = [[1, 5, 6, 7], [1, 9], [1, 40, 41]]
EOS, PAD, GROUP = 2, 0, 3


@pytest.fixture(scope="module")
def policy() -> HFPolicy:
    return HFPolicy(tiny_llama(seed=1), tokenizer=None)


@pytest.fixture(scope="module")
def engine(policy) -> VLLMEngine:
    return VLLMEngine(policy, "fp32", top_k_logprobs=K, seed=0)


def rollout(engine, seed: int = 0):
    return engine.generate(
        PROMPTS, GROUP, 1.0, max_new_tokens=10, eos_id=EOS, pad_id=PAD, generator=torch.Generator().manual_seed(seed)
    )


def trainer_logprobs(policy, ro) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(ro.response_logits(policy).float(), -1)


def assert_matches(policy, ro) -> None:
    full, valid = trainer_logprobs(policy, ro), ro.response_mask
    at_a = full.gather(-1, ro.tokens[..., None])[..., 0]
    torch.testing.assert_close(ro.logp[valid], at_a[valid], atol=1e-3, rtol=0)
    torch.testing.assert_close(ro.topk_logp[valid], full.gather(-1, ro.topk_ids)[valid], atol=1e-3, rtol=0)
    torch.testing.assert_close(ro.topk_logp[valid], full.topk(K, -1).values[valid], atol=1e-3, rtol=0)


def test_engine_restores_set_num_threads(engine) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    assert torch.get_num_threads() == 1
    torch.set_num_threads(before)


def test_rollout_layout_and_values(policy, engine) -> None:
    ro = rollout(engine)
    n, width = ro.tokens.shape
    assert n == len(PROMPTS) * GROUP and ro.topk_ids.shape == (n, width, K)
    for row in range(n):  # row i belongs to prompt i // GROUP, left-padded
        prompt = PROMPTS[row // GROUP]
        assert ro.input_ids[row, ro.prompt_len - len(prompt) : ro.prompt_len].tolist() == prompt
        tokens, valid = ro.tokens[row].tolist(), ro.response_mask[row].tolist()
        length = tokens.index(EOS) + 1 if EOS in tokens[: sum(valid)] else 10
        assert valid == [True] * length + [False] * (width - length)  # up to and including EOS
        assert all(t == PAD for t in tokens[length:])
    assert_matches(policy, ro)
    # Padding is consistent for pdmask's validation: μ(pad) = 1.
    ro.rollout_logprobs().validated(ro.tokens, VOCAB, torch.float32)
    # The same seed gives the same rollout.
    assert torch.equal(rollout(engine).tokens, ro.tokens)


def test_sync_loads_the_trainers_weights(policy, engine) -> None:
    stale = rollout(engine, seed=1)
    with torch.no_grad():
        for p in policy.parameters():
            p.mul_(1.2)
    gap = (trainer_logprobs(policy, stale).gather(-1, stale.tokens[..., None])[..., 0] - stale.logp)[stale.response_mask]
    assert gap.abs().max() > 1e-2  # the old μ no longer matches: the check below has teeth
    engine.sync(policy)
    assert_matches(policy, rollout(engine, seed=1))
    engine.sync(policy.state_dict())  # a state dict (the lab's lagged snapshots) works the same
    assert_matches(policy, rollout(engine, seed=2))


def test_load_weights_alone_leaves_cpu_engine_stale(policy, engine) -> None:
    """The trap sync avoids: vLLM's CPU linear layers compute from weights prepacked at load time, so
    load_weights changes the parameter and not the output."""
    engine.sync(policy)
    before = rollout(engine, seed=3)
    head = policy.model.lm_head.weight
    with torch.no_grad():
        head.mul_(2.0)
    engine.llm.apply_model(lambda model: model.load_weights([("lm_head.weight", head)]))
    engine.llm.reset_prefix_cache()
    stale = rollout(engine, seed=3)
    assert torch.equal(stale.tokens, before.tokens) and torch.equal(stale.logp, before.logp)
    engine.sync(policy)
    synced = rollout(engine, seed=3)
    assert not torch.equal(synced.logp, before.logp)
    assert_matches(policy, synced)


def test_refuses_bad_settings(policy) -> None:
    with pytest.raises(ValueError, match="engine=vllm runs fp32, bf16, fp16, not 'fp8'"):
        VLLMEngine(policy, "fp8")
    with pytest.raises(ValueError, match="not TinyGPT"):
        VLLMEngine(torch.nn.Linear(2, 2), "fp32")


def test_config_validates_engine() -> None:
    from pdmask.lab.config import ConfigError, config_from
    from pdmask.lab.presets import PRESETS

    pretrained = {"model": "smollm2-135m", "task": "arithmetic", "heldout_size": 8, "engine": "vllm"}
    assert config_from(pretrained).engine == "vllm"
    assert PRESETS["vllm"].validate().base.engine == "vllm"
    for changes, message in (
        ({"engine": "sglang"}, "engine: must be 'local' or 'vllm'"),
        ({"engine": "vllm"}, "engine: vllm serves pretrained models"),
        (pretrained | {"rollout_dtype": "fp8"}, "engine=vllm runs fp32, bf16 or fp16"),
        (pretrained | {"method": "pdm_full_tv"}, "needs all of μ but vLLM returns its top K"),
    ):
        with pytest.raises(ConfigError, match=message):
            config_from(changes)
    config_from(pretrained | {"method": "pdm_full_tv", "mu": "recompute"})
