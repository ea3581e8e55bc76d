"""One analysis run, as repeated rounds (``pdmask.analysis.round``) whose memory is bounded by one round,
resumable after a kill and shardable over processes: each finished round is one file (``ROUND_FILE``,
written atomically); a rerun with the same settings loads the finished rounds and continues with the next."""

from __future__ import annotations

import json
import os
import re
import shutil
import tarfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from pdmask.analysis.config import STOPPING, AnalysisConfig, config_dict
from pdmask.analysis.records import TokenResults, paper_disagreements
from pdmask.analysis.round import run_round
from pdmask.estimators import KINDS
from pdmask.lab.files import save_atomic, write_text_atomic

if TYPE_CHECKING:
    from pdmask.lab.engine import RolloutEngine
    from pdmask.lab.tasks import Task

ROUND_FILE = "round_{:05d}.pt"
#: A finished run's rounds packed into one file (``results/``): ``tar -cJf rounds.tar.xz rounds``.
ROUNDS_ARCHIVE = "rounds.tar.xz"
_ARCHIVED_ROUND = re.compile(r"rounds/round_\d{5}\.pt")


def unpack_rounds(out_dir: Path) -> int:
    """Extracts the rounds of ``out_dir/ROUNDS_ARCHIVE`` that ``out_dir/rounds`` lacks; returns how many.

    Only regular files named ``rounds/round_NNNNN.pt`` are read from the archive; anything else in it raises.
    """
    archive = out_dir / ROUNDS_ARCHIVE
    if not archive.exists():
        return 0
    count = 0
    with tarfile.open(archive) as tar:
        for member in tar:
            if member.isdir() and member.name == "rounds":
                continue
            if not (member.isfile() and _ARCHIVED_ROUND.fullmatch(member.name)):
                raise ValueError(f"{archive}: unexpected member {member.name!r}; it should hold only rounds/round_NNNNN.pt files.")
            target = out_dir / member.name
            if target.exists():
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            source = tar.extractfile(member)
            assert source is not None
            part = target.with_name(f"{target.name}.{os.getpid()}.part")  # shards may unpack at once
            with source, open(part, "wb") as f:
                shutil.copyfileobj(source, f)
            part.replace(target)
            count += 1
    return count


def _check_resumable(cfg: AnalysisConfig, run_file: Path) -> None:
    """Writes run.json for a new run; for an existing one, checks that only the stopping settings changed."""
    mine = {k: v for k, v in config_dict(cfg).items() if k not in STOPPING}
    if not run_file.exists():
        write_text_atomic(run_file, json.dumps(mine, indent=1))
        return
    theirs = json.loads(run_file.read_text())
    changed = sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))
    if changed:
        raise ValueError(
            f"{run_file.parent} holds finished rounds of a run with other settings ({', '.join(changed)}): "
            "rerun with that run's settings to continue it, or choose another --out."
        )



def _round_line(index: int, rec: dict[str, Tensor], seconds: float, counts: dict[str, int]) -> str:
    """One line on a finished round: its tokens, those beyond δ, the autograd truths, the running target count."""
    if not len(rec["adv"]):
        return f"round {index}: no token with A != 0; {seconds:.0f} s"
    beyond = ", ".join(f"{k.upper()} {int(rec[f'beyond/{k}'].sum())}" for k in KINDS)
    truths = ", ".join(f"{k.upper()} {int(torch.isfinite(rec[f'truth/{k}/own_sgd']).sum())}" for k in KINDS)
    so_far = ", ".join(f"{k.upper()} {v}" for k, v in counts.items())
    return (f"round {index}: {len(rec['adv'])} tokens, beyond δ {beyond}; own-step truths {truths}; {seconds:.0f} s; "
            f"the paper's masks and DPPO's differed so far on {so_far}")


def _check_same_record(rec: dict[str, Tensor], records: Sequence[dict[str, Tensor]], path: Path) -> None:
    """Raises ValueError if ``rec`` (loaded from, or to be written to, ``path``) holds other quantities than the
    run's earlier non-empty ``records``; an empty round (no token with A != 0) holds nothing to compare.

    Round files outlive the code that wrote them (a long run is continued later, or elsewhere): a version of
    pdmask that records other signals or masks must start a new run instead of mixing its rounds in.
    """
    if not len(rec["adv"]) or not records or rec.keys() == records[0].keys():
        return
    diff = sorted(rec.keys() ^ records[0].keys())
    more = f" and {len(diff) - 3} more" if len(diff) > 3 else ""
    raise ValueError(
        f"{path} records other quantities than the run's earlier rounds ({', '.join(diff[:3])}{more}): "
        "one of them comes from another version of pdmask. Continue the run with the version that wrote its "
        "rounds, or choose another --out."
    )


def check_shard(shard: tuple[int, int]) -> tuple[int, int]:
    """``shard`` unchanged if it is (I, N) with 0 <= I < N; raises ValueError naming it otherwise."""
    worker, workers = shard
    if not 0 <= worker < workers:
        raise ValueError(f"shard must be I/N with 0 <= I < N, got {worker}/{workers}.")
    return shard


def run_analysis(
    cfg: AnalysisConfig,
    policy: nn.Module,
    task: Task,
    engine_factory: Callable[[nn.Module], RolloutEngine],
    out_dir: Path,
    progress: Callable[[str, int], Callable[[], None]] | None = None,
    log: Callable[[str], None] | None = None,
    shard: tuple[int, int] = (0, 1),
) -> tuple[TokenResults, dict[str, float]]:
    """Runs rounds (``pdmask.analysis.round``) on a warm-started ``policy`` until ``cfg.rounds`` or the target.

    Finished rounds live in ``out_dir/rounds`` (missing ones are first unpacked from ``out_dir/ROUNDS_ARCHIVE``
    where there is one); those already there (from a killed run, or another shard,
    with the same settings) are loaded, not recomputed. ``shard = (i, n)`` computes only the rounds whose
    index is i mod n and skips the others' unfinished ones, so n processes can share ``out_dir``; a call
    with the default (0, 1) completes any gap. ``engine_factory(policy)`` builds the rollout engine (the
    lab's RolloutEngine with full log-probs); ``progress(label, total)`` returns a callback that advances
    a progress bar by one (a label seen before resets its bar); ``log(line)`` reports each finished round.
    Returns the results of the rounds seen and the summed timings of the rounds computed in this call.
    """
    cfg.validate()
    worker, workers = check_shard(shard)
    rounds_dir = out_dir / "rounds"
    rounds_dir.mkdir(parents=True, exist_ok=True)
    unpack_rounds(out_dir)
    _check_resumable(cfg, out_dir / "run.json")
    start = {k: v.detach().clone() for k, v in policy.state_dict().items()}
    engine = engine_factory(policy)
    times: dict[str, float] = {}
    records: list[dict[str, Tensor]] = []
    indices: list[int] = []
    counts = dict.fromkeys(KINDS, 0)
    advance = progress("rounds", cfg.rounds) if progress else None
    for index in range(cfg.rounds):
        path = rounds_dir / ROUND_FILE.format(index)
        computed = not path.exists()
        if computed and index % workers != worker:
            continue  # another shard's round, not finished yet
        if computed:
            policy.load_state_dict(start)
            rec, round_times = run_round(cfg, index, policy, engine, task, progress)
        else:
            rec = torch.load(path, weights_only=True)["tokens"]
        _check_same_record(rec, records, path)  # before a computed round is written into the run
        if computed:
            save_atomic({"round": index, "tokens": rec, "timing": round_times}, path)
            for k, v in round_times.items():
                times[k] = times.get(k, 0.0) + v
        if len(rec["adv"]):  # an empty round (every group got equal rewards) holds no token
            records.append(rec)
            indices.append(index)
        if advance:
            advance()
        for kind, c in paper_disagreements(rec).items():
            counts[kind] += c
        if log and computed:
            log(_round_line(index, rec, sum(round_times.values()), counts))
        if cfg.target_disagreements is not None and min(counts.values()) >= cfg.target_disagreements:
            break
    policy.load_state_dict(start)
    if not records:
        raise ValueError(
            "no response token of the analysed minibatches has A != 0 (every group got equal rewards): "
            "use more prompts, a larger group, another seed or --advantages random."
        )
    times["rounds_analysed"] = float(len(records))
    return TokenResults.from_records(records, indices), times
