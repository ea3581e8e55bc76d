"""The rollout's top-K as verl batch fields: response-aligned [batch, response_length(, K)] tensors.

The converter from vLLM's outputs is pdmask's vLLM adapter (``pdmask.integrations.vllm``:
``rollout_from_outputs`` for ``RequestOutput``s, ``completions_from_lists`` for plain per-position
lists); its ``Completions`` go into verl's batch through ``topk_batch_fields``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from pdmask.integrations.verl.topk import TOPK_IDS, TOPK_LOGP
from pdmask.rollout import RolloutLogprobs


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


__all__ = ["topk_batch_fields"]
