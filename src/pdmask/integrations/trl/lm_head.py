"""The LM head on the loss side: its whole weight under ZeRO-3 or FSDP2, its logits at a few ids per
position, and what TRL's scoring forward computes besides log π(a) (‖π‖², the last hidden states)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, cast

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor
from transformers import PreTrainedModel
from trl.trainer.utils import maybe_gather_lm_head_ctx

#: Memory budget for the float32 temporaries of one chunk of LM-head rows.
_CHUNK_BYTES = 64 << 20


@contextmanager
def capture_scoring(policy: PreTrainedModel, *, hidden: bool) -> Iterator[dict[str, list[Tensor]]]:
    """Collects, per forward of TRL's scoring loop, the fused head's log Σπ² and the backbone's last hidden state."""
    caught: dict[str, list[Tensor]] = {"log_sum_sq_probs": [], "hidden": []}

    def on_policy(module: torch.nn.Module, args: tuple, output: Any) -> None:
        if getattr(output, "log_sum_sq_probs", None) is not None:
            caught["log_sum_sq_probs"].append(output.log_sum_sq_probs.detach())

    def on_backbone(module: torch.nn.Module, args: tuple, output: Any) -> None:
        caught["hidden"].append(output.last_hidden_state.detach())

    handles = [policy.register_forward_hook(on_policy)]
    if hidden:
        handles.append(cast(torch.nn.Module, policy.base_model).register_forward_hook(on_backbone))
    try:
        yield caught
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def head_weights(head: torch.nn.Linear) -> Iterator[tuple[Tensor, Tensor | None]]:
    """The LM head's whole weight [V, d] and bias [V]: gathered under ZeRO-3 (TRL's context) or FSDP2 (DTensor)."""
    params = cast(list[torch.nn.Parameter], [head.weight, head.bias])
    with torch.no_grad(), maybe_gather_lm_head_ctx(*params):
        weight: Tensor = head.weight
        bias: Tensor | None = head.bias
        if isinstance(weight, DTensor):
            weight = weight.full_tensor()
            bias = bias.full_tensor() if isinstance(bias, DTensor) else bias
        yield weight, bias


def head_logits_at(head: torch.nn.Linear, hidden: Tensor, ids: Tensor) -> Tensor:
    """Logits [..., S] = h·W[ids] (+ b[ids]) in float32 for hidden [..., d] and ids [..., S], in chunks (no grad)."""
    flat_h, flat_ids = hidden.reshape(-1, hidden.shape[-1]), ids.reshape(-1, ids.shape[-1])
    rows = max(1, _CHUNK_BYTES // (4 * flat_ids.shape[1] * flat_h.shape[1]))
    out = torch.empty(flat_ids.shape, dtype=torch.float32, device=hidden.device)
    with head_weights(head) as (weight, bias):
        for start in range(0, flat_h.shape[0], rows):
            sl = slice(start, start + rows)
            rows_w = weight[flat_ids[sl]].float()  # [rows, S, d]
            out[sl] = torch.linalg.vecdot(rows_w, flat_h[sl].float().unsqueeze(1))
            if bias is not None:
                out[sl] += bias[flat_ids[sl]].float()
    return out.reshape(ids.shape)


__all__ = ["capture_scoring", "head_logits_at", "head_weights"]
