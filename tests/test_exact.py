"""The one exact divergence over the full vocabulary, pinned to a hand-computed case."""

from __future__ import annotations

import math

import pytest
import torch

from pdmask import exact_divergence


def test_exact_divergence_by_hand_with_a_zero_of_mu():
    pi = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    mu = torch.tensor([0.6, 0.4, 0.0], dtype=torch.float64)
    logp = pi.log().requires_grad_(True)
    assert exact_divergence(logp, mu.log(), "tv").item() == pytest.approx(0.2)
    kl = exact_divergence(logp, mu.log(), "kl")
    assert kl.item() == pytest.approx(0.6 * math.log(0.6 / 0.5) + 0.4 * math.log(0.4 / 0.3))
    (grad,) = torch.autograd.grad(kl, logp)
    assert torch.equal(grad, -mu)  # ∂KL/∂log π = −μ, and no NaN where μ = 0


def test_exact_divergence_names_its_kinds():
    with pytest.raises(ValueError, match="kind must be one of 'tv', 'kl'"):
        exact_divergence(torch.zeros(3), torch.zeros(3), "js")
