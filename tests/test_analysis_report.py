"""Agreement statistics of the analysis: Wilson intervals, NaN/zero handling, unbiased populations."""

from __future__ import annotations

import pytest
import torch

from pdmask.analysis.rates import wilson
from pdmask.analysis.records import TokenResults
from pdmask.analysis.render import verdict
from pdmask.analysis.tables import TRUTHS, agreement, summarize


def test_wilson_known_values() -> None:
    lo, hi = wilson(5, 10)
    assert (lo, hi) == pytest.approx((0.2366, 0.7634), abs=1e-4)
    lo, hi = wilson(0, 10)
    assert lo == 0.0 and hi == pytest.approx(0.2775, abs=1e-4)
    assert wilson(10, 10)[1] == pytest.approx(1.0)
    assert wilson(0, 0) == (None, None)


def test_agreement_skips_unmeasured_and_zero_truths() -> None:
    signal = torch.tensor([1.0, -1.0, 1.0, 2.0, -3.0], dtype=torch.float64)
    truth = torch.tensor([2.0, 1.0, float("nan"), 0.0, -1.0], dtype=torch.float64)
    cell = agreement(signal, truth, torch.ones(5, dtype=torch.bool))
    assert (cell["k"], cell["n"]) == (2, 3)
    assert cell["lo"] < cell["rate"] < cell["hi"]


def _results(m: int = 40) -> TokenResults:
    g = torch.Generator().manual_seed(0)
    adv = torch.where(torch.rand(m, generator=g) < 0.5, -1.0, 1.0).double()
    ratio = torch.randn(m, generator=g, dtype=torch.float64)
    pdm = ratio.clone()
    pdm[30:35] = -pdm[30:35]  # PDM full and the ratio sign disagree on five tokens beyond δ
    sampled = torch.zeros(m, dtype=torch.bool)
    sampled[:20] = True  # the uniform sample of all tokens
    beyond_sampled = torch.zeros(m, dtype=torch.bool)
    beyond_sampled[20:30] = True  # the uniform sample of the tokens beyond δ
    targeted = torch.zeros(m, dtype=torch.bool)
    targeted[30:35] = True
    measured = sampled | beyond_sampled | targeted
    own = torch.where(measured, pdm, torch.nan)  # the truth follows PDM wherever it is measured
    truths = {name: own.clone() for name in TRUTHS}
    truths["step_adam"] = ratio.clone()  # measured everywhere
    truths["step_sgd"] = ratio.clone()
    signals = {"ratio": ratio, "pdm_full": pdm}
    # Two direction masks set by hand: every token from 10 on is beyond δ; one keeps all, one drops all.
    beyond = torch.arange(m) >= 10
    masks = {
        "dppo_topk_tv": {"beyond": beyond, "keep": torch.ones(m, dtype=torch.bool)},
        "pdm_proportional_tv": {"beyond": beyond, "keep": ~beyond},
    }
    return TokenResults(
        advantage=adv,
        pi_a=torch.linspace(0.01, 0.99, m, dtype=torch.float64),
        mu_a=torch.full((m,), 0.5, dtype=torch.float64),
        div={k: torch.linspace(0, 0.3, m, dtype=torch.float64) for k in ("tv", "kl")},
        beyond={k: beyond.clone() for k in ("tv", "kl")},
        raw_g={k: {"full": pdm / adv, "aggregated@1": -pdm / adv, "backbone_full": ratio, "backbone_topk@1": ratio}
               for k in ("tv", "kl")},
        signals={k: dict(signals) for k in ("tv", "kl")},
        truth={k: {n: t.clone() for n, t in truths.items()} for k in ("tv", "kl")},
        sampled=sampled,
        beyond_sampled=beyond_sampled,
        targeted={k: targeted.clone() for k in ("tv", "kl")},
        disagree_sampled={k: targeted.clone() for k in ("tv", "kl")},
        row=torch.arange(m) // 2,
        masks=masks,
        round_index=torch.arange(m) // 4,  # rounds of 4 tokens (2 responses) each
    )


def test_summarize_uses_uniform_samples_and_every_disagreement_beyond_delta() -> None:
    summary = summarize(_results(), {"tv": 0.15, "kl": 0.05})
    own = summary["agreement"]["tv"]["own_sgd"]
    # "all" covers only the uniform sample of all tokens (20), not the beyond-δ sample nor the targeted ones.
    assert own["pdm_full"]["all"]["n"] == 20
    assert own["pdm_full"]["all"]["rate"] == 1.0
    # "beyond δ" covers the uniform beyond-δ sample (10 tokens) and the sample's tokens beyond δ (10..19).
    assert own["pdm_full"]["beyond_delta"]["n"] == 10
    # The disagreement subset covers every disagreement beyond δ: PDM right, ratio wrong.
    assert own["pdm_full"]["differs_beyond_delta"]["n"] == 5
    assert own["pdm_full"]["differs_beyond_delta"]["rate"] == 1.0
    assert own["ratio"]["differs_beyond_delta"]["rate"] == 0.0
    # A truth measured everywhere is rated over every token.
    assert summary["agreement"]["tv"]["step_adam"]["ratio"]["all"]["n"] == 40
    by_pi = own["pdm_full"]["by_pi_a"]
    assert sum(c["n"] for c in by_pi.values()) == 20
    tracking = summary["topk_tracking"]["tv"]
    assert tracking["aggregated@1"]["sign_match"] == 0.0 and tracking["aggregated@1"]["corr"] == pytest.approx(-1.0)
    assert tracking["backbone_topk@1"]["sign_match"] == 1.0  # measured against backbone_full, not full
    assert summary["counts"]["tv"]["differs_beyond_delta"] == 5
    lines = verdict(summary)
    assert any("PDM is right more often than the ratio sign" in line for line in lines)
    assert any("check 5 (output layer alone) holds" in line for line in lines)


def test_grpo_advantages_normalise_within_groups() -> None:
    from pdmask.lab.train import grpo_advantages

    adv = grpo_advantages(torch.tensor([1.0, 0.0, 0.5, 0.5]), group_size=2)
    assert adv[0] > 0 > adv[1] and adv[0] == pytest.approx(-adv[1])
    assert torch.equal(adv[2:], torch.zeros(2))  # equal rewards: no signal


def test_mask_view_counts_the_uniform_sample_beyond_delta() -> None:
    res = _results()
    summary = summarize(res, {"tv": 0.15, "kl": 0.05})
    view = summary["mask_view"]
    assert set(view) == {"dppo_topk_tv", "pdm_proportional_tv"}
    # Own truths: the beyond-δ sample, tokens 20..29 (10 tokens); the own truth there is `pdm`.
    raises = int((res.signals["tv"]["pdm_full"][20:30] > 0).sum())
    keep_all, drop_all = view["dppo_topk_tv"]["own_sgd"], view["pdm_proportional_tv"]["own_sgd"]
    assert (keep_all["unsafe_keep"]["k"], keep_all["unsafe_keep"]["n"]) == (raises, 10)
    assert keep_all["wasted_drop"]["n"] == 0 and keep_all["wasted_drop"]["rate"] is None
    assert (drop_all["wasted_drop"]["k"], drop_all["wasted_drop"]["n"]) == (10 - raises, 10)
    assert drop_all["unsafe_keep"]["n"] == 0
    # The real step's truth is measured everywhere: every token beyond δ (10..39) counts.
    assert view["dppo_topk_tv"]["step_adam"]["unsafe_keep"]["n"] == 30
    # Paired: the two masks differ on all 30 tokens beyond δ; the predictive one drops them all, so it is
    # right exactly where the truth raises D.
    paired = view["pdm_proportional_tv"]["paired"]
    assert paired["counterpart"] == "dppo_topk_tv" and paired["differ"] == 30
    # `proportional` is not one of the paper's estimators: its paired rates use the uniform sample of the
    # disagreements (tokens 30..34 here), not the other tokens that happen to have truth.
    measured = slice(30, 35)
    assert paired["own_sgd"]["n"] == 5
    assert paired["own_sgd"]["k"] == int((res.truth["tv"]["own_sgd"][measured] > 0).sum())
    # How often each mask acts counts every token, not only the sample.
    assert view["pdm_proportional_tv"]["beyond_delta"] == 30 and view["pdm_proportional_tv"]["dropped"] == 30
    assert view["dppo_topk_tv"]["dropped"] == 0 and view["dppo_topk_tv"]["drop_share"] == 0.0
    assert view["pdm_proportional_tv"]["kind"] == "tv" and view["pdm_proportional_tv"]["rule"] == "pdm"
    assert any("unsafe keeps" in line and "dppo_topk_tv" in line for line in verdict(summary))


def test_paired_view_is_split_into_rounds_of_disjoint_seeds() -> None:
    res = _results()
    paired = summarize(res, {"tv": 0.15, "kl": 0.05})["mask_view"]["pdm_proportional_tv"]["paired"]
    halves = paired["halves"]
    # Tokens 30..34 (the measured disagreements) lie in rounds 7 (30, 31) and 8 (32..34).
    assert (halves["even"]["own_sgd"]["n"], halves["odd"]["own_sgd"]["n"]) == (3, 2)
    for half, rounds in (("even", [8]), ("odd", [7])):
        own = res.truth["tv"]["own_sgd"]
        chosen = (torch.arange(40) >= 30) & (torch.arange(40) < 35) & torch.isin(res.round_index, torch.tensor(rounds))
        assert halves[half]["own_sgd"]["k"] == int((own[chosen] > 0).sum())
    assert halves["even"]["own_sgd"]["n"] + halves["odd"]["own_sgd"]["n"] == paired["own_sgd"]["n"]
    assert "halves" not in halves["even"]  # one level deep
    assert any("disjoint seeds" in line for line in verdict(summarize(res, {"tv": 0.15, "kl": 0.05})))


def test_select_keeps_every_per_token_array_aligned() -> None:
    res = _results()
    keep = res.round_index % 2 == 1
    sub = res.select(keep)
    assert torch.equal(sub.row, res.row[keep]) and torch.equal(sub.round_index, res.round_index[keep])
    assert torch.allclose(sub.truth["tv"]["own_sgd"], res.truth["tv"]["own_sgd"][keep], equal_nan=True)
    assert torch.equal(sub.masks["pdm_proportional_tv"]["keep"], res.masks["pdm_proportional_tv"]["keep"][keep])
