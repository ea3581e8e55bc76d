"""The results of a pass, flat over positions: each rank's partial sums, and their combine over the ranks.

A backend's first sweep stores, per row, sums relative to its own row max (``Partial``); ``Partial.combine``
rescales them to the group's max and sums them over the ranks (one all-reduce MAX, one SUM; nothing on one
rank) into ``Accumulators``. What needs the final log-normaliser (full-μ reductions, exactpi sums, the LM
head's rows at S) is summed afterwards and combined by ``reduce_normalised``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from pdmask.backends.inputs import Prepared
from pdmask.backends.shard import VocabShard
from pdmask.backends.sums import Block, Buffers, normalised_sums, set_rows_dot
from pdmask.types import HeadMeans


@dataclass
class Accumulators:
    """Flat [n] (or [k, n], [n, d]) results of a pass; ``weight`` [real, d] is this rank's LM head rows, if any."""

    lse: Tensor
    set_logp: Tensor
    rest: Tensor
    tail_sq: Tensor | None
    full: Tensor | None  # [5, n]
    exactpi: Tensor | None  # [2, n]
    head: HeadMeans | None = None
    weight: Tensor | None = None

    @staticmethod
    def empty(prep: Prepared, need_sq_norm: bool, need_exactpi: bool, weight: Tensor | None = None) -> Accumulators:
        def zeros(*size: int) -> Tensor:
            return torch.zeros(*size, dtype=prep.set_mu.dtype, device=prep.tokens.device)

        head = None
        if weight is not None:
            d, full = weight.shape[1], prep.full_logp is not None
            head = HeadMeans(zeros(prep.n, d), zeros(prep.n, d) if full else None, zeros(prep.n, d) if full else None)
        return Accumulators(
            zeros(prep.n), zeros(*prep.set_ids.shape), zeros(prep.n), zeros(prep.n) if need_sq_norm else None,
            None if prep.full_logp is None else zeros(5, prep.n),
            zeros(2, prep.n) if need_exactpi and prep.rollout.topk_ids is not None else None,
            head, None if weight is None else weight.detach(),
        )

    def rows(self, vocab: slice, dtype: torch.dtype) -> Tensor:
        """The LM head's rows W[vocab] [c, d] in the compute dtype."""
        assert self.weight is not None
        return self.weight[vocab].to(dtype)

    def finish_rows(
        self, sl: slice, m: Tensor, total: Tensor, rest: Tensor, tail_sq: Tensor | None, set_z: Tensor,
        head_tail: Tensor | None = None,
    ) -> None:
        """Stores rows ``sl`` from their sums relative to the shift m: e.g. lse = m + log Σ exp(z − m)."""
        self.lse[sl] = m + total.log()
        self.set_logp[sl] = set_z - self.lse[sl, None]
        self.rest[sl] = rest / total
        if self.tail_sq is not None and tail_sq is not None:
            self.tail_sq[sl] = tail_sq / total.square()
        if self.head is not None and head_tail is not None:  # in place when head_tail is this very storage
            torch.div(head_tail, total[:, None], out=self.head.tail[sl])

    def tail_product(self, bufs: Buffers, r: int, c: int, vocab: slice) -> Tensor | None:
        """Σ_{j∉S} e_j w_j [r, d] of the block whose tail e [r, c] ``shifted_sums`` left in ``bufs``
        (None without a head)."""
        if self.head is None:
            return None
        return Buffers.block(bufs.exp, r, c) @ self.rows(vocab, bufs.exp.dtype)

    def add_normalised(self, prep: Prepared, blocks: Iterable[Block], bufs: Buffers) -> None:
        """Adds the full-μ reductions and exactpi sums (those asked for) of ``blocks`` (made in ``bufs``), whose
        rows' lse is final."""
        flat_u = prep.flat_even_mu
        for sl, z, set_cols, vocab in blocks:
            u = None if self.exactpi is None else flat_u[sl]
            logq = None if self.full is None or prep.full_logp is None else prep.full_logp[sl, vocab]
            rows = None if self.head is None or logq is None else self.rows(vocab, z.dtype)
            full, exactpi, head = normalised_sums(z, self.lse[sl], set_cols, bufs, u, logq, rows)
            if full is not None and self.full is not None:
                self.full[:, sl] += full
            if head is not None and self.head is not None and self.head.mu is not None and self.head.sign_pi is not None:
                self.head.mu[sl] += head[0]
                self.head.sign_pi[sl] += head[1]
            if exactpi is not None and self.exactpi is not None:
                self.exactpi[:, sl] += exactpi

    def add_set_rows(self, prep: Prepared, shard: VocabShard) -> None:
        """The LM head's rows at S that the backbone-aware direction needs (``HeadMeans``: Σ_S π_j w_j, w_a, and
        with top-K Σ_S μ_j w_j, Σ_S s_j π_j w_j), this rank's share; none for binary information (no
        backbone-aware mask can use it)."""
        head, topk = self.head, prep.rollout.topk_ids is not None
        if head is None or self.weight is None or not (topk or prep.full_logp is not None):
            return
        valid = prep.set_valid.reshape(prep.n, -1)
        pi = self.set_logp.exp().masked_fill(~valid, 0.0)
        coefs = [pi, torch.zeros_like(pi).index_fill_(1, torch.tensor([pi.shape[1] - 1], device=pi.device), 1.0)]
        if topk:
            mu = prep.set_mu.reshape(prep.n, -1)
            coefs += [mu, torch.sign(pi - mu) * pi]
        owned = shard.owned(prep.set_ids)
        sums = set_rows_dot(self.weight, shard.local(prep.set_ids, 0), torch.stack(coefs).masked_fill(~owned, 0.0))
        head.set_pi, head.at_a = sums[0], sums[1]
        if topk:
            head.set_mu, head.set_sign_pi = sums[2], sums[3]


@dataclass
class Partial:
    """One rank's sums of a first sweep relative to its own row max m [n] (``finish_rows``'s arguments)."""

    m: Tensor
    total: Tensor
    rest: Tensor
    tail_sq: Tensor | None
    set_z: Tensor  # [n, C], 0 at the ids other ranks hold
    head_tail: Tensor | None  # [n, d]: the accumulators' own storage, finished in place (no second [n, d])

    @staticmethod
    def empty(acc: Accumulators) -> Partial:
        like = acc.lse
        return Partial(torch.full_like(like, -torch.inf), torch.zeros_like(like), torch.zeros_like(like),
                       None if acc.tail_sq is None else torch.zeros_like(like), torch.zeros_like(acc.set_logp),
                       None if acc.head is None else acc.head.tail)  # fmt: skip

    def store(self, sl: slice, m: Tensor, total: Tensor, rest: Tensor, tail_sq: Tensor | None, set_z: Tensor,
              head_tail: Tensor | None) -> None:  # fmt: skip
        """Keeps rows ``sl`` of this rank's sums."""
        self.m[sl], self.total[sl], self.rest[sl], self.set_z[sl] = m, total, rest, set_z
        if self.tail_sq is not None and tail_sq is not None:
            self.tail_sq[sl] = tail_sq
        if self.head_tail is not None and head_tail is not None:
            self.head_tail[sl] = head_tail

    def combine(self, shard: VocabShard, acc: Accumulators) -> None:
        """The whole vocabulary's sums into ``acc``: all-reduce MAX of m, then one all-reduce SUM of the sums
        rescaled to the global max (a rank whose row is all -inf contributes 0; NaN propagates to every rank).
        On one rank the same arithmetic with no collective."""
        m = shard.all_reduce(self.m.clone(), dist.ReduceOp.MAX)
        scale = torch.where(torch.isneginf(self.m), 0.0, (self.m - m).exp())
        parts = [self.total * scale, self.rest * scale] + ([] if self.tail_sq is None else [self.tail_sq * scale.square()])
        set_z, head_tail = self.set_z, None if self.head_tail is None else self.head_tail.mul_(scale[:, None])
        if shard.group is not None:  # one all-reduce of everything; on one rank the sums are already whole
            packed = shard.all_reduce(torch.cat([torch.stack(parts, 1), set_z] + ([] if head_tail is None else [head_tail]), 1))
            k, c = len(parts), set_z.shape[1]
            parts, set_z = list(packed[:, :k].unbind(1)), packed[:, k : k + c]
            head_tail = None if head_tail is None else packed[:, k + c :]
        tail_sq = parts[2] if self.tail_sq is not None else None
        acc.finish_rows(slice(None), m, parts[0], parts[1], tail_sq, set_z, head_tail)


def reduce_normalised(shard: VocabShard, acc: Accumulators) -> None:
    """Sums the second stage's partial full-μ reductions, exactpi sums and head sums over the shards, in one
    all-reduce (nothing on one rank)."""
    if shard.group is None:
        return
    parts = [x for x in (acc.full, acc.exactpi) if x is not None]
    if acc.head is not None:
        h = acc.head
        parts += [x for x in (h.mu, h.sign_pi, h.set_pi, h.at_a, h.set_mu, h.set_sign_pi) if x is not None]
    if not parts:
        return
    packed = shard.all_reduce(torch.cat([x.reshape(-1) for x in parts]))
    offset = 0
    for x in parts:
        x.copy_(packed[offset : offset + x.numel()].view_as(x))
        offset += x.numel()


__all__ = ["Accumulators", "Partial", "reduce_normalised"]
