"""verl on the CPU, for tests and smoke runs: its FSDP engine in one process, or its whole trainer under Ray.

verl resolves its device through a platform object (``verl.plugin.platform``) and ships CUDA, NPU and
ROCm ones only; ``CPUPlatform`` is the missing one. It is registered in verl's platform registry as
``pdmask_cpu`` whenever verl loads pdmask's plugin, and chosen only by ``VERL_PLATFORM=pdmask_cpu`` (never
by verl's auto-detection), so that every process of a Ray run (the trainer's workers, the rollout server,
vLLM's engine) uses it. Nothing here is used in a real (GPU) run.
"""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import torch
from verl.plugin.platform import PlatformBase, PlatformRegistry, set_platform

logger = logging.getLogger(__name__)

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


def init_cpu_process_group() -> None:
    """Installs ``CPUPlatform`` and a one-process gloo group, with the environment verl's workers read (idempotent)."""
    set_platform(CPUPlatform())
    # verl registers its FSDP engines for cuda/npu only; the same class runs on CPU.
    env = {"VERL_ENGINE_DEVICE": "cuda", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29517", "RANK": "0"}
    for key, value in (env | {"WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}).items():
        os.environ.setdefault(key, value)
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo", rank=0, world_size=1)


def init_worker_process_group() -> None:
    """Ray's ``worker_process_setup_hook`` for verl's trainer on the CPU: the gloo group of a worker-group process.

    verl's engine worker creates its group with the backend ``cpu:gloo,{device}:{backend}``
    (``verl/utils/distributed.py:89``, ``initialize_global_process_group_ray``), which torch refuses when the
    device is the CPU itself (a duplicate device type); it skips that when a group exists. So each process
    verl starts for a worker group (``WG_BACKEND=ray``, with the ``RANK``/``WORLD_SIZE``/``MASTER_*`` verl
    gives it) gets the same group, gloo only, before verl's code runs there. Set with
    ``+ray_kwargs.ray_init.runtime_env.worker_process_setup_hook=pdmask.integrations.verl.cpu.init_worker_process_group``.
    """
    if os.environ.get("WG_BACKEND") == "ray" and not torch.distributed.is_initialized():
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        torch.distributed.init_process_group("gloo", rank=rank, world_size=world_size)


def on_cpu_platform() -> bool:
    """Whether verl runs on ``CPUPlatform`` in this process (``VERL_PLATFORM=pdmask_cpu``)."""
    from verl.plugin.platform import get_platform

    return isinstance(get_platform(), CPUPlatform)


class WithoutWeightSync:
    """verl's ``CheckpointEngineManager`` whose ``update_weights`` does nothing: the CPU stop of a trainer run.

    verl 0.9.1 moves the actor's weights into vLLM through a shared-memory bucket where CUDA IPC is missing
    (``verl/workers/rollout/vllm_rollout/vllm_rollout.py:143``, ``use_shm = not is_support_ipc()``). Its
    receiver in vLLM's worker hands views of that bucket to the model loader, counting on
    ``tensor.to(device)`` to copy them off it (``bucketed_weight_transfer.py:296-297``); on the CPU that is
    the same tensor, the views outlive the bucket and closing it fails (``:340``, ``BufferError: cannot
    close exported pointers exist``), which leaves the trainer waiting on the sender forever. A GPU run
    sends CUDA IPC handles instead and copies nothing through shared memory. On the CPU the rollout
    therefore keeps the weights vLLM loaded from the model path (``rollout.load_format=auto``): μ is the
    initial policy at every step, which the trainer's mask sees as growing off-policyness.
    """

    def __init__(self, manager: Any) -> None:
        self._manager = manager

    def __getattr__(self, name: str) -> Any:
        return getattr(self._manager, name)

    def update_weights(self, global_steps: int | None = None) -> dict:
        """Skips the sync; tells the servers the step as verl's sync does last (it tags each trajectory)."""
        import ray

        logger.warning(
            "pdmask CPU run: verl's weight sync into vLLM is skipped (step %s); the rollout keeps its loaded weights "
            "(see pdmask.integrations.verl.cpu.WithoutWeightSync).",
            global_steps,
        )
        if global_steps is not None:
            servers = [server for replica in self._manager.replicas for server in replica.servers]
            ray.get([server.set_global_steps.remote(global_steps) for server in servers])
        return {}


def actor_configs(model_path: str, *, use_remove_padding: bool, lr: float = 1e-3) -> dict[str, Any]:
    """verl's model, engine (FSDP2, float32), optimizer and checkpoint configs for the model at ``model_path``."""
    from verl.trainer.config.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig

    return {
        "model_config": HFModelConfig(
            path=model_path, use_remove_padding=use_remove_padding, override_config={"attn_implementation": "sdpa"}
        ),
        "engine_config": FSDPEngineConfig(
            strategy="fsdp2",
            model_dtype="fp32",
            mixed_precision={"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"},
            use_torch_compile=False,
            use_dynamic_bsz=False,
            micro_batch_size_per_gpu=2,
            max_token_len_per_gpu=4096,
        ),
        "optimizer_config": FSDPOptimizerConfig(lr=lr, weight_decay=0.0, clip_grad=1e9),
        "checkpoint_config": CheckpointConfig(),
    }


def build_actor_engine(model_path: str, *, use_remove_padding: bool, lr: float = 1e-3, seed: int = 0) -> Any:
    """verl's FSDP actor engine (``FSDPEngineWithLMHead``) for the Hugging Face model at ``model_path``, in float32."""
    from verl.workers.engine import EngineRegistry

    init_cpu_process_group()
    torch.manual_seed(seed)
    configs = actor_configs(model_path, use_remove_padding=use_remove_padding, lr=lr)
    engine = EngineRegistry.new(model_type="language_model", backend="fsdp2", **configs)
    engine.initialize()
    return engine


def build_training_worker(model_path: str, *, use_remove_padding: bool, lr: float = 1e-3, seed: int = 0) -> Any:
    """verl's ``TrainingWorker`` (the actor side of its worker group, called directly rather than through Ray)."""
    from verl.workers.config import TrainingWorkerConfig
    from verl.workers.engine_workers import TrainingWorker

    init_cpu_process_group()
    torch.manual_seed(seed)
    configs = actor_configs(model_path, use_remove_padding=use_remove_padding, lr=lr)
    worker = TrainingWorker(TrainingWorkerConfig(model_type="language_model", **configs))
    worker.reset()
    return worker


def save_tiny_llama(path: str, *, vocab_size: int = 64, seed: int = 0, hidden_size: int = 32, heads: int = 4) -> str:
    """Writes a random 2-layer Llama (``heads`` attention heads of ``hidden_size / heads``; vLLM's CPU attention
    needs a head size such as 64) and a word-level tokenizer ``t0 … t{V-1}`` (with a plain chat template, for
    verl's agent loops) to ``path``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(vocab_size)}, unk_token="t1"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    special = {"pad_token": "t0", "unk_token": "t1", "eos_token": "t2", "bos_token": "t3"}
    chat = "{% for m in messages %}t4 {{ m.content }} t5 {% endfor %}{% if add_generation_prompt %}t6 {% endif %}"
    PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=chat, **special).save_pretrained(path)
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        max_position_embeddings=128,
        tie_word_embeddings=False,
        pad_token_id=0,
        eos_token_id=2,
        bos_token_id=3,
    )
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def padded_batch(
    prompts: list[list[int]], responses: list[list[int]], response_length: int | None = None, **fields: torch.Tensor
) -> dict[str, torch.Tensor]:
    """verl's padded actor batch: prompts left-padded, responses right-padded to ``response_length`` (default the
    longest), plus the given [B, response_length, ...] response fields."""
    batch, p_len, r_len = len(prompts), max(map(len, prompts)), response_length or max(map(len, responses))
    prompt_ids = torch.zeros(batch, p_len, dtype=torch.long)
    response_ids = torch.zeros(batch, r_len, dtype=torch.long)
    attention = torch.zeros(batch, p_len + r_len, dtype=torch.long)
    for b, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        prompt_ids[b, p_len - len(p) :] = torch.tensor(p)
        response_ids[b, : len(r)] = torch.tensor(r)
        attention[b, p_len - len(p) : p_len + len(r)] = 1
    return {
        "prompts": prompt_ids,
        "responses": response_ids,
        "input_ids": torch.cat([prompt_ids, response_ids], 1),
        "attention_mask": attention,
        "position_ids": (attention.cumsum(1) - 1).clamp(min=0),
        "response_mask": attention[:, p_len:].clone(),
        **fields,
    }


__all__ = [
    "CPUPlatform",
    "WithoutWeightSync",
    "actor_configs",
    "build_actor_engine",
    "build_training_worker",
    "init_cpu_process_group",
    "init_worker_process_group",
    "on_cpu_platform",
    "padded_batch",
    "save_tiny_llama",
]
