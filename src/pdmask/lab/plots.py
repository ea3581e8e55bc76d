"""PNG plots of a compare report: learning curves, final accuracy, dropped shares, mismatch and divergence, entropy
and how often the paper's PDM and DPPO masks differ."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pdmask.lab.run_summary import ACCURACY_KEYS


def write_plots(settings: dict[str, Any], out: Path) -> dict[str, list[str]]:
    """Five figures per setting under out/plots; returns their paths relative to out, per setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plot_dir = out / "plots"
    plot_dir.mkdir(parents=True, exist_ok=True)
    files: dict[str, list[str]] = {}

    def curves(ax, setting, key, title, ylabel, smooth: int = 1) -> None:
        """Mean over seeds ± 95% band per method; methods whose curves coincide are drawn once and named together."""
        drawn: dict[str, list[str]] = {}
        for m, e in setting["methods"].items():
            c = e["curves"][key]
            drawn.setdefault(repr(c), []).append(m)
        for names in drawn.values():
            c = setting["methods"][names[0]]["curves"][key]
            marker = "o" if len(c["step"]) <= 12 else None  # evaluation points: show where they are
            label = names[0] if len(names) == 1 else " = ".join(names) + " (identical)"
            ax.plot(c["step"], _smooth(c["mean"], smooth), label=label, lw=1.4, marker=marker, ms=3)
            ax.fill_between(c["step"], _smooth(c["low"], smooth), _smooth(c["high"], smooth), alpha=0.15)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("RL step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)

    for name, setting in settings.items():
        paths = []
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        acc_key = ACCURACY_KEYS[setting["accuracy"]]
        curves(axes[0], setting, acc_key, f"held-out accuracy ({setting['accuracy']}), mean ± 95% CI", "exact-match accuracy")
        curves(axes[1], setting, "reward/mean", "train reward (5-step average), mean ± 95% CI", "reward", smooth=5)
        axes[0].legend(fontsize=8)
        paths.append(_save(fig, plot_dir / f"learning_curves_{name}.png"))

        fig, ax = plt.subplots(figsize=(7, 4))
        ms = list(setting["comparison"]["order"])
        acc = [setting["methods"][m]["final_accuracy"] for m in ms]
        # Means with their intervals, not bars from 0: the axis spans the data, so differences between methods show.
        ax.errorbar(
            range(len(ms)),
            [a["mean"] for a in acc],
            yerr=[[a["mean"] - a["low"] for a in acc], [a["high"] - a["mean"] for a in acc]],
            fmt="s",
            capsize=5,
            color="tab:blue",
            ms=7,
        )
        start = sum(e["initial_accuracy"]["mean"] for e in setting["methods"].values()) / len(setting["methods"])
        ax.axhline(start, color="tab:gray", ls="--", lw=1, label=f"SFT start {start:.3f}")
        ax.legend(fontsize=8)
        ax.set_ylabel("final held-out accuracy")
        for i, m in enumerate(ms):
            ax.scatter(
                [i - 0.15] * len(setting["methods"][m]["per_seed"]["final_accuracy"]),  # beside the interval
                list(setting["methods"][m]["per_seed"]["final_accuracy"].values()),
                color="k",
                s=10,
                zorder=3,
            )
        ax.set_xticks(range(len(ms)), ms, rotation=30, ha="right", fontsize=8)
        ax.set_title(f"final held-out accuracy ({setting['accuracy']}), {name} (squares: mean ± 95% CI, dots: seeds)", fontsize=10)
        paths.append(_save(fig, plot_dir / f"final_accuracy_{name}.png"))

        fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
        curves(axes[0], setting, "mask/dropped_frac_pos", "dropped fraction, A > 0 (5-step average)", "share of tokens", smooth=5)
        curves(axes[1], setting, "mask/dropped_frac_neg", "dropped fraction, A < 0 (5-step average)", "share of tokens", smooth=5)
        axes[0].legend(fontsize=8)
        paths.append(_save(fig, plot_dir / f"dropped_{name}.png"))

        fig, axes = plt.subplots(1, 3, figsize=(16, 4))
        curves(axes[0], setting, "mismatch/tv_mean", "mismatch: TV(trainer now, rollout engine)", "TV per token", smooth=5)
        curves(axes[1], setting, "div/mean", "method's divergence D(π, μ) during updates", "D per token", smooth=5)
        curves(axes[2], setting, "topk/masks_differ_frac", "share of tokens: top-K PDM masks differ", "share of tokens", smooth=5)
        axes[0].legend(fontsize=8)
        paths.append(_save(fig, plot_dir / f"mismatch_{name}.png"))

        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        curves(axes[0], setting, "policy/entropy", "policy entropy on the response tokens", "nats per token")
        curves(axes[1], setting, "topk/vs_dppo_aggregated_frac", "share of tokens: pdm_aggregated and dppo_topk masks differ",
               "share of tokens", smooth=5)
        axes[0].legend(fontsize=8)
        paths.append(_save(fig, plot_dir / f"entropy_{name}.png"))
        files[name] = [str(p.relative_to(out)) for p in paths]
    return files


def _smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average (shorter at the start), same length as values."""
    return [sum(values[max(0, i - window + 1) : i + 1]) / (i + 1 - max(0, i - window + 1)) for i in range(len(values))]


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
