"""The fused Triton logits pass (pdmask.triton_pass) against the chunked torch pass and the float64 reference.

On the CPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1, numpy); the tests marked
``gpu`` run them compiled on CUDA (scripts/gpu_check.sh) and are skipped without a GPU.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from pdmask import divergence, policy_loss, policy_stats, predicted_change
from pdmask import reference as ref
from pdmask.tools.counts import counting
from pdmask.triton_pass import fused_kernels, fused_requested, triton_available

from conftest import make_case, rollout_of

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton is not installed (pip install 'pdmask[gpu]')")

FIELDS = ("logp", "set_logp", "rest_mass", "tail_sq", "sq_norm", "exactpi_sums")
TOPK_ESTIMATORS = ("aggregated", "uniform", "proportional", "exactpi")


@pytest.fixture
def fused(monkeypatch):
    """The fused kernels asked for, on CPU tensors: interpreted (conftest sets TRITON_INTERPRET=1 without CUDA)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs the kernels on CPU tensors, in Triton's interpreter: TRITON_INTERPRET=1 before triton is imported")
    with fused_kernels(True):
        yield monkeypatch


def both_paths(fn):
    """fn() with the fused kernels, then with the torch pass; asserts the fused one ran."""
    with counting() as c:
        out = fn()
    assert c.launches["logits_stats"] == 1
    with fused_kernels(False):
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

    (got, got_grad), (want, want_grad) = both_paths(run)
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


def _placed_case(rows_ids: list[list[int]], vocab: int, dtype: torch.dtype, peak: float | None = None):
    """Logits [n, V] and a top-K rollout whose S = TopK ∪ {a} is given per row (a = the row's last id); with
    ``peak``, the row's first id holds π = 1 − peak, the rest of π spread over the other ids."""
    n, k = len(rows_ids), len(rows_ids[0]) - 1
    g = torch.Generator().manual_seed(3)
    z = torch.randn(n, vocab, generator=g, dtype=torch.float64) * 2
    ids = torch.tensor(rows_ids)
    if peak is not None:
        first = ids[:, 0]
        others = z.scatter(-1, first[:, None], -torch.inf).logsumexp(-1)
        z[torch.arange(n), first] = others + math.log1p(-peak) - math.log(peak)  # π = 1 − peak at the first id
    z = z.to(dtype)
    logmu = torch.log_softmax(z.double() + 0.5 * torch.randn(n, vocab, generator=g, dtype=torch.float64), -1)
    topk, a = ids[:, :k], ids[:, k]
    return z, a, rollout_of(logmu, a, topk, logmu.gather(-1, topk))


def _tail_sums_float64(z: torch.Tensor, a: torch.Tensor, rollout, u: torch.Tensor) -> dict[str, torch.Tensor]:
    """π_R, Σ_{∉S} π² and the exactpi sums Σ_{∉S} s π, Σ_{∉S} s π² (s = sign(π − u)) in float64, with the pass's own
    u = μ_R/T [n] (its float32 μ_R, a difference near 0 on peaked rows, is not what is tested here)."""
    pi = torch.softmax(z.double(), -1)
    in_set = torch.zeros_like(pi, dtype=torch.bool).scatter(-1, torch.cat([rollout.topk_ids, a[:, None]], -1), True)
    tail = torch.where(in_set, 0.0, pi)
    u = u.double()[:, None]
    signed = torch.sign(pi - u) * tail
    return {"rest": tail.sum(-1), "sq": tail.square().sum(-1), "sign_pi": signed.sum(-1), "sign_pi2": (signed * pi).sum(-1)}


#: Ids of S per row at V = 2,500, whose interpreted blocks are [0, 1024), [1024, 2048) and the partial [2048, 2500):
#: in every block, in the first only, in the partial last one only, on the blocks' edges with a ∈ TopK.
PLACED = [
    [5, 700, 1030, 1500, 2049, 2300, 999],
    [0, 3, 17, 512, 1000, 1023, 64],
    [2048, 2100, 2200, 2300, 2400, 2499, 2222],
    [1023, 1024, 2047, 2048, 2499, 0, 1024],
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ids_of_s_in_several_blocks_in_one_and_on_the_edges(fused, dtype):
    z, a, rollout = _placed_case(PLACED, 2_500, dtype)
    got, want = both_paths(lambda: policy_stats(z, a, rollout, need_exactpi=True))
    for name in FIELDS:
        torch.testing.assert_close(getattr(got, name), getattr(want, name), rtol=1e-5, atol=1e-6, msg=name)
    exact = _tail_sums_float64(z, a, rollout, got.even_tail_mu)
    torch.testing.assert_close(got.rest_mass.double(), exact["rest"], rtol=1e-5, atol=0)
    torch.testing.assert_close(got.tail_sq.double(), exact["sq"], rtol=1e-5, atol=0)


@pytest.mark.parametrize("vocab", [300, 2_500])  # one block; several, with S's ids in each
def test_peaked_rows_keep_the_tail_sums_to_float64_precision(fused, vocab):
    """One id of S holds π = 1 − 1e-6: π_R, Σ_{∉S} π² and the exactpi sums are summed off S, never as a difference."""
    rows = PLACED if vocab == 2_500 else [[(37 * i + 11 * r) % vocab for i in range(7)] for r in range(4)]
    z, a, rollout = _placed_case(rows, vocab, torch.float32, peak=1e-6)
    stats = policy_stats(z, a, rollout, need_exactpi=True)
    exact = _tail_sums_float64(z, a, rollout, stats.even_tail_mu)
    assert bool((exact["rest"] < 1e-6).all()) and bool((exact["rest"] > 1e-8).all())
    torch.testing.assert_close(stats.rest_mass.double(), exact["rest"], rtol=1e-5, atol=0)
    torch.testing.assert_close(stats.tail_sq.double(), exact["sq"], rtol=1e-5, atol=0)
    torch.testing.assert_close(stats.exactpi_sums[0].double(), exact["sign_pi"], rtol=1e-5, atol=1e-5 * exact["rest"].max().item())
    torch.testing.assert_close(stats.exactpi_sums[1].double(), exact["sign_pi2"], rtol=1e-5, atol=1e-5 * exact["sq"].max().item())


def test_the_kernel_setting_is_read_once_and_overridden_in_process(monkeypatch):
    before = fused_requested()
    monkeypatch.setenv("PDMASK_TRITON", "0" if before else "1")  # read at import: changing it now changes nothing
    assert fused_requested() == before
    with fused_kernels(True):
        assert fused_requested()
        with fused_kernels(False):
            assert not fused_requested()
        assert fused_requested()
    assert fused_requested() == before and os.environ["PDMASK_TRITON"] == ("0" if before else "1")


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
    with fused_kernels(False):
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
def test_compiled_kernels_on_cuda_equal_the_torch_pass(dtype):
    z, logmu, a, ids, vals = _case(64, 32_000, 20, dtype, seed=1)
    z, logmu, a, ids, vals = (x.cuda() for x in (z, logmu, a, ids, vals))
    z.requires_grad_(True)
    rollout = rollout_of(logmu, a, ids, vals)
    weights = torch.linspace(-2, 3, a.numel(), device="cuda")

    def run():
        stats = policy_stats(z, a, rollout, need_exactpi=True)
        (grad,) = torch.autograd.grad((weights * stats.logp).sum(), z)
        return stats, grad

    with fused_kernels(True), counting() as c:  # opt-in until this test has passed on a GPU
        got, got_grad = run()
    assert c.launches["logits_stats"] == 1
    with fused_kernels(False):
        want, want_grad = run()
    for name in FIELDS[:-1]:
        torch.testing.assert_close(getattr(got, name), getattr(want, name), rtol=1e-5, atol=1e-6, msg=name)
    torch.testing.assert_close(got_grad, want_grad, **({"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {}))
    # The exactpi sums threshold each π_j at u = μ_R/T. The compiled kernel's π_j = ex2.approx(z_j·log₂e − lse·log₂e)
    # differs from the torch pass's exp(z_j − lse) by (i) the two passes' lse, a few float32 ulps apart (≲ 4·2⁻²⁴·|lse|,
    # 2.4e-6 at lse ≈ 10), (ii) the rounding of the FFMA's argument (≲ 2⁻²⁴·|arg|·ln 2, 1.2e-6 at |arg| ≤ 30) and
    # (iii) ex2.approx's 2 ulps (2.4e-7): ≲ 4e-6 relative in all. An id with |π_j − u| within that of u may take either
    # sign in either pass (a review's compile of this case left one id 1.7e-6 from a flip): it moves Σ s π by 2π_j and
    # Σ s π² by 2π_j². The sums may differ by that mass, found in float64 with a 1e-5 band, on top of rtol.
    pi = torch.softmax(z.detach().double(), -1)
    u = got.even_tail_mu.double()[:, None]
    in_set = torch.zeros_like(pi, dtype=torch.bool).scatter(-1, got.set_ids, True)
    either = torch.where(~in_set & ((pi - u).abs() <= 1e-5 * u), pi, 0.0)
    allowed = torch.stack([2 * either.sum(-1), 2 * either.square().sum(-1)])
    gap = (got.exactpi_sums.double() - want.exactpi_sums.double()).abs()
    assert bool((gap <= 1e-5 * want.exactpi_sums.double().abs() + 1e-6 + allowed).all()), (gap - allowed).max()
