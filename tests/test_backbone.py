"""The backbone-aware direction G_W: its derivation, the float64 reference, and both fast passes against it."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_hidden import head_case, logits_of

import pdmask
from pdmask import RolloutLogprobs, policy_stats, policy_stats_from_hidden, predicted_change
from pdmask import reference as ref

SETTINGS = settings(max_examples=20, deadline=None)
BACKBONE_METHODS = ("pdm_backbone_full_tv", "pdm_backbone_topk_tv", "pdm_backbone_full_kl", "pdm_backbone_topk_kl")


def reference_gw(h, w, b, t, a, rollout, kind, estimator):
    """G_W in float64 from the materialised logits and the full μ (proportional μ' for the top-K form)."""
    z = logits_of(h.double(), w.double(), None if b is None else b.double(), t)
    mu = rollout.full_logp.double().exp()
    if estimator == "backbone_topk":
        mu = ref.proportional_mu(z, mu, a, rollout.topk_ids)
    return ref.backbone_change(z, mu, a, w, kind)


@pytest.mark.parametrize("kind", ["tv", "kl"])
def test_reference_is_the_derivative_along_the_hidden_gradient(kind):
    h, w, _, a, rollout = head_case(12, 40, 6, 5, seed=1, bias=False)
    mu = rollout.full_logp.exp()
    got = ref.backbone_change(h @ w.T, mu, a, w, kind)
    want = ref.backbone_finite_difference(h, w, mu, a, kind)
    assert torch.allclose(got, want, atol=1e-7, rtol=1e-6)


@pytest.mark.parametrize("kind", ["tv", "kl"])
def test_own_step_with_an_identity_backbone_is_head_term_plus_gw(kind):
    # The derivation (docs/method.md): a token's own step on (h, W) changes D by ‖h‖²·G + κ·G_W, κ = 1 here.
    h, w, _, a, rollout = head_case(10, 30, 5, 4, seed=2, bias=False)
    z, mu = h @ w.T, rollout.full_logp.exp()
    want = (h * h).sum(-1) * ref.predicted_change(z, mu, a, kind) + ref.backbone_change(z, mu, a, w, kind)
    assert torch.allclose(ref.own_step_change(h, w, mu, a, kind), want, atol=1e-9, rtol=1e-7)


@SETTINGS
@given(
    st.integers(1, 30), st.integers(2, 400), st.integers(1, 12), st.integers(0, 2**31 - 1),
    st.sampled_from(["tv", "kl"]), st.sampled_from(["backbone_full", "backbone_topk"]), st.integers(1, 9),
)
def test_logits_pass_matches_the_reference(n, vocab, d, seed, kind, estimator, chunk):
    h, w, b, a, rollout = head_case(n, vocab, d, min(vocab, 5), seed=seed)
    z = logits_of(h, w, b, 1.0)
    stats = policy_stats(z.float(), a, rollout, head_weight=w.float(), chunk_size=chunk)
    got = predicted_change(stats, kind, estimator)
    want = reference_gw(h, w, b, 1.0, a, rollout, kind, estimator)
    scale = 1 + want.abs()
    assert torch.allclose(got.double() / scale, want / scale, atol=2e-5), (got, want)


@settings(max_examples=10, deadline=None)
@given(
    st.integers(1, 20), st.integers(2, 200), st.integers(1, 12), st.integers(0, 2**31 - 1),
    st.sampled_from([torch.float64, torch.float32, torch.bfloat16]), st.booleans(), st.sampled_from([1.0, 0.6]),
    st.integers(2, 8), st.integers(32, 150), st.sampled_from(["tv", "kl"]), st.sampled_from(["backbone_full", "backbone_topk"]),
)
def test_hidden_pass_matches_the_logits_pass(n, vocab, d, seed, dtype, bias, t, rows, cols, kind, estimator):
    h, w, b, a, rollout = head_case(n, vocab, d, min(vocab, 5), seed=seed, dtype=dtype, bias=bias)
    got = policy_stats_from_hidden(h, w, a, rollout, bias=b, temperature=t, need_backbone=True, block_rows=rows, block_vocab=cols)
    want = policy_stats(logits_of(h, w, b, t), a, rollout, head_weight=w.to(torch.float64 if dtype == torch.float64 else torch.float32))
    g_got, g_want = predicted_change(got, kind, estimator), predicted_change(want, kind, estimator)
    scale = 1 + g_want.abs()
    assert torch.allclose(g_got / scale, g_want / scale, atol=1e-10 if dtype == torch.float64 else 2e-5)
    if dtype == torch.float64:  # and the float64 pass is the reference itself
        ref_gw = reference_gw(h, w, b, t, a, rollout, kind, estimator)
        assert torch.allclose(g_got, ref_gw, atol=1e-9, rtol=1e-9)


def test_response_mask_and_batch_shape():
    h, w, b, a, rollout = head_case(12, 50, 4, 5, seed=3)
    mask = torch.tensor([1] * 9 + [0] * 3).reshape(3, 4)
    parts = (rollout.logp, rollout.topk_ids, rollout.topk_logp, rollout.full_logp)
    shaped = RolloutLogprobs(*(x.reshape(3, 4, *x.shape[1:]) for x in parts))
    stats = policy_stats_from_hidden(h.reshape(3, 4, -1), w, a.reshape(3, 4), shaped, bias=b, need_backbone=True, response_mask=mask)
    flat = policy_stats_from_hidden(h, w, a, rollout, bias=b, need_backbone=True)
    for est in ("backbone_full", "backbone_topk"):
        got = predicted_change(stats, "kl", est)
        assert got.shape == (3, 4)
        assert torch.allclose(got.reshape(-1)[:9], predicted_change(flat, "kl", est)[:9])


@pytest.mark.parametrize("name", BACKBONE_METHODS)
def test_registered_and_decided(name):
    m = pdmask.METHODS[name]
    assert m.needs_head and m.origin == "pdmask" and m.rule == "pdm"
    assert m.needs == ("full" if "full" in name else "topk")
    h, w, b, a, rollout = head_case(20, 60, 5, 5, seed=4)
    adv = torch.randn(20, dtype=torch.float64)
    stats = policy_stats(logits_of(h, w, b, 1.0), a, rollout, head_weight=w)
    d = pdmask.decide(name, stats, adv, delta_low=0.0, delta_high=0.0)
    assert torch.equal(d.direction, predicted_change(stats, m.kind, m.estimator))
    assert torch.equal(d.keep, ~(d.beyond & (adv * d.direction > 0)))


def test_without_the_head_the_error_names_the_fix():
    h, w, b, a, rollout = head_case(6, 30, 4, 5, seed=5)
    stats = policy_stats(logits_of(h, w, b, 1.0), a, rollout)
    with pytest.raises(ValueError, match="head_weight=W"):
        pdmask.decide("pdm_backbone_topk_kl", stats, torch.ones(6, dtype=torch.float64))
    with pytest.raises(ValueError, match="head_weight must be"):
        policy_stats(logits_of(h, w, b, 1.0), a, rollout, head_weight=w[:-1])


def test_backbone_full_needs_the_full_mu_in_the_pass():
    h, w, b, a, rollout = head_case(6, 30, 4, 5, seed=6)
    topk_only = RolloutLogprobs(rollout.logp, rollout.topk_ids, rollout.topk_logp)
    stats = policy_stats(logits_of(h, w, b, 1.0), a, topk_only, head_weight=w)
    with pytest.raises(ValueError, match="full"):
        pdmask.decide("pdm_backbone_full_kl", stats, torch.ones(6, dtype=torch.float64))


def test_backbone_scale_measures_both_terms(monkeypatch):
    from pdmask.lab.models import build_policy
    from pdmask.tools import backbone_scale

    torch.manual_seed(0)
    policy = build_policy("tiny", vocab_size=64, block_size=16)
    monkeypatch.setattr(backbone_scale, "_policy_and_prompt", lambda name: (policy, torch.randint(4, 60, (1, 12))))
    m = backbone_scale.measure("tiny", positions=3, probes=2, seed=0)
    assert len(m["kappa"]) == len(m["h_sq"]) == 3 and min(m["kappa"]) > 0 and min(m["h_sq"]) > 0
    for kind in ("kl", "tv"):
        assert len(m[f"ratio_{kind}"]) == 3 and set(m[f"agree_{kind}"]) <= {0.0, 1.0}
