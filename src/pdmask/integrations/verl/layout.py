"""Where the engine's logits sit in the micro-batch: μ's rows laid out on this rank as the engine lays out its sequence.

``PDMLoss``'s logits processor gets this rank's logits only. Each per-token row it needs (the next token,
log μ(a), μ's top K, the response mask) is built on verl's whole packed sequence [N, ...] (every rank of a
sequence-parallel group holds the whole micro-batch) and cut here the way the engine cut its input:
- verl's FSDP engine: the packed sequence [1, N]; under Ulysses sequence parallelism padded to a multiple of
  the group size and sliced by rank (verl's ``slice_input_tensor``, as its top-K distillation slices the
  teacher's rows), [1, ⌈N/sp⌉];
- verl's Megatron engine (``data_format`` "thd" or "bshd"): per-sequence alignment padding and the
  context-parallel split of verl's own ``preprocess_thd_engine``/``preprocess_bshd_engine`` (the functions
  that lay out the model's input), [1, N'/cp] or [B, S/cp].
The engine gathers the processor's per-token outputs back along the same layout.
"""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDict
from torch import Tensor

#: verl's Megatron engine's ``data_format`` values: packed sequences or padded batch-major ones.
MEGATRON_FORMATS = ("thd", "bshd")


def local_rows(packed: Tensor, data: TensorDict, data_format: str | None) -> Tensor:
    """This rank's part of per-position rows ``packed`` [N, ...] on verl's packed sequence, shaped like the logits'
    leading dimensions: [1, L, ...] (FSDP, Ulysses; Megatron thd) or [B, S/cp, ...] (Megatron bshd)."""
    if data_format is None:
        from verl.utils.ulysses import get_ulysses_sequence_parallel_world_size, slice_input_tensor

        rows = packed.unsqueeze(0)
        return slice_input_tensor(rows, dim=1) if get_ulysses_sequence_parallel_world_size() > 1 else rows
    if data_format not in MEGATRON_FORMATS:
        raise ValueError(f"data_format must be one of {MEGATRON_FORMATS} (verl's Megatron engine), got {data_format!r}.")
    from verl.models.mcore.util import preprocess_bshd_engine, preprocess_thd_engine

    nested = torch.nested.nested_tensor_from_jagged(packed, data["input_ids"].offsets())
    preprocess = preprocess_thd_engine if data_format == "thd" else preprocess_bshd_engine
    return preprocess(nested, pre_process=True)[0]


def tensor_parallel_group(data_format: str | None) -> Any:
    """The process group over which the logits' vocabulary is split: Megatron's tensor-parallel group when it has
    more than one rank, else None (verl's FSDP engine gathers a tensor-parallel vocabulary before the processor)."""
    if data_format is None:
        return None
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_group() if parallel_state.get_tensor_model_parallel_world_size() > 1 else None


__all__ = ["MEGATRON_FORMATS", "local_rows", "tensor_parallel_group"]
