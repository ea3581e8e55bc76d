"""verl on the CPU (tests, smoke and end-to-end runs): the platform, the Ray workers' process group, the weight sync,
the attention.

verl resolves its device through a platform object (``verl.plugin.platform``) and ships CUDA, NPU and
ROCm ones only; ``CPUPlatform`` is the missing one. It is registered in verl's platform registry as
``pdmask_cpu`` whenever verl loads pdmask's plugin, and chosen only by ``VERL_PLATFORM=pdmask_cpu`` (never
by verl's auto-detection), so that every process of a Ray run (the trainer's workers, the rollout server,
vLLM's engine) uses it. Nothing here is used in a real (GPU) run; the fixtures of the tests and examples
(a tiny model, verl's engine in one process) are in ``pdmask.testing.verl``.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import torch
from verl.plugin.platform import PlatformBase, PlatformRegistry

from pdmask.integrations.verl.cpu_attention import register_cpu_attention

#: ``VERL_PLATFORM`` value that selects ``CPUPlatform``.
PLATFORM = "pdmask_cpu"
#: Ray resource that stands for one "device" of ``CPUPlatform``: verl's placement groups reserve one per worker
#: and verl counts only Ray's "GPU" or "NPU" before it starts (``verl/single_controller/ray/base.py:230``),
#: so a Ray run declares logical GPUs (``+ray_kwargs.ray_init.num_gpus=N``); no process uses a GPU.
RAY_RESOURCE = "GPU"


def _host_memory(device: Any = None) -> tuple[int, int]:
    """(free, total) bytes of host memory, what ``torch.cuda.mem_get_info`` says of a GPU."""
    page = os.sysconf("SC_PAGE_SIZE")
    return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page


_CPU_MEMORY_FUNCTIONS: dict[str, Any] = {
    "empty_cache": lambda: None,
    "get_rng_state": lambda device=None: torch.get_rng_state(),  # verl's checkpoints save the device's generator
    "set_rng_state": lambda state, device=None: torch.set_rng_state(state),
    "reset_peak_memory_stats": lambda device=None: None,
    "memory_stats": lambda device=None: {},
    "memory_allocated": lambda device=None: 0,
    "memory_reserved": lambda device=None: 0,
    "max_memory_allocated": lambda device=None: 0,
    "max_memory_reserved": lambda device=None: 0,
    "mem_get_info": _host_memory,
    "ipc_collect": lambda: None,
    "set_per_process_memory_fraction": lambda fraction, device=None: None,
}


@PlatformRegistry.register(platform=PLATFORM)
class CPUPlatform(PlatformBase):
    """The host CPU as a verl platform: gloo collectives, no device memory, no profiler."""

    def __init__(self) -> None:
        # verl calls the device module's memory and generator functions without a CPU guard (its workers'
        # memory logs, cache cleanup, checkpoints); torch.cpu lacks them. The CPU has no device memory to
        # report or free, and its generator is torch's default one.
        for name, fn in _CPU_MEMORY_FUNCTIONS.items():
            if not hasattr(torch.cpu, name):
                setattr(torch.cpu, name, fn)
        # verl's packed-sequence and Ulysses attention is flash-attn's, which has no CPU build: every process of a
        # CPU run gets the stand-in (``attn_implementation=pdmask_cpu_varlen``).
        register_cpu_attention()

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> ModuleType:
        return torch.cpu  # verl tests `device == torch.cpu` where the CPU needs other handling

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        return False  # chosen by VERL_PLATFORM only: verl's auto-detection keeps its own fallback

    def current_device(self) -> Any:
        # verl passes this to FSDP(device_id=...) and TensorDict.to(...): the CPU device serves both.
        return torch.device("cpu")

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        pass

    def synchronize(self, device_index: int | None = None) -> None:
        pass

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    @contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        pass

    def profiler_stop(self) -> None:
        pass

    def ray_resource_name(self) -> str:
        return RAY_RESOURCE

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> Any:
        return None


def init_worker_process_group() -> None:
    """Ray's ``worker_process_setup_hook`` for verl's trainer on the CPU: the gloo group of a worker-group process.

    verl's engine worker creates its group with the backend ``cpu:gloo,{device}:{backend}``
    (``verl/utils/distributed.py:89``, ``initialize_global_process_group_ray``), which torch refuses when the
    device is the CPU itself (a duplicate device type); it skips that when a group exists. So each process
    verl starts for a worker group (``WG_BACKEND=ray``, with the ``RANK``/``WORLD_SIZE``/``MASTER_*`` verl
    gives it) gets the same group, gloo only, before verl's code runs there; and every process gets pdmask's
    CPU weight sync (``use_host_weight_sync``). Set with
    ``+ray_kwargs.ray_init.runtime_env.worker_process_setup_hook=pdmask.integrations.verl.cpu.init_worker_process_group``.
    """
    use_host_weight_sync()
    if os.environ.get("WG_BACKEND") == "ray" and not torch.distributed.is_initialized():
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        torch.distributed.init_process_group("gloo", rank=rank, world_size=world_size)


#: verl's rollout registry entry of pdmask's CPU weight sync (``pdmask.integrations.verl.cpu_weights``).
CPU_ROLLOUT_ADAPTER = "pdmask.integrations.verl.cpu_weights.CPUServerAdapter"
#: The vLLM worker extension that loads the weights it is sent (same module).
CPU_WORKER_EXTENSION = "pdmask.integrations.verl.cpu_weights.HostWeightsExtension"


def use_host_weight_sync() -> None:
    """Makes verl's colocated weight sync into vLLM send host tensors in this process (verl's rollout registry;
    ``cpu_weights`` says why the shared-memory bucket fails on the CPU). Imported by verl when it builds the
    actor's rollout adapter."""
    from verl.workers.rollout.base import _ROLLOUT_REGISTRY

    _ROLLOUT_REGISTRY[("vllm", "async")] = CPU_ROLLOUT_ADAPTER


def on_cpu_platform() -> bool:
    """Whether verl runs on ``CPUPlatform`` in this process (``VERL_PLATFORM=pdmask_cpu``)."""
    from verl.plugin.platform import get_platform

    return isinstance(get_platform(), CPUPlatform)


__all__ = [
    "CPU_ROLLOUT_ADAPTER",
    "CPU_WORKER_EXTENSION",
    "PLATFORM",
    "CPUPlatform",
    "init_worker_process_group",
    "on_cpu_platform",
    "use_host_weight_sync",
]
