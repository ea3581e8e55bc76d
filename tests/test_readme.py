"""The README's first example of ``pdmask.policy_loss`` runs as written, on small random tensors."""

from __future__ import annotations

import math
import re
from pathlib import Path
from types import SimpleNamespace

import torch

README = Path(__file__).resolve().parent.parent / "README.md"


def first_policy_loss_example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    return next(block for block in blocks if "pdmask.policy_loss" in block)


def test_the_readme_example_runs():
    b, t, v, k = 2, 5, 11, 3
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, v - k, (b, t + 1), generator=g)  # never among μ's top K below, so μ(a) is free
    causal = torch.randn(b, t + 1, v, generator=g, requires_grad=True)
    # The names the example takes from "your trainer" and "the engine": a causal LM's forward over ids and μ.
    names = {
        "model": lambda x: SimpleNamespace(logits=causal[:, : x.shape[1]]),
        "ids": ids,
        "logits": causal[:, :-1],
        "tokens": ids[:, 1:],
        "mu_logp": torch.full((b, t), math.log(0.1)),
        "mu_topk_ids": torch.arange(v - k, v).expand(b, t, k),
        "mu_topk_logp": torch.full((b, t, k), math.log(0.2)),
        "advantages": torch.randn(b, t, generator=g),
        "response_mask": torch.ones(b, t),
    }
    exec(compile(first_policy_loss_example(), str(README), "exec"), names)
    assert torch.isfinite(names["loss"]) and causal.grad is not None
    assert 0.0 <= names["metrics"]["mask/dropped_frac"] <= 1.0
