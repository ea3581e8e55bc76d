"""verl's weight sync into vLLM on the CPU: the actor's weights handed to vLLM's worker as host tensors.

verl 0.9.1 syncs through a shared-memory bucket where CUDA IPC is missing
(``verl/workers/rollout/vllm_rollout/vllm_rollout.py:143``). Its receiver in vLLM's worker hands views of the
bucket to the model loader, counting on ``tensor.to(device)`` to copy them off it
(``bucketed_weight_transfer.py:296-297``); on the CPU that returns the same tensor, closing the bucket then
fails (``:340``, ``BufferError: cannot close exported pointers exist``) and the trainer waits for ever.
On ``CPUPlatform`` (``VERL_PLATFORM=pdmask_cpu``), this replaces the two ends of verl's colocated ("naive")
sync, through verl's registries and vLLM's own RPC, no verl module patched:
- the actor's rollout adapter (``CPUServerAdapter``, verl's rollout registry entry for ``vllm``) copies each
  full tensor of ``get_per_tensor_param`` and sends them to its server (a Ray call);
- the server forwards them to its vLLM worker(s) with ``collective_rpc``, as one ``torch.save`` blob (vLLM's RPC
  turns tensors inside its arguments into nested lists; bytes pass unchanged), where
  ``HostWeightsExtension`` (the server's worker extension, a subclass of verl's) loads them with vLLM's own
  in-place reload.
The weights travel twice through host memory (a copy per hop): fine for CPU test models, not for a GPU run.
"""

from __future__ import annotations

import io
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor
from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension
from verl.workers.rollout.vllm_rollout.vllm_rollout import ServerAdapter

#: The worker-extension method the server calls with the weights.
LOAD_METHOD = "update_weights_from_host"


class HostWeightsExtension(vLLMColocateWorkerExtension):
    """verl's vLLM worker extension, plus loading weights sent as host tensors."""

    def update_weights_from_host(self, blob: bytes) -> int:
        """Loads the weights in ``blob`` (``torch.save`` of {name: full tensor}) with vLLM's own in-place reload
        (``model_runner.reload_weights``: the layers' checkpoint-format parameters restored, loaded, processed
        again; a plain ``load_weights`` fails on the CPU, whose linear layers were repacked after the first load);
        returns how many tensors came."""
        weights = list(torch.load(io.BytesIO(blob), weights_only=True).items())
        self.model_runner.reload_weights(weights_iterator=weights)
        return len(weights)


class CPUServerAdapter(ServerAdapter):
    """verl's vLLM rollout adapter in the actor worker, sending the weights as host tensors on the CPU."""

    async def update_weights(
        self, weights: Iterable[tuple[str, Tensor]], global_steps: int | None = None, **kwargs: Any
    ) -> None:
        if kwargs.get("peft_config") or kwargs.get("wire_format", "named_tensors") != "named_tensors":
            raise NotImplementedError(
                "pdmask's CPU weight sync sends full named tensors only: LoRA adapters and delta syncs need verl's "
                "GPU path (CUDA IPC)."
            )
        # Every rank drains the generator (it may gather shards collectively); the server's rank sends.
        named = {name: tensor.detach().to("cpu", copy=True) for name, tensor in weights}
        if not self._ensure_server_handle():
            return
        blob = io.BytesIO()
        torch.save(named, blob)
        await self.server_handle.collective_rpc.remote(LOAD_METHOD, args=(blob.getvalue(),))
        await self.server_handle.clear_kv_cache.remote()
        if global_steps is not None:
            await self.server_handle.set_global_steps.remote(global_steps)


__all__ = ["LOAD_METHOD", "CPUServerAdapter", "HostWeightsExtension"]
