"""The rollout's top-K on its way into verl's batch: per-completion lists, then response-aligned tensors.

verl's rollout server answers one request with a ``TokenOutput``; ``topk_lists`` turns the engine's
per-position entries of that completion (``pdmask.integrations.entries``, shared with the vLLM
adapter) into μ's top K as plain lists for ``TokenOutput.extra_fields``, and the agent loop
(``pdmask.integrations.verl.agent_loop``) makes them [response_len, K] tensors of the sample.
``topk_batch_fields`` builds the same fields for a whole batch from pdmask ``Completions``.
Nothing here imports vLLM: the trainer's environment converts what the engine's process sent.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from pdmask.integrations.entries import check_k, completion_entries, completions_from_lists
from pdmask.integrations.verl.topk import TOPK_IDS, TOPK_LOGP
from pdmask.rollout import RolloutLogprobs

#: The rollout config key holding K: ``+actor_rollout_ref.rollout.custom.pdmask_top_k=K``.
TOP_K_KEY = "pdmask_top_k"


def rollout_top_k(rollout_config: Any) -> int:
    """K from verl's rollout config (``custom.pdmask_top_k``); a one-line error naming the override if unset."""
    custom = rollout_config.get("custom") or {}
    top_k = custom.get(TOP_K_KEY)
    if top_k is None:
        raise ValueError(
            "pdmask's top-K rollout needs K: add +actor_rollout_ref.rollout.custom.pdmask_top_k=K (the top log-probs "
            "per token the rollout returns; 20 is a common engine cap)."
        )
    check_k(top_k)
    return int(top_k)


def topk_lists(completion: Any, top_k: int) -> dict[str, list]:
    """One vLLM ``CompletionOutput`` -> ``{rollout_topk_ids: [R][K] ints, rollout_topk_log_probs: [R][K] floats}``,
    μ's K most likely tokens per generated token, descending (``TokenOutput.extra_fields`` of verl's server)."""
    token_ids, entry_ids, entry_logps, ranks = completion_entries(completion)
    rollout = completions_from_lists([token_ids], [entry_ids], [entry_logps], top_k, sampled_ranks=[ranks]).rollout
    assert rollout.topk_ids is not None and rollout.topk_logp is not None
    length = len(token_ids)
    return {TOPK_IDS: rollout.topk_ids[0, :length].tolist(), TOPK_LOGP: rollout.topk_logp[0, :length].tolist()}


def topk_batch_fields(completions: Any, response_length: int) -> dict[str, Tensor]:
    """verl batch fields from pdmask ``Completions`` (tokens, rollout, response_mask; [N, R(, K)]).

    Returns ``rollout_log_probs`` [N, L] and ``rollout_topk_ids`` / ``rollout_topk_log_probs`` [N, L, K],
    L = ``response_length`` (verl's ``rollout.response_length``: every response is padded to it); positions
    past a completion's end hold pdmask's neutral filler (``RolloutLogprobs.masked``).
    """
    rollout = completions.rollout
    if rollout.topk_ids is None or rollout.topk_logp is None:
        raise ValueError(
            "completions carry no top-K: generate with logprobs=K (pdmask.integrations.vllm.sampling_params)."
        )
    width = rollout.topk_ids.shape[1]
    if not isinstance(response_length, int) or response_length < width:
        raise ValueError(
            f"response_length={response_length!r} is shorter than the longest completion ({width} tokens): pass verl's "
            "rollout.response_length, which bounds every response."
        )
    pad = response_length - width
    mask = torch.nn.functional.pad(completions.response_mask.bool(), (0, pad))
    padded = RolloutLogprobs(
        torch.nn.functional.pad(rollout.logp.float(), (0, pad)),
        torch.nn.functional.pad(rollout.topk_ids.long(), (0, 0, 0, pad)),
        torch.nn.functional.pad(rollout.topk_logp.float(), (0, 0, 0, pad)),
    ).masked(mask)
    assert padded.topk_ids is not None and padded.topk_logp is not None
    return {"rollout_log_probs": padded.logp, TOPK_IDS: padded.topk_ids, TOPK_LOGP: padded.topk_logp}


__all__ = ["TOP_K_KEY", "rollout_top_k", "topk_batch_fields", "topk_lists"]
