"""μ at every completion token, recorded on the rollout side: a forward hook on the policy during TRL's
transformers ``generate`` (``RolloutRecorder``), or a wrapper of TRL's vLLM generation (``VLLMRecorder``)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from pdmask.integrations.logprob_lists import check_logprobs_mode, completions_from_lists


class RolloutRecorder:
    """Forward hook on the policy recording μ = softmax(z/τ) at each step of transformers' ``generate``.

    Step t's logits give μ for completion token t; step t+1's input is the token sampled at step t, which
    gives log μ(a_t). TRL's fused scoring forward returns no logits and is skipped.
    """

    def __init__(self, temperature: float, top_k: int, *, full: bool) -> None:
        self.temperature, self.top_k, self.full = temperature, top_k, full
        self._rows: list[tuple[Tensor, ...]] = []  # per step: (top-K log μ, top-K ids) or (log μ,), [B, ·]
        self._sampled: list[Tensor] = []  # per step but the last: log μ(a) [B]
        self._fed: list[Tensor] = []  # per step but the last: a [B]
        self._last: Tensor | None = None  # the latest step's log μ [B, V]

    def __call__(self, module: torch.nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
        logits = getattr(output, "logits", None)
        if logits is None:
            return
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        if input_ids is None:
            raise NotImplementedError("PDMTrainer records generation from input_ids; inputs_embeds is not supported.")
        with torch.no_grad():
            logp = torch.log_softmax(logits[:, -1].float() / self.temperature, dim=-1)
            if self._last is not None:
                fed = input_ids[:, -1]
                self._fed.append(fed)
                self._sampled.append(self._last.gather(-1, fed.unsqueeze(-1)).squeeze(-1))
            self._last = logp
            self._rows.append((logp,) if self.full else tuple(logp.topk(min(self.top_k, logp.shape[-1]), dim=-1)))

    def finish(self, completion_ids: Tensor, completion_mask: Tensor) -> dict[str, Tensor]:
        """The recorded μ aligned to TRL's completions [B, T]; columns beyond the last step get a uniform μ."""
        if self._last is None:
            raise RuntimeError("no generation step of the policy was recorded; PDMTrainer needs TRL's generate path.")
        steps, width = len(self._rows), completion_ids.shape[1]
        if steps > width:
            raise RuntimeError(f"recorded {steps} generation steps for completions of length {width}.")
        # A token TRL kept that differs from the one generate fed back means the two are misaligned.
        if self._fed:
            fed = torch.stack(self._fed, 1)
            kept = completion_mask[:, : steps - 1].bool()
            if (fed != completion_ids[:, : steps - 1])[kept].any():
                raise RuntimeError("generation steps do not line up with TRL's completion tokens.")
        last = self._last.gather(-1, completion_ids[:, steps - 1 : steps]).squeeze(-1)
        logp = torch.stack([*self._sampled, last], 1)
        columns = [torch.stack(c, 1) for c in zip(*self._rows)]
        pad = width - steps
        vocab = self._last.shape[-1]
        uniform = -math.log(vocab)
        logp = torch.nn.functional.pad(logp, (0, pad), value=uniform)
        if self.full:
            return {"pdm_rollout_logps": logp, "pdm_full_logps": _pad_steps(columns[0], pad, uniform)}
        top_logp, ids = columns
        filler = torch.arange(ids.shape[-1], device=ids.device).expand(ids.shape[0], pad, -1)
        return {
            "pdm_rollout_logps": logp,
            "pdm_topk_ids": torch.cat([ids, filler], 1),
            "pdm_topk_logps": _pad_steps(top_logp, pad, uniform),
        }


class VLLMRecorder:
    """Wraps TRL's ``VLLMGeneration.generate`` so that it asks for ``logprobs=K`` and keeps μ's top K.

    TRL keeps the first entry of each position's log-probs as the sampled token's (right for
    ``logprobs=0`` only): the wrapper hands TRL log μ(a) there, read by ``completions_from_lists``.
    """

    def __init__(self, generation: Any, top_k: int, temperature: float, mode: str) -> None:
        if mode == "server" and getattr(generation, "vllm_client", None) is not None:
            info = generation.vllm_client.get_server_info()
            check_logprobs_mode(info["model_config"]["logprobs_mode"], temperature)
        self._convert, self.top_k = completions_from_lists, top_k
        self.pending: list[Any] = []  # Completions of the generation calls of one batch
        self._generate = generation.generate
        generation.logprobs = top_k
        generation.generate = self

    def __call__(self, *args: Any, **kwargs: Any) -> tuple[Any, Any, list, None]:
        prompt_ids, completion_ids, logprobs, token_ids = self._generate(*args, **kwargs)
        if logprobs is None or token_ids is None:
            raise RuntimeError("TRL's vLLM generation returned no log-probs; PDMTrainer needs logprobs=K from vLLM.")
        done = self._convert(completion_ids, token_ids, logprobs, self.top_k)
        self.pending.append(done)
        sampled = [[[x] for x in row[: len(ids)].tolist()] for row, ids in zip(done.rollout.logp, completion_ids)]
        return prompt_ids, completion_ids, sampled, None

    def finish(self, completion_ids: Tensor, completion_mask: Tensor) -> dict[str, Tensor]:
        """The recorded μ aligned to TRL's completions [B, T]."""
        if len(self.pending) != 1:
            raise RuntimeError(f"expected one vLLM generation per batch, recorded {len(self.pending)}.")
        done = self.pending.pop()
        (rows, steps), width = done.tokens.shape, completion_ids.shape[1]
        if rows != completion_ids.shape[0] or steps > width:
            raise RuntimeError(f"vLLM returned {rows} x {steps} tokens for TRL's completions {tuple(completion_ids.shape)}.")
        kept = completion_mask[:, :steps].bool().cpu() & done.response_mask
        if (done.tokens != completion_ids[:, :steps].cpu())[kept].any():
            raise RuntimeError("vLLM's tokens do not line up with TRL's completion tokens.")
        pad, device = width - steps, completion_ids.device
        return {  # columns past vLLM's longest completion are padding, neutralised before use
            "pdm_rollout_logps": torch.nn.functional.pad(done.rollout.logp, (0, pad)).to(device),
            "pdm_topk_ids": _pad_steps(done.rollout.topk_ids, pad, 0).to(device),
            "pdm_topk_logps": _pad_steps(done.rollout.topk_logp, pad, 0.0).to(device),
        }


def _pad_steps(x: Tensor, pad: int, value: float) -> Tensor:
    """Pads [B, steps, C] to [B, steps + pad, C] with ``value``."""
    return torch.nn.functional.pad(x, (0, 0, 0, pad), value=value)


__all__ = ["RolloutRecorder", "VLLMRecorder"]
