"""Row slices: how the passes and the masks bound their temporaries."""

from __future__ import annotations


def row_slices(n: int, step: int) -> list[slice]:
    """[0, n) in consecutive slices of at most ``step`` rows."""
    return [slice(start, min(start + step, n)) for start in range(0, n, step)]


__all__ = ["row_slices"]
