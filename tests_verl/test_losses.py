"""pdmask's binary masks as verl policy losses: registration by `import verl`, parity with verl's DPPO losses."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from verl.trainer.ppo.core_algos import agg_loss, get_policy_loss_fn

import pdmask
from pdmask.integrations.verl import BINARY_METHODS, TOPK_METHODS, check_verl_version
from pdmask.integrations.verl.losses import binary_stats
from pdmask.integrations.verl.topk import HEAD_METHODS

from conftest import actor_config

AGG = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def _loss_and_grad(name, old, new, adv, mask, agg, config, weights=None):
    new.grad = None
    loss, metrics = get_policy_loss_fn(name)(old, new, adv, mask, agg, config, weights)
    loss.backward()
    return loss.detach(), new.grad.clone(), metrics


def test_import_verl_registers_the_losses():
    code = (
        "import verl\nfrom verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY as R\n"
        "print(sorted(k for k in R if k.startswith('pdmask_')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    names = (*BINARY_METHODS, *TOPK_METHODS, *HEAD_METHODS)
    assert out.strip() == str(sorted(f"pdmask_{m}" for m in names))
    assert set(BINARY_METHODS) == {"ppo_clip", "pg_is", "dppo_binary_tv", "dppo_binary_kl"}
    assert {"pdm_proportional_tv", "pdm_aggregated_kl", "pdm_uniform_tv", "dppo_topk_kl"} <= set(TOPK_METHODS)


def test_backbone_aware_modes_say_why_verl_cannot_run_them(binary_batch):
    from verl.workers.config import PolicyLossConfig

    from pdmask.integrations.verl import PDMLoss

    assert set(HEAD_METHODS) == {n for n, m in pdmask.METHODS.items() if m.needs_head} and not set(HEAD_METHODS) & set(TOPK_METHODS)
    with pytest.raises(ValueError, match="hidden states and the LM head"):
        PDMLoss(actor_config(policy_loss=PolicyLossConfig(loss_mode="pdmask_pdm_backbone_topk_kl")))
    old, new, adv, mask = binary_batch
    with pytest.raises(ValueError, match="hidden states and the LM head"):
        get_policy_loss_fn("pdmask_pdm_backbone_topk_kl")(old, new, adv, mask, "token-mean", actor_config(), None)


def test_a_name_of_no_release_is_no_loss_mode():
    with pytest.raises(ValueError, match="Unsupported loss mode"):
        get_policy_loss_fn("pdmask_pdm_bucket_kl")


@pytest.mark.parametrize("kind", ["tv", "kl"])
@pytest.mark.parametrize("agg", (*AGG, "token-sum"))  # token-sum: verl's mode, not pdmask's
@pytest.mark.parametrize("global_info", [False, True])
def test_dppo_binary_equals_verl_dppo(binary_batch, kind, agg, global_info):
    old, new, adv, mask = binary_batch
    delta = 0.15 if kind == "tv" else 0.05
    config = actor_config(clip_ratio_low=delta, clip_ratio_high=delta * 1.3, clip_ratio_c=2.0)
    if global_info:  # verl's global-batch normalisation, as its ppo_loss sets it per micro-batch
        config.global_batch_info.update(dp_size=2, batch_num_tokens=97, global_batch_size=11, loss_scale_factor=16)
    weights = torch.rand(old.shape, generator=torch.Generator().manual_seed(1)) + 0.5
    for w in (None, weights):
        ref_loss, ref_grad, ref_m = _loss_and_grad(f"dppo_{kind}", old, new, adv, mask, agg, config, w)
        loss, grad, m = _loss_and_grad(f"pdmask_dppo_binary_{kind}", old, new, adv, mask, agg, config, w)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-6, atol=1e-7)
        assert ref_grad.abs().sum() > 0
        assert m["actor/ppo_kl"] == pytest.approx(ref_m["actor/ppo_kl"], rel=1e-6)


@pytest.mark.parametrize("kind", ["tv", "kl"])
def test_drop_fraction_matches_verl_without_zero_advantages(binary_batch, kind):
    old, new, adv, mask = binary_batch
    config = actor_config(clip_ratio_low=0.1, clip_ratio_high=0.1)
    _, _, ref_m = _loss_and_grad(f"dppo_{kind}", old, new, adv, mask, "token-mean", config)
    _, _, m = _loss_and_grad(f"pdmask_dppo_binary_{kind}", old, new, adv, mask, "token-mean", config)
    assert m["actor/pg_clipfrac"] == pytest.approx(ref_m["actor/pg_clipfrac"])
    assert m["actor/pdmask/mask/dropped_frac"] == pytest.approx(ref_m["actor/pg_clipfrac"])
    assert 0 < m["actor/pg_clipfrac"] < 1
    # A = 0 tokens: pdmask keeps them, verl's DPPO applies its A < 0 rule (same loss, other drop fraction).
    zero = adv.clone()
    zero[0] = 0.0
    _, _, ref_m = _loss_and_grad(f"dppo_{kind}", old, new, zero, mask, "token-mean", config)
    _, _, m = _loss_and_grad(f"pdmask_dppo_binary_{kind}", old, new, zero, mask, "token-mean", config)
    assert m["actor/pg_clipfrac"] <= ref_m["actor/pg_clipfrac"]


@pytest.mark.parametrize("method", ["ppo_clip", "pg_is", "dppo_binary_tv"])
def test_same_loss_as_pdmask_core(binary_batch, method):
    old, new, adv, mask = binary_batch
    config = actor_config(clip_ratio=0.2, clip_ratio_low=None, clip_ratio_high=0.28, clip_ratio_c=4.0)
    loss, grad, metrics = _loss_and_grad(f"pdmask_{method}", old, new, adv, mask, "token-mean", config)
    m = pdmask.get_method(method)
    t = {"ratio_cap": 4.0} | (
        {"eps_low": 0.2, "eps_high": 0.28}
        if m.rule == "ppo_clip"
        else {}
        if m.rule == "none"
        else {"delta_low": 0.2, "delta_high": 0.28}
    )
    leaf = new.detach().clone().requires_grad_(True)
    stats = binary_stats(leaf, old, mask)
    loss_mat, keep = pdmask.per_token_loss(m, stats, adv, mask, **t)
    ref = pdmask.aggregate_loss(loss_mat, mask, "token-mean")
    ref.backward()
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad, leaf.grad, rtol=1e-6, atol=1e-7)
    assert metrics["actor/pdmask/mask/dropped_frac"] == pytest.approx(
        pdmask.mask_metrics(pdmask.decide(m, stats, adv, mask, **t))["mask/dropped_frac"]
    )


@pytest.mark.parametrize("agg", AGG[:3])
def test_pdmask_aggregation_equals_verls_in_one_process(binary_batch, agg):
    _, _, loss_mat, mask = binary_batch
    torch.testing.assert_close(pdmask.aggregate_loss(loss_mat, mask, agg), agg_loss(loss_mat, mask, agg))


def test_agg_is_verls(binary_batch):
    """seq-mean-token-sum-norm: verl divides by (sequences × length); pdmask's own aggregate_loss by length alone."""
    old, new, adv, mask = binary_batch
    config = actor_config()
    loss, _, _ = _loss_and_grad("pdmask_pg_is", old, new, adv, mask, "seq-mean-token-sum-norm", config)
    stats = binary_stats(new.detach(), old, mask)
    loss_mat, _ = pdmask.per_token_loss("pg_is", stats, adv, mask, ratio_cap=3.0)
    torch.testing.assert_close(loss, agg_loss(loss_mat, mask, "seq-mean-token-sum-norm"))
    sequences = int((mask.sum(-1) > 0).sum())
    torch.testing.assert_close(loss * sequences, pdmask.aggregate_loss(loss_mat, mask, "seq-mean-token-sum-norm"))


def test_verl_default_ratio_cap_is_3(binary_batch):
    old, new, adv, mask = binary_batch
    new = (old + 2.0).clamp(max=0.0).requires_grad_(True)  # ratios up to e²
    adv = adv.abs()
    config = actor_config(clip_ratio_low=1.0, clip_ratio_high=1.0)  # a band no token leaves
    _, grad, _ = _loss_and_grad("pdmask_dppo_binary_tv", old, new, adv, mask, "token-mean", config)
    _, ref, _ = _loss_and_grad("dppo_tv", old, new, adv, mask, "token-mean", config)
    torch.testing.assert_close(grad, ref)
    ratio = (new - old).exp().detach()
    expected = -(adv * ratio.clamp(max=3.0)) * mask / mask.sum()
    torch.testing.assert_close(grad, expected)


def test_version_check():
    for ok in ("0.9.1", "0.9.5", "0.9.2.dev0"):
        check_verl_version(ok)
    for bad in ("0.9.0", "0.10.0", "1.0.0"):
        with pytest.raises(ImportError, match=r"supports verl >=0\.9\.1,<0\.10 .*pdmask\[verl\]"):
            check_verl_version(bad)


def test_bad_input_is_one_line(binary_batch):
    old, new, adv, mask = binary_batch
    loss_fn = get_policy_loss_fn("pdmask_dppo_binary_tv")
    with pytest.raises(ValueError, match="config is None"):
        loss_fn(old, new, adv, mask, "token-mean", None, None)
    bad = old.clone()
    bad[0, 0] = 0.5
    mask = mask.clone()
    mask[0, 0] = True
    with pytest.raises(ValueError, match=r"rollout\.logp has a value 0\.5 > 0"):
        loss_fn(bad, new, adv, mask, "token-mean", actor_config(), None)
    nan_adv = adv.clone()
    nan_adv[0, 0] = float("nan")
    with pytest.raises(ValueError, match="advantages contain NaN"):
        loss_fn(old, new, nan_adv, mask, "token-mean", actor_config(), None)


def test_ppo_clip_gradient_equals_verl_vanilla_but_past_the_dual_clip(binary_batch):
    old, new, adv, mask = binary_batch
    config = actor_config(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)
    _, grad, _ = _loss_and_grad("pdmask_ppo_clip", old, new, adv, mask, "token-mean", config)
    _, ref, _ = _loss_and_grad("vanilla", old, new, adv, mask, "token-mean", config)
    dual = (adv < 0) & ((new - old).exp() > 3.0) & mask
    assert dual.any()
    torch.testing.assert_close(grad[~dual], ref[~dual], rtol=1e-6, atol=1e-7)
    assert (ref[dual] == 0).all() and (grad[dual] != 0).all()
