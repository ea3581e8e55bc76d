"""Strict JSON for every file pdmask writes: undefined numbers (NaN, ±inf) become ``null``.

Python's ``json`` writes ``NaN``/``Infinity`` literals by default, which jq, JavaScript and other strict
parsers reject; ``allow_nan=False`` makes a missed case fail loudly instead of writing them.
"""

from __future__ import annotations

import json
import math
from typing import Any


def finite_or_none(obj: Any) -> Any:
    """``obj`` with every non-finite float (and tensor/numpy scalar) replaced by None, containers walked."""
    if isinstance(obj, dict):
        return {k: finite_or_none(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_or_none(v) for v in obj]
    if getattr(obj, "ndim", None) == 0 and hasattr(obj, "item"):  # torch / numpy scalars
        obj = obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def dumps(obj: Any, **kwargs: Any) -> str:
    """``json.dumps`` that writes ``null`` for NaN/±inf and never a non-standard literal."""
    return json.dumps(finite_or_none(obj), allow_nan=False, **kwargs)


__all__ = ["dumps", "finite_or_none"]
