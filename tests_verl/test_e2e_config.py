"""The GPU example's configuration through verl's own Hydra config code, and the top-K mode's config checks on it.

``examples/verl_gsm8k_pdm.sh`` is run with a stand-in ``python3`` that records its arguments; they are
composed into verl's ``ppo_trainer`` config as ``python -m verl.trainer.main_ppo`` composes them, and
validated as its ``main`` validates them (no GPU needed), so a renamed key fails here.
"""

from __future__ import annotations

import copy
import os
import stat
import subprocess
from pathlib import Path

import pytest
from omegaconf import OmegaConf, open_dict

from pdmask.integrations.verl.rollout import TOP_K_KEY, rollout_top_k

from conftest import K

v1 = pytest.importorskip(
    "verl.trainer.ppo.v1", reason="verl's v1 trainer needs TransferQueue, FastAPI, ... (.ci/verl.sh)"
)

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "verl_gsm8k_pdm.sh"


def example_overrides(tmp_path: Path, **env: str) -> list[str]:
    """The Hydra overrides examples/verl_gsm8k_pdm.sh hands verl's entry point (under ``env``)."""
    bin_dir, out = tmp_path / "bin", tmp_path / "argv"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "python3"
    fake.write_text(f"#!/bin/sh\nprintf '%s\\n' \"$@\" > {out}\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    environ = os.environ | {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "DATA": "/data/gsm8k"} | env
    subprocess.run(["bash", str(EXAMPLE)], check=True, env=environ)
    argv = out.read_text().splitlines()
    assert argv[:2] == ["-m", "verl.trainer.main_ppo"]
    return argv[2:]


def composed(overrides: list[str]):
    """verl's config as ``main_ppo.main`` gets it, validated as it validates it."""
    from hydra import compose, initialize_config_module
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import omega_conf_to_dataclass, validate_config
    from verl.utils.device import auto_set_device

    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        config = compose(config_name="ppo_trainer", overrides=overrides)
    auto_set_device(config)
    validate_config(config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
    for section in (config.actor_rollout_ref.actor, config.actor_rollout_ref.rollout):
        omega_conf_to_dataclass(section)  # verl's dataclasses refuse unknown or ill-typed fields
    return config


@pytest.mark.parametrize("method", ["dppo_binary_tv", "dppo_binary_kl", "ppo_clip", "pg_is"])
def test_the_gpu_example_composes_for_binary_methods(tmp_path, method):
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    config = composed(example_overrides(tmp_path, METHOD=method))
    assert config.trainer.v1.trainer_mode == "sync" and config.algorithm.rollout_correction.bypass_mode
    assert get_policy_loss_fn(config.actor_rollout_ref.actor.policy_loss.loss_mode).__name__ == f"pdmask_{method}"


@pytest.fixture(scope="module")
def topk_config(tmp_path_factory):
    overrides = example_overrides(tmp_path_factory.mktemp("example"), METHOD="pdm_aggregated_kl", K=str(K))
    return composed(overrides)


def test_the_gpu_example_composes_for_topk_methods(topk_config):
    from pdmask.integrations.verl.trainer import PDMTrainerSync, check_topk_config

    assert v1.get_trainer_cls(topk_config.trainer.v1.trainer_mode) is PDMTrainerSync
    assert rollout_top_k(topk_config.actor_rollout_ref.rollout) == K
    check_topk_config(topk_config)


def changed(config, key: str, value):
    config = copy.deepcopy(config)
    with open_dict(config):
        OmegaConf.update(config, key, value, force_add=True)
    return config


BAD_INPUT = {  # (key, value): what the one-line error names
    "a server without top K (SGLang)": ("actor_rollout_ref.rollout.name", "sglang", "rollout.name=vllm"),
    "a custom server in place of pdmask's": (
        "actor_rollout_ref.rollout.agent.custom_async_server.path",
        "my_server.py",
        "custom_async_server.path=null",
    ),
    "a server capped below K": (
        "actor_rollout_ref.rollout.engine_kwargs.vllm.max_logprobs",
        K - 1,
        f"max_logprobs>={K}",
    ),
    "no log-probs from the server": ("actor_rollout_ref.rollout.calculate_log_probs", False, "calculate_log_probs=True"),
    "the wrong agent loop": (
        "actor_rollout_ref.rollout.agent.default_agent_loop",
        "single_turn_agent",
        "default_agent_loop=pdmask_topk_single_turn",
    ),
    "fused kernels": ("actor_rollout_ref.model.use_fused_kernels", True, "use_fused_kernels=False"),
    "a binary loss": ("actor_rollout_ref.actor.policy_loss.loss_mode", "pdmask_dppo_binary_tv", "top-K methods"),
    "no K": (f"actor_rollout_ref.rollout.custom.{TOP_K_KEY}", None, "custom.pdmask_top_k=K"),
    "K of 0": (f"actor_rollout_ref.rollout.custom.{TOP_K_KEY}", 0, "top_k must be an int >= 1"),
    "raw logits": ("actor_rollout_ref.rollout.logprobs_mode", "processed_logits", "logprobs_mode=processed_logprobs"),
    "prefill/decode disaggregation": (
        "actor_rollout_ref.rollout.disaggregation.enabled",
        True,
        "disaggregation.enabled=False",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUT))
def test_bad_input_is_one_line_before_the_first_step(topk_config, case):
    """check_topk_config runs first in PDMTrainerSync._setup: before Ray workers, the server or any step."""
    from pdmask.integrations.verl.trainer import check_topk_config

    key, value, fix = BAD_INPUT[case]
    with pytest.raises(ValueError) as err:
        check_topk_config(changed(topk_config, key, value))
    assert fix in str(err.value) and "\n" not in str(err.value)


def test_ulysses_needs_attention_that_gathers_the_sequence(topk_config, monkeypatch):
    """verl's Ulysses all-to-all is in transformers' flash-attention path; any other attention (sdpa, eager) would
    silently attend within this rank's slice. On pdmask's CPU platform flash-attn is absent and pdmask's CPU
    attention stands in (registered there only)."""
    from pdmask.integrations.verl import trainer

    config = changed(topk_config, "actor_rollout_ref.actor.ulysses_sequence_parallel_size", 2)
    attention = {
        name: changed(config, "actor_rollout_ref.model.override_config", {"attn_implementation": name})
        for name in ("flash_attention_3", "sdpa", "pdmask_cpu_varlen")
    }
    monkeypatch.setattr(trainer, "on_cpu_platform", lambda: False)  # in-process tests may have chosen CPUPlatform
    trainer.check_topk_config(config)  # verl's default, flash_attention_2
    trainer.check_topk_config(attention["flash_attention_3"])
    for name in ("sdpa", "pdmask_cpu_varlen"):
        with pytest.raises(ValueError, match=f"attn_implementation=flash_attention_2 .*; {name} does not\\)"):
            trainer.check_topk_config(attention[name])
    monkeypatch.setattr(trainer, "on_cpu_platform", lambda: True)
    trainer.check_topk_config(attention["pdmask_cpu_varlen"])
    for bad in (config, attention["sdpa"]):
        with pytest.raises(ValueError, match="attn_implementation=pdmask_cpu_varlen .* on the CPU"):
            trainer.check_topk_config(bad)


def test_megatron_tensor_parallelism_is_accepted(topk_config):
    from pdmask.integrations.verl import trainer

    config = changed(changed(topk_config, "actor_rollout_ref.actor.strategy", "megatron"),
                     "actor_rollout_ref.actor.megatron.tensor_model_parallel_size", 2)  # fmt: skip
    trainer.check_topk_config(config)


def test_the_setup_checks_before_it_starts_anything(topk_config):
    from pdmask.integrations.verl.trainer import PDMTrainerSync

    trainer = PDMTrainerSync.__new__(PDMTrainerSync)
    trainer.config = changed(topk_config, "actor_rollout_ref.model.use_fused_kernels", True)
    with pytest.raises(ValueError, match="use_fused_kernels=False"):
        trainer._setup()  # raises before verl's _setup would build a tokenizer, data or workers


def test_the_cpu_platform_is_chosen_by_name_only():
    from verl.plugin.platform import PlatformRegistry

    from pdmask.integrations.verl.cpu import PLATFORM, CPUPlatform

    assert PlatformRegistry.get(PLATFORM) is CPUPlatform  # registered on `import verl` (pdmask's plugin)
    assert not CPUPlatform().is_platform_available(use_smi_check=True)  # verl's auto-detection never picks it
    assert CPUPlatform().ray_resource_options(0.5) == {"num_gpus": 0.5}  # logical Ray GPUs as worker slots
