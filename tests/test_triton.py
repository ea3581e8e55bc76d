"""The fused Triton logits pass (pdmask.triton_pass) against the chunked torch pass and the float64 reference.

On the CPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1, numpy); the tests marked
``gpu`` run them compiled on CUDA (scripts/gpu_check.sh) and are skipped without a GPU.
"""

from __future__ import annotations

import os

import pytest
import torch

from pdmask import divergence, policy_loss, policy_stats, predicted_change
from pdmask import reference as ref
from pdmask.tools.counts import counting
from pdmask.triton_pass import ENV, triton_available

from conftest import make_case, rollout_of

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton is not installed (pip install 'pdmask[gpu]')")

FIELDS = ("logp", "set_logp", "rest_mass", "tail_sq", "sq_norm", "exactpi_sums")
TOPK_ESTIMATORS = ("aggregated", "uniform", "proportional", "exactpi")


@pytest.fixture
def fused(monkeypatch):
    """The fused kernels forced on, on CPU tensors: interpreted (conftest sets TRITON_INTERPRET=1 without CUDA)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs the kernels on CPU tensors, in Triton's interpreter: TRITON_INTERPRET=1 before triton is imported")
    monkeypatch.setenv(ENV, "1")
    return monkeypatch


def both_paths(fused, fn):
    """fn() with the fused kernels, then with the torch pass; asserts the fused one ran."""
    with counting() as c:
        out = fn()
    assert c.launches["logits_stats"] == 1
    fused.setenv(ENV, "0")
    return out, fn()


def _case(n, vocab, k, dtype, seed=0, drift=1.0):
    z, logmu, a, ids, vals = make_case(n, vocab, k, seed=seed, drift=drift)
    return z.to(dtype), logmu, a, ids, vals


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [7, 300, 2500])  # one block, a partial block, several blocks of 1,024
def test_fused_statistics_and_gradient_equal_the_torch_pass(fused, dtype, vocab):
    z, logmu, a, ids, vals = _case(9, vocab, min(5, vocab - 1), dtype)
    z.requires_grad_(True)
    rollout = rollout_of(logmu, a, ids, vals)
    weights = torch.linspace(-2, 3, a.numel())

    def run():
        stats = policy_stats(z, a, rollout, need_exactpi=True)
        (grad,) = torch.autograd.grad((weights * stats.logp).sum(), z)
        return stats, grad

    (got, got_grad), (want, want_grad) = both_paths(fused, run)
    for name in FIELDS:
        torch.testing.assert_close(getattr(got, name), getattr(want, name), rtol=1e-5, atol=1e-6, msg=name)
    assert got_grad.dtype == dtype
    torch.testing.assert_close(got_grad, want_grad, **({"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {}))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["tv", "kl"])
def test_every_estimator_from_the_fused_pass_matches_the_float64_reference(fused, dtype, kind):
    z, logmu, a, ids, vals = _case(6, 400, 8, dtype, seed=5)
    zr, mu = z.double(), logmu.exp()  # the reference sees exactly the values the kernel was given
    stats = policy_stats(z, a, rollout_of(logmu, a, ids, vals), need_exactpi=True)
    binary = policy_stats(z, a, rollout_of(logmu, a))
    expect = {
        "aggregated": ref.aggregated_change(zr, mu, a, ids, kind),
        "uniform": ref.uniform_change(zr, mu, a, ids, kind),
        "proportional": ref.proportional_change(zr, mu, a, ids, kind),
        "exactpi": ref.exactpi_change(zr, mu, a, ids, kind),
    }
    for estimator, want in expect.items():
        torch.testing.assert_close(predicted_change(stats, kind, estimator).double(), want, rtol=1e-3, atol=2e-5, msg=estimator)
    torch.testing.assert_close(divergence(stats, kind, "topk").double(), ref.topk_divergence(zr, mu, a, ids, kind), rtol=1e-3, atol=2e-5)
    torch.testing.assert_close(divergence(binary, kind, "binary").double(), ref.binary_divergence(zr, mu, a, kind), rtol=1e-3, atol=2e-5)


def test_fused_loss_equals_the_torch_loss_without_syncs(fused):
    z, logmu, a, ids, vals = _case(12, 500, 6, torch.bfloat16, seed=2)
    z = z.reshape(3, 4, 500).requires_grad_(True)
    rollout = rollout_of(logmu.reshape(3, 4, 500), a.reshape(3, 4), ids.reshape(3, 4, 6), vals.reshape(3, 4, 6))
    adv, mask = torch.tensor([1.0, -0.5, 2.0]), torch.ones(3, 4)
    mask[2, 3] = 0

    def run():
        loss, metrics = policy_loss("pdm_exactpi_tv", z, a.reshape(3, 4), rollout, adv, mask, validate=False, tensor_metrics=True)
        (grad,) = torch.autograd.grad(loss, z)
        return loss, grad, metrics

    with counting() as c:
        got = run()
    assert sum(c.syncs.values()) == 0, dict(c.syncs)
    fused.setenv(ENV, "0")
    want = run()
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])
    assert set(got[2]) == set(want[2])


def test_the_fused_pass_rejects_non_finite_logits(fused):
    z, logmu, a, ids, vals = _case(3, 50, 4, torch.float32)
    z[1, 7] = float("nan")
    with pytest.raises(ValueError, match="logits contain NaN"):
        policy_stats(z, a, rollout_of(logmu, a, ids, vals))


def test_forcing_the_kernels_on_cpu_logits_needs_the_interpreter(fused):
    z, logmu, a, ids, vals = _case(2, 20, 3, torch.float32)
    fused.delenv("TRITON_INTERPRET")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        policy_stats(z, a, rollout_of(logmu, a, ids, vals))


def test_the_torch_pass_stays_where_the_kernels_do_not_apply(fused):
    z, logmu, a, ids, vals = _case(4, 60, 3, torch.float32)
    cases = {
        "float64": (z.double(), rollout_of(logmu, a, ids, vals), None),
        "full mu": (z, rollout_of(logmu, a, full=True), None),
        "LM head": (z, rollout_of(logmu, a, ids, vals), torch.randn(60, 3)),
        "no unit stride": (z.T.contiguous().T, rollout_of(logmu, a, ids, vals), None),
    }
    for name, (logits, rollout, head) in cases.items():
        with counting() as c, pytest.warns(UserWarning, match="the chunked torch pass runs"):
            policy_stats(logits, a, rollout, head_weight=head)
        assert c.launches["logits_stats"] == 0, name


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_kernels_on_cuda_equal_the_torch_pass(monkeypatch, dtype):
    monkeypatch.setenv(ENV, "1")  # opt-in until this test has passed on a GPU
    z, logmu, a, ids, vals = _case(64, 32_000, 20, dtype, seed=1)
    z, logmu, a, ids, vals = (x.cuda() for x in (z, logmu, a, ids, vals))
    z.requires_grad_(True)
    rollout = rollout_of(logmu, a, ids, vals)
    weights = torch.linspace(-2, 3, a.numel(), device="cuda")

    def run():
        stats = policy_stats(z, a, rollout, need_exactpi=True)
        (grad,) = torch.autograd.grad((weights * stats.logp).sum(), z)
        return stats, grad

    with counting() as c:
        got, got_grad = run()
    assert c.launches["logits_stats"] == 1
    monkeypatch.setenv(ENV, "0")
    want, want_grad = run()
    for name in FIELDS:
        torch.testing.assert_close(getattr(got, name), getattr(want, name), rtol=1e-5, atol=1e-6, msg=name)
    torch.testing.assert_close(got_grad, want_grad, **({"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {}))
