"""The paper's two top-K tails and pdmask's refinements, pinned to hand-computed cases from method.md.

One position, V = 6: π = (.40, .20, .15, .10, .10, .05), μ = (.35, .30, .15, .10, .05, .05), a = 1,
K = 1 (TopK(μ) = {0}), so S = {0, 1}, π_R = .40, μ_R = .35 and T = 4 ids off S.
"""

from __future__ import annotations

import pytest
import torch

from pdmask import METHODS, divergence, get_method, policy_stats, predicted_change, trust_region_mask

from conftest import make_case, rollout_of

PI = torch.tensor([[0.40, 0.20, 0.15, 0.10, 0.10, 0.05]], dtype=torch.float64)
MU = torch.tensor([[0.35, 0.30, 0.15, 0.10, 0.05, 0.05]], dtype=torch.float64)
A = torch.tensor([1])

# G by hand, term by term (method.md):
# KL aggregated: (π_a − μ_a) + Σ_S π_j(μ_j − π_j) + π_R(μ_R − π_R) = −.1 + (−.02 + .02) + .4·(−.05)
# KL uniform:    the tail term divided by T = 4
# KL proportional: (π_a − μ_a) + Σ_S μ_j π_j + (μ_R/π_R)·Q − ‖π‖², Q = .045, ‖π‖² = .245
# KL exactpi:    (π_a − μ_a) + Σ_S μ_j π_j + (μ_R/T)·π_R − ‖π‖²
# TV (s_a = −1, s_S = (+1, −1), s_R = +1), G = ½[s_a π_a − Σ s π² + (‖π‖² − π_a) Σ s π]:
#   aggregated: ‖π̃‖² = .36, Σ s π = .6, Σ s π² = .28;  uniform: ‖π̃‖² = .24, Σ s π = .6, Σ s π² = .16
HAND = {
    ("kl", "aggregated"): -0.1 + 0.0 + 0.4 * -0.05,
    ("kl", "uniform"): -0.1 + 0.0 + 0.4 * -0.05 / 4,
    ("kl", "proportional"): -0.1 + 0.2 + 0.35 / 0.4 * 0.045 - 0.245,
    ("kl", "exactpi"): -0.1 + 0.2 + 0.35 / 4 * 0.4 - 0.245,
    ("kl", "full"): -0.1 + 0.24 - 0.245,
    ("tv", "aggregated"): 0.5 * (-0.2 - 0.28 + (0.36 - 0.2) * 0.6),
    ("tv", "uniform"): 0.5 * (-0.2 - 0.16 + (0.24 - 0.2) * 0.6),
}


@pytest.fixture
def stats():
    logmu = MU.log()
    return policy_stats(PI.log(), A, rollout_of(logmu, A, torch.tensor([[0]]), logmu[:, :1], full=True))


@pytest.mark.parametrize(("kind", "estimator"), sorted(HAND))
def test_estimator_matches_the_hand_computed_value(stats, kind, estimator):
    assert predicted_change(stats, kind, estimator).item() == pytest.approx(HAND[kind, estimator], abs=1e-12)


def test_paper_names_are_registered_and_marked():
    for kind in ("kl", "tv"):
        assert METHODS[f"pdm_aggregated_{kind}"].estimator == "aggregated"
        assert METHODS[f"pdm_uniform_{kind}"].estimator == "uniform"
        assert not METHODS[f"pdm_aggregated_{kind}"].needs_sq_norm and not METHODS[f"pdm_uniform_{kind}"].needs_sq_norm
    assert METHODS["pdm_aggregated_kl"].origin == METHODS["pdm_uniform_kl"].origin == "paper"
    assert METHODS["dppo_topk_kl"].origin == "paper"
    for name in ("pdm_uniform_tv", "pdm_aggregated_tv", "pdm_proportional_kl", "pdm_exactpi_kl"):
        assert METHODS[name].origin == "pdmask", name


def test_paper_uniform_and_exactpi_are_different_estimators():
    """The paper's uniform-tail spreads π's tail too; pdmask's exactpi keeps π exact: their KL masks differ."""
    z, logmu, a, ids, vals = make_case(4000, 200, 20, seed=3, drift=1.0)
    stats = policy_stats(z, a, rollout_of(logmu, a, ids, vals))
    adv = torch.ones(4000)
    delta = divergence(stats, "kl", "topk").median().item()
    keep = {e: trust_region_mask(f"pdm_{e}_kl", stats, adv, delta_low=delta, delta_high=delta) for e in ("uniform", "exactpi")}
    differ = (keep["uniform"] != keep["exactpi"]).sum().item()
    assert 0 < differ < 400, differ


@pytest.mark.parametrize("old", ["pdm_bucket_kl", "pdm_tail_tv"])
def test_names_of_no_release_are_unknown(old):
    """Names used before the first release are not aliases: they fail with the list of methods."""
    with pytest.raises(ValueError, match="unknown mask method .*pdm_aggregated_kl"):
        get_method(old)


def test_unknown_estimator_names_the_choices(stats):
    with pytest.raises(ValueError, match="estimator"):
        predicted_change(stats, "kl", "bucket")
