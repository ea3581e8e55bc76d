"""What the analysis needs of the policy: its final hidden states, its unembedding, logits in float64 from
them, and the gradient of the steps' surrogate, each in micro-batches whose logits stay within a budget."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from pdmask import policy_loss

if TYPE_CHECKING:
    from pdmask.lab.engine import RolloutBatch

#: The surrogate of the optimizer steps: truncated IS without a trust region, so every token moves.
STEP_METHOD = "pg_is"
#: Logits of a forward pass held at once (elements): rows per micro-batch = this / (length × V).
LOGIT_BUDGET = 1 << 24


@contextmanager
def _captured_hidden(head: nn.Module) -> Iterator[list[Tensor]]:
    """Records the input of the output layer (the final hidden states) during forward passes."""
    seen: list[Tensor] = []
    handle = head.register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
    try:
        yield seen
    finally:
        handle.remove()


def unembedding(policy: nn.Module) -> tuple[nn.Module, Tensor, Tensor | None]:
    """The output layer ``policy.lm_head`` with its weight W [V, d] and bias [V] (or None)."""
    head = policy.get_submodule("lm_head")
    weight, bias = head.weight, getattr(head, "bias", None)
    if not isinstance(weight, Tensor):
        raise TypeError("policy.lm_head.weight must be the unembedding matrix [V, d].")
    return head, weight, bias if isinstance(bias, Tensor) else None


def _row_chunks(batch: RolloutBatch, vocab: int) -> list[Tensor]:
    """Row indices of micro-batches whose logits [rows, length, V] stay within LOGIT_BUDGET elements."""
    n, length = batch.input_ids.shape
    return list(torch.arange(n).split(max(1, LOGIT_BUDGET // (length * vocab))))


def accumulate_step_grad(policy: nn.Module, batch: RolloutBatch, adv: Tensor, temperature: float) -> None:
    """Adds ∇ of the minibatch's token-mean surrogate to ``.grad``, one micro-batch at a time."""
    total = batch.response_mask.sum().clamp(min=1)
    for idx in _row_chunks(batch, policy.vocab_size):
        sub = batch.select(idx)
        logits = sub.response_logits(policy) / temperature
        loss, _ = policy_loss(STEP_METHOD, logits, sub.tokens, sub.rollout_logprobs(), adv[idx], sub.response_mask)
        # Weighted by its share of the tokens, the micro-batches' token means add up to the minibatch's.
        (loss * sub.response_mask.sum() / total).backward()


@torch.no_grad()
def final_hidden(policy: nn.Module, batch: RolloutBatch) -> Tensor:
    """Final hidden states h [N, R, d] (fp32) at the positions that predict the response."""
    head, _, _ = unembedding(policy)
    parts = []
    for idx in _row_chunks(batch, policy.vocab_size):
        with _captured_hidden(head) as seen:
            batch.select(idx).response_logits(policy)
        parts.append(seen[-1][:, :-1])  # the output layer's input at the positions response_logits keeps
    return torch.cat(parts)


def head_logits(h: Tensor, weight: Tensor, bias: Tensor | None, temperature: float) -> Tensor:
    """z = (h Wᵀ + b)/T [n, V] in float64 (weight and bias already float64)."""
    z = h.double() @ weight.T
    return (z if bias is None else z + bias) / temperature

