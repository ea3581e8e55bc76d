"""Each method's mask on hand-built positions where the right answer is known."""

from __future__ import annotations

import pytest
import torch

from pdmask import METHODS, RolloutLogprobs, policy_stats, predicted_change, trust_region_mask


def position(pi: list[float], mu: list[float], a: int, k: int | None = None):
    """One position with π = pi, μ = mu, sampled token a; top-K of μ (all of it by default) and full μ."""
    logits = torch.tensor(pi, dtype=torch.float64).log()[None]
    logmu = torch.tensor(mu, dtype=torch.float64).log()[None]
    top = logmu.topk(k or len(mu), -1)
    tokens = torch.tensor([a])
    rollout = RolloutLogprobs(logmu[:, a], top.indices, top.values, logmu)
    return policy_stats(logits, tokens, rollout, need_exactpi=True)


# π under-weights token 0 relative to μ. Raising a = 1 moves π_1 toward μ_1 (0.05 → 0.08) but takes
# mass from token 0 as well, pushing π_0 further from μ_0 = 0.9: the divergence grows (G > 0).
TOWARD_BUT_DIVERGING = ([0.6, 0.05, 0.35], [0.9, 0.08, 0.02], 1)
# π over-weights token 1 (0.12 > 0.10), yet raising it takes mass from token 2, where π is too heavy
# (0.58 vs 0.30): the divergence shrinks (G < 0) although a moves away from μ_a.
AWAY_BUT_CONVERGING = ([0.3, 0.12, 0.58], [0.6, 0.10, 0.30], 1)


@pytest.mark.parametrize("kind", ["tv", "kl"])
def test_direction_signs_of_the_hand_built_positions(kind):
    s = position(*TOWARD_BUT_DIVERGING)
    assert s.pi_a < s.mu_a and predicted_change(s, kind, "full") > 0
    s = position(*AWAY_BUT_CONVERGING)
    assert s.pi_a > s.mu_a and predicted_change(s, kind, "full") < 0


@pytest.mark.parametrize("kind", ["tv", "kl"])
@pytest.mark.parametrize("estimator", ["full", "aggregated", "uniform", "proportional", "exactpi"])
def test_dppo_keeps_but_pdm_drops_a_positive_token_that_raises_the_divergence(kind, estimator):
    s = position(*TOWARD_BUT_DIVERGING)
    adv = torch.tensor([1.0])
    assert trust_region_mask(f"dppo_full_{kind}", s, adv).item() is True
    assert trust_region_mask(f"pdm_{estimator}_{kind}", s, adv).item() is False
    # With a negative advantage the update lowers π_1, which (to first order) shrinks D: PDM keeps it,
    # DPPO drops it because π_1 − μ_1 < 0 has the sign of A.
    adv = torch.tensor([-1.0])
    assert trust_region_mask(f"dppo_full_{kind}", s, adv).item() is False
    assert trust_region_mask(f"pdm_{estimator}_{kind}", s, adv).item() is True


@pytest.mark.parametrize("kind", ["tv", "kl"])
def test_dppo_drops_but_pdm_keeps_a_positive_token_that_lowers_the_divergence(kind):
    s = position(*AWAY_BUT_CONVERGING)
    adv = torch.tensor([2.0])
    assert trust_region_mask(f"dppo_topk_{kind}", s, adv).item() is False
    assert trust_region_mask(f"pdm_proportional_{kind}", s, adv).item() is True


@pytest.mark.parametrize("kind", ["tv", "kl"])
def test_no_divergence_method_drops_inside_the_threshold(kind):
    s = position([0.5, 0.3, 0.2], [0.5, 0.29, 0.21], 1)
    for name, m in METHODS.items():
        if m.kind == kind and not m.needs_head:  # the backbone-aware masks need an LM head (test_backbone.py)
            for sign in (1.0, -1.0):
                assert trust_region_mask(name, s, torch.tensor([sign])).item() is True, name


def test_threshold_overrides_are_used():
    s = position(*TOWARD_BUT_DIVERGING)
    adv = torch.tensor([1.0])
    assert trust_region_mask("pdm_full_tv", s, adv).item() is False
    assert trust_region_mask("pdm_full_tv", s, adv, delta_high=0.5).item() is True
    assert trust_region_mask("pdm_full_tv", s, adv, delta_low=0.5).item() is False  # δ_low only for A < 0
    # With A < 0 only δ_low counts: lowering π_1 at the away-but-converging position raises D (A·G > 0).
    s, neg = position(*AWAY_BUT_CONVERGING), torch.tensor([-1.0])
    assert trust_region_mask("pdm_full_tv", s, neg).item() is False
    assert trust_region_mask("pdm_full_tv", s, neg, delta_low=0.5).item() is True
    assert trust_region_mask("pdm_full_tv", s, neg, delta_high=0.5).item() is False  # δ_high only for A > 0


def test_ppo_clip_band_and_pg_is():
    # r = 0.6/0.4 = 1.5 and r = 0.2/0.4 = 0.5 at token 0
    hi, lo = position([0.6, 0.4], [0.4, 0.6], 0), position([0.2, 0.8], [0.4, 0.6], 0)
    pos, neg = torch.tensor([1.0]), torch.tensor([-1.0])
    assert trust_region_mask("ppo_clip", hi, pos).item() is False
    assert trust_region_mask("ppo_clip", hi, neg).item() is True
    assert trust_region_mask("ppo_clip", lo, neg).item() is False
    assert trust_region_mask("ppo_clip", lo, pos).item() is True
    assert trust_region_mask("ppo_clip", hi, pos, eps_high=0.6).item() is True
    # r = 0.85 with A < 0: inside the default band (1 − 0.2), outside with ε_low = 0.1; ε_high plays no part.
    mid = position([0.34, 0.66], [0.4, 0.6], 0)
    assert trust_region_mask("ppo_clip", mid, neg).item() is True
    assert trust_region_mask("ppo_clip", mid, neg, eps_low=0.1).item() is False
    assert trust_region_mask("ppo_clip", mid, neg, eps_high=0.01).item() is True
    for s in (hi, lo):
        for adv in (pos, neg):
            assert trust_region_mask("pg_is", s, adv).item() is True


def test_zero_advantage_is_always_kept_and_response_mask_excludes():
    s = position(*TOWARD_BUT_DIVERGING)
    for name in (n for n, m in METHODS.items() if not m.needs_head):
        assert trust_region_mask(name, s, torch.tensor([0.0])).item() is True
        assert trust_region_mask(name, s, torch.tensor([0.0]), torch.tensor([0])).item() is False


def test_binary_dppo_uses_only_mu_a():
    # Binary TV = |π_a − μ_a| = 0.2 > 0.15 and π_a > μ_a: dropped for A > 0 whatever μ's other tokens are.
    s = position([0.5, 0.3, 0.2], [0.3, 0.05, 0.65], 0)
    assert trust_region_mask("dppo_binary_tv", s, torch.tensor([1.0])).item() is False
    assert trust_region_mask("dppo_binary_tv", s, torch.tensor([-1.0])).item() is True


def test_registry_entries_are_complete():
    required = {
        "ppo_clip", "pg_is", "dppo_binary_tv", "dppo_binary_kl", "dppo_topk_tv", "dppo_topk_kl",
        "pdm_full_tv", "pdm_full_kl", "pdm_aggregated_tv", "pdm_aggregated_kl", "pdm_proportional_tv", "pdm_proportional_kl",
        "pdm_exactpi_tv", "pdm_exactpi_kl",
    }
    assert required <= set(METHODS)
    for name, m in METHODS.items():
        assert m.name == name and m.description and "ratio_cap" in m.defaults
    assert METHODS["dppo_topk_tv"].defaults["delta_high"] == 0.15
    assert METHODS["pdm_proportional_kl"].defaults["delta_low"] == 0.05
    assert METHODS["ppo_clip"].defaults["eps_high"] == 0.28
    assert METHODS["pdm_proportional_tv"].needs == "topk" and METHODS["pdm_full_kl"].needs == "full"
    assert METHODS["pdm_exactpi_kl"].needs == "topk" and METHODS["pdm_exactpi_kl"].needs_sq_norm
    assert METHODS["pdm_exactpi_tv"].needs_exactpi and not METHODS["pdm_exactpi_kl"].needs_exactpi
