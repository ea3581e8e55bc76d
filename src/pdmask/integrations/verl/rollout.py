"""The rollout's top-K on its way into verl's batch: the engine's entries, then response-aligned tensors.

verl's rollout server answers one request with a ``TokenOutput``; ``entries_field`` copies the
engine's per-position entries of that completion into ``TokenOutput.extra_fields`` as plain lists
(cheap: the server's event loop also runs the engine's output handling), and the agent loop
(``pdmask.integrations.verl.agent_loop``) turns them into μ's top K with ``topk_tensors``, the vLLM
adapter's conversion (``pdmask.integrations.logprob_lists``), as [response_len, K] tensors of the sample.
``topk_batch_fields`` builds the same fields for a whole batch from pdmask ``Completions``.
Nothing here imports vLLM: the trainer's environment converts what the engine's process sent.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from pdmask.integrations.logprob_lists import check_k, completion_entries, completions_from_lists
from pdmask.integrations.verl.topk import TOPK_IDS, TOPK_LOGP
from pdmask.rollout import RolloutLogprobs

#: The rollout config key holding K: ``+actor_rollout_ref.rollout.custom.pdmask_top_k=K``.
TOP_K_KEY = "pdmask_top_k"
#: ``TokenOutput.extra_fields`` key of the engine's per-position entries (``entries_field``).
ENTRIES = "rollout_logprob_entries"
#: The remedy for a rollout whose log-probs are not μ's.
LOGPROBS_FIX = "set actor_rollout_ref.rollout.logprobs_mode=processed_logprobs"


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


def entries_field(completion: Any) -> dict[str, list]:
    """One vLLM ``CompletionOutput`` -> ``{tokens [R], ids [R][L], logps [R][L], ranks [R]}``: the sampled tokens and
    the engine's entries at each position, as JSON-able lists (``TokenOutput.extra_fields[ENTRIES]``)."""
    tokens, ids, logps, ranks = completion_entries(completion)
    return {"tokens": tokens, "ids": ids, "logps": logps, "ranks": ranks}


def topk_tensors(entries: dict[str, list], top_k: int, response_ids: list[int]) -> tuple[Tensor, Tensor]:
    """μ's top K at each response token, ids int64 [R, K] and log-probs float32 [R, K], descending, from
    ``entries_field``'s lists cut to the R = len(response_ids) tokens verl kept."""
    n = len(response_ids)
    if list(entries["tokens"][:n]) != list(response_ids):
        raise ValueError(
            "the rollout server's log-prob entries do not line up with the response: pdmask's top-K agent loop "
            "runs single-turn rollouts (default_agent_loop=pdmask_topk_single_turn), not tool or multi-turn ones."
        )
    if n == 0:
        return torch.zeros(0, top_k, dtype=torch.long), torch.zeros(0, top_k)
    cut = [[entries[key][:n]] for key in ("tokens", "ids", "logps", "ranks")]
    rollout = completions_from_lists(*cut[:3], top_k, sampled_ranks=cut[3]).rollout
    return rollout.topk_ids[0], rollout.topk_logp[0]  # type: ignore[index]  # always set by completions_from_lists


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


__all__ = [
    "ENTRIES",
    "LOGPROBS_FIX",
    "TOP_K_KEY",
    "entries_field",
    "rollout_top_k",
    "topk_batch_fields",
    "topk_tensors",
]
