"""policy_stats_from_hidden: the statistics of hidden @ weight.T (+ bias) / t without the logits, and its gradients."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdmask import RolloutLogprobs, divergence, policy_stats, policy_stats_from_hidden, predicted_change
from pdmask import reference as ref

SETTINGS = settings(max_examples=30, deadline=None)
FIELDS = ("logp", "set_logp", "rest_mass", "tail_sq", "sq_norm", "exactpi_sums")
FULL_FIELDS = ("tv", "kl", "mu_dot_pi", "sign_pi", "sign_pi2")


def head_case(n: int, vocab: int, d: int, k: int, *, seed: int = 0, dtype=torch.float64, bias: bool = True):
    """Hidden states [n, d], an LM head [V, d] (+ bias [V]) and a rollout μ near π with its top-K and full log μ."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=g, dtype=torch.float64)
    w = torch.randn(vocab, d, generator=g, dtype=torch.float64) * (2.0 / d**0.5)
    b = torch.randn(vocab, generator=g, dtype=torch.float64) if bias else None
    h, w, b = h.to(dtype), w.to(dtype), None if b is None else b.to(dtype)
    z = logits_of(h, w, b, 1.0).double()
    logmu = torch.log_softmax(z + 0.7 * torch.randn(n, vocab, generator=g, dtype=torch.float64), -1)
    a = torch.multinomial(logmu.exp(), 1, generator=g).squeeze(-1)
    top = logmu.topk(k, -1)
    rollout = RolloutLogprobs(logmu.gather(-1, a[:, None]).squeeze(-1), top.indices, top.values, logmu)
    return h, w, b, a, rollout


def logits_of(h, w, b, t):
    """The materialised logits policy_stats_from_hidden stands for: the float32 (float64) matmul of the inputs' values, / t."""
    wide = torch.float64 if h.dtype == torch.float64 else torch.float32
    return torch.nn.functional.linear(h.to(wide), w.to(wide), None if b is None else b.to(wide)) / t


def assert_same_stats(got, want, atol):
    for f in FIELDS:
        assert torch.allclose(getattr(got, f).detach(), getattr(want, f).detach(), atol=atol, rtol=0), f
    if want.full is not None:
        for f in FULL_FIELDS:
            assert torch.allclose(getattr(got.full, f), getattr(want.full, f), atol=atol, rtol=0), f


@SETTINGS
@given(
    st.integers(1, 40), st.integers(2, 700), st.integers(1, 24), st.integers(0, 2**31 - 1),
    st.sampled_from([torch.float64, torch.float32, torch.bfloat16]), st.booleans(),
    st.sampled_from([1.0, 0.6]), st.integers(1, 16), st.integers(1, 300),
)
def test_equals_policy_stats_on_the_materialised_logits(n, vocab, d, seed, dtype, bias, t, rows, cols):
    h, w, b, a, rollout = head_case(n, vocab, d, min(vocab, 5), seed=seed, dtype=dtype, bias=bias)
    got = policy_stats_from_hidden(h, w, a, rollout, bias=b, temperature=t, need_exactpi=True, block_rows=rows, block_vocab=cols)
    want = policy_stats(logits_of(h, w, b, t), a, rollout, need_exactpi=True)
    assert got.logp.dtype == want.logp.dtype
    assert_same_stats(got, want, 1e-10 if dtype == torch.float64 else 2e-5)


@SETTINGS
@given(st.integers(2, 400), st.integers(0, 2**31 - 1), st.sampled_from(["tv", "kl"]))
def test_float64_references(vocab, seed, kind):
    h, w, b, a, rollout = head_case(7, vocab, 8, min(vocab, 4), seed=seed)
    stats = policy_stats_from_hidden(h, w, a, rollout, bias=b, temperature=0.8, block_rows=3, block_vocab=50, need_exactpi=True)
    z = (h @ w.T + b) / 0.8
    pi, mu = torch.softmax(z, -1), rollout.full_logp.exp()
    ids = rollout.topk_ids
    assert torch.allclose(stats.logp, torch.log_softmax(z, -1).gather(-1, a[:, None]).squeeze(-1), atol=1e-12)
    assert torch.allclose(stats.sq_norm, pi.square().sum(-1), atol=1e-12)
    rest = torch.where(ref.set_mask(a, ids, vocab), 0.0, pi).sum(-1)
    assert torch.allclose(stats.rest_mass, rest, atol=1e-12)
    expect = {
        "full": ref.predicted_change(z, mu, a, kind),
        "aggregated": ref.aggregated_change(z, mu, a, ids, kind),
        "proportional": ref.proportional_change(z, mu, a, ids, kind),
        "exactpi": ref.exactpi_change(z, mu, a, ids, kind),
    }
    for est, want in expect.items():
        assert torch.allclose(predicted_change(stats, kind, est), want, atol=1e-10), est
    assert torch.allclose(divergence(stats, kind, "full"), ref.DIVERGENCES[kind](pi, mu), atol=1e-10)
    assert torch.allclose(divergence(stats, kind, "topk"), ref.topk_divergence(z, mu, a, ids, kind), atol=1e-10)


@pytest.mark.parametrize("bias", [True, False])
def test_gradients_match_finite_differences(bias):
    h, w, b, a, rollout = head_case(5, 23, 4, 3, seed=4, bias=bias)
    g = torch.randn(5, dtype=torch.float64)
    inputs = tuple(x.clone().requires_grad_(True) for x in (h, w) + ((b,) if bias else ()))

    def logp(*xs):
        bias_ = xs[2] if bias else None
        st = policy_stats_from_hidden(xs[0], xs[1], a, rollout, bias=bias_, temperature=0.7, block_rows=2, block_vocab=6)
        return st.logp * g

    assert torch.autograd.gradcheck(logp, inputs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_match_autograd_of_the_materialised_logits(dtype):
    h, w, b, a, rollout = head_case(20, 300, 16, 5, seed=2, dtype=dtype)
    g = torch.randn(20)
    mine = [x.clone().requires_grad_(True) for x in (h, w, b)]
    stats = policy_stats_from_hidden(*mine[:2], a, rollout, bias=mine[2], temperature=0.9, block_rows=7, block_vocab=64)
    (stats.logp * g).sum().backward()
    plain = [x.clone().requires_grad_(True) for x in (h, w, b)]
    z = logits_of(plain[0], plain[1], plain[2], 0.9)
    (torch.log_softmax(z, -1).gather(-1, a[:, None]).squeeze(-1) * g).sum().backward()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for x, y in zip(mine, plain):
        assert x.grad.dtype == dtype
        assert torch.allclose(x.grad.float(), y.grad.float(), atol=tol, rtol=tol)


def test_packed_batched_and_non_contiguous_hidden_states_agree():
    h, w, b, a, rollout = head_case(3 * 9, 80, 12, 4, seed=6, dtype=torch.float32)
    big = torch.randn(3, 10, 12)
    big[:, :9] = h.reshape(3, 9, 12)
    r3 = RolloutLogprobs(
        rollout.logp.reshape(3, 9), rollout.topk_ids.reshape(3, 9, 4), rollout.topk_logp.reshape(3, 9, 4)
    )
    r1 = RolloutLogprobs(rollout.logp, rollout.topk_ids, rollout.topk_logp)
    leaf = big.clone().requires_grad_(True)
    batched = policy_stats_from_hidden(leaf[:, :9], w, a.reshape(3, 9), r3, bias=b, block_rows=5, block_vocab=30)
    assert not leaf[:, :9].is_contiguous() and batched.logp.shape == (3, 9)
    packed = policy_stats_from_hidden(h, w, a, r1, bias=b, block_rows=4, block_vocab=16)
    for f in ("logp", "set_logp", "rest_mass", "sq_norm"):
        assert torch.allclose(getattr(batched, f).reshape(getattr(packed, f).shape), getattr(packed, f), atol=1e-6), f
    batched.logp.sum().backward()
    assert torch.equal(leaf.grad[:, 9], torch.zeros(3, 12))
    flat = h.clone().requires_grad_(True)
    policy_stats_from_hidden(flat, w, a, r1, bias=b).logp.sum().backward()
    assert torch.allclose(leaf.grad[:, :9].reshape(-1, 12), flat.grad, atol=1e-5)


def test_response_mask_padding_and_the_exactpi_sums_asked_for_up_front():
    h, w, b, a, rollout = head_case(6, 50, 8, 3, seed=8)
    mask = torch.tensor([1, 1, 0, 1, 0, 1])
    ids = rollout.topk_ids.clone()
    ids[2] = ids[2, 0]  # padding may repeat ids
    r = RolloutLogprobs(rollout.logp, ids, rollout.topk_logp)
    eager = policy_stats_from_hidden(h, w, torch.where(mask.bool(), a, -100), r, bias=b, response_mask=mask, need_exactpi=True)
    blocks = policy_stats_from_hidden(h, w, torch.where(mask.bool(), a, -100), r, bias=b, response_mask=mask, need_exactpi=True,
                                      block_vocab=7)  # fmt: skip
    keep = mask.bool()
    assert torch.allclose(predicted_change(eager, "tv", "exactpi")[keep], predicted_change(blocks, "tv", "exactpi")[keep])
    without = policy_stats_from_hidden(h, w, torch.where(mask.bool(), a, -100), r, bias=b, response_mask=mask)
    with pytest.raises(ValueError, match="need_exactpi=True"):
        predicted_change(without, "tv", "exactpi")


def test_no_gradient_needed_and_float64_stays_float64():
    h, w, b, a, rollout = head_case(4, 30, 5, 2, seed=1)
    stats = policy_stats_from_hidden(h, w, a, rollout, bias=b)
    assert stats.logp.dtype == torch.float64 and not stats.logp.requires_grad
    only_w = w.clone().requires_grad_(True)
    policy_stats_from_hidden(h, only_w, a, rollout).logp.sum().backward()
    assert only_w.grad is not None and torch.isfinite(only_w.grad).all()


def test_bad_inputs_name_the_argument_and_the_fix():
    h, w, b, a, rollout = head_case(4, 30, 5, 2, dtype=torch.float32)
    cases = [
        (TypeError, "hidden must be a floating-point", dict(hidden=h.long())),
        (ValueError, r"weight must be the LM head's \[V, d\]", dict(weight=w[0])),
        (ValueError, "weight must be", dict(weight=w[:1])),
        (ValueError, "hidden has d = 5", dict(weight=w[:, :4])),
        (TypeError, "weight has dtype torch.bfloat16 but hidden has torch.float32", dict(weight=w.bfloat16())),
        (TypeError, "bias has dtype torch.float64", dict(bias=b.double())),
        (ValueError, r"bias must be a tensor of shape \(30,\)", dict(bias=b[:-1])),
        (ValueError, "temperature must be a finite number > 0", dict(temperature=0.0)),
        (ValueError, "temperature must be", dict(temperature=float("nan"))),
        (ValueError, "block_vocab must be a positive int", dict(block_vocab=0)),
        (ValueError, "tokens has shape .* hidden states' leading shape", dict(tokens=a[:-1])),
        (ValueError, "tokens contains id 30", dict(tokens=torch.full_like(a, 30))),
    ]
    base = dict(hidden=h, weight=w, tokens=a, rollout=rollout, bias=b)
    for exc, match, change in cases:
        kw = base | change
        with pytest.raises(exc, match=match):
            policy_stats_from_hidden(kw.pop("hidden"), kw.pop("weight"), kw.pop("tokens"), kw.pop("rollout"), **kw)
    bad = w.clone()
    bad[3, 0] = float("nan")
    with pytest.raises(ValueError, match="logits contain NaN"):
        policy_stats_from_hidden(h, bad, a, rollout)


def test_bf16_inputs_give_the_statistics_of_their_float32_copies():
    """So a trainer passes its bf16 hidden states and head as they are (no [N, d] and [V, d] float32 copies)."""
    h, w, b, a, rollout = head_case(12, 500, 32, 5, seed=3, dtype=torch.bfloat16)
    kw = dict(need_exactpi=True, block_rows=5, block_vocab=128)
    low = policy_stats_from_hidden(h, w, a, rollout, bias=b, **kw)
    copies = policy_stats_from_hidden(h.float(), w.float(), a, rollout, bias=b.float(), **kw)
    assert low.logp.dtype == torch.float32
    assert_same_stats(low, copies, 1e-6)
    z = torch.nn.functional.linear(h.double(), w.double(), b.double())  # the float64 reference of the bf16 values
    pi = torch.softmax(z, -1)
    assert torch.allclose(low.logp.double(), torch.log_softmax(z, -1).gather(-1, a[:, None]).squeeze(-1), atol=2e-5)
    assert torch.allclose(low.sq_norm.double(), pi.square().sum(-1), atol=2e-6)
    rest = torch.where(ref.set_mask(a, rollout.topk_ids, 500), 0.0, pi).sum(-1)
    assert torch.allclose(low.rest_mass.double(), rest, atol=2e-6)


def test_without_wide_matmuls_the_operands_are_upcast_once_detected(monkeypatch):
    """A torch whose float32-output matmuls of bf16 operands raise (CPU kernels here; ``addmm`` with a float32 self
    in torch 2.11 on CUDA) falls back to the upcast operands on the first failure, and stays there."""
    from pdmask.backends import hidden as backend

    for name, overload in (("MM", "mm.dtype_out"), ("ADDMM", "addmm.dtype_out")):
        monkeypatch.setattr(backend, name, backend.WideMatmul(overload, devices=("cpu",)))  # try them, as on CUDA
    h, w, b, a, rollout = head_case(12, 300, 16, 4, seed=5, dtype=torch.bfloat16)
    runs = []
    for dtype in (torch.bfloat16, torch.float32):
        leaves = [x.detach().to(dtype).requires_grad_(True) for x in (h, w, b)]
        stats = policy_stats_from_hidden(*leaves[:2], a, rollout, bias=leaves[2], need_exactpi=True, block_rows=5, block_vocab=128)
        stats.logp.sum().backward()
        runs.append((stats, [x.grad.float() for x in leaves]))
    assert backend.MM.works is False and backend.ADDMM.works is False  # tried once each, then upcast
    (low, low_grads), (copies, copy_grads) = runs
    assert_same_stats(low, copies, 1e-6)
    for got, want in zip(low_grads, copy_grads):
        assert torch.allclose(got, want, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
def test_bf16_on_cuda_matches_its_float32_copies_forward_and_backward():
    """The CUDA branch: bf16 matmuls with float32 output (``pdmask.backends.hidden.MM`` and ``ADDMM``) forward and in the gradients."""
    h, w, b, a, rollout = head_case(40, 3000, 64, 5, seed=8, dtype=torch.bfloat16)
    cuda = lambda x: x.cuda()
    rollout = RolloutLogprobs(*(None if x is None else x.cuda() for x in (rollout.logp, rollout.topk_ids, rollout.topk_logp)))
    g = torch.randn(40, device="cuda")
    runs = []
    for dtype in (torch.bfloat16, torch.float32):
        leaves = [cuda(x).to(dtype).requires_grad_(True) for x in (h, w, b)]
        stats = policy_stats_from_hidden(*leaves[:2], cuda(a), rollout, bias=leaves[2], need_exactpi=True, block_rows=16, block_vocab=512)
        (stats.logp * g).sum().backward()
        runs.append((stats, [x.grad.float() for x in leaves]))
    (low, low_grads), (copies, copy_grads) = runs
    assert_same_stats(low, copies, 1e-5)
    for x, y in zip(low_grads, copy_grads):
        assert torch.allclose(x, y, atol=2e-2, rtol=2e-2)
