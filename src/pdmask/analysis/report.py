"""Agreement tables with Wilson intervals, the mask view, top-K tracking, the verdict, analysis.json and report.md."""

from __future__ import annotations

import itertools
from pathlib import Path

import torch
from torch import Tensor

from pdmask import METHODS, jsonio
from pdmask.analysis.experiment import TokenResults
from pdmask.analysis.intervals import wilson
from pdmask.analysis.maskview import mask_view
from pdmask.methods import beyond_threshold

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
        beyond = beyond_threshold(res.div[kind], res.advantage, delta[kind], delta[kind])
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


def _pct(cell: dict) -> str:
    if not cell["n"]:
        return "—"
    return f"{100 * cell['rate']:.1f}% [{100 * cell['lo']:.0f}–{100 * cell['hi']:.0f}]"


def _cell_md(cell: dict) -> str:
    return "—" if not cell["n"] else f"{_pct(cell)} n={cell['n']}"


def share_cell(cell: dict) -> str:
    """A mask-view share as 'rate% [lo–hi] k/n', or '—' where it is undefined."""
    return "—" if not cell["n"] else f"{_pct(cell)} {cell['k']}/{cell['n']}"


def _fixed(x: float | None, fmt: str) -> str:
    return "—" if x is None else format(x, fmt)


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


def verdict(summary: dict) -> list[str]:
    """Plain-words conclusions, one line each, from the measured numbers only."""
    lines = []
    for kind, per_truth in summary["agreement"].items():
        name = kind.upper()
        for tname, label in (("own_sgd", "plain step"), ("own_adam", "Adam step")):
            sig = per_truth[tname]
            pdm, ratio, diff = sig["pdm_full"]["all"], sig["ratio"]["all"], sig["pdm_full"]["differs_from_ratio"]
            if not pdm["n"]:
                continue
            head = (
                f"{name}, {label}: PDM full gets the direction of the token's own divergence change right on "
                f"{_pct(pdm)} of {pdm['n']} uniformly sampled tokens, the ratio sign on {_pct(ratio)}."
            )
            if diff["n"] == 0:
                lines.append(head + " They never disagree on this sample.")
                continue
            if diff["lo"] > 0.5:
                call = "PDM is right more often than the ratio sign there"
            elif diff["hi"] < 0.5:
                call = "the ratio sign is right more often than PDM there"
            else:
                call = "the difference is not significant (the 95% interval contains 50%)"
            lines.append(head + f" Where they disagree ({diff['n']} tokens) PDM is right on {_pct(diff)}: {call}.")
        gw = per_truth["own_sgd"].get("gw_full", {}).get("all")
        if gw and gw["n"]:
            lines.append(f"{name}: the kernel-aware G_W (experimental) matches the plain-step truth on {_pct(gw)}.")
        head = per_truth["head"]["pdm_full"]["all"]
        if head["n"]:
            ok = "holds" if head["k"] == head["n"] else "FAILS"
            lines.append(
                f"{name}: check 5 (output layer alone) {ok}: PDM full matches on {head['k']}/{head['n']} tokens."
            )
        step = per_truth["step_adam"]
        lines.append(
            f"{name}: after one real Adam step on the whole minibatch, the sign of the actual change of D matches "
            f"PDM full on {_pct(step['pdm_full']['all'])} and the ratio sign on {_pct(step['ratio']['all'])} "
            "(this change mixes every token's update, so both signals see only part of it)."
        )
        lines += _mask_verdict(summary, kind)
    return lines


def _mask_verdict(summary: dict, kind: str) -> list[str]:
    """One line per rule: each method's unsafe-keep rate (own plain step) among its kept tokens beyond δ."""
    lines = []
    for rule, words in (("dppo", "ratio-sign masks"), ("pdm", "predictive masks")):
        cells = [
            f"{name} {_pct(v['own_sgd']['unsafe_keep'])} of {v['own_sgd']['unsafe_keep']['n']}"
            for name, v in summary["mask_view"].items()
            if v["kind"] == kind and v["rule"] == rule and v["own_sgd"]["unsafe_keep"]["n"]
        ]
        if cells:
            lines.append(
                f"{kind.upper()}, {words}: unsafe keeps (kept tokens beyond δ whose own plain step raises D): "
                + "; ".join(cells) + "."
            )
        else:
            lines.append(f"{kind.upper()}, {words}: no kept token beyond δ has autograd truth in this run.")
    return lines


def write_report(out_dir: Path, summary: dict, meta: dict) -> Path:
    """analysis.json, report.md and the plots in ``out_dir``; returns the path of report.md."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "analysis.json").write_text(jsonio.dumps({**meta, **summary}, indent=1))
    md = [f"# Direction-signal analysis: {meta['config']['model']} on {meta['config']['task']}", ""]
    md += ["Command: `" + meta["command"] + "`", "", "## Verdict", ""]
    md += [f"- {line}" for line in summary["verdict"]]
    md += ["", "Cells: agreement rate in % [95% Wilson interval] and the number of tokens n.", ""]
    for kind, per_truth in summary["agreement"].items():
        c = summary["counts"][kind]
        md += [
            f"## {kind.upper()}",
            "",
            (
                f"{c['tokens']} tokens (A ≠ 0), {c['sampled']} with autograd ground truth; "
                f"D mean {c['divergence_mean']:.4g}, max {c['divergence_max']:.4g}; "
                f"{c['beyond_delta']} beyond δ = {meta['config']['delta'][kind]} ({c['beyond_delta_sampled']} sampled); "
                f"PDM full and the ratio sign differ on {c['pdm_full_differs_from_ratio']} "
                f"({c['differs_with_truth']} with autograd truth)."
            ),
            "",
        ]
        for tname, per_signal in per_truth.items():
            md += [f"### Truth: {TRUTHS[tname]}", "", "| signal | " + " | ".join(SUBSETS.values()) + " |"]
            md += ["|---" * (len(SUBSETS) + 1) + "|"]
            for sname, cells in per_signal.items():
                md += [f"| {sname} | " + " | ".join(_cell_md(cells[s]) for s in SUBSETS) + " |"]
            labels = pi_bucket_labels()
            md += ["", "By π(a):", "", "| signal | " + " | ".join(f"π(a) {lab}" for lab in labels) + " |"]
            md += ["|---" * (len(labels) + 1) + "|"]
            for sname, cells in per_signal.items():
                md += [f"| {sname} | " + " | ".join(_cell_md(cells["by_pi_a"][lab]) for lab in labels) + " |"]
            md += [""]
        md += _mask_md(summary, kind)
        md += ["### Top-K estimators against the full one", "", "| estimator | sign match | correlation |", "|---|---|---|"]
        for name, t in summary["topk_tracking"][kind].items():
            md += [f"| {name} | {100 * t['sign_match']:.1f}% | {_fixed(t['corr'], '.3f')} |"]
        md += [""]
    md += ["## Timing", "", *(f"- {k}: {v:.1f}" for k, v in meta["timing"].items()), ""]
    md += ["## Config", "", "```json", jsonio.dumps(meta["config"], indent=1), "```", ""]
    path = out_dir / "report.md"
    path.write_text("\n".join(md))
    from pdmask.analysis.plots import write_plots  # matplotlib only when writing

    write_plots(out_dir, summary)
    return path


def _mask_md(summary: dict, kind: str) -> list[str]:
    """The mask-view table of one divergence (docs/analysis.md, "Unsafe keeps and wasted drops")."""
    md = [
        "### Mask view: unsafe keeps and wasted drops beyond δ",
        "",
        "Unsafe keep: share of the kept tokens beyond δ whose own update raises D; wasted drop: share of the "
        "dropped tokens whose own update would have lowered D. Uniform sample; % [95% Wilson interval on the "
        "effective number of tokens, clustered by response] k/n.",
        "",
        "| method | D > δ / dropped (all tokens) | beyond δ with truth | " + " | ".join(h for *_, h in MASK_COLUMNS) + " |",
        "|---" * (len(MASK_COLUMNS) + 3) + "|",
    ]
    for name, acted, sampled, cells in mask_rows(summary, kind):
        md += [f"| {name} | {acted} | {sampled} | " + " | ".join(share_cell(c) for c in cells) + " |"]
    return md + [""]
