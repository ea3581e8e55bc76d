"""verl's vLLM rollout server, answering with μ's top K per generated token (needs vLLM next to verl).

verl 0.9's ``vLLMHttpServer.generate`` asks vLLM for the sampled token's log-prob only
(``logprobs=0``) and returns that. ``TopKvLLMHttpServer`` changes two things through the server's
own hooks and leaves the request path verl's: the engine it serves from is wrapped in
``pdmask.integrations.vllm.TopKCapture`` (requests that want log-probs ask for the top K; the final
output is kept), and each answer's ``extra_fields`` gains ``topk_lists`` of it. Engine arguments get
``max_logprobs >= K``; the config must keep verl's default ``logprobs_mode=processed_logprobs``.
``TopKvLLMReplica`` launches it; ``trainer_mode=pdmask_sync`` puts that replica in place of verl's.
"""

from __future__ import annotations

from typing import Any

import ray
from verl.workers.rollout.replica import RolloutReplicaRegistry, TokenOutput
from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer, vLLMReplica

from pdmask.integrations.entries import check_logprobs_mode
from pdmask.integrations.verl.rollout import rollout_top_k, topk_lists
from pdmask.integrations.vllm import TopKCapture, engine_kwargs


class TopKvLLMHttpServer(vLLMHttpServer):
    """``vLLMHttpServer`` whose ``TokenOutput.extra_fields`` hold ``rollout_topk_ids`` and
    ``rollout_topk_log_probs`` [R][K]."""

    def _init_config(self, config: Any) -> Any:
        config = super()._init_config(config)
        self.top_k = rollout_top_k(config)
        check_logprobs_mode(config.logprobs_mode, config.temperature)
        return config

    def _preprocess_engine_kwargs(self, kwargs: dict) -> None:
        super()._preprocess_engine_kwargs(kwargs)
        # verl passes the config's logprobs_mode itself (checked above); here only the cap on K.
        kwargs["max_logprobs"] = engine_kwargs(self.top_k, **kwargs)["max_logprobs"]

    @property
    def engine(self) -> Any:
        return self.__dict__.get("_topk_engine")

    @engine.setter
    def engine(self, engine: Any) -> None:
        self.__dict__["_topk_engine"] = engine if engine is None else TopKCapture(engine, self.top_k)

    async def generate(
        self, prompt_ids: list[int], sampling_params: dict[str, Any], request_id: str, **kwargs: Any
    ) -> TokenOutput:
        output = await super().generate(prompt_ids, sampling_params, request_id, **kwargs)
        final = self.engine.pop(request_id) if self.engine is not None else None
        if output.log_probs is not None and final is not None and final.outputs:
            output.extra_fields.update(topk_lists(final.outputs[0], self.top_k))
        return output


class TopKvLLMReplica(vLLMReplica):
    """verl's vLLM replica, serving with ``TopKvLLMHttpServer``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.server_class = ray.remote(TopKvLLMHttpServer)


def use_topk_replica() -> None:
    """Makes ``rollout.name=vllm`` launch ``TopKvLLMReplica`` in this process (verl's replica registry)."""
    RolloutReplicaRegistry.register("vllm", lambda: TopKvLLMReplica)


__all__ = ["TopKvLLMHttpServer", "TopKvLLMReplica", "use_topk_replica"]
