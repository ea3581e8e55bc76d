"""The agent loop that carries the rollout's top K from verl's server into the batch.

verl's single-turn agent loop passes the server's ``TokenOutput.extra_fields`` through as a
non-tensor dict. ``TopKSingleTurnAgentLoop`` (registered in verl's agent-loop registry as
``pdmask_topk_single_turn``) turns the engine's entries found there into μ's top K at each response
token, two tensors of the sample [response_len, K]; verl's TransferQueue path then stacks the
samples as it stacks ``rollout_log_probs`` (a jagged tensor when lengths differ), and ``PDMLoss``
pads them like the response mask.
"""

from __future__ import annotations

from typing import Any

import torch
from pydantic import ConfigDict
from verl.experimental.agent_loop.agent_loop import AgentLoopOutput, register
from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop

from pdmask.integrations.verl.rollout import ENTRIES, rollout_top_k, topk_tensors

#: ``actor_rollout_ref.rollout.agent.default_agent_loop`` of pdmask's top-K rollout.
TOPK_AGENT_LOOP = "pdmask_topk_single_turn"


class TopKAgentLoopOutput(AgentLoopOutput):
    """verl's ``AgentLoopOutput`` plus μ's top K at each response token: ids int64 [R, K], log-probs float32 [R, K];
    ``as_dict`` hands both on as top-level fields of the sample."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    rollout_topk_ids: torch.Tensor
    rollout_topk_log_probs: torch.Tensor

    @classmethod
    def from_output(cls, output: AgentLoopOutput, top_k: int) -> TopKAgentLoopOutput:
        """Takes the server's entries out of ``extra_fields`` and converts them for the response verl kept."""
        extra = dict(output.extra_fields)
        entries = extra.pop(ENTRIES, None)
        if entries is None and output.response_ids:
            raise ValueError(
                f"the rollout server sent no log-prob entries ({ENTRIES} in TokenOutput.extra_fields): run verl's "
                "trainer with trainer.v1.trainer_mode=pdmask_sync (its vLLM server returns them) and "
                "actor_rollout_ref.rollout.calculate_log_probs=True."
            )
        ids, logps = topk_tensors(entries or {"tokens": []}, top_k, output.response_ids)
        fields = output.model_dump(exclude_unset=True) | {"extra_fields": extra}
        return cls(**fields, rollout_topk_ids=ids, rollout_topk_log_probs=logps)


@register(TOPK_AGENT_LOOP)
class TopKSingleTurnAgentLoop(SingleTurnAgentLoop):
    """verl's single-turn agent loop whose output carries μ's top K per response token."""

    async def run(self, sampling_params: dict[str, Any], priority: int = 0, **kwargs: Any) -> AgentLoopOutput:
        output = await super().run(sampling_params, priority=priority, **kwargs)
        return TopKAgentLoopOutput.from_output(output, rollout_top_k(self.rollout_config))


__all__ = ["TOPK_AGENT_LOOP", "TopKAgentLoopOutput", "TopKSingleTurnAgentLoop"]
