"""Stage 3 of a round: on the analysed minibatch (π = the current weights in fp32), per response token with
A ≠ 0, in blocks of ``block_positions`` positions: the exact D, every direction signal (the ratio sign, each
registered estimator of G at each K) and every registered direction mask's decision (``pdmask.decide``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch
from torch import Tensor, nn

from pdmask import PolicyStats, RolloutLogprobs, decide, policy_stats, predicted_change
from pdmask.analysis.config import AnalysisConfig
from pdmask.analysis.maskview import direction_methods, mask_decisions
from pdmask.analysis.model import final_hidden, head_logits, unembedding
from pdmask.analysis.records import FULL_ESTIMATORS, PDM_METHODS, TOPK_ESTIMATORS, record_masks
from pdmask.estimators import KINDS
from pdmask.rows import row_slices

if TYPE_CHECKING:
    from pdmask.lab.engine import RolloutBatch


@dataclass
class AnalysedTokens:
    """The M analysed tokens (response tokens with A ≠ 0) of a minibatch [N, R] and their cheap record."""

    keep: Tensor  # bool [N, R]: which positions are analysed
    rows: Tensor  # [M]: each token's row in the minibatch
    cols: Tensor  # [M]: each token's response position
    hidden: Tensor  # [M, d]: the final hidden states that predict them
    tokens: Tensor  # [M]
    adv: Tensor  # [M] float64
    full_logp: Tensor  # [M, V]: log μ
    record: dict[str, Tensor]  # D, beyond δ, every G, every mask's decision
    masks: dict[str, dict[str, Tensor]]  # method -> {"beyond", "keep"} (``record_masks``)


def analyse_signals(cfg: AnalysisConfig, policy: nn.Module, batch: RolloutBatch, batch_adv: Tensor) -> AnalysedTokens | None:
    """The signals of every analysed token of ``batch``; None if no token has A ≠ 0."""
    keep = batch.response_mask & (batch_adv != 0)
    rows_idx, cols_idx = keep.nonzero(as_tuple=True)
    m = len(rows_idx)
    if m == 0:  # every group got equal rewards: nothing to analyse in this round
        return None
    h = final_hidden(policy, batch)[keep]
    assert batch.full_logp is not None
    tokens, a = batch.tokens[keep], batch_adv[keep].double()
    full_logp, mu_logp_a = batch.full_logp[keep], batch.logp[keep]
    top_ids, top_logp = batch.topk_ids[keep], batch.topk_logp[keep]
    _, w, bias = unembedding(policy)
    w64 = w.detach().double()
    b64 = None if bias is None else bias.detach().double()
    blocks = []
    for sl in row_slices(m, cfg.block_positions):
        info = RolloutLogprobs(mu_logp_a[sl], top_ids[sl], top_logp[sl], full_logp[sl])
        # W in the logits' float64: the core's pass would otherwise convert it for every block of the vocabulary.
        blocks.append(_block_stats(cfg, head_logits(h[sl], w64, b64, cfg.temperature), tokens[sl], info, a[sl], w64))
    rec: dict[str, Tensor] = {key: torch.cat([b[key] for b in blocks]) for key in blocks[0]}
    return AnalysedTokens(keep, rows_idx, cols_idx, h, tokens, a, full_logp, rec, record_masks(rec))


def _block_stats(
    cfg: AnalysisConfig,
    z: Tensor,
    tokens: Tensor,
    rollout: RolloutLogprobs,
    adv: Tensor,
    weight: Tensor,
) -> dict[str, Tensor]:
    """Everything cheap of one block of positions [B]: D, beyond δ, every estimate of G, every mask's decision.

    ``rollout`` carries μ's top max(ks) and its full log-probs; ``weight`` is the LM head W [V, d] for the
    backbone-aware estimators. Returns the flat record entries of the block.
    """
    out: dict[str, Tensor] = {}
    methods = direction_methods()

    def stats(info: RolloutLogprobs, estimators: Sequence[str]) -> PolicyStats:
        """One pass over the vocabulary with the sums the given estimators need."""
        wanted = [m for m in PDM_METHODS if m.estimator in estimators]
        return policy_stats(
            z, tokens, info,
            need_exactpi=any(m.needs_exactpi for m in wanted),
            head_weight=weight if any(m.needs_head for m in wanted) else None,
        )

    full = stats(rollout, tuple({m.estimator for m in methods if m.estimator is not None}))
    for kind in KINDS:
        exact = decide(f"pdm_full_{kind}", full, adv, delta_low=cfg.delta[kind], delta_high=cfg.delta[kind])
        out[f"div/{kind}"] = cast(Tensor, exact.divergence).float()
        out[f"beyond/{kind}"] = cast(Tensor, exact.beyond)
        for est in FULL_ESTIMATORS:
            out[f"g/{kind}/{est}"] = predicted_change(full, kind, est).float()
    for k_top in cfg.ks:
        assert rollout.topk_ids is not None and rollout.topk_logp is not None
        sub = stats(RolloutLogprobs(rollout.logp, rollout.topk_ids[:, :k_top], rollout.topk_logp[:, :k_top]), TOPK_ESTIMATORS)
        for kind in KINDS:
            for est in TOPK_ESTIMATORS:
                out[f"g/{kind}/{est}@{k_top}"] = predicted_change(sub, kind, est).float()
    # Every direction mask's decision, each from the information it uses (μ's top max(ks), or all of μ).
    for name, dec in mask_decisions(full, adv, cfg.delta).items():
        out[f"mask/{name}/beyond"], out[f"mask/{name}/keep"] = dec["beyond"], dec["keep"]
    out["pi_a"], out["mu_a"] = full.pi_a.float(), full.mu_a.float()
    return out

