"""verl's vLLM rollout server, answering with μ's top K per generated token (needs vLLM next to verl).

verl 0.9's ``vLLMHttpServer.generate`` asks vLLM for the sampled token's log-prob only
(``logprobs=0``) and returns that. ``TopKvLLMHttpServer`` changes two things through the server's
own hooks and leaves the request path verl's: the engine it serves from is wrapped in
``pdmask.integrations.vllm.TopKCapture`` (requests that want log-probs ask for the top K; the final
output is kept), and each answer's ``extra_fields`` gains the engine's entries (``entries_field``; the
agent loop converts them). Engine arguments get ``max_logprobs >= K``; the config must keep verl's
default ``logprobs_mode=processed_logprobs``. ``TopKvLLMReplica`` launches it for the policy's rollout
(reward and teacher servers stay verl's); ``trainer_mode=pdmask_sync`` puts that replica in place of verl's.
"""

from __future__ import annotations

from typing import Any

import ray
from verl.workers.rollout.replica import RolloutReplicaRegistry, TokenOutput
from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer, vLLMReplica

from pdmask.integrations.logprob_lists import VLLM_MAX_LOGPROBS, check_logprobs_mode
from pdmask.integrations.verl.cpu import CPU_WORKER_EXTENSION, on_cpu_platform
from pdmask.integrations.verl.rollout import ENTRIES, LOGPROBS_FIX, entries_field, rollout_top_k
from pdmask.integrations.vllm import TopKCapture, engine_kwargs


class TopKvLLMHttpServer(vLLMHttpServer):
    """``vLLMHttpServer`` whose ``TokenOutput.extra_fields[ENTRIES]`` hold the engine's entries at each token."""

    def _init_config(self, config: Any) -> Any:
        config = super()._init_config(config)
        self.top_k = rollout_top_k(config)
        check_logprobs_mode(config.logprobs_mode, config.temperature, fix=LOGPROBS_FIX)
        return config

    def _get_worker_extension_cls(self) -> str:
        if on_cpu_platform():  # the worker side of pdmask's CPU weight sync (pdmask.integrations.verl.cpu_weights)
            return CPU_WORKER_EXTENSION
        return super()._get_worker_extension_cls()

    def _preprocess_engine_kwargs(self, kwargs: dict) -> None:
        super()._preprocess_engine_kwargs(kwargs)
        # verl passes the config's logprobs_mode itself (checked above); here only the cap, never lowered.
        kwargs.setdefault("max_logprobs", max(VLLM_MAX_LOGPROBS, self.top_k))
        engine_kwargs(self.top_k, **kwargs)  # refuses a max_logprobs set below K

    @property
    def engine(self) -> Any:
        return self.__dict__.get("_topk_engine")

    @engine.setter
    def engine(self, engine: Any) -> None:
        self.__dict__["_topk_engine"] = engine if engine is None else TopKCapture(engine, self.top_k)

    async def generate(
        self, prompt_ids: list[int], sampling_params: dict[str, Any], request_id: str, **kwargs: Any
    ) -> TokenOutput:
        try:
            output = await super().generate(prompt_ids, sampling_params, request_id, **kwargs)
        finally:  # taken whatever happened, so that no final output stays behind
            final = self.engine.pop(request_id) if self.engine is not None else None
        if output.log_probs is not None and final is not None and final.outputs:
            output.extra_fields[ENTRIES] = entries_field(final.outputs[0])
        return output


class TopKvLLMReplica(vLLMReplica):
    """verl's vLLM replica, serving the policy's rollout with ``TopKvLLMHttpServer``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not (self.is_reward_model or self.is_teacher_model):  # they share the name "vllm"; they stay verl's
            self.server_class = ray.remote(TopKvLLMHttpServer)


def use_topk_replica() -> None:
    """Makes ``rollout.name=vllm`` launch ``TopKvLLMReplica`` in this process (verl's replica registry)."""
    RolloutReplicaRegistry.register("vllm", lambda: TopKvLLMReplica)


__all__ = ["VLLM_MAX_LOGPROBS", "TopKvLLMHttpServer", "TopKvLLMReplica", "use_topk_replica"]
