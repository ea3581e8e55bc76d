"""PDMTrainer on TRL's GRPOTrainer: training runs, rollout capture, and the loss TRL ends up applying.

A tiny random Llama and a character-level tokenizer, both built here, keep every test on CPU and offline.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

trl = pytest.importorskip("trl")
transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

# Not importorskip: with TRL installed, an unsupported version must fail here, not skip.
import pdmask
from pdmask.integrations.trl import PDMConfig, PDMTrainer, check_trl_version
from pdmask.integrations.trl.recorders import RolloutRecorder
from pdmask.integrations.trl.trainer import LateInputs

from tiny_llama import tiny_llama_config

CHARS = list("0123456789+=? abcdefghij")


def tiny_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """One token per character, plus <pad> (0) and <eos> (1)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate(["<pad>", "<eos>", *CHARS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="?"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="?"
    )


def tiny_llama(seed: int = 0) -> transformers.LlamaForCausalLM:
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(tiny_llama_config(len(CHARS) + 2))


def digit_reward(completions: list[str], **_) -> list[float]:
    """Fraction of digits: varies between completions of one prompt, so advantages are non-zero."""
    return [sum(c.isdigit() for c in text) / max(len(text), 1) for text in completions]


#: Shared by every trainer here. GRPOConfig defaults to bf16 autocast, also on CPU; float32 keeps checks tight.
BASE = {
    "per_device_train_batch_size": 4,
    "num_generations": 4,
    "report_to": "none",
    "use_cpu": True,
    "bf16": False,
}


def make_config(tmp_path, mask_method: str, **overrides) -> PDMConfig:
    kwargs = {
        **BASE,
        "output_dir": str(tmp_path),
        "mask_method": mask_method,
        "mask_top_k": 5,
        "steps_per_generation": 2,  # two optimizer steps per generation: the second is off-policy
        "max_completion_length": 6,
        "max_steps": 2,
        "learning_rate": 3e-2,
        "temperature": 0.9,
        "logging_steps": 1,
        "save_strategy": "no",
        "seed": 0,
        "disable_tqdm": True,
    }
    return PDMConfig(**(kwargs | overrides))


def prompts() -> datasets.Dataset:
    return datasets.Dataset.from_dict({"prompt": ["1+2=", "3+4=", "5+1=", "2+2="]})


def test_version_range_is_checked() -> None:
    check_trl_version("1.16.0")
    with pytest.raises(ImportError, match=r"TRL >=1\.16,<1\.17 .* 1\.9\.0"):
        check_trl_version("1.9.0")
    with pytest.raises(ImportError):
        check_trl_version("1.17.0")


@pytest.mark.parametrize("name", sorted(pdmask.METHODS))
def test_config_accepts_every_method(tmp_path, name: str) -> None:
    config = make_config(tmp_path, name)
    clipped = pdmask.METHODS[name].rule == "ppo_clip"
    assert (config.epsilon, config.epsilon_high) == ((0.2, None) if clipped else (1.0, math.inf))
    assert config.top_k == 0  # the sampler's own top-k filter is untouched by mask_top_k


def test_config_rejects_bad_combinations(tmp_path) -> None:
    with pytest.raises(ValueError, match="unknown mask method"):
        make_config(tmp_path, "pdm_nope")
    with pytest.raises(ValueError, match="PPO-clip settings"):
        make_config(tmp_path, "pdm_proportional_tv", epsilon_high=0.28)
    with pytest.raises(ValueError, match="loss_type"):
        make_config(tmp_path, "dppo_binary_tv", loss_type="cispo")
    with pytest.raises(ValueError, match="delta_low"):
        make_config(tmp_path, "ppo_clip", delta_low=0.1)
    with pytest.raises(ValueError, match="two-sided clip"):
        make_config(tmp_path, "ppo_clip", delta=2.0)
    with pytest.raises(ValueError, match="off_policy_mask_threshold"):
        make_config(tmp_path, "pdm_proportional_tv", off_policy_mask_threshold=0.5)
    with pytest.raises(ValueError, match="recorded at one temperature"):
        make_config(tmp_path, "pdm_proportional_tv", generation_kwargs={"temperature": 0.5})
    with pytest.warns(UserWarning, match="sampler's distribution"):
        make_config(tmp_path, "pdm_proportional_tv", generation_kwargs={"top_p": 0.5})


def test_config_with_vllm(tmp_path) -> None:
    """use_vllm=True (run in tests_vllm/): TRL's IS correction off for the masks, full μ and K > 20 refused."""
    config = make_config(tmp_path, "dppo_topk_tv", use_vllm=True)
    assert not config.vllm_importance_sampling_correction and (config.epsilon, config.epsilon_high) == (1.0, math.inf)
    assert make_config(tmp_path, "ppo_clip", use_vllm=True).vllm_importance_sampling_correction
    with pytest.raises(NotImplementedError, match="needs all of μ, but vLLM returns its top K"):
        make_config(tmp_path, "pdm_full_tv", use_vllm=True)
    with pytest.raises(ValueError, match="max_logprobs=20"):
        make_config(tmp_path, "pdm_proportional_tv", use_vllm=True, mask_top_k=30)
    with pytest.raises(NotImplementedError, match="continuous batching"):
        make_config(tmp_path, "pdm_proportional_tv", use_transformers_continuous_batching=True)


def train(tmp_path, mask_method: str, spy=None):
    model = tiny_llama()
    initial = copy.deepcopy(model)
    trainer = PDMTrainer(
        model,
        reward_funcs=digit_reward,
        args=make_config(tmp_path, mask_method),
        train_dataset=prompts(),
        processing_class=tiny_tokenizer(),
    )
    if spy is not None:
        spy(trainer)
    trainer.train()
    return trainer, initial


@pytest.mark.parametrize("mask_method", ["pdm_proportional_tv", "dppo_binary_kl"])
def test_trains_two_steps(tmp_path, mask_method: str) -> None:
    trainer, initial = train(tmp_path, mask_method)
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == 2
    assert all(math.isfinite(entry["loss"]) for entry in logs)
    for key in ("dropped_frac", "dropped_frac_pos", "dropped_frac_neg", "direction_disagree_frac"):
        assert all(0.0 <= entry[f"pdmask/mask/{key}"] <= 1.0 for entry in logs)
    assert all(math.isfinite(entry["pdmask/div/mean"]) for entry in logs)
    changed = [not torch.equal(p, q) for p, q in zip(trainer.model.parameters(), initial.parameters())]
    assert any(changed)


def test_rollout_topk_is_the_generating_models_softmax(tmp_path) -> None:
    """What reaches the loss: μ's top-K and log μ(a) from generation, π at S and ‖π‖² from the scoring pass."""
    seen: list[dict] = []

    def spy(trainer: PDMTrainer) -> None:
        apply_mask, compute = trainer._apply_mask, trainer._policy_stats

        def recording_stats(*args):
            seen[-1]["stats"] = compute(*args)
            return seen[-1]["stats"]

        def recording(batch, logps, caught, logits_to_keep):
            seen.append({k: batch.early(k) for k in batch if k.startswith(("pdm_", "prompt", "completion"))})
            ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
            attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
            with torch.no_grad():
                logits = trainer.model(input_ids=ids, attention_mask=attention).logits
            seen[-1]["current"] = torch.log_softmax(logits[:, -logits_to_keep - 1 : -1] / trainer.temperature, -1)
            return apply_mask(batch, logps, caught, logits_to_keep)

        trainer._apply_mask, trainer._policy_stats = recording, recording_stats

    trainer, initial = train(tmp_path, "pdm_proportional_tv", spy)
    first = seen[0]  # the first step trains on completions of the initial model
    ids = torch.cat([first["prompt_ids"], first["completion_ids"]], 1)
    attention = torch.cat([first["prompt_mask"], first["completion_mask"]], 1)
    with torch.no_grad():
        logits = initial(input_ids=ids, attention_mask=attention).logits
    width = first["completion_ids"].shape[1]
    full = torch.log_softmax(logits[:, -width - 1 : -1] / trainer.temperature, -1)
    keep = first["completion_mask"].bool()
    assert keep.sum() > 0
    topk_ids, topk_logp = first["pdm_topk_ids"], first["pdm_topk_logps"]
    torch.testing.assert_close(full.gather(-1, topk_ids)[keep], topk_logp[keep], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(full.topk(5, -1).values[keep], topk_logp[keep], atol=1e-5, rtol=1e-5)
    at_a = full.gather(-1, first["completion_ids"].unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(at_a[keep], first["pdm_rollout_logps"][keep], atol=1e-5, rtol=1e-5)
    # The loss side, on every step: π at S and ‖π‖² agree with a full softmax of the current logits.
    for entry in seen:
        keep, stats, current = entry["completion_mask"].bool(), entry["stats"], entry["current"]
        ids_s = torch.cat([entry["pdm_topk_ids"], entry["completion_ids"].unsqueeze(-1)], -1)
        torch.testing.assert_close(stats.set_logp[keep], current.gather(-1, ids_s)[keep], atol=1e-4, rtol=1e-4)
        sq_norm = current.exp().square().sum(-1)
        torch.testing.assert_close(stats.sq_norm[keep], sq_norm[keep], atol=1e-5, rtol=1e-4)


def scoring_batch(model, seed: int = 1, k: int = 5) -> dict:
    """A fixed batch with old log-probs and a top-K μ that differ from the model, so clips and masks bind."""
    g = torch.Generator().manual_seed(seed)
    batch_size, prompt_len, width = 4, 3, 5
    vocab = model.config.vocab_size
    prompt_ids = torch.randint(2, vocab, (batch_size, prompt_len), generator=g)
    completion_ids = torch.randint(2, vocab, (batch_size, width), generator=g)
    completion_mask = torch.ones(batch_size, width, dtype=torch.long)
    completion_mask[0, 3:] = 0
    with torch.no_grad():
        logits = model(input_ids=torch.cat([prompt_ids, completion_ids], 1)).logits[:, prompt_len - 1 : -1]
    log_mu = torch.log_softmax(logits + 1.5 * torch.randn(logits.shape, generator=g), -1)
    top = log_mu.topk(k, -1)
    rollout_logp = log_mu.gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": torch.ones_like(prompt_ids),
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": torch.tensor([1.0, -0.5, 0.7, -1.2]),
        "old_per_token_logps": rollout_logp,
        "num_items_in_batch": completion_mask.sum(),
        "pdm_rollout_logps": rollout_logp,
        "pdm_topk_ids": top.indices,
        "pdm_topk_logps": top.values,
        "pdm_full_logps": log_mu,
    }


def loss_and_grads(trainer, batch: dict) -> tuple[torch.Tensor, list[torch.Tensor]]:
    trainer.model.zero_grad()
    loss = trainer._compute_loss(trainer.model, batch)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in trainer.model.parameters()]


def make_trainer(tmp_path, cls, config):
    model = tiny_llama(seed=3)
    trainer = cls(
        model, reward_funcs=digit_reward, args=config, train_dataset=prompts(), processing_class=tiny_tokenizer()
    )
    trainer.model.eval()  # eval mode: no gradient-accumulation normaliser, so the loss is the plain token mean
    return trainer


def test_ppo_clip_is_grpos_loss(tmp_path) -> None:
    """mask_method="ppo_clip" trains with GRPOTrainer's own clipped loss: same value, same gradients."""
    common = {**BASE, "output_dir": str(tmp_path), "loss_type": "bnpo", "epsilon": 0.2, "epsilon_high": 0.28}
    grpo = make_trainer(tmp_path, trl.GRPOTrainer, trl.GRPOConfig(**common))
    pdm = make_trainer(tmp_path, PDMTrainer, PDMConfig(mask_method="ppo_clip", **common))
    batch = scoring_batch(grpo.model)
    loss_grpo, grads_grpo = loss_and_grads(grpo, batch)
    loss_pdm, grads_pdm = loss_and_grads(pdm, batch)
    assert torch.equal(loss_grpo, loss_pdm)
    for a, b in zip(grads_grpo, grads_pdm):
        assert torch.equal(a, b)
    # The measured mask is GRPO's clip region, so it matches TRL's own clip metric.
    dropped = pdm._metrics["eval"]["pdmask/mask/dropped_frac"][0]
    assert dropped == pytest.approx(grpo._metrics["eval"]["clip_ratio/region_mean"][0])
    assert dropped > 0


@pytest.mark.parametrize(
    "mask_method",
    [
        "pdm_proportional_tv", "pdm_aggregated_kl", "pdm_uniform_kl", "pdm_exactpi_tv", "pdm_exactpi_kl",
        "dppo_topk_kl", "pdm_full_kl", "dppo_binary_tv", "pg_is", "pdm_backbone_topk_kl", "pdm_backbone_full_tv",
    ],  # fmt: skip
)
def test_gradient_is_pdmask_surrogate(tmp_path, mask_method: str) -> None:
    """TRL's loss, given PDMTrainer's per-token advantages, has the gradient of pdmask's DPPO-form surrogate.

    The values differ by design: TRL reports the ratio form −M·min(r, c)·A, pdmask's surrogate is
    −M·sg(min(r, c))·A·log π(a); their gradients are the same, and that is what is compared.
    """
    thresholds = {} if mask_method == "pg_is" else {"delta_low": 0.05, "delta_high": 0.05}
    config = PDMConfig(
        **BASE, output_dir=str(tmp_path), loss_type="bnpo", mask_method=mask_method, mask_top_k=5, **thresholds
    )
    trainer = make_trainer(tmp_path, PDMTrainer, config)
    batch = scoring_batch(trainer.model)
    _, grads = loss_and_grads(trainer, batch)

    reference = tiny_llama(seed=3)  # the trainer's untouched weights (a deepcopy would share TRL's patched forward)
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    logits = reference(input_ids=ids).logits[:, batch["prompt_ids"].shape[1] - 1 : -1] / config.temperature
    needs = pdmask.METHODS[mask_method].needs
    rollout = pdmask.RolloutLogprobs(
        batch["pdm_rollout_logps"],
        topk_ids=batch["pdm_topk_ids"] if needs == "topk" else None,
        topk_logp=batch["pdm_topk_logps"] if needs == "topk" else None,
        full_logp=batch["pdm_full_logps"] if needs == "full" else None,
    )
    head = reference.get_output_embeddings().weight.detach() if pdmask.METHODS[mask_method].needs_head else None
    loss, metrics = pdmask.policy_loss(mask_method, logits, batch["completion_ids"], rollout, batch["advantages"],
                                       batch["completion_mask"], "token-mean", head_weight=head, **config.mask_thresholds)
    loss.backward()
    for p, g in zip(reference.parameters(), grads):
        torch.testing.assert_close(g, p.grad, atol=1e-6, rtol=1e-4)
    logged = trainer._metrics["eval"]
    assert logged["pdmask/mask/dropped_frac"][0] == pytest.approx(metrics["mask/dropped_frac"])
    if mask_method != "pg_is":
        assert 0 < metrics["mask/dropped_frac"] < 1  # the batch exercises the mask


def test_late_batch_fails_loudly(tmp_path) -> None:
    """If a TRL release read the advantages before scoring, PDMTrainer must raise, not train unmasked."""
    batch = LateInputs({"advantages": torch.ones(2), "completion_ids": torch.ones(2, 3)}, late=True)
    assert batch["completion_ids"].shape == (2, 3)
    with pytest.raises(RuntimeError, match="before scoring"):
        batch["advantages"]
    with pytest.raises(RuntimeError, match="before scoring"):
        batch.get("old_per_token_logps")
    batch.fill(advantages=torch.zeros(2, 3), old_per_token_logps=torch.zeros(2, 3))
    assert batch["advantages"].shape == (2, 3)


def test_recorder_checks_alignment() -> None:
    """The generation hook refuses completions that are not the tokens generate fed back."""
    from types import SimpleNamespace

    recorder = RolloutRecorder(1.0, 2, full=False)
    logits = torch.randn(3, 1, 6)
    fed = torch.tensor([[4], [5], [1]])
    recorder(None, (), {"input_ids": torch.zeros(3, 2, dtype=torch.long)}, SimpleNamespace(logits=logits))
    recorder(None, (), {"input_ids": fed}, SimpleNamespace(logits=logits))
    completion_ids = torch.tensor([[4, 2, 0], [5, 3, 0], [1, 0, 0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0], [1, 0, 0]])
    out = recorder.finish(completion_ids, mask)
    assert out["pdm_topk_ids"].shape == (3, 3, 2) and out["pdm_rollout_logps"].shape == (3, 3)
    log_mu = torch.log_softmax(logits[:, 0], -1)
    torch.testing.assert_close(out["pdm_rollout_logps"][:, 0], log_mu.gather(-1, fed).squeeze(-1))
    with pytest.raises(RuntimeError, match="do not line up"):
        recorder.finish(torch.tensor([[3, 2, 0], [5, 3, 0], [1, 0, 0]]), mask)
