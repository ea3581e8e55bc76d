"""`pdmask bench --part compiled`: the fused Triton kernels compiled for an H100 (sm_90) on this machine, no GPU needed.

Each kernel is compiled as ``pdmask.triton_pass`` launches it at the bench's shape (V = 151,936, N = 16,384, bf16
logits, K = 20, so C = 21 ids of S): the launch's own arguments (meta tensors: no memory) go through the JIT's own
argument binding and specialisation, then ``triton.compile`` for ``GPUTarget("cuda", 90, 32)`` (Triton's bundled
ptxas). From the cubin, with the ``cuobjdump`` and ``nvdisasm`` that Triton's wheel ships:

- registers a thread, spill bytes (local memory and stack) and shared memory a block (``cuobjdump -res-usage``);
- SASS instructions per logit element of each loop over the vocabulary (an outermost backward branch of the
  disassembly whose body issues a vector load): the instructions on the shortest path from the loop's head (the
  branch's target label) to the back-edge branch, nested loops' back-edges dropped — the path of a block that holds
  no id of S (nor a, in the backward) — divided by the elements a thread handles an iteration, BLOCK / (32 · warps);
  a warp issues the same count per 32 elements. A kernel's figure is its worst loop (the exactpi variant reads the
  logits twice, one loop each). At most C blocks of a row take a longer path; what they add, spread over the row,
  is bounded apart (``special_per_element``).

Roofline (docs/bench.md): a bf16 logit is 2 bytes; an H100 SXM moves 3.35 TB/s, i.e. 1.68e12 logits/s, and
issues about 9.3e11 warp instructions/s (132 SMs × 4 schedulers × 1.76 GHz), i.e. 2.97e13 thread instructions/s:
a pass stays memory-bound while it issues fewer than ~18 instructions per element (~12 at an H200's 4.8 TB/s).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

#: The compile target: an H100 (compute capability 9.0, 32 threads a warp).
TARGET = ("cuda", 90, 32)
#: The bench's launch shape (``pdmask bench --device cuda``'s defaults) and the target per loop.
VOCAB, POSITIONS, TOPK = 151_936, 16_384, 20
TARGET_PER_ELEMENT = 12.0

_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_LABEL = re.compile(r"^(\.L_x_\d+):")
_BRANCH = re.compile(r"^(@!?U?P\w+\s+)?BRA\b.*?\((\.L_x_\d+)\)")
_EXIT = re.compile(r"^EXIT\b")
_VECTOR_LOAD = re.compile(r"^(@!?P\w+\s+)?LDG\.E\.(64|128)\b")


@dataclass
class Loop:
    """One loop over the vocabulary, in instructions per thread per iteration."""

    fast: int  # on the shortest path from the loop's head to its back-edge: a block that holds no id of S (or a)
    slow: int  # on the longest path, nested loops' bodies once: a block that holds one
    per_element: float  # fast / elements a thread handles per iteration


@dataclass
class CompiledKernel:
    name: str
    registers: int
    spill_bytes: int
    shared_bytes: int
    warps: int
    block: int
    sass_per_element: float  # the worst loop's fast path
    special_per_element: float  # the most the blocks holding S's ids (or a) add, spread over a whole row
    loops: list[Loop]

    @property
    def meets_target(self) -> bool:
        return self.spill_bytes == 0 and self.sass_per_element <= TARGET_PER_ELEMENT


def _bin(tool: str) -> str:
    """A CUDA tool that Triton's wheel ships (triton/backends/nvidia/bin), else one on PATH."""
    import triton

    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / tool
    return str(path) if path.exists() else tool


def compile_launch(launch) -> object:
    """``triton.compile`` of a ``pdmask.triton_pass.Launch`` for sm_90, bound as the JIT binds a real launch."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget(*TARGET)
    backend = make_backend(target)
    fn = launch.kernel
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*launch.args, **launch.constants)
    options, signature, constexprs, attrs = fn._pack_args(backend, launch.constants, bound, specialization, options)
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)


def resource_usage(cubin: Path) -> dict[str, int]:
    """REG, LOCAL (spill bytes), STACK and SHARED of the cubin's one function, from ``cuobjdump -res-usage``."""
    text = subprocess.run([_bin("cuobjdump"), "-res-usage", str(cubin)], capture_output=True, text=True, check=True).stdout
    return {k: int(v) for k, v in re.findall(r"\b(REG|LOCAL|SHARED|STACK):(\d+)", text)}


def vocabulary_loops(sass: str) -> list[tuple[int, int]]:
    """(fast, slow) instructions of each loop over the vocabulary in an ``nvdisasm -c`` listing: the outermost
    loops (a backward branch, from its target label to it) that issue a vector load of the logits. fast and slow
    are the shortest and longest paths through the body from its head to the back-edge, every nested loop's
    back-edge dropped (its body counts once on a path that enters it)."""
    labels: dict[str, int] = {}
    code: list[str] = []
    for line in sass.splitlines():
        if label := _LABEL.match(line.strip()):
            labels[label.group(1)] = len(code)
        elif instruction := _INSTRUCTION.search(line):
            code.append(instruction.group(2))
    successors: list[list[int]] = []
    back: list[tuple[int, int]] = []
    for i, text in enumerate(code):
        branch = _BRANCH.match(text)
        target = labels[branch.group(2)] if branch else None
        nxt = [] if (branch and not branch.group(1)) or _EXIT.match(text) else [i + 1]
        successors.append(nxt + ([target] if target is not None else []))
        if target is not None and target < i:
            back.append((target, i))
    outermost = [(h, t) for h, t in back if not any(a <= h and t <= b and (a, b) != (h, t) for a, b in back)]
    result = []
    for head, tail in outermost:
        if not any(_VECTOR_LOAD.match(code[i]) for i in range(head, tail + 1)):
            continue
        fast = {head: 1}
        slow = {head: 1}
        for i in range(head, tail):  # forward edges only: the nodes in order are a topological order
            if i not in fast:
                continue
            for j in successors[i]:
                if i < j <= tail:
                    fast[j] = min(fast.get(j, 1 << 30), fast[i] + 1)
                    slow[j] = max(slow.get(j, 0), slow[i] + 1)
        result.append((fast[tail], slow[tail]))
    return result


def measure(name: str, launch, work: Path) -> CompiledKernel:
    """Compiles one launch and reads its cubin (written under ``work``)."""
    compiled = compile_launch(launch)
    cubin = work / (re.sub(r"\W+", "_", name).strip("_") + ".cubin")
    cubin.write_bytes(compiled.asm["cubin"])
    usage = resource_usage(cubin)
    sass = subprocess.run([_bin("nvdisasm"), "-c", str(cubin)], capture_output=True, text=True, check=True).stdout
    warps, block = launch.constants["num_warps"], launch.constants["BLOCK"]
    per_thread = block / (32 * warps)
    loops = [Loop(fast, slow, fast / per_thread) for fast, slow in vocabulary_loops(sass)]
    # At most C blocks of a row hold an id of S (one holds a, in the backward), each taking the slow path once
    # (the zeroing loop's further turns, one per id, are within C slow paths too).
    special = launch.constants.get("C", 1) * max((loop.slow - loop.fast for loop in loops), default=0)
    return CompiledKernel(
        name, usage.get("REG", 0), usage.get("LOCAL", 0) + usage.get("STACK", 0), usage.get("SHARED", 0), warps, block,
        max((loop.per_element for loop in loops), default=0.0), special / (VOCAB / (32 * warps)), loops,
    )


def launches() -> dict[str, object]:
    """Every kernel launch of ``pdmask.triton_pass``, on meta tensors at the bench's shape."""
    from pdmask.triton_pass import grad_launch, stats_launch

    meta = torch.device("meta")
    logits = torch.empty(POSITIONS, VOCAB, dtype=torch.bfloat16, device=meta)
    set_ids = torch.empty(POSITIONS, TOPK + 1, dtype=torch.long, device=meta)
    rows = torch.empty(POSITIONS, device=meta)
    out = torch.empty(5, POSITIONS, device=meta)
    return {
        "stats (dppo_topk)": stats_launch(logits, set_ids, rows, out, False, False),
        "stats + Q (pdm_proportional)": stats_launch(logits, set_ids, rows, out, True, False),
        "stats + Q + exactpi sums": stats_launch(logits, set_ids, rows, out, True, True),
        "logprob backward": grad_launch(logits, torch.empty(POSITIONS, dtype=torch.long, device=meta), rows, rows,
                                        torch.empty_like(logits)),
    }  # fmt: skip


def measure_all(work: Path) -> list[CompiledKernel]:
    return [measure(name, launch, work) for name, launch in launches().items()]


def report(kernels: list[CompiledKernel]) -> dict:
    import triton

    return {"target": "sm_90", "triton": triton.__version__, "kernels": [asdict(k) for k in kernels]}


def render(kernels: list[CompiledKernel]) -> None:
    import triton

    print(f"pdmask bench --part compiled: Triton {triton.__version__}, sm_90, V = {VOCAB:,}, bf16 logits, C = {TOPK + 1}")
    lines = [("kernel", "regs", "spill B", "smem B", "warps", "BLOCK", "SASS/elem", f"<= {TARGET_PER_ELEMENT:g}", "S blocks")]
    for k in kernels:
        lines.append((k.name, str(k.registers), str(k.spill_bytes), str(k.shared_bytes), str(k.warps), str(k.block),
                      " / ".join(f"{loop.per_element:.1f}" for loop in k.loops), "✓" if k.meets_target else "✗",
                      f"+{k.special_per_element:.2f}"))  # fmt: skip
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    for line in lines:
        print("  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(line, widths))))
    print(
        "SASS/elem: instructions on the shortest path from each vocabulary loop's head to its back-edge (a block\n"
        "that holds no id of S), per element a thread handles an iteration; target <= "
        f"{TARGET_PER_ELEMENT:g} and no spills (✓/✗).\n"
        "S blocks: the most the blocks that hold an id of S (or a) add per element, spread over the row."
    )


def run_compiled(json_path: str | None) -> int:
    """Prints the table (and writes the JSON report); 1 when a kernel misses the target, 0 otherwise."""
    from pdmask.triton_pass import triton_available

    if not triton_available():
        raise SystemExit("pdmask bench --part compiled needs triton: pip install 'pdmask[gpu]'.")
    if os.environ.get("TRITON_INTERPRET") == "1":  # Triton then makes every kernel an interpreted function
        raise SystemExit("pdmask bench --part compiled compiles the kernels: run it without TRITON_INTERPRET=1.")
    with tempfile.TemporaryDirectory() as work:
        kernels = measure_all(Path(work))
    render(kernels)
    if json_path:
        Path(json_path).write_text(json.dumps(report(kernels), indent=1))
    return 0 if all(k.meets_target for k in kernels) else 1


def main(argv: list[str] | None = None) -> int:
    """``python -m pdmask.tools.bench_compiled``: the same as ``pdmask bench --part compiled``, with torch and Triton alone."""
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", metavar="FILE", help="also write the report as JSON")
    return run_compiled(p.parse_args(argv).json)


if __name__ == "__main__":
    raise SystemExit(main())

__all__ = ["CompiledKernel", "Loop", "compile_launch", "launches", "measure", "run_compiled", "vocabulary_loops"]
