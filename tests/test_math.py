"""method.md's checks 1-4: the closed forms, the estimators and the divergences against float64 references."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdmask import RolloutLogprobs, divergence, policy_stats, predicted_change
from pdmask import reference as ref
from pdmask.stats import stats_from_set

from conftest import make_case, rollout_of

SETTINGS = settings(max_examples=40, deadline=None)
DTYPES = st.sampled_from([torch.float64, torch.float32, torch.bfloat16])


@st.composite
def cases(draw, min_vocab=2, max_vocab=2000):
    vocab = draw(st.integers(min_vocab, max_vocab))
    k = draw(st.integers(1, vocab))
    n = draw(st.integers(1, 6))
    seed = draw(st.integers(0, 2**31 - 1))
    drift = draw(st.sampled_from([0.05, 0.5, 2.0]))
    return make_case(n, vocab, k, seed=seed, drift=drift)


def _tol(dtype):
    return {torch.float64: (1e-9, 1e-7), torch.float32: (2e-5, 1e-3), torch.bfloat16: (2e-5, 1e-3)}[dtype]


@SETTINGS
@given(cases(max_vocab=500), st.sampled_from(["tv", "kl"]))
def test_check1_full_G_matches_finite_differences(c, kind):
    z, logmu, a, ids, vals = c
    stats = policy_stats(z, a, rollout_of(logmu, a, full=True))
    fd = ref.finite_difference(z, logmu.exp(), a, kind)
    g = predicted_change(stats, kind, "full")
    assert torch.allclose(g, fd, rtol=1e-4, atol=1e-8), (g, fd)


@SETTINGS
@given(cases(), st.sampled_from(["tv", "kl"]), DTYPES)
def test_fast_paths_match_float64_references(c, kind, dtype):
    z, logmu, a, ids, vals = c
    z = z.to(dtype)
    zr = z.double()  # the reference sees exactly the values the fast path was given
    mu = logmu.exp()
    stats = policy_stats(z, a, rollout_of(logmu, a, ids, vals, full=True), need_exactpi=True)
    atol, rtol = _tol(dtype)
    expect = {
        ("G", "full"): ref.predicted_change(zr, mu, a, kind),
        ("G", "aggregated"): ref.aggregated_change(zr, mu, a, ids, kind),
        ("G", "proportional"): ref.proportional_change(zr, mu, a, ids, kind),
        ("G", "exactpi"): ref.exactpi_change(zr, mu, a, ids, kind),
        ("G", "uniform"): ref.uniform_change(zr, mu, a, ids, kind),
        ("D", "full"): ref.DIVERGENCES[kind](torch.softmax(zr, -1), mu),
        ("D", "topk"): ref.topk_divergence(zr, mu, a, ids, kind),
        ("D", "binary"): ref.binary_divergence(zr, mu, a, kind),
    }
    # TV's G jumps where π_i = μ_i (method.md, check 1 excludes ties): below float64, a near tie can take the
    # other sign, so rows with one are compared only in float64.
    p = torch.softmax(zr, -1)
    rows = torch.ones(a.shape, dtype=torch.bool)
    if kind == "tv" and dtype != torch.float64:
        rows = ~((p - mu).abs() <= 1e-5 * p).any(-1)
    for (what, how), want in expect.items():
        got = predicted_change(stats, kind, how) if what == "G" else divergence(stats, kind, how)
        assert got.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
        keep = rows if what == "G" else torch.ones_like(rows)
        assert torch.allclose(got.double()[keep], want[keep], rtol=rtol, atol=atol), (what, how, got, want)


@SETTINGS
@given(st.integers(2, 300), st.integers(0, 2**31 - 1), st.sampled_from(["tv", "kl"]))
def test_check2_estimators_agree_when_S_covers_the_support(vocab, seed, kind):
    z, logmu, a, ids, vals = make_case(4, vocab, vocab, seed=seed)
    _assert_topk_estimators_exact(policy_stats(z, a, rollout_of(logmu, a, ids, vals, full=True), need_exactpi=True), kind)


@SETTINGS
@given(st.integers(3, 300), st.integers(0, 2**31 - 1), st.sampled_from(["tv", "kl"]))
def test_check2_estimators_agree_with_one_token_outside_S(vocab, seed, kind):
    z, logmu, a, _, _ = make_case(1, vocab, 1, seed=seed)
    outside = (a + 1) % vocab
    ids = torch.tensor([i for i in range(vocab) if i != outside.item()])[None]
    _assert_topk_estimators_exact(policy_stats(z, a, rollout_of(logmu, a, ids, logmu.gather(-1, ids), full=True), need_exactpi=True), kind)


def _assert_topk_estimators_exact(stats, kind):
    full = predicted_change(stats, kind, "full")
    for est in ("aggregated", "uniform", "proportional", "exactpi"):
        assert torch.allclose(predicted_change(stats, kind, est), full, rtol=1e-6, atol=1e-10), est


@SETTINGS
@given(st.integers(4, 1000), st.integers(0, 2**31 - 1), st.sampled_from(["tv", "kl"]))
def test_check2_tail_is_exact_when_mu_tail_is_proportional(vocab, seed, kind):
    z, logmu, a, ids, _ = make_case(3, vocab, max(1, vocab // 5), seed=seed)
    pi = torch.softmax(z, -1)
    in_s = ref.set_mask(a, ids, vocab)
    mu_s = torch.where(in_s, logmu.exp(), 0.0)
    scale = (1 - mu_s.sum(-1, keepdim=True)) / torch.where(in_s, 0.0, pi).sum(-1, keepdim=True)
    mu = torch.where(in_s, mu_s, pi * scale)
    logmu = mu.log()
    stats = policy_stats(z, a, rollout_of(logmu, a, ids, logmu.gather(-1, ids), full=True), need_exactpi=True)
    assert torch.allclose(predicted_change(stats, kind, "proportional"), predicted_change(stats, kind, "full"), atol=1e-10)


@SETTINGS
@given(st.integers(4, 1000), st.integers(0, 2**31 - 1), st.sampled_from(["tv", "kl"]), st.sampled_from([0.0, 1.0]))
def test_check2_exactpi_is_exact_when_mu_tail_is_even(vocab, seed, kind, tail_share):
    """μ completed with an even tail u = μ_R / T off S, as method.md defines it; μ_R = 0 included."""
    z, logmu, a, ids, _ = make_case(3, vocab, max(1, vocab // 5), seed=seed)
    in_s = ref.set_mask(a, ids, vocab)
    mu_s = torch.where(in_s, logmu.exp(), 0.0)
    mu_s = mu_s / mu_s.sum(-1, keepdim=True) * (1 - tail_share * (1 - mu_s.sum(-1, keepdim=True)))
    even = (1 - mu_s.sum(-1, keepdim=True)).clamp_min(0) / (~in_s).sum(-1, keepdim=True).clamp_min(1)
    logmu = torch.where(in_s, mu_s, even).log()
    stats = policy_stats(z, a, rollout_of(logmu, a, ids, logmu.gather(-1, ids), full=True), need_exactpi=True)
    g = predicted_change(stats, kind, "exactpi")
    assert torch.allclose(g, predicted_change(stats, kind, "full"), atol=1e-10)
    assert torch.allclose(g, ref.exactpi_change(z, logmu.exp(), a, ids, kind), atol=1e-10)


@SETTINGS
@given(st.integers(4, 1000), st.integers(0, 2**31 - 1), st.sampled_from(["tv", "kl"]))
def test_check2_paper_uniform_is_exact_when_both_tails_are_even(vocab, seed, kind):
    """π and μ both even off S (π from logits equal off S): the paper's uniform-tail = full."""
    z, logmu, a, ids, _ = make_case(3, vocab, max(1, vocab // 5), seed=seed)
    in_s = ref.set_mask(a, ids, vocab)
    z = torch.where(in_s, z, z.masked_fill(in_s, float("-inf")).logsumexp(-1, keepdim=True) - math.log(vocab))
    mu_s = torch.where(in_s, logmu.exp(), 0.0)
    even = (1 - mu_s.sum(-1, keepdim=True)).clamp_min(0) / (~in_s).sum(-1, keepdim=True).clamp_min(1)
    logmu = torch.where(in_s, mu_s, even).log()
    stats = policy_stats(z, a, rollout_of(logmu, a, ids, logmu.gather(-1, ids), full=True), need_exactpi=True)
    g = predicted_change(stats, kind, "uniform")
    assert torch.allclose(g, predicted_change(stats, kind, "full"), atol=1e-10)
    assert torch.allclose(g, ref.uniform_change(z, logmu.exp(), a, ids, kind), atol=1e-10)


@SETTINGS
@given(st.integers(2, 2000), st.integers(0, 2**31 - 1), st.sampled_from([torch.float64, torch.float32]))
def test_exactpi_sums_are_asked_for_up_front_and_agree_over_chunk_sizes(vocab, seed, dtype):
    z, logmu, a, ids, vals = make_case(5, vocab, min(vocab, 4), seed=seed, dtype=dtype)
    rollout = rollout_of(logmu, a, ids, vals)
    two = policy_stats(z, a, rollout, need_exactpi=True, chunk_size=2)
    three = policy_stats(z, a, rollout, need_exactpi=True, chunk_size=3)
    assert torch.equal(predicted_change(two, "tv", "exactpi"), predicted_change(three, "tv", "exactpi"))
    without = policy_stats(z, a, rollout, chunk_size=3)
    assert without.exactpi_sums is None
    with pytest.raises(ValueError, match="need_exactpi=True"):  # no second pass behind the caller's back
        predicted_change(without, "tv", "exactpi")


@SETTINGS
@given(
    st.integers(0, 2**31 - 1),
    st.sampled_from(["tv", "kl"]),
    st.sampled_from(["full", "aggregated", "uniform", "proportional", "exactpi"]),
)
def test_check3_two_categories_sign_is_the_ratio_sign(seed, kind, est):
    z, logmu, a, ids, vals = make_case(8, 2, 1, seed=seed)
    stats = policy_stats(z, a, rollout_of(logmu, a, ids, vals, full=True), need_exactpi=True)
    g = predicted_change(stats, kind, est)
    assert torch.equal(torch.sign(g), torch.sign(stats.pi_a - stats.mu_a))


def test_check4_only_logp_carries_gradient(case):
    z, logmu, a, ids, vals = case
    z = z.clone().requires_grad_(True)
    stats = policy_stats(z, a, rollout_of(logmu, a, ids, vals, full=True), need_exactpi=True)
    assert stats.logp.requires_grad
    detached = [stats.rollout_logp, stats.sq_norm, stats.set_logp, stats.set_mu, stats.ratio, stats.pi_a]
    detached += [getattr(stats.full, f) for f in ("tv", "kl", "mu_dot_pi", "sign_pi", "sign_pi2")]
    for kind in ("tv", "kl"):
        detached += [predicted_change(stats, kind, e) for e in ("full", "aggregated", "uniform", "proportional", "exactpi")]
        detached += [divergence(stats, kind, i) for i in ("binary", "topk", "full")]
    assert not any(t.requires_grad for t in detached)


def test_logp_gradient_matches_autograd_of_log_softmax():
    z, logmu, a, _, _ = make_case(6, 40, 3, seed=3)
    z = z.requires_grad_(True)
    g = torch.randn(6, dtype=torch.float64)
    assert torch.autograd.gradcheck(
        lambda x: policy_stats(x, a, rollout_of(logmu, a), chunk_size=4).logp * g, (z,)
    )
    (mine,) = torch.autograd.grad((policy_stats(z, a, rollout_of(logmu, a), chunk_size=4).logp * g).sum(), z)
    (plain,) = torch.autograd.grad((torch.log_softmax(z, -1).gather(-1, a[:, None]).squeeze(-1) * g).sum(), z)
    assert torch.allclose(mine, plain, atol=1e-12)


@SETTINGS
@given(st.integers(1, 40), st.integers(0, 2**31 - 1))
def test_chunked_and_unchunked_statistics_agree(chunk, seed):
    z, logmu, a, ids, vals = make_case(37, 120, 6, seed=seed, dtype=torch.float32)
    rollout = rollout_of(logmu, a, ids, vals, full=True)
    one, many = policy_stats(z, a, rollout, chunk_size=10_000), policy_stats(z, a, rollout, chunk_size=chunk)
    for f in ("logp", "sq_norm", "set_logp"):
        assert torch.allclose(getattr(one, f), getattr(many, f), atol=1e-6)
    for f in ("tv", "kl", "mu_dot_pi", "sign_pi", "sign_pi2"):
        assert torch.allclose(getattr(one.full, f), getattr(many.full, f), atol=1e-6)


def test_non_contiguous_logits_are_not_copied_and_agree():
    z, logmu, a, ids, vals = make_case(3 * 9, 50, 4, seed=1, dtype=torch.float32)
    big = torch.randn(3, 10, 50)
    big[:, :9] = z.reshape(3, 9, 50)
    sliced = big[:, :9].requires_grad_(False)
    r = rollout_of(logmu.reshape(3, 9, 50), a.reshape(3, 9), ids.reshape(3, 9, 4), vals.reshape(3, 9, 4))
    s1 = policy_stats(sliced, a.reshape(3, 9), r, chunk_size=4)
    s2 = policy_stats(sliced.contiguous(), a.reshape(3, 9), r, chunk_size=4)
    assert torch.allclose(s1.sq_norm, s2.sq_norm) and torch.allclose(s1.set_logp, s2.set_logp)
    leaf = big.clone().requires_grad_(True)
    policy_stats(leaf[:, :9], a.reshape(3, 9), r, chunk_size=4).logp.sum().backward()
    leaf2 = big.clone().requires_grad_(True)
    torch.log_softmax(leaf2[:, :9], -1).gather(-1, a.reshape(3, 9, 1)).sum().backward()
    assert torch.allclose(leaf.grad, leaf2.grad, atol=1e-6)


def test_sampled_token_inside_or_outside_topk_gives_the_same_set():
    z, logmu, a, ids, vals = make_case(1, 30, 3, seed=5)
    a_in = ids[:, :1].squeeze(-1)
    s_in = policy_stats(z, a_in, rollout_of(logmu, a_in, ids, vals))
    assert s_in.set_valid[0].tolist() == [True, True, True, False]
    a_out = torch.tensor([int(torch.ones(30).index_fill(0, ids[0], 0).nonzero()[0])])
    s_out = policy_stats(z, a_out, rollout_of(logmu, a_out, ids, vals))
    assert s_out.set_valid[0].all()


def test_bf16_logits_are_upcast_and_differentiable():
    z, logmu, a, ids, vals = make_case(8, 100, 5, seed=2)
    zb = z.to(torch.bfloat16).requires_grad_(True)
    stats = policy_stats(zb, a, rollout_of(logmu, a, ids, vals), need_exactpi=True)
    assert stats.logp.dtype == torch.float32
    stats.logp.sum().backward()
    assert zb.grad.dtype == torch.bfloat16 and torch.isfinite(zb.grad.float()).all()
    want = torch.log_softmax(zb.detach().double(), -1).gather(-1, a[:, None]).squeeze(-1)
    assert torch.allclose(stats.logp.double(), want, atol=1e-5)


def test_rollout_info_levels():
    z, logmu, a, ids, vals = make_case(2, 10, 3)
    assert rollout_of(logmu, a).info == "binary"
    assert rollout_of(logmu, a, ids, vals).info == "topk"
    assert rollout_of(logmu, a, full=True).info == "full"
    assert isinstance(rollout_of(logmu, a), RolloutLogprobs)


def test_float32_peaked_policy_keeps_its_tail():
    """π with almost no tail but μ with 10% there: 1 − Σ_S π would be rounding noise in float32."""
    vocab = 1000
    z = torch.zeros(1, vocab, dtype=torch.float64)
    z[0, :2] = 30.0
    mu = torch.full((1, vocab), 0.1 / (vocab - 2), dtype=torch.float64)
    mu[0, 0], mu[0, 1] = 0.55, 0.35  # no tie with π = (0.5, 0.5, ~0...), where TV is not differentiable
    a = torch.tensor([0])
    top = mu.log().topk(20, -1)
    rollout = rollout_of(mu.log(), a, top.indices, top.values, full=True)
    s32, s64 = (policy_stats(x, a, rollout, need_exactpi=True) for x in (z.float(), z))
    for kind in ("tv", "kl"):
        for est in ("full", "aggregated", "uniform", "proportional", "exactpi"):
            g32, g64 = predicted_change(s32, kind, est).double(), predicted_change(s64, kind, est)
            assert torch.allclose(g32, g64, rtol=1e-4, atol=1e-6), (kind, est, g32, g64)
        for info in ("binary", "topk", "full"):
            assert torch.allclose(divergence(s32, kind, info).double(), divergence(s64, kind, info), rtol=1e-4)


def test_float32_binary_kl_of_a_confident_token():
    vocab = 1000
    z = torch.zeros(1, vocab, dtype=torch.float64)
    z[0, 0] = 25.0
    a = torch.tensor([0])
    rollout = RolloutLogprobs(torch.tensor([0.999], dtype=torch.float64).log())
    d32 = divergence(policy_stats(z.float(), a, rollout), "kl", "binary").double()
    d64 = divergence(policy_stats(z, a, rollout), "kl", "binary")
    assert torch.allclose(d32, d64, rtol=1e-3) and d64.item() < 0.05


def test_neg_inf_topk_logprobs_mean_probability_zero():
    z, logmu, a, ids, vals = make_case(4, 30, 6, seed=9)
    vals = vals.clone()
    vals[:, -2:] = float("-inf")  # the engine's distribution has no mass there (e.g. top-p sampling)
    a = ids[:, 0]  # sampled among the finite top-K entries
    rollout = RolloutLogprobs(vals[:, 0], ids, vals)
    stats = policy_stats(z, a, rollout, need_exactpi=True)
    for kind in ("tv", "kl"):
        assert torch.isfinite(divergence(stats, kind, "topk")).all()
        for est in ("aggregated", "uniform", "proportional", "exactpi"):
            assert torch.isfinite(predicted_change(stats, kind, est)).all()
    with pytest.raises(ValueError, match="disagrees with rollout.topk_logp"):
        policy_stats(z, ids[:, -1], RolloutLogprobs(vals[:, 0], ids, vals))


@pytest.mark.parametrize("with_topk", [True, False])
def test_stats_from_set_matches_policy_stats(with_topk):
    z, logmu, a, ids, vals = make_case(12, 300, 7, seed=11, drift=1.0)
    rollout = rollout_of(logmu, a, ids, vals) if with_topk else rollout_of(logmu, a)
    full = policy_stats(z, a, rollout)
    logsm = torch.log_softmax(z, -1)
    cols = torch.cat([ids, a[:, None]], -1) if with_topk else a[:, None]
    parts = stats_from_set(
        logsm.gather(-1, a[:, None]).squeeze(-1), a, rollout.validated(a, 300, torch.float64),
        logsm.gather(-1, cols), sq_norm=logsm.exp().square().sum(-1), vocab_size=300,
    )
    kinds_infos = [("binary", None)] + ([("topk", e) for e in ("aggregated", "uniform", "proportional")] if with_topk else [])
    for kind in ("tv", "kl"):
        for info, est in kinds_infos + ([("topk", "exactpi")] if with_topk and kind == "kl" else []):
            assert torch.allclose(divergence(parts, kind, info), divergence(full, kind, info), atol=1e-9)
            if est:
                assert torch.allclose(predicted_change(parts, kind, est), predicted_change(full, kind, est), atol=1e-9)
    if with_topk:  # the TV form needs thresholded sums over the vocabulary, which no set of columns gives
        with pytest.raises(ValueError, match="compute the statistics with pdmask.policy_stats"):
            predicted_change(parts, "tv", "exactpi")
