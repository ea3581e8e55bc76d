"""The forking lab task (class_sort), the fork profile, and the power arithmetic of the compare report."""

import math

import pytest
import torch

from pdmask.lab.config import Config
from pdmask.lab.forks import fork_profile, warm_start_profile
from pdmask.lab.intervals import detectable, mean_ci, sd, seeds_needed
from pdmask.lab.tasks import EOS, FIRST_SYMBOL, build_task
from pdmask.lab.verdicts import ask

from conftest import TINY


def _sym(*values: int) -> list[int]:
    return [FIRST_SYMBOL + v for v in values]


def test_class_sort_accepts_every_order_within_a_class_and_only_those():
    task = build_task("class_sort", length=4, num_symbols=8, class_size=4, heldout_size=16)
    problem = task.sample(1, torch.Generator().manual_seed(0))[0]
    p = type(problem)(problem.prompt_ids, tuple(_sym(1, 3, 5, 6)))  # classes 0, 0, 1, 1
    for answer in ([1, 3, 5, 6], [3, 1, 5, 6], [1, 3, 6, 5], [3, 1, 6, 5]):
        assert task.score(p, [*_sym(*answer), EOS]) == (1.0, True)
    assert task.score(p, [*_sym(5, 1, 3, 6), EOS]) == (0.5, False)  # class order broken at positions 0 and 2
    assert task.score(p, [*_sym(1, 1, 5, 6), EOS]) == (0.75, False)  # a symbol used twice counts once
    assert task.score(p, [*_sym(1, 2, 5, 6), EOS]) == (0.75, False)  # right class, but not a prompt symbol
    assert task.score(p, [*_sym(1, 3, 5, 6)]) == (1.0, False)  # no EOS: not exact


def test_class_sort_draws_its_sft_answers_uniformly_among_the_right_ones():
    task = build_task("class_sort", length=4, num_symbols=8, class_size=4, heldout_size=16)
    p = type(task.heldout[0])(task.heldout[0].prompt_ids, tuple(_sym(0, 1, 2, 7)))  # 3! orders of class 0
    g = torch.Generator().manual_seed(0)
    seen = [tuple(task.answer_ids(p, g)) for _ in range(600)]
    assert len(set(seen)) == 6 and all(task.score(p, list(a)) == (1.0, True) for a in set(seen))
    assert min(seen.count(a) for a in set(seen)) > 60  # about 100 each
    with pytest.raises(ValueError, match="generator"):
        task.answer_ids(p)
    # class_size 1 is sort: one right answer.
    assert build_task("class_sort", length=4, num_symbols=8, class_size=1, heldout_size=16).answer_ids(p, g) == [*p.target, EOS]


def test_fork_profile_by_hand():
    probs = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.97, 0.01, 0.01, 0.01]], dtype=torch.float64)
    logp = probs.log()
    out = fork_profile(logp, torch.tensor([1, 0]), k=2)
    assert out["positions"] == 2
    assert out["runner_up_ge_0.1"] == 0.5 and out["not_mode"] == 0.5
    h = [-(p[p > 0] * p[p > 0].log()).sum().item() for p in probs]
    h_top2 = [-(0.5 * math.log(0.5) + 0.3 * math.log(0.3)), -(0.97 * math.log(0.97) + 0.01 * math.log(0.01))]
    assert out["entropy"] == pytest.approx(sum(h) / 2)
    assert out["entropy_topk"] == pytest.approx(sum(h_top2) / 2)
    assert out["entropy_rest"] == pytest.approx((sum(h) - sum(h_top2)) / 2)
    assert out["top1_median"] == pytest.approx(0.5)  # torch's median of two values is the lower one
    with pytest.raises(ValueError, match="logp must be"):
        fork_profile(logp, torch.tensor([0]))


def test_class_sort_policy_forks_where_sort_does_not(tmp_path, monkeypatch):
    monkeypatch.setenv("PDMASK_CACHE", str(tmp_path))
    base = TINY.replace(sft_steps=60, sft_lr=3e-3, task_length=4, num_symbols=8, heldout_size=16)
    sort = warm_start_profile(base.replace(task="sort"), prompts=16, samples=2)
    forks = warm_start_profile(base.replace(task="class_sort", class_size=8), prompts=16, samples=2)
    assert sort is not None and forks is not None
    assert forks["runner_up_ge_0.1"] > sort["runner_up_ge_0.1"] and forks["entropy_topk"] > sort["entropy_topk"]
    assert warm_start_profile(Config(model="smollm2-135m", task="arithmetic")) is None


def test_power_arithmetic():
    # (t_0.975 + t_0.80) * sd / sqrt(n) with df = 11: (2.201 + 0.876) * 0.02 / sqrt(12)
    assert detectable(0.02, 12) == pytest.approx((2.201 + 0.876) * 0.02 / math.sqrt(12))
    assert detectable(0.02, 1) == math.inf
    n = seeds_needed(0.02, 0.01)
    assert n is not None and detectable(0.02, n) <= 0.01 < detectable(0.02, n - 1)
    assert sd([1.0, 2.0, 3.0]) == pytest.approx(1.0) and sd([4.0]) == 0.0


def test_pdm_pair_carries_mask_share_and_power():
    seeds = range(6)
    per_seed = lambda finals, share: {
        "final_accuracy": finals, "mean_accuracy": finals, "initial_accuracy": {s: 0.5 for s in seeds},
        "accuracy_gain": {s: v - 0.5 for s, v in finals.items()}, "mismatch_growth": {s: 0.0 for s in seeds},
        "vs_dppo_aggregated": {s: share for s in seeds},
    }  # fmt: skip
    with_intervals = lambda ps: {"per_seed": ps} | {k: mean_ci(list(v.values())).as_dict() for k, v in ps.items()}
    methods = {
        "dppo_topk_kl": with_intervals(per_seed({s: 0.6 + 0.01 * (s % 2) for s in seeds}, 0.01)),
        "pdm_aggregated_kl": with_intervals(per_seed({s: 0.6 + 0.02 * (s % 3) for s in seeds}, 0.03)),
    }
    pair = ask(methods).pdm_vs_dppo.pairs["pdm_aggregated_kl"]
    assert pair.masks_differ == pytest.approx(0.02)
    diffs = [0.02 * (s % 3) - 0.01 * (s % 2) for s in seeds]
    assert pair.spread == pytest.approx(sd(diffs)) and pair.detectable == pytest.approx(detectable(sd(diffs), 6))
