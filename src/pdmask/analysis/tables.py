"""The analysis' numbers: agreement rates with Wilson intervals per truth, signal, subset and π(a) bucket,
the mask view of each direction method, and how the top-K estimators track the full one."""

from __future__ import annotations

import itertools

import torch
from torch import Tensor

from pdmask import METHODS
from pdmask.analysis.maskview import mask_view, paired_view
from pdmask.analysis.rates import wilson
from pdmask.analysis.records import (
    ALWAYS_MEASURED,
    AUTOGRAD_TRUTHS,
    FULL_ESTIMATORS,
    TokenResults,
    disagreements,
)
from pdmask.estimators import PAPER_TOPK_ESTIMATORS

#: Ground truths, in the order reported. "own_*" are autograd first-order changes on the token sample.
TRUTHS = {
    "own_sgd": "own update, plain step (first order, autograd)",
    "own_adam": "own update, Adam-preconditioned (first order, autograd)",
    "head": "own update, output layer only (method.md check 5)",
    "step_adam": "actual change after one Adam step on the whole minibatch",
    "step_sgd": "actual change after one plain gradient step on the whole minibatch",
}
SUBSETS = {
    "all": "all tokens",
    "beyond_delta": "tokens with D > δ (where the mask acts)",
    "differs_beyond_delta": "tokens with D > δ where PDM full and the ratio sign disagree (where the choice matters)",
}
#: Truths of the mask view: the token's own first-order change, the real step (and check 5's output layer alone).
MASK_TRUTHS = ("own_sgd", "own_adam", "step_adam", "head")
#: Truths of the paired comparison where a predictive mask and its ratio-sign counterpart decide differently.
PAIRED_TRUTHS = ("own_sgd", "own_adam", "step_adam")
#: The two disjoint sets of seeds a verdict is checked on: round i has seed ``seed + 1_000_003·i``.
SEED_HALVES = {"even": 0, "odd": 1}
#: π(a) bucket edges: confident tokens behave differently from unlikely ones (the softmax coupling).
PI_EDGES = (0.0, 0.1, 0.5, 0.9, 1.0)


def agreement(signal: Tensor, truth: Tensor, subset: Tensor) -> dict:
    """Rate at which sign(signal) = sign(truth) on ``subset``, skipping unmeasured (NaN) and exact-zero truths.

    Rate and interval are None over an empty subset.
    """
    valid = subset & torch.isfinite(truth) & (truth != 0)
    n = int(valid.sum())
    k = int((torch.sign(signal[valid]) == torch.sign(truth[valid])).sum())
    lo, hi = wilson(k, n)
    return {"rate": k / n if n else None, "lo": lo, "hi": hi, "n": n, "k": k}


def _pearson(x: Tensor, y: Tensor) -> float | None:
    x, y = x - x.mean(), y - y.mean()
    denom = (x.norm() * y.norm()).item()
    return (x @ y).item() / denom if denom > 0 else None


def pi_bucket_labels() -> list[str]:
    return [f"{lo:g}–{hi:g}" for lo, hi in itertools.pairwise(PI_EDGES)]


def _populations(res: TokenResults, tname: str) -> tuple[Tensor, Tensor]:
    """(all tokens, tokens beyond δ for any mask) as a truth measures them without bias: autograd truths on
    their uniform samples, the real step's on every token."""
    if tname in AUTOGRAD_TRUTHS:
        return res.sampled, res.beyond_sampled
    everyone = torch.ones_like(res.sampled)
    return everyone, everyone


def summarize(res: TokenResults, delta: dict[str, float]) -> dict:
    """All agreement rates (per kind, truth, signal, subset and π(a) bucket), the mask view and the top-K tracking."""
    out: dict = {"agreement": {}, "topk_tracking": {}, "counts": {}, "mask_view": summarize_masks(res, delta)}
    bucket = torch.bucketize(res.pi_a, torch.tensor(PI_EDGES[1:-1], dtype=res.pi_a.dtype), right=True)
    labels = pi_bucket_labels()
    for kind, signals in res.signals.items():
        beyond = res.beyond[kind]
        differ = torch.sign(signals["ratio"]) != torch.sign(signals["pdm_full"])
        out["counts"][kind] = {
            "tokens": len(res.pi_a),
            "responses": len(res.row.unique()),
            "sampled": int(res.sampled.sum()),
            "beyond_delta": int(beyond.sum()),
            "beyond_delta_sampled": int((beyond & res.beyond_sampled).sum()),
            "pdm_full_differs_from_ratio": int(differ.sum()),
            # Every one of these has autograd truth: pdm_full and dppo_full decide differently there.
            "differs_beyond_delta": int((differ & beyond).sum()),
            "paper_masks_differ_from_dppo": int(disagreements(res.masks, kind, PAPER_TOPK_ESTIMATORS).sum()),
            "targeted": int(res.targeted[kind].sum()),
            "divergence_mean": res.div[kind].mean().item(),
            "divergence_max": res.div[kind].max().item(),
        }
        per_truth: dict = {}
        for tname in TRUTHS:
            truth = res.truth[kind][tname]
            # Autograd truths exist on uniform samples plus every disagreement beyond δ: rates over all
            # tokens, beyond δ and by π(a) use the uniform samples only, so they stay unbiased.
            population, beyond_population = _populations(res, tname)
            subsets = {"all": population, "beyond_delta": beyond_population & beyond, "differs_beyond_delta": differ & beyond}
            per_signal: dict = {}
            for sname, sig in signals.items():
                cells = {name: agreement(sig, truth, sub) for name, sub in subsets.items()}
                cells["by_pi_a"] = {lab: agreement(sig, truth, population & (bucket == i)) for i, lab in enumerate(labels)}
                per_signal[sname] = cells
            per_truth[tname] = per_signal
        out["agreement"][kind] = per_truth
        raw = res.raw_g[kind]
        tracking: dict = {}
        for name, g in raw.items():
            if name in FULL_ESTIMATORS:
                continue
            # Each top-K estimator against its full-μ version: the backbone-aware one against backbone_full.
            ref = raw["backbone_full"] if name.startswith("backbone") and "backbone_full" in raw else raw["full"]
            same = torch.sign(g) == torch.sign(ref)
            tracking[name] = {"sign_match": same.double().mean().item(), "corr": _pearson(g, ref), "n": len(g)}
        out["topk_tracking"][kind] = tracking
    return out


def summarize_masks(res: TokenResults, delta: dict[str, float], split: bool = True) -> dict:
    """Per direction method: how often it acts (all tokens), its unsafe keeps / wasted drops per truth, and
    for a predictive mask, which side the truths take where it and its ratio-sign counterpart disagree,
    over all rounds and (``split``) over the even and the odd rounds apart (disjoint seeds).

    Autograd truths are rated over the uniform sample of the tokens beyond δ (unbiased), the real step's
    over every token; intervals are Wilson on the effective number of tokens, clustered by response.
    """
    halves = {
        half: summarize_masks(res.select(res.round_index % 2 == parity), delta, split=False)
        for half, parity in SEED_HALVES.items()
    } if split else {}
    out: dict = {}
    for name, dec in res.masks.items():
        m = METHODS[name]
        assert m.kind is not None
        beyond, dropped = int(dec["beyond"].sum()), int((dec["beyond"] & ~dec["keep"]).sum())
        out[name] = {
            "rule": m.rule,
            "kind": m.kind,
            "info": m.info,
            "estimator": m.estimator,
            "delta": delta[m.kind],
            "beyond_delta": beyond,
            "dropped": dropped,
            "drop_share": dropped / beyond if beyond else None,
        } | {
            tname: mask_view(dec["beyond"], dec["keep"], res.truth[m.kind][tname], _populations(res, tname)[1], res.row)
            for tname in MASK_TRUTHS
        }
        other = m.dppo_counterpart
        if m.rule == "pdm" and other in res.masks:
            other_keep = res.masks[other]["keep"]
            # Autograd truths: every disagreement of the ALWAYS_MEASURED estimators, a uniform sample of the others'.
            sample = None if m.estimator in ALWAYS_MEASURED else res.disagree_sampled[m.kind]
            out[name]["paired"] = {"counterpart": other, "differ": int((dec["keep"] != other_keep).sum())} | {
                tname: paired_view(dec["keep"], other_keep, res.truth[m.kind][tname], res.row,
                                   None if tname not in AUTOGRAD_TRUTHS else sample)
                for tname in PAIRED_TRUTHS
            }
            if halves:
                out[name]["paired"]["halves"] = {half: h[name]["paired"] for half, h in halves.items()}
    return out


#: Mask-view columns: (truth, rate, header).
MASK_COLUMNS = (
    ("own_sgd", "unsafe_keep", "unsafe keep, own step"),
    ("own_sgd", "wasted_drop", "wasted drop, own step"),
    ("own_adam", "unsafe_keep", "unsafe keep, own Adam"),
    ("own_adam", "wasted_drop", "wasted drop, own Adam"),
    ("step_adam", "unsafe_keep", "unsafe keep, real step"),
    ("step_adam", "wasted_drop", "wasted drop, real step"),
)


def mask_rows(summary: dict, kind: str) -> list[tuple[str, str, str, list[dict]]]:
    """(method, "beyond δ / dropped" of all tokens, beyond δ with own truth in the sample, MASK_COLUMNS cells) per method of ``kind``."""
    rows = []
    for name, v in summary["mask_view"].items():
        if v["kind"] != kind:
            continue
        counts = v["own_sgd"]["counts"]
        acted = f"{v['beyond_delta']} / {v['dropped']}"
        rows.append((name, acted, str(sum(counts.values())), [v[t][r] for t, r, _ in MASK_COLUMNS]))
    return rows


def paired_rows(summary: dict, kind: str) -> list[tuple[str, str, list[dict]]]:
    """(predictive method vs its counterpart, tokens where they differ, PAIRED_TRUTHS cells, then the own
    plain step's cell on each of SEED_HALVES) per method of ``kind``."""
    return [
        (
            f"{name} vs {v['paired']['counterpart']}",
            str(v["paired"]["differ"]),
            [v["paired"][t] for t in PAIRED_TRUTHS] + [v["paired"]["halves"][h]["own_sgd"] for h in SEED_HALVES],
        )
        for name, v in summary["mask_view"].items()
        if v["kind"] == kind and "paired" in v
    ]


#: Headers of paired_rows' cells.
PAIRED_COLUMNS = (*PAIRED_TRUTHS, *(f"own_sgd, {h} rounds" for h in SEED_HALVES))


__all__ = [
    "MASK_COLUMNS",
    "MASK_TRUTHS",
    "PAIRED_COLUMNS",
    "PAIRED_TRUTHS",
    "PI_EDGES",
    "SEED_HALVES",
    "SUBSETS",
    "TRUTHS",
    "agreement",
    "mask_rows",
    "paired_rows",
    "pi_bucket_labels",
    "summarize",
    "summarize_masks",
]
