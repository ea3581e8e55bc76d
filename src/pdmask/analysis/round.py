"""One round of the analysis (docs/analysis.md), from the same starting weights and a fresh Adam, with its
own seed, in five stages: sample rollouts (``rollouts``), stale Adam steps (``stale``), the signals of the
analysed minibatch (``signals``), autograd truths where they decide something (``targets``), and the
actual change after one real step (``step``). A round keeps only per-token float32/bool vectors."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from pdmask.analysis.config import AnalysisConfig
from pdmask.analysis.rollouts import sample_rollouts
from pdmask.analysis.signals import analyse_signals
from pdmask.analysis.stale import stale_steps
from pdmask.analysis.step import after_one_step
from pdmask.analysis.targets import autograd_truths, select_targets
from pdmask.estimators import KINDS

if TYPE_CHECKING:
    from pdmask.lab.engine import RolloutEngine
    from pdmask.lab.tasks import Task


def run_round(
    cfg: AnalysisConfig,
    index: int,
    policy: nn.Module,
    engine: RolloutEngine,
    task: Task,
    progress: Callable[[str, int], Callable[[], None]] | None = None,
) -> tuple[dict[str, Tensor], dict[str, float]]:
    """Round ``index`` from the policy's current weights; returns its flat record (``pdmask.analysis.records``)
    and the seconds of each stage."""
    times: dict[str, float] = {}
    t0 = time.perf_counter()
    # Each round has its own stream: a resumed run draws exactly what an uninterrupted one would.
    gen = torch.Generator().manual_seed(cfg.seed + 1_000_003 * index)
    rollout, adv = sample_rollouts(cfg, engine, task, gen)
    n_rows = rollout.tokens.shape[0]
    times["rollout_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    stale = stale_steps(cfg, policy, rollout, adv, gen)
    del rollout  # the other minibatches' full μ is no longer needed
    times["stale_steps_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    analysed = analyse_signals(cfg, policy, stale.batch, stale.adv)
    if analysed is None:  # every group got equal rewards: nothing to analyse in this round
        return {"adv": torch.zeros(0)}, times
    rec = analysed.record
    times["signals_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    targets = select_targets(cfg, analysed, gen)
    truth = autograd_truths(cfg, policy, stale.opt, stale.params, stale.batch, analysed, targets, progress)
    times["truth_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    after = after_one_step(
        policy, stale.opt, stale.params, stale.batch, stale.adv, cfg.temperature, analysed.keep, analysed.full_logp, cfg
    )
    for name, d_after in after.items():
        for kind in KINDS:
            truth[f"truth/{kind}/step_{name}"] = d_after[kind] - rec[f"div/{kind}"].double()
    times["step_s"] = time.perf_counter() - t0

    rec |= {key: val.float() for key, val in truth.items()}
    rec |= {f"targeted/{kind}": t for kind, t in targets.targeted.items()}
    rec |= {f"disagree_sampled/{kind}": t for kind, t in targets.disagree_sampled.items()}
    rec |= {
        "adv": analysed.adv.float(),
        "sampled": targets.sampled,
        "beyond_sampled": targets.beyond_sampled,
        # Unique over rounds: the clustered intervals treat each response as one cluster.
        "row": analysed.rows + index * n_rows,
    }
    return rec, times
