"""The exact divergences over the full vocabulary: the one definition that the reference, the analysis'
truths and the lab's mismatch metrics use (docs/method.md, "Setting"). A leaf module (torch only), so that
the vocabulary pass can use it too."""

from __future__ import annotations

import torch
from torch import Tensor

#: The divergences: TV and the forward KL(μ‖π).
KINDS = ("tv", "kl")


def exact_divergence(logp: Tensor, mu_logp: Tensor, kind: str) -> Tensor:
    """Exact D(π, μ) [...] from log π and log μ [..., V] (−inf where a probability is 0), differentiable.

    TV = ½ Σ_i |π_i − μ_i|;  KL = KL(μ‖π) = Σ_i μ_i (log μ_i − log π_i), with 0·log 0 = 0.
    μ is taken in log π's dtype.
    """
    mu_logp = mu_logp.to(logp.dtype)
    mu = mu_logp.exp()
    if kind == "tv":
        return 0.5 * (logp.exp() - mu).abs().sum(-1)
    if kind == "kl":
        # μ = 0 terms are 0 (and must not turn into 0·(−inf) = NaN, nor a NaN gradient).
        return torch.where(mu > 0, mu * (mu_logp - logp), 0.0).sum(-1)
    raise ValueError(f"kind must be one of {', '.join(map(repr, KINDS))}; got {kind!r}.")


__all__ = ["KINDS", "exact_divergence"]
