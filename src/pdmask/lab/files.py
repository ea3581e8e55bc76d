"""Atomic writes of the lab's files: run config, metrics, checkpoints and the SFT cache.

Each file is written to a temporary name beside it and renamed over it, so a kill mid-write never
leaves a torn file, and parallel runs sharing a cache never read one. A failed write (a full disk
surfaces in ``torch.save`` as "unexpected pos") removes the temporary file and names the free space.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def _write_atomic(path: Path, write: Callable[[Path], None]) -> None:
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")  # one per process: runs may share the SFT cache
    try:
        write(tmp)
    except (OSError, RuntimeError) as e:
        tmp.unlink(missing_ok=True)
        free = shutil.disk_usage(path.parent).free / 2**30
        raise RuntimeError(
            f"writing {path} failed with {free:.1f} GiB free on its disk ({e}); free disk space or write to a "
            "larger disk (--out for runs, PDMASK_CACHE for SFT weights); a run resumes from its last checkpoint"
        ) from e
    os.replace(tmp, path)


def write_text_atomic(path: Path, text: str) -> None:
    """``path.write_text(text)``, atomically."""
    _write_atomic(path, lambda tmp: tmp.write_text(text))


def save_atomic(obj: Any, path: Path) -> None:
    """``torch.save(obj, path)``, atomically."""
    _write_atomic(path, lambda tmp: torch.save(obj, tmp))
