"""The main suite, for the main environment (.venv: `pip install -e ".[all]"`); tests_verl/ and tests_vllm/ each
need their own environment (.ci/verl.sh, .ci/vllm.sh).

Shared builders: random positions with a full μ, and their RolloutLogprobs at each information level."""

from __future__ import annotations

import os

import pytest
import torch

from pdmask import RolloutLogprobs
from pdmask.lab.config import Config

torch.set_num_threads(min(2, os.cpu_count() or 1))
if not torch.cuda.is_available():
    # Triton kernels (pdmask.triton_pass) run on CPU tensors in Triton's interpreter; Triton reads this once, on import.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def make_case(n: int, vocab: int, k: int, *, seed: int = 0, drift: float = 0.7, dtype=torch.float64):
    """n positions: logits z [n, V], log μ [n, V] (float64), sampled tokens a ~ μ [n], top-K of μ."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, vocab, generator=g, dtype=torch.float64) * 2.0
    logmu = torch.log_softmax(z + drift * torch.randn(n, vocab, generator=g, dtype=torch.float64), -1)
    a = torch.multinomial(logmu.exp(), 1, generator=g).squeeze(-1)
    top = logmu.topk(k, -1)
    return z.to(dtype), logmu, a, top.indices, top.values


def rollout_of(logmu, a, topk_ids=None, topk_logp=None, full=False) -> RolloutLogprobs:
    return RolloutLogprobs(
        logmu.gather(-1, a[..., None]).squeeze(-1),
        topk_ids=topk_ids,
        topk_logp=topk_logp,
        full_logp=logmu if full else None,
    )


@pytest.fixture
def case():
    return make_case(16, 64, 5)


#: A lab config small enough for a unit test: a few seconds per run on one core.
TINY = Config(
    task_length=4,
    num_symbols=8,
    heldout_size=16,
    steps=3,
    prompts_per_step=4,
    group_size=4,
    minibatches=2,
    sft_steps=5,
    sft_batch=16,
    eval_every=2,
    tensorboard=False,
    reward="partial",
    epochs=1,
)


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` need CUDA: skipped without it."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (a GPU): scripts/gpu_check.sh runs it")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
