"""The analysis' numbers: agreement rates with Wilson intervals per truth, signal, subset and π(a) bucket,
the mask view of each direction method, and how the top-K estimators track the full one."""

from __future__ import annotations

import itertools

import torch
from torch import Tensor

from pdmask import METHODS
from pdmask.analysis.experiment import TokenResults
from pdmask.analysis.maskview import mask_view
from pdmask.analysis.rates import wilson

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
    "differs_from_ratio": "tokens where PDM full and the ratio sign disagree (where the choice matters)",
}
#: Truths of the mask view: the token's own first-order change (and check 5's output layer alone).
MASK_TRUTHS = ("own_sgd", "own_adam", "head")
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


def summarize(res: TokenResults, delta: dict[str, float]) -> dict:
    """All agreement rates (per kind, truth, signal, subset and π(a) bucket), the mask view and the top-K tracking."""
    out: dict = {"agreement": {}, "topk_tracking": {}, "counts": {}, "mask_view": summarize_masks(res, delta)}
    bucket = torch.bucketize(res.pi_a, torch.tensor(PI_EDGES[1:-1], dtype=res.pi_a.dtype), right=True)
    labels = pi_bucket_labels()
    everyone = torch.ones_like(res.pi_a, dtype=torch.bool)
    for kind, signals in res.signals.items():
        beyond = res.beyond[kind]
        differ = torch.sign(signals["ratio"]) != torch.sign(signals["pdm_full"])
        out["counts"][kind] = {
            "tokens": len(res.pi_a),
            "sampled": int(res.sampled.sum()),
            "beyond_delta": int(beyond.sum()),
            "beyond_delta_sampled": int((beyond & res.sampled).sum()),
            "pdm_full_differs_from_ratio": int(differ.sum()),
            "differs_with_truth": int((differ & (res.sampled | res.targeted)).sum()),
            "divergence_mean": res.div[kind].mean().item(),
            "divergence_max": res.div[kind].max().item(),
        }
        per_truth: dict = {}
        for tname in TRUTHS:
            truth = res.truth[kind][tname]
            # Autograd truths exist on the uniform sample plus the targeted disagreements: rates over
            # all tokens, beyond δ and by π(a) use the uniform sample only, so they stay unbiased.
            population = res.sampled if torch.isnan(truth).any() else everyone
            subsets = {"all": population, "beyond_delta": population & beyond, "differs_from_ratio": differ}
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
            if name in ("full", "gw_full"):
                continue
            ref = raw["gw_full"] if name.startswith("gw") else raw["full"]
            same = torch.sign(g) == torch.sign(ref)
            tracking[name] = {"sign_match": same.double().mean().item(), "corr": _pearson(g, ref), "n": len(g)}
        out["topk_tracking"][kind] = tracking
    return out


def summarize_masks(res: TokenResults, delta: dict[str, float]) -> dict:
    """Per direction method: how often it acts (all tokens) and its unsafe keeps / wasted drops per truth.

    The truths are autograd ones, so the rates use the uniform sample (unbiased); intervals are
    Wilson on the effective number of tokens, clustered by response.
    """
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
            tname: mask_view(dec["beyond"], dec["keep"], res.truth[m.kind][tname], res.sampled, res.row)
            for tname in MASK_TRUTHS
        }
    return out


#: Mask-view columns: (truth, rate, header).
MASK_COLUMNS = (
    ("own_sgd", "unsafe_keep", "unsafe keep, own step"),
    ("own_sgd", "wasted_drop", "wasted drop, own step"),
    ("own_adam", "unsafe_keep", "unsafe keep, own Adam"),
    ("own_adam", "wasted_drop", "wasted drop, own Adam"),
)


def mask_rows(summary: dict, kind: str) -> list[tuple[str, str, str, list[dict]]]:
    """(method, "beyond δ / dropped" of all tokens, beyond δ with truth in the sample, MASK_COLUMNS cells) per method of ``kind``."""
    rows = []
    for name, v in summary["mask_view"].items():
        if v["kind"] != kind:
            continue
        counts = v["own_sgd"]["counts"]
        acted = f"{v['beyond_delta']} / {v['dropped']}"
        rows.append((name, acted, str(sum(counts.values())), [v[t][r] for t, r, _ in MASK_COLUMNS]))
    return rows


__all__ = [
    "MASK_COLUMNS",
    "MASK_TRUTHS",
    "PI_EDGES",
    "SUBSETS",
    "TRUTHS",
    "agreement",
    "mask_rows",
    "pi_bucket_labels",
    "summarize",
    "summarize_masks",
]
