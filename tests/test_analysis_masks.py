"""The mask view: unsafe-keep / wasted-drop counts on a hand-built case, the clustered interval, and the
decisions of every registered direction mask against method.md's rule."""

from __future__ import annotations

import pytest
import torch

from pdmask import RolloutLogprobs, policy_stats, predicted_change, reference
from pdmask.analysis.maskview import direction_methods, mask_decisions, mask_view
from pdmask.analysis.rates import clustered_rate, effective_size, wilson

from conftest import make_case

NAN = float("nan")


def test_unsafe_keep_and_wasted_drop_counts_by_hand() -> None:
    # token:            0      1      2      3      4      5      6      7     8      9
    beyond = torch.tensor([1, 1, 1, 1, 1, 1, 1, 1, 0, 1], dtype=torch.bool)
    keep = torch.tensor([1, 1, 1, 0, 0, 0, 1, 1, 1, 0], dtype=torch.bool)
    truth = torch.tensor([0.3, -0.2, 0.1, 0.4, -0.5, -0.1, NAN, 0.0, 0.9, -0.7], dtype=torch.float64)
    population = torch.tensor([1, 1, 1, 1, 1, 1, 1, 1, 1, 0], dtype=torch.bool)
    clusters = torch.arange(10)
    # Counted: beyond δ, in the population, truth measured and nonzero -> tokens 0-5.
    # (6: truth not measured; 7: truth exactly 0; 8: not beyond δ; 9: outside the population.)
    # Kept 0, 1, 2 with truths +, −, +: 2 unsafe keeps of 3.
    # Dropped 3, 4, 5 with truths +, −, −: 2 wasted drops of 3.
    view = mask_view(beyond, keep, truth, population, clusters)
    assert view["counts"] == {"kept_raises": 2, "kept_lowers": 1, "dropped_raises": 1, "dropped_lowers": 2}
    assert (view["unsafe_keep"]["k"], view["unsafe_keep"]["n"]) == (2, 3)
    assert (view["wasted_drop"]["k"], view["wasted_drop"]["n"]) == (2, 3)
    assert view["unsafe_keep"]["rate"] == pytest.approx(2 / 3)
    # One token per response: the clustered interval is the plain Wilson interval.
    assert (view["unsafe_keep"]["lo"], view["unsafe_keep"]["hi"]) == pytest.approx(wilson(2, 3))


def test_empty_sets_are_undefined_not_zero() -> None:
    none = torch.zeros(4, dtype=torch.bool)
    view = mask_view(none, ~none, torch.ones(4, dtype=torch.float64), ~none, torch.arange(4))
    for name in ("unsafe_keep", "wasted_drop"):
        cell = view[name]
        assert cell["n"] == 0 and cell["rate"] is None and cell["lo"] is None and cell["hi"] is None


def test_clustering_widens_the_interval() -> None:
    hits = torch.tensor([1] * 5 + [0] * 5, dtype=torch.bool)
    # Independent tokens: deff = 1.
    assert effective_size(hits, torch.arange(10)) == pytest.approx(10)
    # Two responses, all hits in one: Var = 2/1·(2.5² + 2.5²)/10² = 0.25 against 0.25/9, so deff = 9.
    assert effective_size(hits, torch.tensor([0] * 5 + [1] * 5)) == pytest.approx(10 / 9)
    # Hits spread evenly over the responses: no between-response variance, deff floored at 1.
    assert effective_size(hits, torch.tensor([0, 1, 2, 3, 4] * 2)) == pytest.approx(10)
    # One response is one observation; a rate of 0 or 1 keeps n.
    assert effective_size(hits, torch.zeros(10, dtype=torch.long)) == 1.0
    assert effective_size(torch.zeros(10, dtype=torch.bool), torch.tensor([0] * 5 + [1] * 5)) == 10.0
    wide, narrow = clustered_rate(hits, torch.tensor([0] * 5 + [1] * 5)), clustered_rate(hits, torch.arange(10))
    assert wide["rate"] == narrow["rate"] == 0.5
    assert wide["lo"] < narrow["lo"] and wide["hi"] > narrow["hi"]


def test_decisions_follow_method_md_for_every_direction_method() -> None:
    """drop = D > δ and A·direction > 0 (D from the method's own information), A = 0 always kept."""
    z, logmu, a, top_ids, top_logp = make_case(64, 40, 5, seed=3, drift=1.5)
    g = torch.Generator().manual_seed(1)
    # The backbone-aware masks read the LM head's sums: any W [V, d] exercises their decision rule.
    head = torch.randn(z.shape[-1], 6, generator=g, dtype=z.dtype)
    rollout = RolloutLogprobs(logmu.gather(-1, a[:, None]).squeeze(-1), top_ids, top_logp, logmu)
    stats = policy_stats(z, a, rollout, head_weight=head, need_exactpi=True)
    adv = torch.randn(64, generator=g, dtype=torch.float64)
    adv[::7] = 0.0
    delta = {"tv": 0.1, "kl": 0.05}
    decisions = mask_decisions(stats, adv, delta)
    assert list(decisions) == [m.name for m in direction_methods()]
    assert {m.rule for m in direction_methods()} == {"dppo", "pdm"}
    pi = z.softmax(-1)
    mu = logmu.exp()
    ref_div = {
        "full": lambda kind: reference.DIVERGENCES[kind](pi, mu),
        "topk": lambda kind: reference.topk_divergence(z, mu, a, top_ids, kind),
        "binary": lambda kind: reference.binary_divergence(z, mu, a, kind),
    }
    acted = 0
    for m in direction_methods():
        beyond, keep = decisions[m.name]["beyond"], decisions[m.name]["keep"]
        expected_beyond = (ref_div[m.info](m.kind) > delta[m.kind]) & (adv != 0)
        assert torch.equal(beyond, expected_beyond), m.name
        direction = stats.pi_a - stats.mu_a if m.rule == "dppo" else predicted_change(stats, m.kind, m.estimator)
        assert torch.equal(~keep, beyond & (adv * direction > 0)), m.name
        assert keep[adv == 0].all()
        acted += int((~keep).sum())
    assert acted > 0  # the case exercises drops
