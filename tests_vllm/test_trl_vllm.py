"""PDMTrainer with use_vllm=True (colocate) on a CPU vLLM engine: μ's top K from vLLM reaches the mask."""

from __future__ import annotations

import functools
import math
import sys
from pathlib import Path

import pytest
import torch
import transformers

from conftest import tiny_llama

trl = pytest.importorskip("trl")
sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
from test_trl import CHARS, digit_reward, prompts, tiny_tokenizer  # noqa: E402  (the TRL tests' tiny setup)

from pdmask.integrations.trl import PDMConfig, PDMTrainer  # noqa: E402

TEMPERATURE, TOP_K = 0.9, 5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    """A tiny Llama with head size 64 (vLLM's CPU attention) and the TRL tests' tokenizer, saved for TRL's vLLM."""
    path = tmp_path_factory.mktemp("trl-vllm-model")
    vocab = {"vocab_size": len(CHARS) + 2, "bos_token_id": None, "eos_token_id": 1}  # the tokenizer's ids
    tiny_llama(max_position_embeddings=64, **vocab).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return str(path)


def cpu_sync(trainer) -> None:
    """TRL's colocated sync calls vLLM's load_weights, which fails on vLLM's CPU backend (its linear layers
    were repacked at load time); reload_weights repacks. Only the CPU tests need this."""
    generation = trainer.vllm_generation

    def sync_weights() -> None:
        weights = list(generation._iter_named_params())
        generation.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        generation.llm.reset_prefix_cache()

    generation.sync_weights = sync_weights


def make_trainer(tmp_path, model_dir: str, mask_method: str) -> PDMTrainer:
    config = PDMConfig(
        output_dir=str(tmp_path),
        mask_method=mask_method,
        mask_top_k=TOP_K,
        per_device_train_batch_size=4,
        num_generations=4,
        steps_per_generation=2,
        max_completion_length=6,
        max_steps=2,
        learning_rate=3e-2,
        temperature=TEMPERATURE,
        logging_steps=1,
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
        report_to="none",
        use_cpu=True,
        bf16=False,
        use_vllm=True,
        vllm_mode="colocate",
        vllm_max_model_length=64,
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    trainer = PDMTrainer(
        model, reward_funcs=digit_reward, args=config, train_dataset=prompts(), processing_class=tiny_tokenizer()
    )
    cpu_sync(trainer)
    return trainer


def check_trained(trainer, initial: list[torch.Tensor]) -> None:
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == 2 and all(math.isfinite(entry["loss"]) for entry in logs)
    assert all(0.0 <= entry["pdmask/mask/dropped_frac"] <= 1.0 for entry in logs)
    assert any(not torch.equal(p, q) for p, q in zip(trainer.model.parameters(), initial))
    if trainer.mask_method.rule != "ppo_clip":
        assert trainer.vllm_generation.logprobs == TOP_K and not trainer.args.vllm_importance_sampling_correction


@pytest.mark.parametrize("mask_method", ["dppo_binary_tv", "ppo_clip"])
def test_trains_with_vllm(tmp_path, model_dir, mask_method: str) -> None:
    """Two steps with a binary method and with the clip (TRL's own loss); pdm_proportional_tv trains in the test below."""
    trainer = make_trainer(tmp_path, model_dir, mask_method)
    initial = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    check_trained(trainer, initial)


def test_vllm_topk_is_the_generating_models_softmax(tmp_path, model_dir, monkeypatch) -> None:
    """μ's top K and log μ(a) from vLLM, as they reach the mask, equal a float32 full softmax of the weights
    that generated them (the first batch: the initial weights).

    TRL starts its colocated vLLM with dtype "auto", which runs a float32 checkpoint in bf16; here the
    engine is made float32 so that the check is exact."""
    from trl.generation import vllm_generation

    monkeypatch.setattr(vllm_generation, "LLM", functools.partial(vllm_generation.LLM, dtype="float32"))
    trainer = make_trainer(tmp_path, model_dir, "pdm_proportional_tv")
    assert str(trainer.vllm_generation.llm.llm_engine.model_config.dtype) == "torch.float32"
    reference = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    seen: list[dict] = []
    apply_mask = trainer._apply_mask

    def recording(batch, logps, caught, logits_to_keep):
        seen.append({k: batch.early(k) for k in batch if k.startswith(("pdm_", "prompt", "completion"))})
        return apply_mask(batch, logps, caught, logits_to_keep)

    trainer._apply_mask = recording
    initial = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    check_trained(trainer, initial)
    first = seen[0]
    ids = torch.cat([first["prompt_ids"], first["completion_ids"]], 1)
    attention = torch.cat([first["prompt_mask"], first["completion_mask"]], 1)
    with torch.no_grad():
        logits = reference(input_ids=ids, attention_mask=attention).logits
    width = first["completion_ids"].shape[1]
    full = torch.log_softmax(logits[:, -width - 1 : -1].float() / TEMPERATURE, -1)
    keep = first["completion_mask"].bool()
    assert keep.sum() > 0
    torch.testing.assert_close(full.gather(-1, first["pdm_topk_ids"])[keep], first["pdm_topk_logps"][keep], atol=1e-3, rtol=0)
    torch.testing.assert_close(full.topk(TOP_K, -1).values[keep], first["pdm_topk_logps"][keep], atol=1e-3, rtol=0)
    at_a = full.gather(-1, first["completion_ids"].unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(at_a[keep], first["pdm_rollout_logps"][keep], atol=1e-3, rtol=0)

