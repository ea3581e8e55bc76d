"""Stage 5 of a round: the actual change of D of every analysed token after one real step on the whole
minibatch (Adam with its state, and a plain gradient step of the same parameter-space length)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from pdmask.analysis.config import AnalysisConfig
from pdmask.analysis.model import accumulate_step_grad, final_hidden, head_logits, unembedding
from pdmask.analysis.truth import full_divergence
from pdmask.estimators import KINDS
from pdmask.rows import row_slices

if TYPE_CHECKING:
    from pdmask.lab.engine import RolloutBatch


def after_one_step(
    policy: nn.Module,
    opt: torch.optim.Adam,
    params: list[Tensor],
    batch: RolloutBatch,
    adv: Tensor,
    temperature: float,
    keep: Tensor,
    full_logp: Tensor,
    cfg: AnalysisConfig,
) -> dict[str, dict[str, Tensor]]:
    """Exact D of the analysed tokens after one Adam step (with its state) and after a plain gradient step
    of the same length, each on the whole minibatch from the current weights.

    The weights end at the plain step and the optimizer's state is spent: the round is over after this.
    """
    saved = [p.detach().clone() for p in params]
    opt.zero_grad(set_to_none=True)
    accumulate_step_grad(policy, batch, adv, temperature)
    _, w, bias = unembedding(policy)

    def measure() -> dict[str, Tensor]:
        h = final_hidden(policy, batch)[keep]
        w64 = w.detach().double()
        b64 = None if bias is None else bias.detach().double()
        out = {kind: torch.empty(len(h), dtype=torch.float64) for kind in KINDS}
        for sl in row_slices(len(h), cfg.block_positions):
            z = head_logits(h[sl], w64, b64, temperature)
            for kind in KINDS:
                out[kind][sl] = full_divergence(z, full_logp[sl], kind)
        return out

    opt.step()
    result = {"adam": measure()}
    with torch.no_grad():
        length = torch.stack([(p - s).square().sum() for p, s in zip(params, saved)]).sum().sqrt()
        grad_norm = torch.stack([torch.zeros(()) if p.grad is None else p.grad.square().sum() for p in params]).sum().sqrt()
        for p, s in zip(params, saved):
            p.copy_(s if p.grad is None else s - length / grad_norm * p.grad)
    result["sgd"] = measure()
    opt.zero_grad(set_to_none=True)
    return result

