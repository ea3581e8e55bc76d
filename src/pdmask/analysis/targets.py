"""Stage 4 of a round: autograd ground truths only where they decide something — every token beyond δ on
which a predictive mask and its ratio-sign counterpart decide differently (the others' disagreements may be
sampled, ``disagree_sample``), a uniform sample of the tokens beyond δ (the mask view's rates) and a uniform
sample of all tokens (the agreement tables, and the output layer's own-step truth)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from pdmask.analysis.config import AnalysisConfig
from pdmask.analysis.model import unembedding
from pdmask.analysis.records import ALWAYS_MEASURED, disagreements
from pdmask.analysis.signals import AnalysedTokens
from pdmask.analysis.truth import adam_preconditioner, head_change, own_change
from pdmask.estimators import KINDS

if TYPE_CHECKING:
    from pdmask.lab.engine import RolloutBatch


@dataclass
class Targets:
    """bool [M] selections of the analysed tokens (per kind where a dict) and ``need`` [M, kinds]: which get truth."""

    targeted: dict[str, Tensor]  # a predictive mask and its ratio-sign counterpart decide differently
    disagree_sampled: dict[str, Tensor]  # the uniform sample of ``targeted`` with truth
    sampled: Tensor  # the uniform sample of all tokens
    beyond_sampled: Tensor  # the uniform sample of the tokens beyond δ for any mask
    need: Tensor  # [M, kinds]: the own-step truths to compute


def select_targets(cfg: AnalysisConfig, analysed: AnalysedTokens, gen: torch.Generator) -> Targets:
    """The tokens that get autograd truth, the samples drawn from ``gen``."""
    masks, m = analysed.masks, len(analysed.tokens)
    none = torch.zeros(m, dtype=torch.bool)
    targeted = {kind: disagreements(masks, kind) for kind in KINDS}
    size = m if cfg.disagree_sample is None else cfg.disagree_sample
    disagree_sampled = {kind: _uniform(targeted[kind], size, gen) for kind in KINDS}
    measured = {kind: disagree_sampled[kind] | disagreements(masks, kind, ALWAYS_MEASURED) for kind in KINDS}
    union_beyond = none.clone()
    for dec in masks.values():
        union_beyond |= dec["beyond"]
    sampled = _uniform(~none, cfg.sample_tokens, gen)
    beyond_sampled = _uniform(union_beyond, cfg.beyond_sample, gen)
    need = torch.stack([sampled | beyond_sampled | measured[kind] for kind in KINDS], 1)
    return Targets(targeted, disagree_sampled, sampled, beyond_sampled, need)


def autograd_truths(
    cfg: AnalysisConfig,
    policy: nn.Module,
    opt: torch.optim.Adam,
    params: Sequence[Tensor],
    batch: RolloutBatch,
    analysed: AnalysedTokens,
    targets: Targets,
    progress: Callable[[str, int], Callable[[], None]] | None = None,
) -> dict[str, Tensor]:
    """Record entries ``truth/<kind>/head`` (on the uniform sample) and ``truth/<kind>/own_{sgd,adam}`` (where
    ``targets.need``), float64 [M], NaN elsewhere; ``opt`` holds the stale steps' Adam state."""
    m, a, full_logp = len(analysed.tokens), analysed.adv, analysed.full_logp
    _, w, bias = unembedding(policy)
    truth: dict[str, Tensor] = {}
    pick = targets.sampled.nonzero().squeeze(-1)
    for kind in KINDS:
        v = torch.full((m,), float("nan"), dtype=torch.float64)
        v[pick] = head_change(analysed.hidden[pick], w, bias, cfg.temperature, analysed.tokens[pick], full_logp[pick], a[pick], kind)
        truth[f"truth/{kind}/head"] = v
    precond: dict[str, Sequence[Tensor] | None] = {"sgd": None, "adam": adam_preconditioner(opt, params)}
    own = {(kind, name): torch.full((m,), float("nan"), dtype=torch.float64) for kind in KINDS for name in precond}
    pick = targets.need.any(1).nonzero().squeeze(-1)
    sample_rows = analysed.rows[pick]
    advance = progress("ground truth (autograd)", len(pick)) if progress else None
    for row in sample_rows.unique().tolist():
        sel = pick[sample_rows == row]
        ids, att = batch.input_ids[row], batch.attention_mask[row]

        def forward(x: Tensor, att: Tensor = att) -> Tensor:
            return policy(x[None], att[None, : len(x)])[0] / cfg.temperature

        positions = batch.prompt_len - 1 + analysed.cols[sel]
        res = own_change(forward, params, ids, positions, full_logp[sel], a[sel], precond, need=targets.need[sel])
        for key, val in res.items():
            own[key][sel] = val
        if advance:
            for _ in range(len(sel)):
                advance()
    del precond
    for (kind, name), val in own.items():
        truth[f"truth/{kind}/own_{name}"] = val
    return truth


def _uniform(candidates: Tensor, size: int, gen: torch.Generator) -> Tensor:
    """bool mask of ``size`` tokens drawn uniformly without replacement among ``candidates`` (bool [M])."""
    idx = candidates.nonzero().squeeze(-1)
    out = torch.zeros_like(candidates)
    out[idx[torch.randperm(len(idx), generator=gen)[:size]]] = True
    return out
