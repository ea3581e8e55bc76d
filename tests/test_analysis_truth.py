"""Ground truth of the analysis: autograd vs finite differences, the per-token path, and check 5.

The backbone-aware G_W the analysis reads from the core is tested against float64 references in test_backbone.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from pdmask import RolloutLogprobs, policy_stats, predicted_change
from pdmask.analysis.truth import (
    adam_preconditioner,
    full_divergence,
    head_change,
    own_change,
)

V, D, L = 24, 8, 7


class TinyLM(nn.Module):
    """Embedding, one causal attention block with an MLP, final norm and a biased output layer."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(V, D)
        self.qkv = nn.Linear(D, 3 * D)
        self.mlp = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, V)
        self.double()

    def hidden(self, ids: Tensor) -> Tensor:  # [L] -> [L, D]
        x = self.emb(ids)
        q, k, v = self.qkv(x).chunk(3, -1)
        causal = torch.ones(len(ids), len(ids), dtype=torch.bool).tril()
        att = (q @ k.T / math.sqrt(D)).masked_fill(~causal, -math.inf).softmax(-1)
        x = x + att @ v
        return self.norm(x + self.mlp(x))

    def forward(self, ids: Tensor) -> Tensor:  # [L] -> [L, V]
        return self.head(self.hidden(ids))


Tensor = torch.Tensor
TEMP = 0.8


def _setup(seed: int = 0):
    model = TinyLM(seed)
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, V, (L,), generator=g)
    positions = torch.tensor([1, 3, 5])
    mu_logp = torch.log_softmax(torch.randn(len(positions), V, generator=g, dtype=torch.float64) * 2, -1)
    adv = torch.tensor([1.0, -1.0, 0.5], dtype=torch.float64)
    return model, ids, positions, mu_logp, adv


def _forward(model: TinyLM):
    return lambda x: model(x) / TEMP


def _d_after(model: TinyLM, params, step, eps: float, ids, p: int, mu_logp, kind: str) -> float:
    """D at row p after moving the parameters by eps·step (then moving them back)."""
    with torch.no_grad():
        for q, s in zip(params, step):
            q.add_(eps * s)
        value = full_divergence(_forward(model)(ids)[p], mu_logp, kind).item()
        for q, s in zip(params, step):
            q.sub_(eps * s)
    return value


@pytest.mark.parametrize("kind", ["tv", "kl"])
def test_own_change_matches_finite_difference(kind: str) -> None:
    model, ids, positions, mu_logp, adv = _setup()
    params = list(model.parameters())
    g = torch.Generator().manual_seed(7)
    precond = [torch.rand(p.shape, generator=g, dtype=torch.float64) + 0.5 for p in params]
    truth = own_change(_forward(model), params, ids, positions, mu_logp, adv, {"sgd": None, "adam": precond}, [kind])
    eps = 1e-6
    for i, p in enumerate(positions.tolist()):
        logp = torch.log_softmax(_forward(model)(ids)[p], -1)[ids[p + 1]]
        grads = torch.autograd.grad(logp, params)
        for name, weight in (("sgd", None), ("adam", precond)):
            step = [adv[i] * gr * (1 if weight is None else weight[j]) for j, gr in enumerate(grads)]

            fd = (_d_after(model, params, step, eps, ids, p, mu_logp[i], kind)
                  - _d_after(model, params, step, -eps, ids, p, mu_logp[i], kind)) / (2 * eps)
            assert truth[(kind, name)][i].item() == pytest.approx(fd, rel=1e-5, abs=1e-10)


def test_own_change_per_token_path_matches_the_batched_one_and_measures_only_what_is_asked() -> None:
    """Large models take one backward pass per token and needed kind: same numbers, NaN where not asked."""
    model, ids, positions, mu_logp, adv = _setup(2)
    params = list(model.parameters())
    precond = {"sgd": None, "adam": [torch.rand_like(p) + 0.5 for p in params]}
    batched = own_change(_forward(model), params, ids, positions, mu_logp, adv, precond)
    need = torch.tensor([[True, True], [False, True], [True, False]])
    per_token = own_change(_forward(model), params, ids, positions, mu_logp, adv, precond, batch_elems=1, need=need)
    for (kind, name), value in per_token.items():
        j = ("tv", "kl").index(kind)
        torch.testing.assert_close(value[need[:, j]], batched[(kind, name)][need[:, j]], rtol=1e-9, atol=1e-14)
        assert value[~need[:, j]].isnan().all()


@pytest.mark.parametrize("kind", ["tv", "kl"])
def test_head_change_is_output_layer_autograd(kind: str) -> None:
    model, ids, positions, mu_logp, adv = _setup(1)
    head = [model.head.weight, model.head.bias]
    ref = own_change(_forward(model), head, ids, positions, mu_logp, adv, {"sgd": None}, [kind])[(kind, "sgd")]
    h = model.hidden(ids)[positions]
    got = head_change(h, model.head.weight, model.head.bias, TEMP, ids[positions + 1], mu_logp, adv, kind)
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("kind", ["tv", "kl"])
@pytest.mark.parametrize("seed", range(5))
def test_check5_output_layer_sign_equals_pdm_full(kind: str, seed: int) -> None:
    """method.md check 5: for the output layer alone, sign(A·G_full) is the sign of the true change."""
    model, ids, positions, mu_logp, adv = _setup(seed)
    positions = torch.arange(L - 1)
    g = torch.Generator().manual_seed(seed)
    mu_logp = torch.log_softmax(torch.randn(L - 1, V, generator=g, dtype=torch.float64) * 3, -1)
    adv = torch.randn(L - 1, generator=g, dtype=torch.float64)
    with torch.no_grad():
        h = model.hidden(ids)[positions]
        z = model.head(h) / TEMP
    tokens = ids[positions + 1]
    truth = head_change(h, model.head.weight, model.head.bias, TEMP, tokens, mu_logp, adv, kind)
    rollout = RolloutLogprobs(mu_logp.gather(-1, tokens[:, None]).squeeze(-1), full_logp=mu_logp)
    g_full = predicted_change(policy_stats(z, tokens, rollout), kind, "full")
    assert torch.equal((adv * g_full).sign(), truth.sign())
    # The magnitude, too: the logits move by (‖h‖² + 1)/T² · (e_a − π).
    scale = (h.square().sum(-1) + 1) / TEMP**2
    torch.testing.assert_close(truth, adv * scale * g_full.double(), rtol=1e-6, atol=1e-12)


def test_adam_preconditioner_reproduces_the_first_step() -> None:
    p = nn.Parameter(torch.randn(5, dtype=torch.float64))
    opt = torch.optim.Adam([p], lr=0.1)
    grad = torch.randn(5, dtype=torch.float64)
    before = p.detach().clone()
    p.grad = grad.clone()
    opt.step()
    # First Adam step: m̂ = g, so Δθ = −lr·g·P.
    (precond,) = adam_preconditioner(opt, [p])
    torch.testing.assert_close(p.detach() - before, -0.1 * grad * precond)
