"""Fork profile of a policy: how often it stands at a fork, where several continuations are likely.

The direction tests of DPPO and PDM-KL can only disagree on a token that is not the mode of π, at a position
where the drift spreads over three or more real candidates (for KL(μ‖π), G = Δ_a − E_{i∼π}[Δ_i] with
Δ = π − μ). A policy that is peaked everywhere gives the masks nothing to decide differently; a language
model forks. The profile says which of the two a policy is like, from its own samples:

- ``runner_up_ge_0.1``: share of positions whose second most likely token has π ≥ 0.1;
- ``not_mode``: share of sampled tokens that are not the position's most likely one;
- ``entropy``, split into ``entropy_topk`` (−Σ π log π over the K most likely ids) and ``entropy_rest`` (the
  other ids): a fork keeps its entropy in the top K, a flat junk tail in the rest;
- ``top1_median``: the median of the largest π.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

#: The runner-up probability from which a position counts as a fork.
FORK_PI = 0.1
#: Rows of the full log-probs summed at once (bounds the [rows, V] temporaries).
_ROWS = 4096
#: SmolLM2-135M-Instruct's profile on the analysis prompts, measured once (the command is in the file and in
#: docs/lab.md); in a clone of the repository, beside the package.
REFERENCE = Path(__file__).resolve().parents[3] / "results" / "smollm2-forks" / "forks.json"


def reference_profile() -> dict[str, Any] | None:
    """The stored SmolLM2 measurement (``pdmask analyze --fork-profile``'s forks.json), or None outside a clone."""
    return json.loads(REFERENCE.read_text()) if REFERENCE.exists() else None


@torch.no_grad()
def fork_profile(logp: Tensor, tokens: Tensor, k: int = 20) -> dict[str, float]:
    """The profile of log π [N, V] at N positions, with the sampled tokens [N] there; means over positions."""
    if logp.ndim != 2 or tokens.shape != logp.shape[:1]:
        raise ValueError(f"logp must be [N, V] and tokens [N]; got logp {tuple(logp.shape)}, tokens {tuple(tokens.shape)}.")
    if logp.shape[0] == 0:
        raise ValueError("logp has no positions: profile at least one sampled token.")
    sums = torch.zeros(5, dtype=torch.float64)
    top1 = []
    for rows, toks in zip(logp.split(_ROWS), tokens.split(_ROWS)):
        lp = rows.double()
        p = lp.exp()
        plogp = torch.where(p > 0, p * lp, 0.0)
        top = p.topk(min(k, p.shape[-1]), dim=-1)
        h = -plogp.sum(-1)
        h_topk = -plogp.gather(-1, top.indices).sum(-1)
        sums += torch.stack([
            (top.values[:, 1] >= FORK_PI).double().sum() if top.values.shape[1] > 1 else torch.zeros((), dtype=torch.float64),
            (toks != top.indices[:, 0]).double().sum(),
            h.sum(),
            h_topk.sum(),
            (h - h_topk).sum(),
        ])  # fmt: skip
        top1.append(top.values[:, 0])
    n = logp.shape[0]
    names = ("runner_up_ge_0.1", "not_mode", "entropy", "entropy_topk", "entropy_rest")
    return {"positions": n} | {name: (s / n).item() for name, s in zip(names, sums)} | {
        "top1_median": torch.cat(top1).median().item()
    }


@torch.no_grad()
def policy_fork_profile(
    policy: nn.Module, task: Any, prompts: Sequence[Sequence[int]], *, samples: int, temperature: float, k: int,
    generator: torch.Generator, batch_prompts: int = 64,
) -> dict[str, float]:
    """The fork profile of ``policy`` on its own responses: ``samples`` per prompt at ``temperature``, over every
    response position (up to and including EOS), π at that temperature."""
    from pdmask.lab.engine import sample

    parts, toks = [], []
    for i in range(0, len(prompts), batch_prompts):
        batch = sample(
            policy, prompts[i : i + batch_prompts], max_new_tokens=task.max_new_tokens, eos_id=task.eos_id,
            pad_id=task.pad_id, temperature=temperature, top_k_logprobs=1, generator=generator, return_full=True,
            group_size=samples,
        )  # fmt: skip
        mask = batch.response_mask
        parts.append(batch.full_logp[mask])
        toks.append(batch.tokens[mask])
    return fork_profile(torch.cat(parts), torch.cat(toks), k)


#: Profile keys in the order a table shows them, with their headers.
COLUMNS = (
    ("positions", "positions"),
    ("runner_up_ge_0.1", "runner-up π ≥ 0.1"),
    ("not_mode", "sampled token not the mode"),
    ("top1_median", "median max π"),
    ("entropy", "entropy (nats)"),
    ("entropy_topk", "in the top K"),
    ("entropy_rest", "in the rest"),
)


def profile_cells(profile: dict[str, float]) -> list[str]:
    """One table row's cells, in ``COLUMNS`` order."""
    shares = {"runner_up_ge_0.1", "not_mode"}
    return [
        f"{profile[key]:,.0f}" if key == "positions" else f"{profile[key]:.1%}" if key in shares else f"{profile[key]:.3f}"
        for key, _ in COLUMNS
    ]


def warm_start_profile(cfg: Any, prompts: int = 128, samples: int = 4) -> dict[str, float] | None:
    """The fork profile of a lab config's starting policy (its SFT warm start, trained if not cached) on its first
    ``prompts`` held-out prompts, ``samples`` responses each at the rollout temperature; None for pretrained models
    (``pdmask analyze --fork-profile`` profiles those)."""
    from pdmask.lab.models import is_pretrained
    from pdmask.lab.sft import initial_policy, warm_start
    from pdmask.lab.tasks import build_task

    if is_pretrained(cfg.model):
        return None
    policy = initial_policy(cfg)
    task = build_task(cfg.task, **cfg.task_kwargs())
    if cfg.sft_steps > 0:
        warm_start(cfg, policy, task)
    policy.eval()
    return policy_fork_profile(
        policy, task, [p.prompt_ids for p in task.heldout[:prompts]], samples=samples, temperature=cfg.temperature,
        k=cfg.top_k, generator=torch.Generator().manual_seed(cfg.warm_start_seed),
    )  # fmt: skip
