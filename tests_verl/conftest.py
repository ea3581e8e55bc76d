"""Fixtures for the verl integration tests (run in .venv-verl by .ci/verl.sh; the main suite does not collect them)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("verl", reason="the verl tests need `pip install 'pdmask[verl]'` (.ci/verl.sh)")


def actor_config(**overrides):
    """verl's own ActorConfig, as its trainer builds it, with the given fields."""
    from verl.workers.config import ActorConfig

    return ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, **overrides)


@pytest.fixture
def binary_batch():
    """(old_log_prob, log_prob leaf, advantages, response_mask) [6, 9]: ratios well spread, some A = 0."""
    g = torch.Generator().manual_seed(0)
    shape = (6, 9)
    old = torch.log(torch.rand(shape, generator=g) * 0.98 + 0.01)
    new = torch.log(torch.rand(shape, generator=g) * 0.98 + 0.01).requires_grad_(True)
    adv = torch.randn(shape, generator=g)
    mask = torch.rand(shape, generator=g) > 0.2
    mask[2] = False  # one empty sequence: verl's seq-mean modes skip it
    return old, new, adv, mask
