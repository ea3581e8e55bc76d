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

import warnings
from collections.abc import Sequence
from typing import Any

from pdmask.integrations._version import SUPPORTED, in_range
from pdmask.integrations.logprob_lists import (
    PROCESSED,
    Completions,
    check_k,
    check_logprobs_mode,
    completion_entries,
    completions_from_lists,
)

#: vLLM releases this integration was written and tested against: [VLLM_MIN, VLLM_MAX).
VLLM_MIN, VLLM_MAX = SUPPORTED["vllm"]
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


def engine_kwargs(top_k: int = 20, **kwargs: Any) -> dict[str, Any]:
    """Keyword arguments for ``vllm.LLM`` (or ``AsyncEngineArgs``) that return μ's top K: processed
    log-probs and ``max_logprobs >= top_k``; ``kwargs`` pass through, and a conflicting one is refused."""
    check_k(top_k)
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
    check_k(top_k)
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
    token_ids, entry_ids, entry_logps, ranks = [], [], [], []
    for i, request in enumerate(outputs):
        for j, completion in enumerate(request.outputs):
            entries = completion_entries(completion, f"outputs[{i}].outputs[{j}]")
            for acc, value in zip((token_ids, entry_ids, entry_logps, ranks), entries, strict=True):
                acc.append(value)
    return completions_from_lists(token_ids, entry_ids, entry_logps, top_k, sampled_ranks=ranks)


class TopKCapture:
    """An async vLLM engine (``AsyncLLM``) whose requests return μ's top K to whoever serves them.

    Serving code that asks the engine for the sampled token's log-prob only (``logprobs=0``, as verl's
    rollout servers do) keeps working unchanged: ``generate`` raises every request that wants log-probs to
    ``logprobs=top_k`` (the sampled token's entry stays among them) and keeps each request's final
    ``RequestOutput`` until ``pop(request_id)``. Every other attribute is the engine's.
    """

    def __init__(self, engine: Any, top_k: int) -> None:
        check_k(top_k)
        self.engine, self.top_k = engine, top_k
        self._final: dict[str, RequestOutput] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    async def generate(self, prompt: Any, sampling_params: SamplingParams, request_id: str, **kwargs: Any) -> Any:
        """The engine's ``generate`` (an async iterator of ``RequestOutput``) with ``logprobs`` raised to K."""
        wants = sampling_params.logprobs is not None
        if wants and 0 <= sampling_params.logprobs < self.top_k:
            sampling_params = sampling_params.clone()
            sampling_params.logprobs = self.top_k
        async for output in self.engine.generate(prompt, sampling_params, request_id, **kwargs):
            if wants and output.finished:  # kept before it is handed on: a consumer may stop at the last output
                self._final[request_id] = output
            yield output

    def pop(self, request_id: str) -> RequestOutput | None:
        """The final output of a finished request (None if it asked for no log-probs or never finished), once."""
        return self._final.pop(request_id, None)


__all__ = [
    "PROCESSED",
    "VLLM_MAX",
    "VLLM_MIN",
    "Completions",
    "TopKCapture",
    "check_logprobs_mode",
    "check_vllm_version",
    "completions_from_lists",
    "engine_kwargs",
    "rollout_from_outputs",
    "sampling_params",
]
