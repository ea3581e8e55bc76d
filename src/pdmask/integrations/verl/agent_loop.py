"""The agent loop that carries the rollout's top K from verl's server into the batch.

verl's single-turn agent loop passes the server's ``TokenOutput.extra_fields`` through as a
non-tensor dict. ``TopKSingleTurnAgentLoop`` (registered in verl's agent-loop registry as
``pdmask_topk_single_turn``) lifts pdmask's two lists out of it into response-aligned tensors of
the sample, [response_len, K]; verl's TransferQueue path then stacks the samples as it stacks
``rollout_log_probs`` (a jagged tensor when lengths differ), and ``PDMLoss`` pads them like the
response mask.
"""

from __future__ import annotations

from typing import Any

import torch
from verl.experimental.agent_loop.agent_loop import AgentLoopOutput, register
from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop

from pdmask.integrations.verl.topk import TOPK_IDS, TOPK_LOGP

#: ``actor_rollout_ref.rollout.agent.default_agent_loop`` of pdmask's top-K rollout.
TOPK_AGENT_LOOP = "pdmask_topk_single_turn"


class TopKAgentLoopOutput(AgentLoopOutput):
    """verl's ``AgentLoopOutput`` plus μ's top K at each response token: ids [R][K] and log-probs [R][K]."""

    rollout_topk_ids: list[list[int]]
    rollout_topk_log_probs: list[list[float]]

    @classmethod
    def from_output(cls, output: AgentLoopOutput) -> TopKAgentLoopOutput:
        """Moves the server's top-K lists out of ``extra_fields``, cut to the response verl kept."""
        extra = dict(output.extra_fields)
        if TOPK_IDS not in extra or TOPK_LOGP not in extra:
            raise ValueError(
                f"the rollout server sent no top-K ({TOPK_IDS}, {TOPK_LOGP} in TokenOutput.extra_fields): run verl's "
                "trainer with trainer.v1.trainer_mode=pdmask_sync (its vLLM server returns them) and "
                "actor_rollout_ref.rollout.calculate_log_probs=True."
            )
        ids, logps = extra.pop(TOPK_IDS), extra.pop(TOPK_LOGP)
        length = len(output.response_ids)
        if len(ids) < length or len(logps) < length:
            raise ValueError(
                f"the server's top-K covers {len(ids)} tokens but the response has {length}: "
                f"{TOPK_AGENT_LOOP} runs single-turn rollouts only (no tool turns)."
            )
        fields = output.model_dump(exclude_unset=True) | {"extra_fields": extra}
        return cls(**fields, rollout_topk_ids=ids[:length], rollout_topk_log_probs=logps[:length])

    def as_dict(self) -> dict[str, Any]:
        """verl's per-sample dict, with ``rollout_topk_ids`` int64 [R, K] and ``rollout_topk_log_probs`` float32 [R, K]."""
        out = super().as_dict()
        out[TOPK_IDS] = torch.tensor(out.pop(TOPK_IDS), dtype=torch.int64)
        out[TOPK_LOGP] = torch.tensor(out.pop(TOPK_LOGP), dtype=torch.float32)
        return out


@register(TOPK_AGENT_LOOP)
class TopKSingleTurnAgentLoop(SingleTurnAgentLoop):
    """verl's single-turn agent loop whose output carries μ's top K per response token."""

    async def run(self, sampling_params: dict[str, Any], priority: int = 0, **kwargs: Any) -> AgentLoopOutput:
        output = await super().run(sampling_params, priority=priority, **kwargs)
        return TopKAgentLoopOutput.from_output(output)


__all__ = ["TOPK_AGENT_LOOP", "TopKAgentLoopOutput", "TopKSingleTurnAgentLoop"]
