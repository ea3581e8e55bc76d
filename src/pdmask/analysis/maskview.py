"""The token-level view of each mask method: unsafe keeps and wasted drops among the tokens beyond δ.

A direction mask (method.md: ``dppo_*``, ``pdm_*``) looks only at tokens whose divergence estimate is
beyond δ, and drops those whose update it predicts to raise D. Against a ground truth (the signed
first-order change of the token's own D under its own update), each such token is one of:
- kept, truth > 0: an **unsafe keep** (the mask lets through an update that pushes D further out);
- dropped, truth < 0: a **wasted drop** (the mask throws away an update that would have pulled D back).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from pdmask import METHODS, MaskMethod, decide
from pdmask.analysis.rates import clustered_rate
from pdmask.types import PolicyStats

#: The rules that drop tokens beyond δ by a direction test (method.md's mask rules).
DIRECTION_RULES = ("dppo", "pdm")


def direction_methods() -> list[MaskMethod]:
    """Every registered method whose rule is a direction test beyond δ, in registry order."""
    return [m for m in METHODS.values() if m.rule in DIRECTION_RULES]


def mask_decisions(stats: PolicyStats, advantages: Tensor, delta: Mapping[str, float]) -> dict[str, dict[str, Tensor]]:
    """Per direction method: "beyond" (its own D estimate > δ, never where A = 0) and "keep" (its mask), bool [...].

    ``stats`` must carry every method's information (top-K and full μ, and the LM head's sums for the
    backbone-aware masks: ``policy_stats(..., head_weight=W)``); ``delta`` maps kind -> δ (both sides).
    """
    out = {}
    for m in direction_methods():
        assert m.kind is not None and m.info is not None
        d = delta[m.kind]
        decision = decide(m, stats, advantages, delta_low=d, delta_high=d)
        assert decision.beyond is not None  # a direction rule always has a beyond-δ set
        out[m.name] = {"beyond": decision.beyond, "keep": decision.keep}
    return out


def paired_view(keep: Tensor, other_keep: Tensor, truth: Tensor, clusters: Tensor, sample: Tensor | None = None) -> dict:
    """Where a predictive mask and its ratio-sign counterpart decide differently (bool [n] each; such tokens
    are beyond δ), the share on which the truth [n] (NaN = unmeasured, 0 skipped) sides with the predictive
    mask: it drops exactly the tokens whose own update raises D. With a clustered 95% Wilson interval.
    ``sample`` (bool [n]) restricts it to a uniform sample of the disagreements (default: every one)."""
    valid = (keep != other_keep) & torch.isfinite(truth) & (truth != 0)
    if sample is not None:
        valid &= sample
    right = (~keep) == (truth > 0)
    return clustered_rate(right[valid], clusters[valid])


def mask_view(beyond: Tensor, keep: Tensor, truth: Tensor, population: Tensor, clusters: Tensor) -> dict:
    """Unsafe keeps and wasted drops of one mask against one truth, over ``population`` beyond δ.

    Args:
        beyond, keep: the method's decisions [n] (bool); truth: signed change of D [n] (NaN = not measured);
        population: tokens to count [n] (bool); clusters: response id of each token [n] (for the interval).
    Returns:
        "unsafe_keep": share of kept beyond-δ tokens with truth > 0; "wasted_drop": share of dropped ones
        with truth < 0 (each with a clustered 95% Wilson interval); "counts": the 2×2 table.
        Tokens whose truth is unmeasured or exactly 0 are left out.
    """
    valid = population & beyond & torch.isfinite(truth) & (truth != 0)
    raises = truth > 0
    kept, dropped = valid & keep, valid & ~keep
    return {
        "unsafe_keep": clustered_rate(raises[kept], clusters[kept]),
        "wasted_drop": clustered_rate(~raises[dropped], clusters[dropped]),
        "counts": {
            "kept_raises": int((kept & raises).sum()),
            "kept_lowers": int((kept & ~raises).sum()),
            "dropped_raises": int((dropped & raises).sum()),
            "dropped_lowers": int((dropped & ~raises).sum()),
        },
    }
