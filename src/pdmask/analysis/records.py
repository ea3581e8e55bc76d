"""A round's flat record and the per-token results of a run: which estimators are analysed, the masks'
decisions, the disagreements that get autograd truth, and ``TokenResults`` over all rounds.

A record maps names (``adv``, ``div/tv``, ``g/kl/aggregated@5``, ``mask/<method>/keep``,
``truth/kl/own_sgd``, ...) to per-token float32/bool/int64 vectors over a round's analysed tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch
from torch import Tensor

from pdmask import METHODS
from pdmask.analysis.maskview import direction_methods
from pdmask.estimators import KINDS, PAPER_TOPK_ESTIMATORS

#: The predictive methods; estimators of G that need μ over the whole vocabulary (analysed once) or only its
#: top K (at every K).
PDM_METHODS = [m for m in METHODS.values() if m.rule == "pdm"]
FULL_ESTIMATORS = tuple(dict.fromkeys(m.estimator for m in PDM_METHODS if m.info == "full"))
TOPK_ESTIMATORS = tuple(dict.fromkeys(m.estimator for m in PDM_METHODS if m.info == "topk"))
#: Estimators whose every disagreement with the ratio sign gets autograd truth (the others' may be sampled);
#: the paper's top-K estimators' disagreements with DPPO's ratio sign are also the run's target.
ALWAYS_MEASURED = (*PAPER_TOPK_ESTIMATORS, "full")
#: Truths by autograd on selected tokens (NaN elsewhere); the step_* truths are measured on every token.
AUTOGRAD_TRUTHS = ("own_sgd", "own_adam", "head")


@dataclass
class TokenResults:
    """Per-token arrays over the analysed tokens [M] of all rounds (response tokens with A ≠ 0).

    ``signals[kind][name]`` are the signed predictions A·X (positive = D grows); ``truth[kind][name]``
    the signed true changes, NaN where not measured (autograd truths exist on the sampled and targeted
    tokens only).
    """

    advantage: Tensor
    pi_a: Tensor
    mu_a: Tensor
    div: dict[str, Tensor]
    beyond: dict[str, Tensor]  # bool [M]: the exact D beyond δ for the token's advantage (where a mask acts)
    raw_g: dict[str, dict[str, Tensor]]  # G of each estimator, unsigned (for the top-K tracking)
    signals: dict[str, dict[str, Tensor]]
    truth: dict[str, dict[str, Tensor]]
    sampled: Tensor  # bool [M]: the uniform sample of all tokens with autograd truth
    beyond_sampled: Tensor  # bool [M]: the uniform sample of the tokens beyond δ (for any mask) with autograd truth
    targeted: dict[str, Tensor]  # kind -> bool [M]: a predictive mask and its ratio-sign counterpart decide differently
    disagree_sampled: dict[str, Tensor]  # kind -> bool [M]: the uniform sample of ``targeted`` with truth
    row: Tensor  # [M]: the response each token belongs to (its tokens share A and context), unique over rounds
    masks: dict[str, dict[str, Tensor]]  # method -> {"beyond", "keep"} bool [M] at K = max(ks)
    round_index: Tensor  # [M]: the round each token comes from; rounds have disjoint seeds

    @classmethod
    def from_records(cls, records: Sequence[dict[str, Tensor]], indices: Sequence[int]) -> TokenResults:
        """Concatenates the flat per-round records (``run_round``) of rounds ``indices`` into one result, in float64."""
        if not records:
            raise ValueError("no round has been analysed.")
        if len(indices) != len(records):
            raise ValueError(f"indices names {len(indices)} rounds for {len(records)} records.")
        flat = {key: torch.cat([r[key] for r in records]) for key in records[0]}

        def num(key: str) -> Tensor:
            return flat[key].double()

        def sub(prefix: str) -> dict[str, Tensor]:
            return {k[len(prefix) :]: v for k, v in flat.items() if k.startswith(prefix)}

        adv, pi_a, mu_a = num("adv"), num("pi_a"), num("mu_a")
        raw = {kind: {"ratio": pi_a - mu_a} | {k: v.double() for k, v in sub(f"g/{kind}/").items()} for kind in KINDS}
        return cls(
            advantage=adv,
            pi_a=pi_a,
            mu_a=mu_a,
            div={kind: num(f"div/{kind}") for kind in KINDS},
            beyond={kind: flat[f"beyond/{kind}"] for kind in KINDS},
            raw_g={kind: {k: v for k, v in g.items() if k != "ratio"} for kind, g in raw.items()},
            signals={kind: {signal_name(k): adv * v for k, v in g.items()} for kind, g in raw.items()},
            truth={kind: {k: v.double() for k, v in sub(f"truth/{kind}/").items()} for kind in KINDS},
            sampled=flat["sampled"],
            beyond_sampled=flat["beyond_sampled"],
            targeted={kind: flat[f"targeted/{kind}"] for kind in KINDS},
            disagree_sampled={kind: flat[f"disagree_sampled/{kind}"] for kind in KINDS},
            row=flat["row"],
            masks=record_masks(flat),
            round_index=torch.repeat_interleave(torch.tensor(indices), torch.tensor([len(r["adv"]) for r in records])),
        )

    def select(self, keep: Tensor) -> TokenResults:
        """The tokens where ``keep`` (bool [M]) holds, every per-token array alike."""
        return TokenResults(**{f.name: _take(getattr(self, f.name), keep) for f in fields(self)})


def _take(x: Tensor | dict, keep: Tensor) -> Tensor | dict:
    return x[keep] if isinstance(x, Tensor) else {k: _take(v, keep) for k, v in x.items()}


def signal_name(estimate: str) -> str:
    """Table name of an estimate of G: ``full`` -> ``pdm_full``, ``aggregated@5`` -> ``pdm_aggregated@5``."""
    return estimate if estimate == "ratio" else f"pdm_{estimate}"



def disagreements(masks: dict[str, dict[str, Tensor]], kind: str, estimators: Sequence[str] | None = None) -> Tensor:
    """bool [M]: tokens where a predictive mask of ``kind`` (of ``estimators``, default all) and its ratio-sign
    counterpart (``MaskMethod.dppo_counterpart``) decide differently. Both share D, so such tokens are beyond δ."""
    out = torch.zeros_like(next(iter(masks.values()))["keep"])
    for m in direction_methods():
        other = m.dppo_counterpart
        if m.rule != "pdm" or m.kind != kind or m.name not in masks or other not in masks:
            continue
        if estimators is None or m.estimator in estimators:
            out |= masks[m.name]["keep"] != masks[other]["keep"]
    return out



def record_masks(rec: dict[str, Tensor]) -> dict[str, dict[str, Tensor]]:
    """The masks' decisions {"beyond", "keep"} of a flat record, for the methods it has."""
    names = (m.name for m in direction_methods())
    return {n: {"beyond": rec[f"mask/{n}/beyond"], "keep": rec[f"mask/{n}/keep"]} for n in names if f"mask/{n}/keep" in rec}


def paper_disagreements(rec: dict[str, Tensor]) -> dict[str, int]:
    """Per kind: tokens of a record where one of the paper's top-K predictive estimators (as a mask) and
    DPPO's top-K mask decide differently — all of them get autograd truth; the run's stopping count."""
    masks = record_masks(rec)
    return {kind: int(disagreements(masks, kind, PAPER_TOPK_ESTIMATORS).sum()) if masks else 0 for kind in KINDS}

