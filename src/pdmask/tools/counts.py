"""Host-device syncs and kernel launches of a call, counted on the CPU (the same counts a GPU would see).

A sync is an op whose result the host must read before it can go on: ``.item()``, ``bool(tensor)``,
``int``/``float`` of a tensor, ``.tolist()``, ``nonzero``, boolean-mask indexing and ``masked_select``
(their output size depends on the values). A launch is an op that runs a kernel on the device: every
aten op the dispatcher reaches below autograd, except those that only make a view or read metadata.
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

#: Ops whose output size or value the host reads (on CUDA each waits for the device).
SYNC_OPS = frozenset({"_local_scalar_dense", "nonzero", "masked_select", "is_nonzero", "equal", "unique", "_unique2"})
#: Ops that make a view, read metadata or allocate without writing: no kernel runs.
NO_KERNEL_OPS = frozenset({
    "view", "_unsafe_view", "reshape", "as_strided", "slice", "select", "expand", "unsqueeze", "squeeze", "t",
    "transpose", "permute", "alias", "detach", "empty", "empty_like", "empty_strided", "new_empty", "split",
    "unbind", "diagonal", "view_as", "lift_fresh", "_reshape_alias", "sym_size", "sym_stride", "sym_numel",
    "is_same_size", "resize_", "set_", "_to_copy_meta",
})


def _short(func: Any) -> str:
    return func._schema.name.split("::")[-1]


class _Counting(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.syncs: Counter[str] = Counter()
        self.launches: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = _short(func)
        if name in SYNC_OPS:
            self.syncs[name] += 1
        elif name == "index" and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] if i is not None):
            self.syncs["index(bool)"] += 1  # boolean-mask indexing: the output size is the mask's count
        if name not in NO_KERNEL_OPS and name not in SYNC_OPS:
            self.launches[name] += 1
        return func(*args, **(kwargs or {}))


@contextmanager
def counting() -> Iterator[_Counting]:
    """Counts syncs and launches of everything run inside (``.tolist()`` included, which bypasses the dispatcher)."""
    mode = _Counting()
    original = torch.Tensor.tolist

    def tolist(self: torch.Tensor) -> Any:
        mode.syncs["tolist"] += 1
        return original(self)

    torch.Tensor.tolist = tolist  # type: ignore[method-assign]
    try:
        with mode:
            yield mode
    finally:
        torch.Tensor.tolist = original  # type: ignore[method-assign]


def profiled_launches(fn: Callable[[], object]) -> int:
    """Launches of one call of ``fn`` by the torch profiler: its leaf aten ops (no aten op below them) that
    run a kernel, the count a GPU trace of the same call would show."""
    from torch.profiler import ProfilerActivity, profile

    with quiet_stderr(), profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    leaves = 0
    for e in prof.events():
        name = e.name.removeprefix("aten::")
        if not e.name.startswith("aten::") or name in NO_KERNEL_OPS or name in SYNC_OPS:
            continue
        if not any(child.name.startswith("aten::") for child in e.cpu_children):
            leaves += 1
    return leaves


@contextmanager
def quiet_stderr() -> Iterator[None]:
    """Silences the profiler's start/stop lines, which its C++ side writes straight to file descriptor 2."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as devnull:
        os.dup2(devnull.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def count(fn: Callable[[], object]) -> tuple[int, int]:
    """(syncs, launches) of one call of ``fn``."""
    with counting() as c:
        fn()
    return sum(c.syncs.values()), sum(c.launches.values())


__all__ = ["NO_KERNEL_OPS", "SYNC_OPS", "count", "counting", "profiled_launches", "quiet_stderr"]
