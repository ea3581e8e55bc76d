"""The one pass every backend runs under: first sweep, combine over the ranks, finiteness check, the sums
that need the final log-normaliser, log π(a) with its gradient, and ``PolicyStats``.

A backend (``pdmask.backends.dense``, ``pdmask.backends.hidden``) only makes blocks of logits and the
autograd node of log π(a); tensor parallelism is the combine of its partial sums (``Partial.combine``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Protocol

import torch
from torch import Tensor

from pdmask.backends.accumulators import Accumulators, Partial, reduce_normalised
from pdmask.backends.inputs import Prepared
from pdmask.backends.shard import VocabShard
from pdmask.backends.sums import Block, Buffers
from pdmask.rollout import Checks
from pdmask.types import FullReductions, PolicyStats


class Backend(Protocol):
    """What a backend gives the driver: its name in errors, this rank's LM head rows when the head sums are asked for, its
    buffers, the first sweep's partial sums, the blocks again for the second stage, and log π(a)."""

    source: str
    head_weight: Tensor | None

    def buffers(self, need_sign: bool) -> Buffers: ...

    def sweep(self, part: Partial, acc: Accumulators, bufs: Buffers) -> None: ...

    def blocks(self, bufs: Buffers) -> Iterator[Block]: ...

    def log_prob(self, acc: Accumulators) -> Tensor: ...


def run_pass(
    backend: Backend, prep: Prepared, shard: VocabShard, need_sq_norm: bool, need_exactpi: bool, validate: bool
) -> PolicyStats:
    """``PolicyStats`` of ``backend``'s logits: what every rank of ``shard``'s group gets (docs/sharded.md)."""
    acc = Accumulators.empty(prep, need_sq_norm, need_exactpi, backend.head_weight)
    with torch.no_grad():
        bufs = backend.buffers(acc.exactpi is not None)
        part = Partial.empty(acc)
        backend.sweep(part, acc, bufs)
        part.combine(shard, acc)
        if validate:  # before the second stage; the values are the same on every rank
            check_finite(prep, acc, backend.source)
        if acc.full is not None or acc.exactpi is not None:
            acc.add_normalised(prep, backend.blocks(bufs), bufs)
        acc.add_set_rows(prep, shard)
        reduce_normalised(shard, acc)
    return assemble(prep, acc, backend.log_prob(acc))


def check_finite(prep: Prepared, acc: Accumulators, source: str) -> None:
    """Raises unless every lse and log π(a) of the pass is finite: one read of both verdicts; the error says
    how many positions, the first, and whether it lies in the response."""
    checks = Checks()
    bad_rows, bad_a = ~torch.isfinite(acc.lse), ~torch.isfinite(acc.set_logp[:, -1])
    checks.add(
        bad_rows.any(),
        lambda: f"{source} contain NaN or +inf (or a row of only -inf) at {prep.where(bad_rows)}; "
        "the trainer's logits must be finite.",
    )
    checks.add(
        bad_a.any(),
        lambda: f"{source} are -inf at a sampled token at {prep.where(bad_a)}: the trainer gives that token probability zero.",
    )
    checks.read()


def assemble(prep: Prepared, acc: Accumulators, logp: Tensor) -> PolicyStats:
    """PolicyStats from a finished pass: its inputs, its accumulators and log π(a) [n] (with its gradient)."""
    shape = prep.shape
    stats = PolicyStats(
        logp=logp.reshape(shape),
        rollout_logp=prep.rollout.logp,
        has_topk=prep.rollout.topk_ids is not None,
        has_full=prep.rollout.full_logp is not None,
        set_ids=prep.set_ids.reshape(shape + (-1,)),
        set_logp=acc.set_logp.reshape(shape + (-1,)),
        set_mu=prep.set_mu,
        set_valid=prep.set_valid,
        rest_mass=acc.rest.reshape(shape),
        tail_count=prep.tail_count,
        exactpi_sums=None if acc.exactpi is None else acc.exactpi.reshape((2,) + shape),
    )
    if acc.tail_sq is not None:
        stats.tail_sq = acc.tail_sq.reshape(shape)
        stats.sq_norm = stats.set_pi.square().sum(-1) + stats.tail_sq
    if acc.full is not None:
        stats.full = FullReductions(*(r.reshape(shape) for r in acc.full))
    if acc.head is not None:
        h = acc.head
        at = lambda x: None if x is None else x.reshape(shape + (-1,))
        stats.head = replace(h, **{f: at(getattr(h, f)) for f in h.__dataclass_fields__})
    return stats


__all__ = ["Backend", "assemble", "check_finite", "run_pass"]
