"""The surrogate, its aggregation modes, packed input and the metrics."""

from __future__ import annotations

import math

import pytest
import torch

from pdmask import AGG_MODES, METHODS, aggregate_loss, per_token_loss, policy_loss, policy_stats

from conftest import make_case, rollout_of

B, T, V, K = 3, 7, 90, 5


def batch(seed=0, dtype=torch.float32):
    z, logmu, a, ids, vals = make_case(B * T, V, K, seed=seed, drift=1.0)
    g = torch.Generator().manual_seed(seed + 1)
    mask = torch.ones(B, T)
    mask[0, 5:] = 0
    mask[2, 3:] = 0
    adv = torch.randn(B, generator=g)
    rollout = rollout_of(logmu.reshape(B, T, V), a.reshape(B, T), ids.reshape(B, T, K), vals.reshape(B, T, K), True)
    return z.reshape(B, T, V).to(dtype), a.reshape(B, T), rollout, adv, mask


def verl_agg(loss_mat, mask, mode):
    """verl's agg_loss, written out; sequences without response tokens do not count in seq-means."""
    if mode == "token-mean":
        return (loss_mat * mask).sum() / mask.sum()
    nonempty = mask.sum(-1) > 0
    seq = (loss_mat * mask).sum(-1)[nonempty]
    if mode == "seq-mean-token-sum":
        return seq.mean()
    if mode == "seq-mean-token-mean":
        return (seq / mask.sum(-1)[nonempty]).mean()
    return seq.sum() / mask.shape[-1]


@pytest.mark.parametrize("agg", AGG_MODES)
def test_aggregation_matches_verl_semantics(agg):
    g = torch.Generator().manual_seed(0)
    loss_mat, mask = torch.randn(4, 6, generator=g), (torch.rand(4, 6, generator=g) > 0.3).float()
    mask[1] = 0  # a response masked out entirely (e.g. overlong filtering)
    assert torch.allclose(aggregate_loss(loss_mat, mask, agg), verl_agg(loss_mat, mask, agg))
    # TRL's padding-free batches are [1, N] with sequence boundaries.
    lengths = torch.tensor([6, 6, 6, 6])
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    packed = aggregate_loss(loss_mat.reshape(1, -1), mask.reshape(1, -1), agg, cu_seqlens=cu, norm_length=6)
    assert torch.allclose(packed, verl_agg(loss_mat, mask, agg))


@pytest.mark.parametrize("method", sorted(METHODS))
def test_loss_value_and_gradient_match_the_formula(method):
    z, a, rollout, adv, mask = batch(dtype=torch.float64)
    z = z.requires_grad_(True)
    # Any W [V, d] defines the backbone-aware direction; the loss's formula does not depend on it.
    head = torch.randn(V, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) if METHODS[method].needs_head else None
    loss, metrics = policy_loss(method, z, a, rollout, adv, mask, agg="token-mean", head_weight=head)
    loss.backward()
    stats = policy_stats(z.detach(), a, rollout, head_weight=head, need_exactpi=True)
    _, keep = per_token_loss(method, stats, adv, mask)
    w = keep.double() * stats.ratio.clamp(max=METHODS[method].defaults["ratio_cap"]) * adv[:, None] / mask.sum()
    pi = torch.softmax(z.detach(), -1)
    want = -w[..., None] * (torch.nn.functional.one_hot(a, V).double() - pi)
    assert torch.allclose(z.grad, want, atol=1e-12)
    assert math.isclose(loss.item(), -(w * stats.logp).sum().item(), rel_tol=1e-9, abs_tol=1e-12)
    assert metrics["loss/policy"] == pytest.approx(loss.item())


@pytest.mark.parametrize("agg", AGG_MODES)
def test_packed_and_batched_inputs_agree(agg):
    z, a, rollout, adv, mask = batch()
    lens = mask.sum(-1).long()
    sel = mask.bool()
    packed = dict(
        logits=z[sel], tokens=a[sel], advantages=adv[:, None].expand(B, T)[sel], response_mask=torch.ones(int(lens.sum()))
    )
    prollout = type(rollout)(rollout.logp[sel], rollout.topk_ids[sel], rollout.topk_logp[sel], rollout.full_logp[sel])
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])
    for method in ("pdm_proportional_tv", "dppo_binary_kl", "ppo_clip"):
        lb, mb = policy_loss(method, z, a, rollout, adv, mask, agg)
        lp, mp = policy_loss(
            method, packed["logits"], packed["tokens"], prollout, packed["advantages"], packed["response_mask"], agg,
            cu_seqlens=cu, norm_length=T,
        )
        assert torch.allclose(lb, lp, atol=1e-6), (method, agg)
        assert mb == pytest.approx(mp, abs=1e-6)


def test_packed_seq_modes_need_cu_seqlens():
    with pytest.raises(ValueError, match="cu_seqlens"):
        aggregate_loss(torch.zeros(5), torch.ones(5), "seq-mean-token-mean")
    with pytest.raises(ValueError, match="cu_seqlens must rise"):
        aggregate_loss(torch.zeros(5), torch.ones(5), "seq-mean-token-sum", cu_seqlens=torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="cu_seqlens describes packed input"):
        aggregate_loss(torch.zeros(2, 5), torch.ones(2, 5), "seq-mean-token-sum", cu_seqlens=torch.tensor([0, 5]))
    with pytest.raises(ValueError, match="norm_length must be a positive int"):
        aggregate_loss(torch.zeros(2, 5), torch.ones(2, 5), "seq-mean-token-sum-norm", norm_length=-3)


def test_all_tokens_dropped_gives_zero_loss_with_a_graph():
    z, a, rollout, adv, mask = batch()
    z = z.requires_grad_(True)
    # μ(a) far below π(a) puts every ratio above the PPO band: all positive-advantage tokens are dropped.
    loss, metrics = policy_loss("ppo_clip", z, a, type(rollout)(rollout.logp - 5.0), torch.ones(B), mask)
    assert metrics["mask/dropped_frac"] == 1.0 and loss.item() == 0.0
    loss.backward()
    assert z.grad is not None and torch.count_nonzero(z.grad) == 0


def test_empty_response_mask_gives_zero_loss_and_defined_metrics():
    z, a, rollout, adv, _ = batch()
    z = z.requires_grad_(True)
    for agg in AGG_MODES:
        loss, metrics = policy_loss("pdm_proportional_kl", z, a, rollout, adv, torch.zeros(B, T), agg)
        assert loss.item() == 0.0 and loss.requires_grad
        assert all(math.isfinite(v) for v in metrics.values())


def test_metrics_names_and_ranges():
    z, a, rollout, adv, mask = batch(seed=4)
    _, m = policy_loss("pdm_proportional_tv", z, a, rollout, adv, mask)
    for key in (
        "mask/dropped_frac", "mask/dropped_frac_pos", "mask/dropped_frac_neg", "mask/beyond_threshold_frac",
        "mask/direction_disagree_frac", "div/mean", "div/max", "div/p90", "ratio/mean", "ratio/max",
    ):
        assert isinstance(m[key], float) and math.isfinite(m[key]), key
    assert 0 <= m["mask/dropped_frac"] <= m["mask/beyond_threshold_frac"] <= 1
    assert m["div/mean"] <= m["div/max"] and m["div/p90"] <= m["div/max"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_logits(dtype):
    z, a, rollout, adv, mask = batch()
    zl = z.to(dtype).requires_grad_(True)
    loss, _ = policy_loss("pdm_proportional_tv", zl, a, rollout, adv, mask)
    loss.backward()
    ref, _ = policy_loss("pdm_proportional_tv", zl.detach().float(), a, rollout, adv, mask)
    assert torch.isfinite(loss) and torch.allclose(loss, ref, atol=1e-5)
    assert zl.grad.dtype == dtype


def test_padding_outside_the_response_mask_is_ignored():
    z, a, rollout, adv, mask = batch()
    pad = ~mask.bool()
    dirty_a = a.masked_fill(pad, -100)
    dirty = type(rollout)(
        rollout.logp.masked_fill(pad, 0.0),
        rollout.topk_ids.masked_fill(pad[..., None], 0),
        rollout.topk_logp.masked_fill(pad[..., None], 0.0),
        rollout.full_logp.masked_fill(pad[..., None], 0.0),
    )
    for method in ("pdm_full_kl", "pdm_proportional_tv", "dppo_topk_kl", "ppo_clip"):
        clean_loss, clean_m = policy_loss(method, z, a, rollout, adv, mask)
        dirty_loss, dirty_m = policy_loss(method, z, dirty_a, dirty, adv, mask)
        assert torch.allclose(clean_loss, dirty_loss) and clean_m == pytest.approx(dirty_m)
    with pytest.raises(ValueError, match="tokens contains id -100"):
        policy_loss("pdm_proportional_tv", z, dirty_a, rollout, adv, torch.ones(B, T))


def test_metrics_stay_finite_for_extreme_ratios():
    z, a, rollout, adv, mask = batch()
    tiny_mu = type(rollout)(torch.full_like(rollout.logp, -120.0))
    loss, metrics = policy_loss("pg_is", z, a, tiny_mu, adv, mask)
    assert torch.isfinite(loss) and all(math.isfinite(v) for v in metrics.values())
    assert metrics["ratio/max"] > 1e40


def test_mask_metrics_takes_a_decision(case):
    from pdmask import mask_metrics

    with pytest.raises(TypeError, match="pdmask.decide"):
        mask_metrics("pdm_aggregated_kl")

