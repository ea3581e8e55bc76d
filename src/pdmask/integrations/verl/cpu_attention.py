"""Packed-sequence attention for verl on the CPU, with Ulysses sequence parallelism (a stand-in for flash-attn).

verl's Ulysses sequence parallelism lives in its flash-attn patch (``_ulysses_flash_attention_forward``,
``verl/models/transformers/monkey_patch.py:87-155``, installed at ``:545-551``): an all-to-all that gathers the
sequence and scatters the heads, flash-attn's variable-length kernel over the sequences that the position ids
delimit, and the all-to-all back. flash-attn has no CPU build, so neither runs here. ``varlen_attention`` does the
same three steps with verl's own all-to-all (``verl.utils.ulysses``) and PyTorch's SDPA under a block-diagonal
causal mask, and is registered in transformers' attention registry (``AttentionInterface``) as
``pdmask_cpu_varlen``; a model chooses it with ``attn_implementation=pdmask_cpu_varlen`` (in verl's trainer
``+actor_rollout_ref.model.override_config.attn_implementation=pdmask_cpu_varlen``). It materialises the
[S, S] mask: for test models, not for long sequences.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

#: ``attn_implementation`` of ``varlen_attention``.
ATTENTION = "pdmask_cpu_varlen"
#: Attention arguments of transformers' models that ``varlen_attention`` does not implement (refused when set).
UNSUPPORTED = ("sliding_window", "softcap", "s_aux")


def packed_causal_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """[B, S] position ids of packed sequences (each starts at 0) → bool [B, 1, S, S]: i sees j ≤ i of its own sequence."""
    seq = (position_ids == 0).cumsum(-1)
    same = seq.unsqueeze(-1) == seq.unsqueeze(-2)
    return (same & torch.ones_like(same).tril()).unsqueeze(1)


def varlen_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    position_ids: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Causal attention within packed sequences: q [B, H, S/sp, d], k, v [B, Hk, S/sp, d] → [B, S/sp, H, d].

    The position ids [B, S/sp] alone delimit the sequences, each starting at 0 (the padding-free layout verl
    trains on; verl's Ulysses padding starts at 0 too): transformers hands an attention outside its mask registry
    no mask. Under Ulysses (verl's group of size sp > 1) each rank holds S/sp positions and all heads before the
    all-to-all.
    """
    from verl.utils.ulysses import (
        gather_heads_scatter_seq,
        gather_seq_scatter_heads,
        get_ulysses_sequence_parallel_group,
        get_ulysses_sequence_parallel_world_size,
    )

    if position_ids is None:
        raise ValueError(f"attn_implementation={ATTENTION} needs position_ids: it delimits packed sequences by them")
    unsupported = [name for name in UNSUPPORTED if kwargs.get(name) is not None]
    if unsupported:
        raise ValueError(
            f"attn_implementation={ATTENTION} computes plain causal attention; this model asks for "
            f"{', '.join(unsupported)}: use a model without them for verl's CPU runs."
        )
    sp = get_ulysses_sequence_parallel_world_size()
    if sp > 1:
        # As verl's flash-attn patch: kv heads repeated up to sp so that each rank keeps at least one.
        repeats = max(sp // key.size(1), 1)
        key, value = key.repeat_interleave(repeats, dim=1), value.repeat_interleave(repeats, dim=1)
        query, key, value = (gather_seq_scatter_heads(t, seq_dim=2, head_dim=1) for t in (query, key, value))
        parts = [torch.empty_like(position_ids) for _ in range(sp)]
        torch.distributed.all_gather(parts, position_ids, group=get_ulysses_sequence_parallel_group())
        position_ids = torch.cat(parts, dim=-1)
    out = F.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=packed_causal_mask(position_ids),
        dropout_p=dropout if module.training else 0.0,
        scale=scaling,
        enable_gqa=key.size(1) != query.size(1),
    )
    if sp > 1:
        out = gather_heads_scatter_seq(out, seq_dim=2, head_dim=1)
    return out.transpose(1, 2).contiguous(), None


def register_cpu_attention() -> None:
    """Puts ``varlen_attention`` in transformers' attention registry under ``ATTENTION`` (idempotent)."""
    AttentionInterface.register(ATTENTION, varlen_attention)


__all__ = ["ATTENTION", "UNSUPPORTED", "packed_causal_mask", "register_cpu_attention", "varlen_attention"]
