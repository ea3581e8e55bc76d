"""Obviously-right float64 reference implementations over the full vocabulary, for tests and audits.

Everything here works on one position's full vectors (or a batch of them, [..., V]) with autograd
for ∇_z D, so that no closed form is trusted: the fast paths are checked against these.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pdmask.exact import exact_divergence


def tv(pi: Tensor, mu: Tensor) -> Tensor:
    """½ Σ_i |π_i − μ_i| over the last dim (probabilities [..., V])."""
    return exact_divergence(pi.log(), mu.log(), "tv")


def kl(pi: Tensor, mu: Tensor) -> Tensor:
    """KL(μ‖π) = Σ_i μ_i (log μ_i − log π_i), with 0·log 0 = 0 (probabilities [..., V])."""
    return exact_divergence(pi.log(), mu.log(), "kl")


DIVERGENCES = {"tv": tv, "kl": kl}


def predicted_change(z: Tensor, mu: Tensor, a: Tensor, kind: str) -> Tensor:
    """G = ⟨∇_z D(softmax(z), μ), e_a − π⟩ by autograd in float64; z, μ [..., V], a [...]."""
    z = z.detach().double().requires_grad_(True)
    pi = torch.softmax(z, -1)
    d = DIVERGENCES[kind](pi, mu.double())
    (grad,) = torch.autograd.grad(d.sum(), z)
    u = torch.nn.functional.one_hot(a, z.shape[-1]).double() - pi.detach()
    return (grad * u).sum(-1)


def finite_difference(z: Tensor, mu: Tensor, a: Tensor, kind: str, eps: float = 1e-6) -> Tensor:
    """(D(softmax(z + εu)) − D(softmax(z − εu))) / 2ε with u = e_a − π: the ground truth for G."""
    z, mu = z.double(), mu.double()
    u = torch.nn.functional.one_hot(a, z.shape[-1]).double() - torch.softmax(z, -1)
    d = DIVERGENCES[kind]
    return (d(torch.softmax(z + eps * u, -1), mu) - d(torch.softmax(z - eps * u, -1), mu)) / (2 * eps)


def set_mask(a: Tensor, topk_ids: Tensor, vocab: int) -> Tensor:
    """Bool [..., V]: membership of S = TopK ∪ {a}."""
    s = torch.zeros(a.shape + (vocab,), dtype=torch.bool, device=a.device)
    s.scatter_(-1, topk_ids, True)
    return s.scatter(-1, a.unsqueeze(-1), True)


def coarse(p: Tensor, in_set: Tensor) -> Tensor:
    """[..., V+1]: p on S (0 elsewhere), then the rest bucket 1 − Σ_S p as the last category."""
    on_set = torch.where(in_set, p, torch.zeros_like(p))
    return torch.cat([on_set, (1 - on_set.sum(-1, keepdim=True)).clamp_min(0)], -1)


def topk_divergence(z: Tensor, mu: Tensor, a: Tensor, topk_ids: Tensor, kind: str) -> Tensor:
    """DPPO's top-K estimate: the divergence of the K+1-category distributions S ∪ {R}."""
    s = set_mask(a, topk_ids, z.shape[-1])
    return DIVERGENCES[kind](_nonzero(coarse(torch.softmax(z.double(), -1), s)), coarse(mu.double(), s))


def binary_divergence(z: Tensor, mu: Tensor, a: Tensor, kind: str) -> Tensor:
    """The divergence of the two-category distributions ({a}, rest)."""
    s = set_mask(a, a.unsqueeze(-1), z.shape[-1])
    return DIVERGENCES[kind](_nonzero(coarse(torch.softmax(z.double(), -1), s)), coarse(mu.double(), s))


def aggregated_change(z: Tensor, mu: Tensor, a: Tensor, topk_ids: Tensor, kind: str) -> Tensor:
    """G of the coarse K+1-category policy: softmax logits log π̃, with a as one of the categories."""
    s = set_mask(a, topk_ids, z.shape[-1])
    pi_c = _nonzero(coarse(torch.softmax(z.double(), -1), s))
    return predicted_change(pi_c.log(), coarse(mu.double(), s), a, kind)


def proportional_change(z: Tensor, mu: Tensor, a: Tensor, topk_ids: Tensor, kind: str) -> Tensor:
    """Full G against μ' = μ on S and μ'_j = π_j · μ_R / π_R off S (μ's tail made proportional to π's)."""
    return predicted_change(z, proportional_mu(z, mu, a, topk_ids), a, kind)


def proportional_mu(z: Tensor, mu: Tensor, a: Tensor, topk_ids: Tensor) -> Tensor:
    """μ' [..., V] = μ on S = TopK ∪ {a}, π_j · μ_R / π_R off S."""
    s = set_mask(a, topk_ids, z.shape[-1])
    pi, mu = torch.softmax(z.double(), -1), mu.double()
    pi_r = torch.where(s, 0.0, pi).sum(-1, keepdim=True)
    mu_r = (1 - torch.where(s, mu, 0.0).sum(-1, keepdim=True)).clamp_min(0)
    return torch.where(s, mu, pi * torch.where(pi_r > 0, mu_r / pi_r, 0.0))


def backbone_change(z: Tensor, mu: Tensor, a: Tensor, weight: Tensor, kind: str) -> Tensor:
    """G_W = ⟨Wᵀ∇_z D(softmax(z), μ), Wᵀ(e_a − π)⟩ by autograd in float64; z, μ [..., V], W [V, d].

    The top-K form (``backbone_topk``) is this against ``proportional_mu``.
    """
    z = z.detach().double().requires_grad_(True)
    w = weight.detach().double()
    pi = torch.softmax(z, -1)
    (grad,) = torch.autograd.grad(DIVERGENCES[kind](pi, mu.double()).sum(), z)
    u = torch.nn.functional.one_hot(a, z.shape[-1]).double() - pi.detach()
    return ((grad @ w) * (u @ w)).sum(-1)


def backbone_finite_difference(h: Tensor, weight: Tensor, mu: Tensor, a: Tensor, kind: str, eps: float = 1e-6) -> Tensor:
    """Central difference of D(softmax(W(h + εv)), μ) in ε, v = Wᵀ(e_a − π): the ground truth for G_W
    (the hidden state moved along the token's own gradient ∇_h log π_a); h [..., d], W [V, d]."""
    h, w, mu = h.double(), weight.double(), mu.double()
    v = (torch.nn.functional.one_hot(a, w.shape[0]).double() - torch.softmax(h @ w.T, -1)) @ w
    d = DIVERGENCES[kind]
    return (d(torch.softmax((h + eps * v) @ w.T, -1), mu) - d(torch.softmax((h - eps * v) @ w.T, -1), mu)) / (2 * eps)


def own_step_change(h: Tensor, weight: Tensor, mu: Tensor, a: Tensor, kind: str) -> Tensor:
    """⟨∇_θ D, ∇_θ log π_a⟩ for θ = (h, W) with logits W h, one position at a time, by autograd in float64:
    the first-order change of D under the token's own plain gradient step when the backbone's kernel
    in hidden space is the identity (h a free parameter). It equals ‖h‖²·G + G_W; h [n, d], W [V, d]."""
    out = []
    for i in range(h.shape[0]):
        hi = h[i].detach().double().requires_grad_(True)
        w = weight.detach().double().requires_grad_(True)
        logp = torch.log_softmax(w @ hi, -1)
        dl = torch.autograd.grad(logp[a[i]], (hi, w), retain_graph=True)
        dd = torch.autograd.grad(DIVERGENCES[kind](logp.exp(), mu[i].double()), (hi, w))
        out.append(sum((x * y).sum() for x, y in zip(dl, dd, strict=True)))
    return torch.stack(out)


def exactpi_change(z: Tensor, mu: Tensor, a: Tensor, topk_ids: Tensor, kind: str) -> Tensor:
    """pdmask's exact-π uniform: full G against μ' = μ on S and μ'_j = μ_R / T off S (π exact)."""
    s = set_mask(a, topk_ids, z.shape[-1])
    return predicted_change(z, _even_tail(mu.double(), s), a, kind)


def uniform_change(z: Tensor, mu: Tensor, a: Tensor, topk_ids: Tensor, kind: str) -> Tensor:
    """The paper's uniform-tail: full G of π' and μ', each equal to π, μ on S and spread evenly off S
    (π'_j = π_R / T, μ'_j = μ_R / T for the T ids off S)."""
    s = set_mask(a, topk_ids, z.shape[-1])
    return predicted_change(_nonzero(_even_tail(torch.softmax(z.double(), -1), s)).log(), _even_tail(mu.double(), s), a, kind)


def _even_tail(p: Tensor, in_set: Tensor) -> Tensor:
    """p on S; its rest 1 − Σ_S p spread evenly over the ids off S."""
    rest = (1 - torch.where(in_set, p, 0.0).sum(-1, keepdim=True)).clamp_min(0)
    outside = (~in_set).sum(-1, keepdim=True)
    return torch.where(in_set, p, torch.where(outside > 0, rest / outside.clamp_min(1), 0.0))


def _nonzero(p: Tensor) -> Tensor:
    # The rest bucket can be exactly empty; a floor keeps log π̃ finite without moving G measurably.
    return p.clamp_min(1e-300)


__all__ = [
    "aggregated_change",
    "binary_divergence",
    "exactpi_change",
    "finite_difference",
    "backbone_change",
    "backbone_finite_difference",
    "kl",
    "own_step_change",
    "predicted_change",
    "proportional_change",
    "proportional_mu",
    "topk_divergence",
    "tv",
    "uniform_change",
]
