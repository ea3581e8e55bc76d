"""`pdmask analyze`: how well does each direction signal predict the real change of divergence?"""

from __future__ import annotations

import argparse
import copy
import resource
import shlex
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from pdmask.analysis.config import SOURCES, AnalysisConfig, config_dict
from pdmask.analysis.run import check_shard, run_analysis
from pdmask.estimators import KINDS

if TYPE_CHECKING:
    from rich.console import Console

    from pdmask.lab.config import Config

HELP = (
    "Measure how well each direction signal (ratio sign, PDM, G_W) predicts the real change of D, "
    "and each mask's unsafe keeps and wasted drops beyond δ."
)

#: Presets: the field values they set; explicit flags win. Pretrained models get PRETRAINED's variant on top.
PRESETS: dict[str, dict[str, Any]] = {
    "default": {},
    # Random advantages: a 30-step warm start may earn no reward at all, and the smoke run checks the plumbing.
    # Its D stays far below the default δ; thresholds near its median D give the mask view tokens to count.
    "smoke": {"model": "tiny", "prompts": 8, "group_size": 4, "stale_steps": 1, "sample_tokens": 24, "beyond_sample": 24,
              "sft_steps": 30, "advantages": "random", "delta": {"tv": 0.01, "kl": 0.0004}},
    # The paper's source of mismatch (FP8 rollouts plus stale steps), in rounds until the paper's masks and
    # DPPO's have disagreed on 2,000 tokens per divergence, each with autograd truth (docs/analysis.md).
    "scale": {"rollout_dtype": "fp8", "prompts": 256, "group_size": 8, "sample_tokens": 32, "beyond_sample": 64,
              "rounds": 500, "target_disagreements": 2000},
}
# Random advantages for pretrained models: SmolLM2-135M almost never solves `arithmetic`, so GRPO leaves
# nearly every token with A = 0. The per-token agreement does not depend on A's sign (signal and
# truth both carry the factor A); A decides which tokens count and where the optimizer steps go.
PRETRAINED: dict[str, dict[str, Any]] = {
    "default": {"task": "arithmetic", "prompts": 8, "group_size": 4, "stale_steps": 1, "sample_tokens": 48, "lr": 1e-5,
                "advantages": "random"},
    "smoke": {"task": "arithmetic", "prompts": 2, "group_size": 2, "stale_steps": 1, "sample_tokens": 8, "lr": 1e-5,
              "advantages": "random"},
    # Per-token gradients of a 135M model take seconds each: the samples are small, the refinements'
    # disagreements are sampled, and the paper's masks' disagreements (all of them get truth) are most of the
    # cost. K = 20 only: the engines' usual limit, and each K is a pass over the 49,152-token vocabulary.
    "scale": {"task": "arithmetic", "prompts": 16, "group_size": 4, "stale_steps": 1, "sample_tokens": 2, "beyond_sample": 6,
              "disagree_sample": 8, "ks": (20,), "block_positions": 128, "lr": 1e-5, "advantages": "random",
              "rounds": 5000},
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", choices=PRESETS, default="default",
                   help="default (<10 min on 2 cores), smoke (<60 s) or scale (FP8 and stale steps, rounds until 2,000 "
                        "disagreements per divergence; hours; resumable)")
    p.add_argument("--model", help="tiny | small | medium | smollm2-135m | hf:PATH (default: small)")
    p.add_argument("--task", help="sort | copy | reverse (TinyGPT) | arithmetic (pretrained; default for them)")
    p.add_argument("--reward", choices=("partial", "exact"), help="sequence-task reward (default partial)")
    p.add_argument("--source", choices=SOURCES, help="how π and μ come apart (default: both)")
    p.add_argument("--rollout-dtype", choices=("fp32", "bf16", "fp16", "fp8"),
                   help="engine precision for mismatch and both (default bf16; fp8 for the scale preset)")
    p.add_argument("--stale-steps", type=int, help="Adam steps on other minibatches before the analysed one (>= 1)")
    p.add_argument("--lr", type=float, help="Adam learning rate (default 1e-4; 1e-5 for pretrained models)")
    p.add_argument("--prompts", type=int, help="prompts in the rollout batch")
    p.add_argument("--group-size", type=int, help="responses per prompt")
    p.add_argument("--temperature", type=float, help="sampling temperature (default 1)")
    p.add_argument(
        "--advantages",
        choices=("grpo", "random"),
        help="GRPO from rewards (default for TinyGPT) or random ±1 per token (default for pretrained models)",
    )
    p.add_argument("--sample-tokens", type=int, help="per round: uniform sample of all tokens with autograd ground truth")
    p.add_argument("--beyond-sample", type=int, help="per round: uniform sample of the tokens beyond δ with autograd truth")
    p.add_argument("--disagree-sample", type=int,
                   help="per round: uniform sample of the disagreements of pdmask's refinements with truth "
                        "(default all; the paper's masks' and PDM full's always get truth)")
    p.add_argument("--rounds", type=int, help="at most this many rounds (rollout batch, stale steps, analysis); default 1")
    p.add_argument("--target-disagreements", type=int,
                   help="stop once the paper's masks and DPPO's disagreed on this many tokens for TV and for KL")
    p.add_argument("--block-positions", type=int, help="positions per block of the per-token statistics (memory)")
    p.add_argument("--ks", help="comma-separated K values for the top-K estimators (default 1,5,20)")
    p.add_argument("--sft-steps", type=int, help="SFT warm-start steps for TinyGPT (default: the lab's)")
    p.add_argument("--delta-tv", type=float, help="TV threshold δ (default 0.15)")
    p.add_argument("--delta-kl", type=float, help="KL threshold δ (default 0.05)")
    p.add_argument("--seed", type=int)
    # One thread: on a shared 2-core machine a second torch thread spins against other processes
    # (measured: SmolLM2 per-token gradients 3.4 s with 1 thread, 23 s with 2 under load).
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--shard", default="0/1", metavar="I/N",
                   help="compute only the rounds whose index is I mod N: start N of these on the same --out in "
                        "parallel (one core each), then once without --shard for the report")
    p.add_argument("--fork-profile", action="store_true",
                   help="only profile the warm-started policy's forks on --prompts x --group-size of its own samples "
                        "(runner-up π >= 0.1, sampled token not the mode, entropy in and off the top K); writes forks.json")
    p.add_argument("--out", default="runs/analyze",
                   help="output folder (default runs/analyze); a rerun with the same settings continues its rounds")


def config_from_args(args: argparse.Namespace) -> AnalysisConfig:
    """Preset values, then the pretrained-model variant, then explicit flags."""
    from pdmask.lab.models import is_pretrained

    values: dict[str, Any] = copy.deepcopy(PRESETS[args.preset])
    flags = {
        name: getattr(args, name)
        for name in ("model", "task", "reward", "source", "rollout_dtype", "stale_steps", "lr", "prompts", "group_size",
                     "temperature", "advantages", "sample_tokens", "beyond_sample", "disagree_sample", "rounds", "target_disagreements",
                     "block_positions", "sft_steps", "seed")
        if getattr(args, name) is not None
    }
    model = flags.get("model", values.get("model", AnalysisConfig.model))
    if is_pretrained(model):
        values.update(PRETRAINED[args.preset])
    values.update(flags)
    if args.ks:
        values["ks"] = tuple(int(k) for k in args.ks.split(","))
    cfg = AnalysisConfig(**values)
    for kind in KINDS:
        override = getattr(args, f"delta_{kind}")
        if override is not None:
            cfg.delta[kind] = override
    return cfg


def _lab_config(cfg: AnalysisConfig) -> Config:
    """The lab's Config for the same model, task and warm start (validated there)."""
    from pdmask.lab.config import config_from

    fields: dict[str, Any] = {"model": cfg.model, "task": cfg.task, "reward": cfg.reward, "seed": cfg.seed,
                              "rollout_dtype": cfg.engine_dtype(), "top_k": max(cfg.ks), "temperature": cfg.temperature,
                              "lr": cfg.lr, "group_size": cfg.group_size}
    if cfg.sft_steps is not None:
        fields["sft_steps"] = cfg.sft_steps
    return config_from(fields)


#: Terminal table columns: (truth, subset, header).
TABLE_COLUMNS = (
    ("own_sgd", "all", "own step\nall"),
    ("own_sgd", "beyond_delta", "own step\nD > δ"),
    ("own_sgd", "differs_beyond_delta", "own step\nPDM ≠ ratio, D > δ"),
    ("own_adam", "all", "own Adam\nall"),
    ("own_adam", "differs_beyond_delta", "own Adam\nPDM ≠ ratio, D > δ"),
    ("step_adam", "all", "real Adam\nstep, all"),
    ("head", "all", "output layer\nonly, all"),
)


def agreement_table(summary: dict, kind: str):
    """The headline rich table of one divergence: rows = signals, columns = TABLE_COLUMNS."""
    from rich.table import Table

    agreement = summary["agreement"][kind]
    table = Table(title=f"{kind.upper()}: sign agreement with the true change of D, % [95% CI]", title_justify="left")
    table.add_column("signal")
    for tname, subset, header in TABLE_COLUMNS:
        table.add_column(f"{header}\nn={agreement[tname]['ratio'][subset]['n']}", justify="right")
    for sname in agreement["own_sgd"]:
        cells = [agreement[t][sname][s] for t, s, _ in TABLE_COLUMNS]
        table.add_row(sname, *("—" if not c["n"] else f"{100 * c['rate']:.1f} [{100 * c['lo']:.0f}–{100 * c['hi']:.0f}]" for c in cells))
    return table


def tracking_table(summary: dict):
    """How the top-K estimators track their full-information versions (backbone_topk: backbone_full), per divergence."""
    from rich.table import Table

    table = Table(title="Top-K estimators against the full one (all analysed tokens)", title_justify="left")
    table.add_column("estimator")
    for kind in KINDS:
        table.add_column(f"{kind.upper()} sign = full", justify="right")
        table.add_column(f"{kind.upper()} corr", justify="right")
    for name in summary["topk_tracking"][KINDS[0]]:
        cells = []
        for kind in KINDS:
            t = summary["topk_tracking"][kind][name]
            cells += [f"{100 * t['sign_match']:.1f}%", "—" if t["corr"] is None else f"{t['corr']:.3f}"]
        table.add_row(name, *cells)
    return table


def mask_table(summary: dict, kind: str):
    """Unsafe keeps and wasted drops of every direction mask of one divergence (docs/analysis.md)."""
    from rich.table import Table

    from pdmask.analysis.render import share_cell
    from pdmask.analysis.tables import MASK_COLUMNS, mask_rows

    table = Table(
        title=f"{kind.upper()}: mask view beyond δ, % [95% CI, clustered by response] k/n", title_justify="left"
    )
    for header in ("method", "D > δ / dropped\n(all tokens)", "beyond δ\nwith truth", *(h.replace(", ", "\n") for *_, h in MASK_COLUMNS)):
        table.add_column(header, justify="left" if header == "method" else "right")
    for name, acted, sampled, cells in mask_rows(summary, kind):
        table.add_row(name, acted, sampled, *(share_cell(c) for c in cells))
    return table


def paired_table(summary: dict, kind: str):
    """Where each predictive mask and its ratio-sign counterpart differ: how often the truths side with it."""
    from rich.table import Table

    from pdmask.analysis.render import share_cell
    from pdmask.analysis.tables import PAIRED_COLUMNS, paired_rows

    table = Table(title=f"{kind.upper()}: where PDM and the ratio sign decide differently, right by PDM, % [95% CI] k/n",
                  title_justify="left")
    for header in ("predictive mask vs ratio sign", "differ", *PAIRED_COLUMNS):
        table.add_column(header, justify="left" if header.startswith("predictive") else "right")
    for label, differ, cells in paired_rows(summary, kind):
        table.add_row(label, differ, *(share_cell(c) for c in cells))
    return table


def _fork_profile(cfg: AnalysisConfig, policy: torch.nn.Module, task: Any, out: Path, console: Console) -> int:
    """`--fork-profile`: the policy's fork profile on its own samples, to forks.json and the terminal."""
    from rich.table import Table

    from pdmask import jsonio
    from pdmask.lab.forks import COLUMNS, policy_fork_profile, profile_cells

    with console.status(f"sampling {cfg.prompts} x {cfg.group_size} responses"):
        g = torch.Generator().manual_seed(cfg.seed)
        prompts = [p.prompt_ids for p in task.sample(cfg.prompts, g)]
        profile = policy_fork_profile(policy, task, prompts, samples=cfg.group_size, temperature=cfg.temperature,
                                      k=max(cfg.ks), generator=g)
    record = {"command": shlex.join(["pdmask", "analyze", *sys.argv[2:]]), "model": cfg.model, "task": cfg.task,
              "prompts": cfg.prompts, "samples": cfg.group_size, "temperature": cfg.temperature, "k": max(cfg.ks),
              "profile": profile}
    out.mkdir(parents=True, exist_ok=True)
    (out / "forks.json").write_text(jsonio.dumps(record, indent=1))
    table = Table(title=f"Fork profile of {cfg.model} on {cfg.task} (K = {max(cfg.ks)})", title_justify="left")
    for _, header in COLUMNS:
        table.add_column(header, justify="right")
    table.add_row(*profile_cells(profile))
    console.print(table)
    console.print(f"written: {out / 'forks.json'}")
    return 0


def _parse_shard(text: str) -> tuple[int, int]:
    """"I/N" -> (I, N), checked before any model is loaded; raises ValueError naming the shard."""
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise ValueError(f"--shard must be I/N (e.g. 0/2), got {text!r}.") from None
    return check_shard((i, n))


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    console = Console(stderr=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return _run(args, console)
    finally:
        torch.set_num_threads(threads)


def _run(args: argparse.Namespace, console: Console) -> int:
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TaskID,
        TextColumn,
        TimeElapsedColumn,
    )

    from pdmask.analysis.render import verdict, write_report
    from pdmask.analysis.tables import summarize
    from pdmask.lab.config import ConfigError
    from pdmask.lab.engine import RolloutEngine
    from pdmask.lab.sft import initial_policy, warm_start
    from pdmask.lab.tasks import SequenceTask, build_task

    start = time.perf_counter()
    try:
        cfg = config_from_args(args).validate()
        lab = _lab_config(cfg)
        shard = _parse_shard(args.shard)
    except (ConfigError, TypeError, ValueError) as e:
        console.print(f"[red]pdmask analyze: {e}[/red]")
        return 2
    timing: dict[str, float] = {}
    with console.status(f"loading {cfg.model} and warming up"):
        t0 = time.perf_counter()
        policy = initial_policy(lab)
        task = build_task(cfg.task, getattr(policy, "tokenizer", None), **lab.task_kwargs())
        if isinstance(task, SequenceTask):  # TinyGPT tasks: the lab's cached SFT warm start
            warm_start(lab, policy, task)
        timing["load_and_warm_start_s"] = time.perf_counter() - t0

    if args.fork_profile:
        return _fork_profile(cfg, policy, task, Path(args.out), console)

    def engine_factory(p: torch.nn.Module) -> RolloutEngine:
        return RolloutEngine(p, dtype=cfg.engine_dtype(), top_k_logprobs=max(cfg.ks), return_full=True)

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as bar:

        bars: dict[str, TaskID] = {}

        def progress(label: str, total: int):
            # One bar per label: each round's ground-truth bar restarts the previous round's.
            if label in bars:
                bar.reset(bars[label], total=total)
            else:
                bars[label] = bar.add_task(label, total=total)
            task_id = bars[label]
            return lambda: bar.advance(task_id)

        try:
            results, run_timing = run_analysis(cfg, policy, task, engine_factory, Path(args.out), progress,
                                               bar.console.print, shard)
        except ValueError as e:
            console.print(f"[red]pdmask analyze: {e}[/red]")
            return 2
    timing.update(run_timing)
    timing["total_s"] = time.perf_counter() - start
    timing["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB
    if shard[1] > 1:
        console.print(f"shard {args.shard}: {run_timing['rounds_analysed']:.0f} rounds in {args.out}, "
                      f"{timing['total_s']:.0f} s, peak {timing['peak_rss_gib']:.1f} GiB; "
                      "when every shard is done, rerun without --shard for the report.")
        return 0
    summary = summarize(results, cfg.delta)
    summary["verdict"] = verdict(summary)
    meta = {"command": shlex.join(["pdmask", "analyze", *sys.argv[2:]]), "config": config_dict(cfg), "timing": timing}
    path = write_report(Path(args.out), summary, meta)

    # Wide enough for the table even when piped (rich falls back to 80 columns there).
    out = Console(width=max(Console().width, 150))
    for kind in KINDS:
        out.print(agreement_table(summary, kind))
    for kind in KINDS:
        out.print(mask_table(summary, kind))
        out.print(paired_table(summary, kind))
    out.print(tracking_table(summary))
    out.print("[bold]Verdict[/bold]")
    for line in summary["verdict"]:
        out.print(f"- {line}")
    out.print(f"Report: {path} (analysis.json, agreement.png, by_pi_a.png, topk.png, masks.png); {timing['total_s']:.0f} s "
              f"for {run_timing['rounds_analysed']:.0f} rounds (finished rounds of an earlier call are loaded, not rerun).")
    return 0
