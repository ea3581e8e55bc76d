"""Evidence for the end-to-end check (``examples/verl_cpu_e2e.sh``): what the rollout server sent, what reached PDMLoss.

Off unless ``PDMASK_VERL_RECORD`` names a folder. Then the vLLM server and ``PDMLoss``, in whatever Ray
worker they run, each append one JSON line per response to a file of their own there, so that the
run's μ top K can be compared at the two ends of verl's path (agent loop, TransferQueue, padding,
packing) after the run.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

#: The environment variable naming the folder; Ray workers inherit it from the driver.
RECORD_ENV = "PDMASK_VERL_RECORD"


def recording() -> bool:
    """Whether this process records (``PDMASK_VERL_RECORD`` is set)."""
    return bool(os.environ.get(RECORD_ENV))


def record(kind: str, rows: list[dict[str, Any]]) -> None:
    """Appends ``rows`` as JSON lines to ``$PDMASK_VERL_RECORD/{kind}-{pid}.jsonl`` (nothing when not recording)."""
    folder = os.environ.get(RECORD_ENV)
    if not folder:
        return
    Path(folder).mkdir(parents=True, exist_ok=True)
    with (Path(folder) / f"{kind}-{os.getpid()}.jsonl").open("a") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)


def load(folder: str | Path, kind: str) -> list[dict[str, Any]]:
    """Every row recorded under ``kind`` in ``folder``."""
    return [json.loads(line) for path in sorted(Path(folder).glob(f"{kind}-*.jsonl")) for line in path.open()]


__all__ = ["RECORD_ENV", "load", "record", "recording"]
