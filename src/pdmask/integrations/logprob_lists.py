"""An inference engine's per-position log-prob entries -> pdmask's ``Completions`` (no engine import).

vLLM (and SGLang) return, at each generated position, the top L >= K token ids with their log-probs
plus the sampled token: K entries when the sampled token is among the top K, K + 1 when it is not.
``completions_from_lists`` turns such entries into log μ(a) [N, R] and μ's top K [N, R, K];
``completion_entries`` reads them off one vLLM ``CompletionOutput``. Both run without vLLM
installed, so a trainer's environment (verl's, TRL's) converts what an engine process sent it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from pdmask.rollout import MASS_TOL, RolloutLogprobs

#: The only vLLM ``logprobs_mode`` whose log-probs are those of the distribution the engine samples from.
PROCESSED = "processed_logprobs"
#: vLLM's default cap on log-probs per position (``ModelConfig.max_logprobs``), which an engine started
#: without ``max_logprobs`` keeps (TRL's colocated one does).
VLLM_MAX_LOGPROBS = 20


@dataclass(frozen=True)
class Completions:
    """N sampled completions, right-padded to the longest, R positions."""

    tokens: Tensor  # [N, R] int64; 0 beyond each completion's end
    rollout: RolloutLogprobs  # log μ(a) [N, R] and μ's top K [N, R, K], float32; neutral beyond the end
    response_mask: Tensor  # [N, R] bool: the completion's tokens


#: How to fix the engine's log-prob mode when pdmask builds the engine's arguments.
ENGINE_FIX = f"start the engine with logprobs_mode={PROCESSED!r} (pdmask.integrations.vllm.engine_kwargs)"


def check_logprobs_mode(logprobs_mode: str | None, temperature: float | None, fix: str = ENGINE_FIX) -> None:
    """Refuses an engine ``logprobs_mode`` whose values are not μ = the sampler's distribution at ``temperature``;
    ``fix`` is the remedy the error names (the engine argument, or a host's config override)."""
    if logprobs_mode is None:
        raise ValueError(f"logprobs_mode is unset, so vLLM returns its default raw_logprobs: {fix}.")
    if logprobs_mode.endswith("_logits"):
        raise ValueError(f"the engine returns {logprobs_mode}, not log-probabilities: {fix}.")
    if logprobs_mode == "raw_logprobs" and temperature != 1.0:
        raise ValueError(
            f"the engine returns raw_logprobs, taken before the temperature {temperature}, so they are μ only at "
            f"temperature 1 (pass temperature=1.0 if so): {fix}."
        )
    if logprobs_mode not in ("raw_logprobs", PROCESSED):
        raise ValueError(f"unknown logprobs_mode {logprobs_mode!r}; pdmask reads {PROCESSED!r}: {fix}.")


def completion_entries(
    completion: Any, where: str = "the completion"
) -> tuple[list[int], list[list[int]], list[list[float]], list[int | None]]:
    """One vLLM ``CompletionOutput`` (``token_ids``, ``logprobs``: one {id: Logprob} per position) -> the sampled
    ids [R], entry ids [R][L], entry log-probs [R][L] and vLLM's 1-based rank of the sampled token [R]."""
    if completion.logprobs is None:
        raise ValueError(
            f"{where} has no log-probs: generate with logprobs=K (pdmask.integrations.vllm.sampling_params(K))."
        )
    ids, logps, ranks = [], [], []
    for token, position in zip(completion.token_ids, completion.logprobs, strict=True):
        ids.append([int(i) for i in position])
        logps.append([entry.logprob for entry in position.values()])
        ranks.append(position[token].rank if token in position else None)
    return [int(t) for t in completion.token_ids], ids, logps, ranks


def completions_from_lists(
    token_ids: Sequence[Sequence[int]],
    entry_ids: Sequence[Sequence[Sequence[int]]],
    entry_logps: Sequence[Sequence[Sequence[float | None]]],
    top_k: int,
    *,
    sampled_ranks: Sequence[Sequence[int | None]] | None = None,
) -> Completions:
    """``Completions`` from plain lists: completion n's tokens ``token_ids[n]`` [R_n] and, at position t, the
    engine's entries ``entry_ids[n][t]`` with log-probs ``entry_logps[n][t]`` (top L >= K plus the sampled token).

    ``sampled_ranks[n][t]`` (vLLM's 1-based rank of the sampled token, optional) tells a list of K entries
    that holds a token ranked below K (the request asked for fewer than K) from one that holds the top K.
    """
    check_k(top_k)
    if not len(token_ids) == len(entry_ids) == len(entry_logps):
        raise ValueError(
            f"token_ids, entry_ids and entry_logps must list the same completions; got {len(token_ids)}, "
            f"{len(entry_ids)} and {len(entry_logps)}."
        )
    if not token_ids:
        raise ValueError("no completions: outputs must hold at least one completion.")
    width = max(len(t) for t in token_ids)
    n = len(token_ids)
    tokens = torch.zeros(n, width, dtype=torch.long)
    mask = torch.zeros(n, width, dtype=torch.bool)
    logp = torch.zeros(n, width)
    topk_ids = torch.zeros(n, width, top_k, dtype=torch.long)
    topk_logp = torch.zeros(n, width, top_k)
    for i, seq in enumerate(token_ids):
        if not len(seq) == len(entry_ids[i]) == len(entry_logps[i]):
            raise ValueError(
                f"completion {i} has {len(seq)} tokens but {len(entry_ids[i])} entry lists and "
                f"{len(entry_logps[i])} log-prob lists; give one per token."
            )
        for t, token in enumerate(seq):
            rank = None if sampled_ranks is None else sampled_ranks[i][t]
            where = f"completion {i}, position {t}"
            logp[i, t], ids, values = _position(int(token), entry_ids[i][t], entry_logps[i][t], top_k, rank, where)
            topk_ids[i, t], topk_logp[i, t] = torch.tensor(ids), torch.tensor(values)
            tokens[i, t] = int(token)
        mask[i, : len(seq)] = True
    rollout = RolloutLogprobs(logp, topk_ids=topk_ids, topk_logp=topk_logp).masked(mask)
    return Completions(tokens=tokens, rollout=rollout, response_mask=mask)


def _position(
    token: int, ids: Sequence[int], values: Sequence[float | None], k: int, rank: int | None, where: str
) -> tuple[float, list[int], list[float]]:
    """One position: log μ(a) and μ's top K (ids, log-probs, descending) from the engine's entries."""
    if len(ids) != len(values):
        raise ValueError(f"{where}: {len(ids)} entry ids but {len(values)} log-probs.")
    entries: Mapping[int, float] = dict(zip((int(i) for i in ids), (_finite_or_neg_inf(v, where) for v in values)))
    if token not in entries:
        raise ValueError(f"{where}: the sampled token {token} is not among the entries; pass vLLM's entries unfiltered.")
    # With the rank, K entries that hold a token ranked below K show a request for K - 1; without it they pass.
    needed = k + 1 if rank is not None and rank > k else k
    if len(entries) < needed:
        raise ValueError(
            f"{where}: {len(entries)} log-prob entries with the sampled token ranked {rank}: the request asked for "
            f"fewer than K = {k}; generate with logprobs=K (pdmask.integrations.vllm.sampling_params({k}))."
        )
    top = sorted(entries.items(), key=lambda item: -item[1])[:k]
    mass = sum(math.exp(v) for _, v in top) + (0.0 if token in dict(top) else math.exp(entries[token]))
    if mass > 1 + MASS_TOL:
        raise ValueError(
            f"{where}: the entries' probabilities sum to {mass:.4f} > 1, so they are logits, not log-probs: "
            f"{ENGINE_FIX}."
        )
    return entries[token], [i for i, _ in top], [v for _, v in top]


def _finite_or_neg_inf(value: float | None, where: str) -> float:
    if value is None or math.isnan(value) or value == math.inf:
        raise ValueError(f"{where}: a log-prob entry is {value}; the engine returned no usable log-prob there.")
    return float(value)


def check_k(top_k: int) -> None:
    """Refuses a K that is not an int >= 1."""
    if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1:
        raise ValueError(f"top_k must be an int >= 1 (K, the top log-probs per position), got {top_k!r}.")


__all__ = [
    "ENGINE_FIX",
    "PROCESSED",
    "VLLM_MAX_LOGPROBS",
    "Completions",
    "check_k",
    "check_logprobs_mode",
    "completion_entries",
    "completions_from_lists",
]
