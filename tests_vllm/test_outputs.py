"""rollout_from_outputs on a real vLLM engine, against a float32 full softmax of the same weights."""

from __future__ import annotations

import pytest
import torch
from vllm import SamplingParams
from vllm.inputs import TokensPrompt

import pdmask
from pdmask.integrations.vllm import rollout_from_outputs, sampling_params

from conftest import VOCAB, K

PROMPTS = [[1, 5, 6, 7], [1, 9], [1, 40, 41, 42, 43, 44]]
LENGTHS = (7, 12, 4)  # max_tokens per request: ragged completions


def generate(llm, temperature: float, top_k: int = K, n: int = 2):
    params = [
        sampling_params(top_k, temperature, n=n, max_tokens=m, seed=10 + i, ignore_eos=True, detokenize=False)
        for i, m in enumerate(LENGTHS)
    ]
    return llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params, use_tqdm=False)


def full_logprobs(reference, prompt: list[int], completion: list[int], temperature: float) -> torch.Tensor:
    """log softmax(z / temperature) [R, V] at the positions that predict the completion, float32."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = reference(ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits / temperature, -1)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_matches_full_softmax(llm, reference, temperature: float) -> None:
    """log μ(a) and the top K equal a float32 full softmax of the same weights at temperature τ (processed
    log-probs), in request then sample order, both when the sampled token is in the top K and when it is not."""
    outputs = generate(llm, temperature)
    got = rollout_from_outputs(
        outputs, K, logprobs_mode=llm.llm_engine.model_config.logprobs_mode, temperature=temperature
    )
    rows = [(prompt, list(c.token_ids)) for prompt, out in zip(PROMPTS, outputs) for c in out.outputs]
    assert got.tokens.shape == (6, max(LENGTHS)) and got.rollout.topk_ids.shape == (6, max(LENGTHS), K)
    inside = outside = 0
    for row, (prompt, completion) in enumerate(rows):
        length = len(completion)
        assert got.tokens[row, :length].tolist() == completion
        assert got.response_mask[row].tolist() == [True] * length + [False] * (max(LENGTHS) - length)
        assert not got.tokens[row, length:].any()
        full = full_logprobs(reference, prompt, completion, temperature)
        tokens, ids = got.tokens[row, :length], got.rollout.topk_ids[row, :length]
        torch.testing.assert_close(got.rollout.logp[row, :length], full.gather(-1, tokens[:, None])[:, 0], atol=1e-3, rtol=0)
        torch.testing.assert_close(got.rollout.topk_logp[row, :length], full.gather(-1, ids), atol=1e-3, rtol=0)
        torch.testing.assert_close(got.rollout.topk_logp[row, :length], full.topk(K, -1).values, atol=1e-3, rtol=0)
        in_top = (ids == tokens[:, None]).any(-1)
        inside, outside = inside + int(in_top.sum()), outside + int((~in_top).sum())
    assert inside > 0 and outside > 0  # K and K + 1 entries both occurred

    # The same weights on both sides: pdmask measures (almost) no divergence.
    logits = torch.stack([
        torch.nn.functional.pad(full_logprobs(reference, p, c, 1.0), (0, 0, 0, max(LENGTHS) - len(c))) for p, c in rows
    ]) / temperature
    stats = pdmask.policy_stats(logits, got.tokens, got.rollout, response_mask=got.response_mask)
    tv = pdmask.divergence(stats, "tv", "topk")[got.response_mask]
    assert tv.max() < 1e-3


def test_raw_logprobs_at_other_temperature_refused(llm) -> None:
    outputs = generate(llm, 0.7)
    with pytest.raises(ValueError, match="raw_logprobs, taken before the temperature 0.7"):
        rollout_from_outputs(outputs, K, logprobs_mode="raw_logprobs", temperature=0.7)
    rollout_from_outputs(outputs, K, logprobs_mode="processed_logprobs", temperature=0.7)
    with pytest.raises(ValueError, match="taken before the temperature None"):  # raw needs the temperature
        rollout_from_outputs(outputs, K, logprobs_mode="raw_logprobs")
    rollout_from_outputs(generate(llm, 1.0), K, logprobs_mode="raw_logprobs", temperature=1.0)


def test_logits_modes_refused(llm) -> None:
    outputs = generate(llm, 1.0)
    for mode in ("raw_logits", "processed_logits"):
        with pytest.raises(ValueError, match=f"returns {mode}, not log-probabilities"):
            rollout_from_outputs(outputs, K, logprobs_mode=mode, temperature=1.0)


def test_outputs_without_logprobs_refused(llm) -> None:
    params = SamplingParams(max_tokens=3, ignore_eos=True, detokenize=False, seed=0)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=PROMPTS[0])], params, use_tqdm=False)
    with pytest.raises(ValueError, match=r"outputs\[0\]\.outputs\[0\] has no log-probs: generate with logprobs=K"):
        rollout_from_outputs(outputs, K)


def test_fewer_than_k_refused(llm) -> None:
    """logprobs=K-1 gives K entries when the sampled token ranks below K - 1: the rank tells them apart."""
    outputs = generate(llm, 1.0, top_k=K - 1)
    with pytest.raises(ValueError, match="the request asked for fewer than K = 5"):
        rollout_from_outputs(outputs, K)
    assert rollout_from_outputs(outputs, K - 1).rollout.k == K - 1


def test_validated_for_the_trainer(llm) -> None:
    got = rollout_from_outputs(generate(llm, 1.0), K)
    checked = got.rollout.validated(got.tokens, VOCAB, torch.float32)
    assert checked.info == "topk"
