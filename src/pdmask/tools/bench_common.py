"""What every part of `pdmask bench` shares: its inputs, its memory measurement and how it marks a target.

Needs torch alone (no rich): ``python -m pdmask.tools.bench_device`` runs where only torch and Triton are installed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch
from torch import Tensor

from pdmask.rollout import RolloutLogprobs
from pdmask.tools.counts import quiet_stderr


def sample_rollout(z: Tensor, g: torch.Generator, k: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(a [r], log μ(a) [r], top-K ids [r, K], top-K log μ [r, K]) of μ = softmax(z + 0.3·ε), a perturbed π,
    for float32 logits z [r, V] on g's device; a is sampled from μ."""
    logmu = torch.log_softmax(z + 0.3 * torch.randn(z.shape, generator=g, device=z.device), -1)
    tokens = torch.multinomial(logmu.exp(), 1, generator=g).squeeze(-1)
    top = logmu.topk(k, -1)
    return tokens, logmu.gather(-1, tokens[:, None]).squeeze(-1), top.indices, top.values


def make_inputs(vocab: int, n: int, dtype: torch.dtype, device: torch.device | str = "cpu", k: int = 20, seed: int = 0):
    """(logits [n, V] of scale 3 in ``dtype``, sampled tokens [n], their top-K rollout, advantages [n]) on ``device``,
    made 64 MiB of float32 at a time so that the setup does not dominate peak memory."""
    device = torch.device(device)
    g = torch.Generator(device=device).manual_seed(seed)
    logits = torch.empty(n, vocab, dtype=dtype, device=device)
    tokens = torch.empty(n, dtype=torch.long, device=device)
    logp, ids, vals = torch.empty(n, device=device), torch.empty(n, k, dtype=torch.long, device=device), torch.empty(n, k, device=device)
    step = max(1, (1 << 24) // vocab)
    for s in range(0, n, step):
        z = torch.randn(min(step, n - s), vocab, generator=g, device=device) * 3
        logits[s : s + step] = z.to(dtype)
        tokens[s : s + step], logp[s : s + step], ids[s : s + step], vals[s : s + step] = sample_rollout(z, g, k)
    return logits, tokens, RolloutLogprobs(logp, ids, vals), torch.randn(n, generator=g, device=device)


def peak_bytes(fn: Callable[[], object]) -> int:
    """Peak of the bytes allocated on the CPU while fn runs (and its result lives), from the profiler's memory events."""
    from torch.profiler import ProfilerActivity, profile

    with quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
        del out
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    current = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        current += e.nbytes()
        peak = max(peak, current)
    return peak


def peak_mib(fn: Callable[[], object], device: torch.device) -> float:
    """Peak bytes allocated above what was allocated before, while ``fn`` runs, in MiB (CUDA's allocator statistics
    on a GPU, the profiler's memory events on the CPU)."""
    if device.type != "cuda":
        return peak_bytes(fn) / 2**20
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    del out
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def marked(value: float | None, target: float, text: str | None = None) -> str:
    """A cell with its verdict against an upper target: "1.07x ✓≤1.15" (met) or "1.40x ✗≤1.15" (missed)."""
    if value is None:
        return "-"
    return f"{text if text is not None else f'{value:.2f}x'} {'✓' if value <= target else '✗'}≤{target:g}"


def print_table(title: str, columns: Sequence[str], rows: Iterable[Sequence[str]], note: str | None = None) -> None:
    """A rich table as wide as the terminal (100 columns where the output is no terminal): headers and cells wrap
    or fold, never cut; ``note`` below it."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not console.is_terminal:
        console = Console(width=100)
    table = Table(title=title)
    for i, col in enumerate(columns):
        table.add_column(col, justify="left" if i == 0 else "right", overflow="fold")
    for row in rows:
        table.add_row(*row)
    console.print(table)
    if note:
        console.print(note)


__all__ = ["make_inputs", "marked", "peak_bytes", "peak_mib", "print_table", "sample_rollout"]
