"""Evidence for the end-to-end check (``examples/verl_cpu_e2e.sh``): what the rollout server sent, what reached PDMLoss.

Test scaffolding: production code never imports this. ``worker_setup`` (the run's Ray
``worker_process_setup_hook``) makes each Ray worker's gloo group as ``pdmask.integrations.verl.cpu`` does and,
when ``PDMASK_VERL_RECORD`` names a folder, wraps the vLLM server's ``generate`` and ``PDMLoss``'s packing of
μ's rows so that each appends one JSON line per response to a file of its own there; the check compares
μ's top K at the two ends of verl's path (agent loop, TransferQueue, padding, packing) after the run.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
from pathlib import Path
from typing import Any

#: The environment variable naming the folder; Ray workers inherit it from the driver.
RECORD_ENV = "PDMASK_VERL_RECORD"
#: The environment variable with the trainer run's ``total_training_steps``, which tells the end-to-end script's two
#: runs apart (the second resumes the first's checkpoint).
STEPS_ENV = "PDMASK_VERL_STEPS"


def record(kind: str, rows: list[dict[str, Any]]) -> None:
    """Appends ``rows`` as JSON lines to ``$PDMASK_VERL_RECORD/{kind}-{pid}.jsonl``."""
    folder = Path(os.environ[RECORD_ENV])
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / f"{kind}-{os.getpid()}.jsonl").open("a") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)


def load(folder: str | Path, kind: str) -> list[dict[str, Any]]:
    """Every row recorded under ``kind`` in ``folder``."""
    return [json.loads(line) for path in sorted(Path(folder).glob(f"{kind}-*.jsonl")) for line in path.open()]


def install() -> None:
    """Wraps ``pack_rollout`` (PDMLoss's rows at the packed tokens), ``PDMLoss``'s logits processor (its outputs on
    this rank) and, where vLLM is installed, the top-K server."""
    from pdmask.integrations.verl import topk

    pack = topk.pack_rollout
    if getattr(pack, "recorded", False):
        return

    @functools.wraps(pack)
    def recorded_pack(data: Any, tokens: Any, method: Any, top_k: Any) -> Any:
        packed = pack(data, tokens, method, top_k)
        rows = []
        for b, sequence in enumerate(data["input_ids"].unbind()):
            at = packed.where[b][packed.valid[b]]
            rows.append(
                {
                    "steps": os.environ.get(STEPS_ENV),
                    "sequence": sequence.tolist(),
                    "targets": tokens[at].tolist(),
                    "topk_ids": packed.rollout.topk_ids[at].tolist(),
                    "topk_logps": packed.rollout.topk_logp[at].tolist(),
                    "logp": packed.rollout.logp[at].tolist(),
                }
            )
        record("loss", rows)
        return packed

    recorded_pack.recorded = True  # type: ignore[attr-defined]
    topk.pack_rollout = recorded_pack

    process = topk.PDMLoss.logits_processor
    calls = itertools.count()

    @functools.wraps(process)
    def recorded_process(self: Any, student_logits: Any, data: Any, data_format: Any = None) -> Any:
        from verl.utils.ulysses import get_ulysses_sequence_parallel_rank, get_ulysses_sequence_parallel_world_size

        outputs = process(self, student_logits, data, data_format)
        row = {
            "steps": os.environ.get(STEPS_ENV),
            "call": next(calls),  # this process's processor calls: 0 is its first micro-batch
            "sp": get_ulysses_sequence_parallel_world_size(),
            "sp_rank": get_ulysses_sequence_parallel_rank(),
            "input_ids": data["input_ids"].values().tolist(),  # the whole packed micro-batch
            "offsets": data["input_ids"].offsets().tolist(),
            "outputs": {key: value.flatten().tolist() for key, value in outputs.items()},  # this rank's slice
        }
        record("processor", [row])
        return outputs

    topk.PDMLoss.logits_processor = recorded_process  # type: ignore[method-assign]
    try:
        from pdmask.integrations.verl.vllm_server import TopKvLLMHttpServer
    except ImportError:  # no vLLM in this environment: only the loss side records
        return
    from pdmask.integrations.verl.rollout import ENTRIES

    generate = TopKvLLMHttpServer.generate

    @functools.wraps(generate)
    async def recorded_generate(self: Any, prompt_ids: list[int], *args: Any, **kwargs: Any) -> Any:
        output = await generate(self, prompt_ids, *args, **kwargs)
        if ENTRIES in output.extra_fields:
            step = getattr(self, "global_steps", None)  # the weights' step, set by verl's sync
            record("server", [{"prompt": list(prompt_ids), "step": step, **output.extra_fields[ENTRIES]}])
        return output

    TopKvLLMHttpServer.generate = recorded_generate  # type: ignore[method-assign]


def worker_setup() -> None:
    """Ray ``worker_process_setup_hook`` of the end-to-end run: the worker's gloo group, then the recorders if asked."""
    from pdmask.integrations.verl.cpu import init_worker_process_group

    init_worker_process_group()
    if os.environ.get(RECORD_ENV):
        install()


__all__ = ["RECORD_ENV", "STEPS_ENV", "install", "load", "record", "worker_setup"]
