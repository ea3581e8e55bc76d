"""Bad input raises a clear error naming the argument; it never turns into NaN or a silent wrong answer."""

from __future__ import annotations

import pytest
import torch

from pdmask import (
    RolloutLogprobs,
    policy_loss,
    policy_stats,
    policy_stats_from_hidden,
    predicted_change,
    stats_from_set,
    trust_region_mask,
)

from conftest import make_case, rollout_of

N, V, K = 6, 20, 4


@pytest.fixture
def good():
    z, logmu, a, ids, vals = make_case(N, V, K, dtype=torch.float32)
    return z, logmu, a, ids, vals


def loss_of(z, a, rollout, method="pdm_proportional_tv", adv=None, mask=None, **kw):
    return policy_loss(method, z, a, rollout, torch.ones(N) if adv is None else adv,
                       torch.ones(N) if mask is None else mask, **kw)


def expect(exc, match, fn, *args, **kw):
    with pytest.raises(exc, match=match):
        fn(*args, **kw)


def test_shape_mismatches(good):
    z, logmu, a, ids, vals = good
    expect(ValueError, "tokens has shape", loss_of, z, a[:-1], rollout_of(logmu, a, ids, vals))
    expect(ValueError, "rollout.logp has shape", loss_of, z, a, RolloutLogprobs(torch.zeros(N + 1) - 1, ids, vals))
    expect(ValueError, "rollout.topk_ids has shape", loss_of, z, a, RolloutLogprobs(rollout_of(logmu, a).logp, ids[:3], vals[:3]))
    expect(ValueError, "both must be", RolloutLogprobs, torch.zeros(N), ids, vals[:, :2])
    expect(ValueError, "full_logp has shape", loss_of, z, a, RolloutLogprobs(rollout_of(logmu, a).logp, full_logp=logmu[:, :-1]))
    expect(ValueError, "advantages has shape", loss_of, z, a, rollout_of(logmu, a, ids, vals), adv=torch.ones(N + 2))
    expect(ValueError, "response_mask has shape", loss_of, z, a, rollout_of(logmu, a, ids, vals), mask=torch.ones(2, 3))


def test_ids_out_of_range(good):
    z, logmu, a, ids, vals = good
    bad_a = a.clone()
    bad_a[0] = V
    expect(ValueError, "tokens contains id 20", loss_of, z, bad_a, rollout_of(logmu, a, ids, vals))
    bad_ids = ids.clone()
    bad_ids[1, 0] = -1
    expect(ValueError, "topk_ids contains id -1", loss_of, z, a, rollout_of(logmu, a, bad_ids, vals))


def test_non_finite_logits_and_logprobs(good):
    z, logmu, a, ids, vals = good
    for bad in (float("nan"), float("inf")):
        zb = z.clone()
        zb[2, 3] = bad
        expect(ValueError, "logits contain NaN", loss_of, zb, a, rollout_of(logmu, a, ids, vals))
        lp = rollout_of(logmu, a).logp.clone()
        lp[1] = bad
        expect(ValueError, "rollout.logp contains NaN", loss_of, z, a, RolloutLogprobs(lp))
        vb = vals.clone()
        vb[0, 1] = bad
        expect(ValueError, "rollout.topk_logp contains NaN", loss_of, z, a, rollout_of(logmu, a, ids, vb))
    zb = z.clone()
    zb[0, a[0]] = float("-inf")
    expect(ValueError, "-inf at a sampled token", loss_of, zb, a, rollout_of(logmu, a, ids, vals))
    lp = rollout_of(logmu, a).logp.clone()
    lp[0] = float("-inf")
    expect(ValueError, "positive probability", loss_of, z, a, RolloutLogprobs(lp))


def test_logprobs_above_zero_and_topk_mass_above_one(good):
    z, logmu, a, ids, vals = good
    expect(ValueError, "pass log-probabilities", loss_of, z, a, RolloutLogprobs(torch.full((N,), 0.3)))
    inflated = (vals + 0.5).clamp(max=-0.01)
    expect(ValueError, "sum to", loss_of, z, ids[:, 0], RolloutLogprobs(inflated[:, 0], ids, inflated))
    # within tolerance is accepted (engines round)
    lp = rollout_of(logmu, a).logp.clone()
    lp[0] = 5e-5
    loss, _ = loss_of(z, a, RolloutLogprobs(lp), method="dppo_binary_tv")
    assert torch.isfinite(loss)


def test_duplicate_topk_ids_and_k_zero(good):
    z, logmu, a, ids, vals = good
    dup = ids.clone()
    dup[0, 1] = dup[0, 0]
    expect(ValueError, "duplicate id", loss_of, z, a, rollout_of(logmu, a, dup, vals))
    expect(ValueError, "K = 0", RolloutLogprobs, torch.zeros(N), ids[:, :0], vals[:, :0])
    expect(ValueError, "come together", RolloutLogprobs, torch.zeros(N), ids, None)


def test_inconsistent_sampled_logprob(good):
    z, logmu, a, ids, vals = good
    lp = rollout_of(logmu, a).logp - 0.5
    expect(ValueError, "disagrees with rollout.full_logp", loss_of, z, a, RolloutLogprobs(lp, full_logp=logmu))


def test_unknown_method_agg_threshold_and_missing_information(good):
    z, logmu, a, ids, vals = good
    r = rollout_of(logmu, a, ids, vals)
    expect(ValueError, "unknown mask method 'pdm_magic'", loss_of, z, a, r, method="pdm_magic")
    expect(ValueError, "agg must be one of", loss_of, z, a, r, agg="mean")
    expect(ValueError, "unexpected eps_high", loss_of, z, a, r, eps_high=0.3)
    expect(ValueError, "must be a finite number", loss_of, z, a, r, delta_high=float("nan"))
    expect(ValueError, "needs topk information", loss_of, z, a, rollout_of(logmu, a), method="pdm_aggregated_kl")
    expect(ValueError, "needs full information", loss_of, z, a, r, method="pdm_full_kl")


def test_type_errors(good):
    z, logmu, a, ids, vals = good
    r = rollout_of(logmu, a, ids, vals)
    expect(TypeError, "tokens must be an integer tensor", policy_stats, z, a.float(), r)
    expect(TypeError, "logits must be a floating-point", policy_stats, z.long(), a, r)
    expect(TypeError, "rollout must be a pdmask.RolloutLogprobs", policy_stats, z, a, {"logp": r.logp})
    expect(TypeError, "rollout.topk_ids must be an integer", RolloutLogprobs, r.logp, ids.float(), vals)
    expect(TypeError, "advantages must be a floating-point", trust_region_mask, "pg_is", policy_stats(z, a, r), [1.0])
    expect(ValueError, "chunk_size must be", policy_stats, z, a, r, chunk_size=0)


def test_non_finite_advantages(good):
    z, logmu, a, ids, vals = good
    adv = torch.ones(N)
    adv[0] = float("nan")
    expect(ValueError, "advantages contain NaN", loss_of, z, a, rollout_of(logmu, a, ids, vals), adv=adv)


def test_k_larger_than_vocab():
    z, logmu, a, _, _ = make_case(2, 3, 1)
    ids = torch.tensor([[0, 1, 2, 3]] * 2)
    expect(ValueError, "K = 4 top log-probs", policy_stats, z, a, rollout_of(logmu, a, ids, torch.full((2, 4), -5.0)))


def test_exactpi_estimator_without_what_it_needs():
    z, logmu, a, ids, vals = make_case(N, V, K)
    r = rollout_of(logmu, a, ids, vals).validated(a, V, torch.float64)
    logsm = torch.log_softmax(z, -1)
    set_logp = logsm.gather(-1, torch.cat([ids, a[:, None]], -1))
    parts = stats_from_set(logsm.gather(-1, a[:, None]).squeeze(-1), a, r, set_logp, sq_norm=torch.ones(N))
    expect(ValueError, r"pass stats_from_set\(..., vocab_size=V\)", predicted_change, parts, "kl", "exactpi")
    expect(ValueError, "vocab_size must be an int >= 5", stats_from_set, parts.logp, a, r, set_logp, vocab_size=3)
    expect(ValueError, "needs topk information", trust_region_mask, "pdm_exactpi_tv",
           policy_stats(z, a, rollout_of(logmu, a)), torch.ones(N))


def batch_case(b: int = 2, t: int = 5, v: int = 7, k: int = 3):
    """Logits [b, t, V], tokens, a top-K rollout, advantages and a response mask [b, t]."""
    z, logmu, a, ids, vals = make_case(b * t, v, k)
    r = rollout_of(logmu, a, ids, vals)
    shaped = RolloutLogprobs(r.logp.reshape(b, t), ids.reshape(b, t, k), vals.reshape(b, t, k))
    return z.reshape(b, t, v), a.reshape(b, t), shaped, torch.ones(b, t), torch.ones(b, t)


def message(fn, *args, **kw) -> str:
    with pytest.raises(ValueError) as e:
        fn(*args, **kw)
    return str(e.value)


def test_a_shape_error_names_the_tensor_that_disagrees_with_the_tokens():
    z, a, r, adv, mask = batch_case()
    short = message(policy_loss, "pdm_proportional_tv", z[:, :-1], a, r, adv, mask)  # unshifted: one position short
    assert short.startswith("logits has shape (2, 4, 7); expected (2, 5, 7) = tokens' shape (2, 5) + (V,)"), short
    assert "logits = model(ids).logits[:, :-1] and tokens = ids[:, 1:]" in short
    h, w = torch.randn(2, 4, 3, dtype=torch.float64), torch.randn(7, 3, dtype=torch.float64)
    hidden = message(policy_stats_from_hidden, h, w, a, r, response_mask=mask)
    assert hidden.startswith("hidden has shape (2, 4, 3); expected (2, 5, 3) = tokens' shape (2, 5) + (d,)"), hidden
    tokens = message(policy_loss, "pdm_proportional_tv", z, a[:, :-1], r, adv, mask)  # the others agree with the logits
    assert tokens.startswith("tokens has shape (2, 4); expected the logits' leading shape (2, 5), as rollout.logp and "
                             "response_mask have"), tokens  # fmt: skip


def test_non_finite_logits_say_how_many_where_and_whether_in_the_response():
    z, a, r, adv, mask = batch_case()
    bad = z.clone()
    bad[1, 2, 0] = float("nan")
    bad[1, 4, 3] = float("inf")
    inside = message(policy_loss, "pdm_proportional_tv", bad, a, r, adv, mask)
    assert "logits contain NaN or +inf (or a row of only -inf) at 2 positions, the first at (1, 2), inside the response mask" in inside
    mask[1, 2] = 0  # outside the response it still fails: 0·NaN is NaN in the loss
    outside = message(policy_loss, "pdm_proportional_tv", bad, a, r, adv, mask)
    assert "at 2 positions, the first at (1, 2), outside the response mask (it would still poison the loss through 0·NaN)" in outside
    assert "at 2 positions, the first at (1, 2); " in message(policy_stats, bad, a, r)  # no mask: nothing to say about it
    zero = z.clone()
    zero[0, 3, a[0, 3]] = float("-inf")
    assert "-inf at a sampled token at 1 position, the first at (0, 3), inside the response mask" in message(
        policy_loss, "pdm_proportional_tv", zero, a, r, adv, torch.ones(2, 5)
    )
