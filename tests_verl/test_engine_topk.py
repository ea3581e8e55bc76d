"""Top-K methods through verl's FSDP engine (CPU, gloo, world size 1) against pdmask.policy_loss on the same weights."""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace

import pytest
import torch
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu
from verl.workers.config import PolicyLossConfig
from verl.workers.utils.losses import ppo_loss

import pdmask
from pdmask.integrations.verl import PDMLoss, topk
from pdmask.integrations.verl.rollout import topk_batch_fields
from pdmask.testing.verl import build_actor_engine

from conftest import DELTA, K, actor_config, captured_stats, engine_data


@pytest.fixture(scope="module")
def engines(model_dir):
    return {rmpad: build_actor_engine(model_dir, use_remove_padding=rmpad) for rmpad in (True, False)}


def _config(method, agg="token-mean"):
    """verl's actor config for ``pdmask_<method>`` (or verl's own ``dppo_tv``/``dppo_kl``)."""
    mode = method if method in ("dppo_tv", "dppo_kl") else f"pdmask_{method}"
    return actor_config(
        clip_ratio_low=DELTA, clip_ratio_high=DELTA, loss_agg_mode=agg, policy_loss=PolicyLossConfig(loss_mode=mode)
    )


@pytest.mark.parametrize("rmpad", [True, False], ids=["remove_padding", "padded"])
@pytest.mark.parametrize("method", ["pdm_proportional_tv", "pdm_aggregated_kl", "pdm_uniform_tv", "dppo_topk_kl"])
def test_engine_loss_and_mask_equal_pdmask(engines, rollout_batch, rmpad, method):
    batch, logits = rollout_batch
    with captured_stats() as seen:
        out = engines[rmpad].infer_batch(engine_data(batch, rmpad=rmpad), loss_function=PDMLoss(_config(method), top_k=K))

    mask = batch["response_mask"]
    rollout = pdmask.RolloutLogprobs(batch["rollout_log_probs"], batch[topk.TOPK_IDS], batch[topk.TOPK_LOGP])
    thresholds = {"delta_low": DELTA, "delta_high": DELTA, "ratio_cap": 3.0}
    ref, _ = pdmask.policy_loss(method, logits, batch["responses"], rollout, batch["advantages"], mask, **thresholds)
    torch.testing.assert_close(torch.tensor(sum(out["loss"])), ref, rtol=1e-5, atol=1e-6)

    ref_stats = pdmask.policy_stats(logits, batch["responses"], rollout, response_mask=mask, need_exactpi=True)
    ref_keep = pdmask.trust_region_mask(method, ref_stats, batch["advantages"], mask, **thresholds)
    keep = torch.cat([pdmask.trust_region_mask(method, s, a, m, **thresholds) for s, a, m in seen])
    assert torch.equal(keep, ref_keep)
    assert 0 < (~keep & mask.bool()).sum() < mask.sum()  # the mask has work to do
    stats = [s for s, _, _ in seen]
    for name in ("logp", "set_logp", "rest_mass", "sq_norm"):
        got = torch.cat([getattr(s, name).detach() for s in stats])
        want = getattr(ref_stats, name).detach()
        torch.testing.assert_close(got[mask.bool()], want[mask.bool()], rtol=1e-5, atol=1e-6)


def test_engine_train_batch_steps(engines, rollout_batch):
    batch, _ = rollout_batch
    engine = engines[True]
    before = [p.detach().full_tensor().clone() for p in engine.module.parameters()]
    out = engine.train_batch(engine_data(batch, rmpad=True), loss_function=PDMLoss(_config("pdm_proportional_tv"), top_k=K))
    after = [p.detach().full_tensor() for p in engine.module.parameters()]
    assert torch.isfinite(torch.tensor(out["metrics"]["grad_norm"]))
    assert any(not torch.equal(a, b) for a, b in zip(before, after, strict=True))


def test_engine_without_the_flag_names_the_fix(engines, rollout_batch):
    batch, _ = rollout_batch
    with pytest.raises(RuntimeError, match="enable_topk_forward"):
        engines[True].infer_batch(
            engine_data(batch, rmpad=True, flag=False), loss_function=PDMLoss(_config("pdm_proportional_tv"))
        )


def test_bad_input_gives_one_line_errors(rollout_batch):
    batch, _ = rollout_batch
    with pytest.raises(ValueError, match="loss_mode is 'pdmask_dppo_binary_tv'"):
        PDMLoss(_config("dppo_binary_tv"))
    td = TensorDict({k: v for k, v in batch.items() if k != topk.TOPK_IDS}, batch_size=[4])
    with pytest.raises(ValueError, match=r"lacks rollout_topk_ids \[batch, response_len, K\]"):
        topk.rollout_from_batch(td, pdmask.get_method("pdm_proportional_tv"))
    with pytest.raises(ValueError, match=r"K = 4 columns but PDMLoss was built with top_k=8"):
        topk.rollout_from_batch(TensorDict(dict(batch), batch_size=[4]), pdmask.get_method("pdm_proportional_tv"), 8)
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    x = batch["rollout_log_probs"]
    with pytest.raises(RuntimeError, match=r"PDMLoss\(config\)"):
        get_policy_loss_fn("pdmask_pdm_proportional_tv")(
            x, x, batch["advantages"], batch["response_mask"], "token-mean", _config("pdm_proportional_tv"), None
        )
    fused = TensorDict({}, batch_size=[])
    tu.assign_non_tensor(fused, use_fused_kernels=True)
    with pytest.raises(RuntimeError, match="use_fused_kernels=False"):
        PDMLoss(_config("pdm_proportional_tv"))(model_output={"log_probs": x}, data=fused)


def test_topk_batch_fields_pads_to_the_response_length(rollout_batch):
    batch, _ = rollout_batch
    mask = batch["response_mask"].bool()
    assert batch[topk.TOPK_IDS].shape == (4, 7, K) and batch["rollout_log_probs"].shape == (4, 7)
    assert (batch["rollout_log_probs"][~mask] == 0).all()
    assert (batch[topk.TOPK_IDS][~mask] == torch.arange(K)).all()
    assert (batch[topk.TOPK_LOGP][~mask][:, 0] == 0).all() and torch.isneginf(batch[topk.TOPK_LOGP][~mask][:, 1:]).all()
    short = SimpleNamespace(rollout=pdmask.RolloutLogprobs(torch.zeros(1, 3)), response_mask=torch.ones(1, 3))
    with pytest.raises(ValueError, match="completions carry no top-K"):
        topk_batch_fields(short, 4)
    topk_short = SimpleNamespace(
        rollout=pdmask.RolloutLogprobs(torch.zeros(1, 3), torch.zeros(1, 3, 1, dtype=torch.long), torch.zeros(1, 3, 1)),
        response_mask=torch.ones(1, 3),
    )
    with pytest.raises(ValueError, match=r"response_length=2 is shorter than the longest completion \(3 tokens\)"):
        topk_batch_fields(topk_short, 2)


@pytest.mark.parametrize("kind", ["tv", "kl"])
def test_binary_loss_through_the_engine_equals_verls(engines, rollout_batch, kind):
    """verl's own ppo_loss with loss_mode pdmask_dppo_binary_* vs dppo_*: the binary path needs no PDMLoss."""
    batch, _ = rollout_batch
    losses = [
        sum(
            engines[True].infer_batch(
                engine_data(batch, rmpad=True, flag=False), loss_function=partial(ppo_loss, config=_config(name))
            )["loss"]
        )
        for name in (f"dppo_binary_{kind}", f"dppo_{kind}")
    ]
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)
