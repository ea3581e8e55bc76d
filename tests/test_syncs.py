"""Host-device syncs of the hot path (counted on the CPU by pdmask.tools.counts) and its fullgraph compile."""

from __future__ import annotations

import pytest
import torch

from pdmask import aggregate_loss, decide, decision_loss, mask_metrics, metrics_to_floats, policy_loss, policy_stats
from pdmask.tools.counts import count, counting, profiled_launches

from conftest import make_case, rollout_of

B, T, V, K = 3, 6, 80, 5
METHODS = ("pdm_proportional_tv", "pdm_exactpi_tv", "dppo_topk_kl", "ppo_clip")


def batch(dtype=torch.float32):
    z, logmu, a, ids, vals = make_case(B * T, V, K, seed=3, drift=1.0)
    rollout = rollout_of(logmu.reshape(B, T, V), a.reshape(B, T), ids.reshape(B, T, K), vals.reshape(B, T, K))
    mask = torch.ones(B, T)
    mask[1, 4:] = 0
    adv = torch.randn(B, generator=torch.Generator().manual_seed(0))
    return z.reshape(B, T, V).to(dtype).requires_grad_(True), a.reshape(B, T), rollout, adv, mask


def test_the_counter_sees_each_kind_of_sync():
    x = torch.arange(6.0)
    with counting() as c:
        x.sum().item()
        bool(x.max() > 2)
        x[x > 2]
        x.tolist()
        torch.nonzero(x)
    assert dict(c.syncs) == {"_local_scalar_dense": 2, "index(bool)": 1, "tolist": 1, "nonzero": 1}


def test_the_dispatcher_and_the_profiler_count_the_same_launches():
    x = torch.randn(10, 7)
    fn = lambda: torch.log_softmax(x, -1).exp().reshape(70).view(10, 7).sum(-1)  # views launch nothing
    assert count(fn) == (0, 3) and profiled_launches(fn) == 3


@pytest.mark.parametrize("method", METHODS)
def test_unvalidated_loss_and_backward_make_no_sync(method):
    z, a, rollout, adv, mask = batch(torch.bfloat16)
    with counting() as c:
        loss, metrics = policy_loss(method, z, a, rollout, adv, mask, validate=False, tensor_metrics=True)
        loss.backward()
    assert sum(c.syncs.values()) == 0, dict(c.syncs)
    assert all(isinstance(v, torch.Tensor) and v.dim() == 0 for v in metrics.values())
    assert count(lambda: metrics_to_floats(metrics))[0] == 1  # logging them is one transfer


def test_float_metrics_cost_one_sync_and_match_the_tensors():
    z, a, rollout, adv, mask = batch()
    syncs, _ = count(lambda: policy_loss("pdm_proportional_tv", z, a, rollout, adv, mask, validate=False))
    assert syncs == 1
    loss, floats = policy_loss("pdm_proportional_tv", z, a, rollout, adv, mask)
    _, tensors = policy_loss("pdm_proportional_tv", z, a, rollout, adv, mask, validate=False, tensor_metrics=True)
    assert floats == metrics_to_floats(tensors) and floats["loss/policy"] == loss.item()
    assert all(type(v) is float for v in floats.values())


def test_the_checks_read_their_verdicts_back_once_per_stage():
    z, a, rollout, adv, mask = batch()
    # The inputs' checks before the pass, the finiteness checks after it (and the advantages, and the metrics).
    assert count(lambda: policy_stats(z, a, rollout, response_mask=mask))[0] == 2
    assert count(lambda: policy_loss("pdm_proportional_tv", z, a, rollout, adv, mask))[0] == 4


def test_unvalidated_statistics_equal_the_validated_ones():
    z, a, rollout, adv, mask = batch()
    assert count(lambda: policy_stats(z, a, rollout, response_mask=mask, need_exactpi=True, validate=False))[0] == 0
    checked = policy_stats(z, a, rollout, response_mask=mask, need_exactpi=True)
    unchecked = policy_stats(z, a, rollout, response_mask=mask, need_exactpi=True, validate=False)
    for name in ("logp", "set_logp", "rest_mass", "tail_sq", "sq_norm", "exactpi_sums"):
        assert torch.equal(getattr(checked, name), getattr(unchecked, name)), name


def test_the_decision_and_loss_path_compiles_without_graph_breaks():
    z, a, rollout, adv, mask = batch()
    stats = policy_stats(z, a, rollout, response_mask=mask, need_exactpi=True, validate=False)

    def step(stats, adv, mask):
        decision = decide("pdm_exactpi_tv", stats, adv, mask, validate=False)
        return aggregate_loss(decision_loss(decision), mask, validate=False), mask_metrics(decision, as_tensors=True)

    # fullgraph=True raises on any graph break; aot_eager also traces the backward, without a C compiler's minute.
    loss, metrics = torch.compile(step, fullgraph=True, backend="aot_eager")(stats, adv, mask)
    eager_loss, eager_metrics = step(stats, adv, mask)
    torch.testing.assert_close(loss, eager_loss)
    assert metrics_to_floats(metrics) == pytest.approx(metrics_to_floats(eager_metrics))
    loss.backward()
    assert z.grad is not None and torch.isfinite(z.grad).all()


@pytest.mark.gpu
def test_no_sync_on_cuda_by_the_sync_debug_mode():
    z, a, rollout, adv, mask = batch(torch.bfloat16)
    z, a, adv, mask = z.detach().cuda().requires_grad_(True), a.cuda(), adv.cuda(), mask.cuda()
    rollout = type(rollout)(*(None if x is None else x.cuda() for x in (rollout.logp, rollout.topk_ids, rollout.topk_logp)))

    def step():
        loss, metrics = policy_loss("pdm_exactpi_tv", z, a, rollout, adv, mask, validate=False, tensor_metrics=True)
        loss.backward()
        return metrics

    step()  # compiles the kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any sync raises
    try:
        metrics = step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert set(metrics_to_floats(metrics)) >= {"mask/dropped_frac", "loss/policy"}
