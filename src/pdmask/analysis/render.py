"""The analysis' numbers in words: the verdict, table cells, analysis.json and report.md (with the figures)."""

from __future__ import annotations

from pathlib import Path

from pdmask import jsonio
from pdmask.analysis.figures import write_plots
from pdmask.analysis.tables import (
    MASK_COLUMNS,
    PAIRED_TRUTHS,
    SEED_HALVES,
    SUBSETS,
    TRUTHS,
    mask_rows,
    paired_rows,
    pi_bucket_labels,
)


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


def verdict(summary: dict) -> list[str]:
    """Plain-words conclusions, one line each, from the measured numbers only."""
    lines = []
    for kind, per_truth in summary["agreement"].items():
        name = kind.upper()
        for tname, label in (("own_sgd", "plain step"), ("own_adam", "Adam step")):
            sig = per_truth[tname]
            pdm, ratio, diff = sig["pdm_full"]["all"], sig["ratio"]["all"], sig["pdm_full"]["differs_beyond_delta"]
            if not pdm["n"]:
                continue
            head = (
                f"{name}, {label}: PDM full gets the direction of the token's own divergence change right on "
                f"{_pct(pdm)} of {pdm['n']} uniformly sampled tokens, the ratio sign on {_pct(ratio)}."
            )
            if diff["n"] == 0:
                lines.append(head + " They never disagree beyond δ in this run.")
                continue
            if diff["lo"] > 0.5:
                call = "PDM is right more often than the ratio sign there"
            elif diff["hi"] < 0.5:
                call = "the ratio sign is right more often than PDM there"
            else:
                call = "the difference is not significant (the 95% interval contains 50%)"
            lines.append(head + f" Where they disagree beyond δ ({diff['n']} tokens) PDM is right on {_pct(diff)}: {call}.")
        gw = per_truth["own_sgd"].get("pdm_backbone_full", {}).get("all")
        if gw and gw["n"]:
            lines.append(f"{name}: the backbone-aware G_W matches the plain-step truth on {_pct(gw)} of the uniform sample.")
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


def _side(cell: dict) -> str:
    if cell["lo"] > 0.5:
        return "the truth sides with the predictive mask"
    if cell["hi"] < 0.5:
        return "the truth sides with the ratio sign"
    return "not significant"


def _mask_verdict(summary: dict, kind: str) -> list[str]:
    """One line per rule: each method's unsafe-keep rate (own plain step) among its kept tokens beyond δ;
    then, per predictive mask, which side the truths take where it and its ratio-sign counterpart differ."""
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
    for label, differ, cells in paired_rows(summary, kind):
        if not differ or differ == "0":
            continue
        parts = [f"{t} {_pct(c)} ({_side(c)})" for t, c in zip(PAIRED_TRUTHS, cells) if c["n"]]
        halves = cells[len(PAIRED_TRUTHS):]
        if all(c["n"] for c in halves):
            parts.append("own_sgd on the " + " / ".join(SEED_HALVES) + " rounds (disjoint seeds) "
                         + " / ".join(f"{_pct(c)} ({_side(c)})" for c in halves))
        lines.append(f"{kind.upper()}, {label}: they decide differently on {differ} tokens; right by the predictive mask: "
                     + "; ".join(parts) + ".")
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
                f"{c['tokens']} tokens (A ≠ 0) of {c['responses']} responses, {c['sampled']} in the uniform sample; "
                f"D mean {c['divergence_mean']:.4g}, max {c['divergence_max']:.4g}; "
                f"{c['beyond_delta']} beyond δ = {meta['config']['delta'][kind]} ({c['beyond_delta_sampled']} in the "
                f"beyond-δ sample); PDM full and the ratio sign differ on {c['pdm_full_differs_from_ratio']}, "
                f"{c['differs_beyond_delta']} of them beyond δ; the paper's masks and DPPO's differ on "
                f"{c['paper_masks_differ_from_dppo']}; autograd truth on every one of the {c['targeted']} tokens where "
                "a predictive mask and its ratio-sign counterpart differ."
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
    write_plots(out_dir, summary)
    return path


def _mask_md(summary: dict, kind: str) -> list[str]:
    """The mask-view table of one divergence (docs/analysis.md, "Unsafe keeps and wasted drops")."""
    md = [
        "### Mask view: unsafe keeps and wasted drops beyond δ",
        "",
        "Unsafe keep: share of the kept tokens beyond δ whose update raises D; wasted drop: share of the "
        "dropped tokens whose update would have lowered D. Own-update truths over the uniform sample of the "
        "tokens beyond δ, the real step's over all of them; % [95% Wilson interval on the effective number of "
        "tokens, clustered by response] k/n.",
        "",
        "| method | D > δ / dropped (all tokens) | beyond δ with truth | " + " | ".join(h for *_, h in MASK_COLUMNS) + " |",
        "|---" * (len(MASK_COLUMNS) + 3) + "|",
    ]
    for name, acted, sampled, cells in mask_rows(summary, kind):
        md += [f"| {name} | {acted} | {sampled} | " + " | ".join(share_cell(c) for c in cells) + " |"]
    md += [
        "",
        "Where a predictive mask and its ratio-sign counterpart (same D) decide differently: the share of those "
        "tokens on which the truth sides with the predictive mask (it drops exactly the tokens whose update raises "
        "D). Every such token has autograd truth; % [95% clustered Wilson] k/n. The last two columns split the "
        "rounds into the even and the odd ones, two disjoint sets of seeds: a verdict that holds on one set only "
        "is not one.",
        "",
        "| predictive mask vs ratio sign | tokens where they differ | " + " | ".join(TRUTHS[t] for t in PAIRED_TRUTHS)
        + "".join(f" | {TRUTHS['own_sgd']}, {h} rounds" for h in SEED_HALVES) + " |",
        "|---" * (len(PAIRED_TRUTHS) + len(SEED_HALVES) + 2) + "|",
    ]
    for label, differ, cells in paired_rows(summary, kind):
        md += [f"| {label} | {differ} | " + " | ".join(share_cell(c) for c in cells) + " |"]
    return md + [""]


__all__ = ["share_cell", "verdict", "write_report"]
