"""Stage 1 of a round: sample responses with the rollout engine (μ, with its full log-probs and top-K) and
compute the advantages (GRPO from the task's rewards, or random ±1 per token)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from pdmask.analysis.config import AnalysisConfig
from pdmask.lab.train import grpo_advantages

if TYPE_CHECKING:
    from pdmask.lab.engine import RolloutBatch, RolloutEngine
    from pdmask.lab.tasks import Task


def sample_rollouts(cfg: AnalysisConfig, engine: RolloutEngine, task: Task, gen: torch.Generator) -> tuple[RolloutBatch, Tensor]:
    """``prompts × group_size`` responses [N, R] and their advantages [N, R] (0 off the responses), drawn from ``gen``."""
    problems = task.sample(cfg.prompts, gen)
    rollout = engine.generate(
        [p.prompt_ids for p in problems],
        cfg.group_size,
        cfg.temperature,
        max(cfg.ks),
        max_new_tokens=task.max_new_tokens,
        eos_id=task.eos_id,
        pad_id=task.pad_id,
        generator=gen,
    )
    if rollout.full_logp is None:
        raise ValueError("the rollout engine must return μ's full log-probs (RolloutEngine(..., return_full=True)).")
    mask = rollout.response_mask
    if cfg.advantages == "grpo":
        rows = [p for p in problems for _ in range(cfg.group_size)]
        rewards = torch.tensor([task.score(p, t[m].tolist())[0] for p, t, m in zip(rows, rollout.tokens, mask)])
        adv = grpo_advantages(rewards, cfg.group_size)[:, None].expand_as(mask).clone()
    else:
        adv = torch.randint(0, 2, mask.shape, generator=gen).float() * 2 - 1
    return rollout, adv * mask
