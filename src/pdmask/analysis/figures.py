"""The analysis' plots: agreement per signal, agreement by π(a), top-K tracking and the mask view."""

from __future__ import annotations

import math
from pathlib import Path

from pdmask.analysis.records import TOPK_ESTIMATORS
from pdmask.analysis.tables import MASK_COLUMNS, SUBSETS, TRUTHS, mask_rows, pi_bucket_labels

#: The predictive-mask paper's unsafe-keep rates (its models and setting, not this run), drawn for scale.
PAPER_UNSAFE_KEEP = {"dppo": (0.369, "ratio sign"), "pdm": (0.342, "divergence-based")}


def _rate(x: float | None) -> float:
    """A rate for plotting: NaN (an empty bar) where undefined."""
    return math.nan if x is None else x


def _error_bars(cells: list[dict]) -> list[list[float]]:
    """[[below], [above]] of each cell's interval around its rate (0 for empty cells)."""
    def gap(rate: float | None, bound: float | None, sign: int) -> float:
        return 0.0 if rate is None or bound is None else max(0.0, sign * (rate - bound))

    return [[gap(c["rate"], c["lo"], 1) for c in cells], [gap(c["rate"], c["hi"], -1) for c in cells]]


def write_plots(out_dir: Path, summary: dict) -> None:
    """agreement.png, by_pi_a.png, topk.png and masks.png of a summary (``tables.summarize``) in ``out_dir``."""
    import matplotlib  # imported here: `pdmask analyze` loads matplotlib only when it writes the figures

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = list(summary["agreement"])
    # 1. Agreement with the plain-step truth per signal and subset.
    fig, axes = plt.subplots(len(kinds), 1, figsize=(12, 4 * len(kinds)), squeeze=False)
    for ax, kind in zip(axes[:, 0], kinds):
        per_signal = summary["agreement"][kind]["own_sgd"]
        names = list(per_signal)
        width = 0.8 / len(SUBSETS)
        for j, subset in enumerate(SUBSETS):
            cells = [per_signal[s][subset] for s in names]
            xs = [i + (j - 1) * width for i in range(len(names))]
            rate = [_rate(c["rate"]) for c in cells]
            ax.bar(xs, rate, width, yerr=_error_bars(cells), capsize=2, label=SUBSETS[subset])
        ax.axhline(0.5, color="grey", lw=0.8, ls="--")
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
        ax.set_ylim(0, 1.05)
        ax.set_ylabel("agreement with truth")
        ax.set_title(f"{kind.upper()}: sign agreement with the token's own first-order change (plain step)")
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=3)
    fig.tight_layout()
    fig.savefig(out_dir / "agreement.png", dpi=110)
    plt.close(fig)

    # 2. Agreement by π(a) for the main signals, plain and Adam truth.
    labels = pi_bucket_labels()
    fig, axes = plt.subplots(len(kinds), 2, figsize=(11, 3.6 * len(kinds)), squeeze=False)
    for row, kind in enumerate(kinds):
        for col, tname in enumerate(("own_sgd", "own_adam")):
            ax = axes[row, col]
            per_signal = summary["agreement"][kind][tname]
            for sname in ("ratio", "pdm_full", "pdm_proportional@20", "pdm_backbone_full"):
                if sname not in per_signal:
                    continue
                cells = [per_signal[sname]["by_pi_a"][lab] for lab in labels]
                ax.errorbar(
                    range(len(labels)),
                    [_rate(c["rate"]) for c in cells],
                    yerr=_error_bars(cells),
                    marker="o",
                    capsize=3,
                    label=sname,
                )
            ax.axhline(0.5, color="grey", lw=0.8, ls="--")
            ax.set_xticks(range(len(labels)), [f"π(a) {lab}" for lab in labels])
            ax.set_ylim(0, 1.05)
            ax.set_title(f"{kind.upper()}: {TRUTHS[tname].split('(')[0].strip()}", fontsize=9)
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_dir / "by_pi_a.png", dpi=110)
    plt.close(fig)

    # 3. How the top-K estimators track the full one as K grows.
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for kind in kinds:
        tracking = summary["topk_tracking"][kind]
        for est in TOPK_ESTIMATORS:
            ks = sorted(int(n.split("@")[1]) for n in tracking if n.startswith(est + "@"))
            axes[0].plot(ks, [tracking[f"{est}@{k}"]["sign_match"] for k in ks], marker="o", label=f"{kind} {est}")
            axes[1].plot(ks, [_rate(tracking[f"{est}@{k}"]["corr"]) for k in ks], marker="o", label=f"{kind} {est}")
    for ax, title in zip(axes, ("sign(G_K) = sign(G_full)", "correlation of G_K with G_full")):
        ax.set_xscale("log")
        ax.set_xlabel("K")
        ax.set_title(title)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_dir / "topk.png", dpi=110)
    plt.close(fig)

    # 4. The mask view: unsafe keeps and wasted drops per direction method (own plain and Adam step).
    fig, axes = plt.subplots(len(kinds), 1, figsize=(12, 3.8 * len(kinds)), squeeze=False)
    for ax, kind in zip(axes[:, 0], kinds):
        rows = mask_rows(summary, kind)
        width = 0.8 / len(MASK_COLUMNS)
        for j, (_, _, header) in enumerate(MASK_COLUMNS):
            cells = [r[3][j] for r in rows]
            xs = [i + (j - (len(MASK_COLUMNS) - 1) / 2) * width for i in range(len(rows))]
            ax.bar(xs, [_rate(c["rate"]) for c in cells], width, yerr=_error_bars(cells), capsize=2, label=header)
        for rule, (rate, words) in PAPER_UNSAFE_KEEP.items():
            ax.axhline(rate, color="grey", lw=0.8, ls="--" if rule == "dppo" else ":", label=f"paper's unsafe keep, {words}")
        ax.set_xticks(range(len(rows)), [r[0] for r in rows], rotation=20, ha="right")
        top = max([0.5] + [c["hi"] for r in rows for c in r[3] if c["hi"] is not None])
        ax.set_ylim(0, min(1.0, top + 0.05))
        ax.set_ylabel("share of kept / dropped tokens beyond δ")
        ax.set_title(f"{kind.upper()}: unsafe keeps (kept, D rises) and wasted drops (dropped, D falls), 95% CI")
        ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(out_dir / "masks.png", dpi=110)
    plt.close(fig)
