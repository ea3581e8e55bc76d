"""vLLM's top-K log-probs as pdmask's ``RolloutLogprobs`` (``pip install pdmask[vllm]``).

The rollout side of the contract, for any training loop that samples with vLLM:

- ``engine_kwargs(top_k)`` and ``sampling_params(top_k, temperature)`` build the arguments pdmask
  needs: ``logprobs_mode="processed_logprobs"`` (vLLM's default, raw log-probs, is taken before the
  temperature and the top-k/top-p filters, while μ is the distribution actually sampled from),
  ``max_logprobs >= K`` (the engine's cap) and ``logprobs=K`` per request.
- ``rollout_from_outputs(outputs, top_k)`` turns ``LLM.generate``'s ``RequestOutput`` list into
  ``Completions``: tokens [N, R], a ``RolloutLogprobs`` (log μ(a) [N, R], top-K [N, R, K]) and a
  response mask [N, R], N = every completion of every request, in request then sample order.
- ``completions_from_lists`` does the same from plain per-position lists (what TRL and verl hold).

vLLM's entries at one position are the top K plus the sampled token: K of them when the sampled
token is among the top K, K + 1 when it is not. Both are handled; fewer than K are refused.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from pdmask.integrations._version import in_range
from pdmask.rollout import MASS_TOL, RolloutLogprobs

#: vLLM releases this integration was written and tested against: [VLLM_MIN, VLLM_MAX).
VLLM_MIN, VLLM_MAX = "0.32", "0.33"
#: The only ``logprobs_mode`` whose log-probs are those of the distribution vLLM samples from.
PROCESSED = "processed_logprobs"
#: Sampling options that reshape μ away from softmax(z / temperature), the trainer's π.
_FILTERS = ("top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
_NEUTRAL = {"top_k": (0, -1, None), "top_p": (1.0, None), "min_p": (0.0, None), "repetition_penalty": (1.0, None)}


def check_vllm_version(version: str) -> None:
    """Raises ImportError unless ``version`` lies in [VLLM_MIN, VLLM_MAX)."""
    if not in_range(version, VLLM_MIN, VLLM_MAX):
        raise ImportError(
            f"pdmask.integrations.vllm supports vLLM >={VLLM_MIN},<{VLLM_MAX} but vLLM {version} is installed: "
            "install a supported one with `pip install 'pdmask[vllm]'`."
        )


try:
    import vllm
except ImportError as err:  # pragma: no cover - exercised only without the extra
    raise ImportError("pdmask.integrations.vllm needs vLLM: `pip install 'pdmask[vllm]'`.") from err
check_vllm_version(vllm.__version__)

from vllm import RequestOutput, SamplingParams


@dataclass(frozen=True)
class Completions:
    """N sampled completions, right-padded to the longest, R positions."""

    tokens: Tensor  # [N, R] int64; 0 beyond each completion's end
    rollout: RolloutLogprobs  # log μ(a) [N, R] and μ's top K [N, R, K], float32; neutral beyond the end
    response_mask: Tensor  # [N, R] bool: the completion's tokens


def engine_kwargs(top_k: int = 20, **kwargs: Any) -> dict[str, Any]:
    """Keyword arguments for ``vllm.LLM`` (or ``AsyncEngineArgs``) that return μ's top K: processed
    log-probs and ``max_logprobs >= top_k``; ``kwargs`` pass through, and a conflicting one is refused."""
    _check_k(top_k)
    if kwargs.get("logprobs_mode", PROCESSED) != PROCESSED:
        raise ValueError(
            f"logprobs_mode={kwargs['logprobs_mode']!r} returns log-probs of another distribution than the one sampled "
            f"from: leave it out (pdmask sets {PROCESSED!r})."
        )
    max_logprobs = kwargs.get("max_logprobs", top_k)
    if max_logprobs != -1 and max_logprobs < top_k:
        raise ValueError(f"max_logprobs={max_logprobs} caps the engine below K = {top_k}: leave it out or raise it.")
    return {**kwargs, "logprobs_mode": PROCESSED, "max_logprobs": max_logprobs}


def sampling_params(top_k: int = 20, temperature: float = 1.0, **kwargs: Any) -> SamplingParams:
    """``SamplingParams`` with ``logprobs=top_k`` at ``temperature``; ``kwargs`` pass through (n, max_tokens, seed…).

    With processed log-probs μ is the sampler's distribution after the temperature and any filter;
    filters (top_k, top_p, min_p, penalties) make it differ from softmax(z / temperature), which is
    what a trainer computes as π, so they warn.
    """
    _check_k(top_k)
    if "logprobs" in kwargs:
        raise ValueError("logprobs is set from top_k: pass top_k=K, not logprobs.")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 (greedy decoding has no μ to train on), got {temperature}.")
    reshaping = [k for k in _FILTERS if k in kwargs and kwargs[k] not in _NEUTRAL.get(k, (0.0, None))]
    if reshaping:
        warnings.warn(
            f"{', '.join(reshaping)} reshape the sampler's distribution μ away from softmax(logits / temperature), the "
            "trainer's π: the mask will measure that difference as mismatch.",
            stacklevel=2,
        )
    return SamplingParams(temperature=temperature, logprobs=top_k, **kwargs)


def rollout_from_outputs(
    outputs: Sequence[RequestOutput],
    top_k: int,
    *,
    logprobs_mode: str | None = None,
    temperature: float | None = None,
) -> Completions:
    """``LLM.generate``'s outputs (any ``n`` per request) -> ``Completions`` (request order, then sample order).

    ``logprobs_mode`` (the engine's, e.g. ``llm.llm_engine.model_config.logprobs_mode``), when given, is
    checked with ``temperature`` (the requests'): raw log-probs are μ only at temperature 1.
    """
    if logprobs_mode is not None:
        check_logprobs_mode(logprobs_mode, temperature)
    token_ids: list[Sequence[int]] = []
    entry_ids: list[list[list[int]]] = []
    entry_logps: list[list[list[float]]] = []
    ranks: list[list[int | None]] = []
    for i, request in enumerate(outputs):
        for j, completion in enumerate(request.outputs):
            if completion.logprobs is None:
                raise ValueError(
                    f"outputs[{i}].outputs[{j}] has no log-probs: generate with logprobs=K "
                    "(pdmask.integrations.vllm.sampling_params(K, temperature))."
                )
            ids, logps, seq_ranks = [], [], []
            for token, position in zip(completion.token_ids, completion.logprobs, strict=True):
                ids.append(list(position))
                logps.append([entry.logprob for entry in position.values()])
                seq_ranks.append(position[token].rank if token in position else None)
            token_ids.append(completion.token_ids)
            entry_ids.append(ids)
            entry_logps.append(logps)
            ranks.append(seq_ranks)
    return completions_from_lists(token_ids, entry_ids, entry_logps, top_k, sampled_ranks=ranks)


def check_logprobs_mode(logprobs_mode: str, temperature: float | None) -> None:
    """Refuses an engine ``logprobs_mode`` whose values are not μ = the sampler's distribution at ``temperature``."""
    if logprobs_mode.endswith("_logits"):
        raise ValueError(
            f"the engine returns {logprobs_mode}, not log-probabilities: start it with "
            f"logprobs_mode={PROCESSED!r} (pdmask.integrations.vllm.engine_kwargs)."
        )
    if logprobs_mode == "raw_logprobs" and temperature != 1.0:
        raise ValueError(
            f"the engine returns raw_logprobs, taken before the temperature {temperature}, so they are μ only at "
            f"temperature 1 (pass temperature=1.0 if so): start it with logprobs_mode={PROCESSED!r} "
            "(pdmask.integrations.vllm.engine_kwargs)."
        )
    if logprobs_mode not in ("raw_logprobs", PROCESSED):
        raise ValueError(f"unknown logprobs_mode {logprobs_mode!r}; pdmask reads {PROCESSED!r}.")


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
    _check_k(top_k)
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
            f"{where}: the entries' probabilities sum to {mass:.4f} > 1, so they are logits, not log-probs: start the "
            f"engine with logprobs_mode={PROCESSED!r} (pdmask.integrations.vllm.engine_kwargs)."
        )
    return entries[token], [i for i, _ in top], [v for _, v in top]


def _finite_or_neg_inf(value: float | None, where: str) -> float:
    if value is None or math.isnan(value) or value == math.inf:
        raise ValueError(f"{where}: a log-prob entry is {value}; the engine returned no usable log-prob there.")
    return float(value)


def _check_k(top_k: int) -> None:
    if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1:
        raise ValueError(f"top_k must be an int >= 1 (K, the top log-probs per position), got {top_k!r}.")


__all__ = [
    "PROCESSED",
    "VLLM_MAX",
    "VLLM_MIN",
    "Completions",
    "check_logprobs_mode",
    "check_vllm_version",
    "completions_from_lists",
    "engine_kwargs",
    "rollout_from_outputs",
    "sampling_params",
]
