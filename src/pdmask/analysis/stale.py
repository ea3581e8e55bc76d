"""Stage 2 of a round: split the rows into ``stale_steps + 1`` minibatches and take one Adam step on the
truncated-IS surrogate of each of the first ``stale_steps`` (lr = 0 for ``mismatch``: the steps fill
Adam's second moment, its preconditioner, without moving the weights). The last minibatch is analysed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from pdmask.analysis.config import AnalysisConfig
from pdmask.analysis.model import accumulate_step_grad

if TYPE_CHECKING:
    from pdmask.lab.engine import RolloutBatch


@dataclass
class StaleState:
    """The analysed minibatch and its advantages [n, R], with the optimizer (lr = cfg.lr) that stepped before it."""

    batch: RolloutBatch
    adv: Tensor
    opt: torch.optim.Adam
    params: list[Tensor]


def stale_steps(cfg: AnalysisConfig, policy: nn.Module, rollout: RolloutBatch, adv: Tensor, gen: torch.Generator) -> StaleState:
    """Adam steps on all minibatches of whole rows but the last (drawn from ``gen``); returns the last one."""
    parts = torch.randperm(rollout.tokens.shape[0], generator=gen).tensor_split(cfg.stale_steps + 1)
    params: list[Tensor] = [p for p in policy.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=0.0 if cfg.source == "mismatch" else cfg.lr)
    for idx in parts[:-1]:
        opt.zero_grad(set_to_none=True)
        accumulate_step_grad(policy, rollout.select(idx), adv[idx], cfg.temperature)
        opt.step()
    opt.param_groups[0]["lr"] = cfg.lr
    opt.zero_grad(set_to_none=True)  # the truths and the real step need the memory of the gradients
    return StaleState(rollout.select(parts[-1]), adv[parts[-1]], opt, params)
