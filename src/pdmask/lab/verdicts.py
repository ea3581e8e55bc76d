"""The compare report's verdicts as typed values, from the per-seed numbers of a setting's methods.

A setting (model × rollout precision) compares its methods over seeds, paired seed by seed, and answers
three questions: did RL learn (the best masked method against its SFT start), did the trust region matter
(``pg_is`` against the best masked method), did PDM differ from DPPO (each ``pdm_*`` against the DPPO mask
with the same divergence and information); each verdict is checked again on two disjoint halves of the seeds.
Their words are ``pdmask.lab.verdict_words``'.

``methods`` maps each method to its numbers: ``per_seed[metric][seed]`` and ``metric -> Interval.as_dict()``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pdmask import get_method
from pdmask.lab.intervals import Interval, compare_methods, detectable, differences, mean_ci, paired, pooled_sd, sd

Methods = dict[str, dict[str, Any]]


@dataclass(frozen=True)
class Ranking:
    """The methods ranked on one per-run metric (higher is better), each paired with the leader."""

    metric: str
    comparison: dict[str, Any]  # ``pdmask.lab.intervals.compare_methods``: order, leader, diff_to_leader
    seeds: int  # the leader's number of seeds
    identical: bool  # every method gave the same value on every seed
    spread: float  # the seed-to-seed standard deviation, pooled over methods

    @property
    def clear(self) -> list[str]:
        """The methods clearly behind the leader (the paired 95% interval excludes 0)."""
        return [m for m in self.comparison["order"][1:] if self.comparison["diff_to_leader"][m]["clear"]]

    @property
    def tied(self) -> list[str]:
        return [m for m in self.comparison["order"][1:] if not self.comparison["diff_to_leader"][m]["clear"]]


@dataclass(frozen=True)
class Learning:
    """Did RL learn? The best masked method's final accuracy against its own SFT start, paired by seed."""

    best_masked: str
    gain: Interval
    start: float  # the best masked method's mean held-out accuracy at the start
    pg_is_gain: Interval | None  # pg_is's own change, where it ran
    other_gain: Interval | None  # the best masked method's change by the other held-out accuracy, where logged

    @property
    def answer(self) -> str:
        """"yes" (the interval excludes 0 and is positive), "fell" (excludes 0, negative) or "not measurably"."""
        return "yes" if self.gain.excludes_zero and self.gain.mean > 0 else "fell" if self.gain.excludes_zero else "not measurably"


@dataclass(frozen=True)
class TrustRegion:
    """Did the trust region matter? pg_is against the best masked method, paired by seed.

    It mattered if pg_is ends clearly behind (the paired 95% interval of best − pg_is excludes 0 and is
    positive) or if pg_is's mismatch grows clearly more than that method's over the run (the criterion
    fixed before the calibration); the gap in mean accuracy over the run (learning speed) is reported beside.
    """

    best_masked: str
    accuracy_gap: Interval  # best − pg_is, final held-out accuracy
    mean_accuracy_gap: Interval  # best − pg_is, mean held-out accuracy over the run
    mismatch_growth_gap: Interval  # pg_is − best, growth of the mismatch TV

    @property
    def mattered(self) -> bool:
        behind = self.accuracy_gap.excludes_zero and self.accuracy_gap.mean > 0
        grows = self.mismatch_growth_gap.excludes_zero and self.mismatch_growth_gap.mean > 0
        return behind or grows

    @property
    def answer(self) -> str:
        return "yes" if self.mattered else "not measurably"


@dataclass(frozen=True)
class PdmPair:
    """One pdm_* method against its DPPO twin (``MaskMethod.dppo_counterpart``)."""

    dppo: str
    accuracy_diff: Interval  # pdm − dppo, final held-out accuracy, paired by seed
    identical_runs: bool  # the two gave the same numbers on every seed: their masks never differed
    masks_differ: float | None  # share of response tokens on which the two masks decided differently (top-K pairs)
    spread: float  # standard deviation of the per-seed differences pdm − dppo

    @property
    def detectable(self) -> float:
        """The true difference these seeds detect with 80% probability (``intervals.detectable``)."""
        return detectable(self.spread, self.accuracy_diff.n)

    @property
    def answer(self) -> str:
        if self.identical_runs:
            return "identical"
        d = self.accuracy_diff
        return "within spread" if not d.excludes_zero else "pdm ahead" if d.mean > 0 else "dppo ahead"


@dataclass(frozen=True)
class PdmVsDppo:
    """Did PDM differ from DPPO? Each pdm_* method with a DPPO twin in the setting."""

    pairs: dict[str, PdmPair]

    @property
    def differed(self) -> bool:
        return any(not p.identical_runs and p.accuracy_diff.excludes_zero for p in self.pairs.values())


@dataclass(frozen=True)
class Questions:
    """The setting's three questions; None where the setting lacks the methods to ask it."""

    learning: Learning | None
    trust_region: TrustRegion | None
    pdm_vs_dppo: PdmVsDppo | None

    def answers(self) -> dict[str, str]:
        """Each verdict as one short answer: "learning", "trust_region" and "pdm_vs_dppo:<pdm method>"."""
        out = {name: q.answer for name, q in (("learning", self.learning), ("trust_region", self.trust_region)) if q is not None}
        if self.pdm_vs_dppo is not None:
            out |= {f"pdm_vs_dppo:{m}": p.answer for m, p in self.pdm_vs_dppo.pairs.items()}
        return out


@dataclass(frozen=True)
class ReplicationRow:
    all: str
    halves: list[str | None]

    @property
    def replicates(self) -> bool:
        return all(h == self.all for h in self.halves)


@dataclass(frozen=True)
class Replication:
    """Each verdict again on two disjoint halves of the seeds (first half, second half of the sorted seeds).

    A verdict replicates when both halves give the answer all seeds give. A half has fewer seeds, so a
    real but small difference can read "within spread" there: a verdict that does not replicate is weak.
    """

    halves: list[list[int]]
    verdicts: dict[str, ReplicationRow]


@dataclass(frozen=True)
class Facts:
    """Plain facts of a setting, means over seeds."""

    start: float  # held-out accuracy at the start, averaged over methods
    least_dropped: str
    most_dropped: str
    most_unstable: str  # the largest fall from a run's best held-out accuracy to its final one
    mismatch_tv: float  # trainer vs engine TV per token, averaged over methods
    mismatch_tv_max: float
    tail_masks_differ: float  # share of response tokens where the top-K predictive estimators' masks differ
    pi_rest: float  # π's mass outside TopK(μ) ∪ {a}
    identical_groups: list[list[str]]  # methods whose runs summarise identically on every seed


def best_masked(methods: Methods) -> str | None:
    """The masked method (not pg_is) with the best mean final held-out accuracy; None if there is none."""
    masked = [m for m in methods if m != "pg_is"]
    return max(masked, key=lambda m: methods[m]["final_accuracy"]["mean"]) if masked else None


def ranking(methods: Methods, metric: str) -> Ranking:
    per_seed = {m: e["per_seed"][metric] for m, e in methods.items()}
    comp = compare_methods(per_seed)
    return Ranking(
        metric,
        comp,
        methods[comp["leader"]][metric]["n"],
        len({tuple(v.values()) for v in per_seed.values()}) == 1,
        pooled_sd(per_seed),
    )


def ask(methods: Methods) -> Questions:
    """The setting's questions, the best masked method chosen once for both that use it."""
    best = best_masked(methods)
    return Questions(
        None if best is None else _learning(methods, best),
        None if best is None or "pg_is" not in methods else _trust_region(methods, best),
        _pdm_vs_dppo(methods),
    )


def _gain(methods: Methods, method: str, key: str = "accuracy_gain") -> Interval:
    return mean_ci(list(methods[method]["per_seed"][key].values()))


def _learning(methods: Methods, best: str) -> Learning:
    other = methods[best]["per_seed"].get("other_accuracy_gain")
    return Learning(
        best,
        _gain(methods, best),
        methods[best]["initial_accuracy"]["mean"],
        _gain(methods, "pg_is") if "pg_is" in methods else None,
        _gain(methods, best, "other_accuracy_gain") if other else None,
    )


def _trust_region(methods: Methods, best: str) -> TrustRegion:
    seeds = lambda m, k: methods[m]["per_seed"][k]
    return TrustRegion(
        best,
        paired(seeds(best, "final_accuracy"), seeds("pg_is", "final_accuracy")),
        paired(seeds(best, "mean_accuracy"), seeds("pg_is", "mean_accuracy")),
        paired(seeds("pg_is", "mismatch_growth"), seeds(best, "mismatch_growth")),
    )


def _pdm_vs_dppo(methods: Methods) -> PdmVsDppo | None:
    twins = {m: get_method(m).dppo_counterpart for m in methods if m.startswith("pdm_")}
    pairs = {}
    for pdm, dppo in twins.items():
        if dppo not in methods:
            continue
        a, b = methods[pdm]["per_seed"]["final_accuracy"], methods[dppo]["per_seed"]["final_accuracy"]
        pairs[pdm] = PdmPair(
            dppo,
            paired(a, b),
            _strip(methods[pdm]["per_seed"]) == _strip(methods[dppo]["per_seed"]),
            _masks_differ(methods, pdm, dppo),
            sd(differences(a, b)),
        )
    return PdmVsDppo(pairs) if pairs else None


def _masks_differ(methods: Methods, pdm: str, dppo: str) -> float | None:
    """Mean over both methods' runs of the share of tokens on which pdm's mask and dppo's differ (logged for the
    top-K estimators against dppo_topk_*; None for other pairs and runs that did not log it)."""
    key = f"vs_dppo_{get_method(pdm).estimator}"
    values = [v for m in (pdm, dppo) for v in methods[m]["per_seed"].get(key, {}).values() if v == v]
    return sum(values) / len(values) if values and dppo.startswith("dppo_topk_") else None


def _strip(per_seed: dict[str, dict[int, float]]) -> str:
    return json.dumps({k: v for k, v in per_seed.items() if k != "step_time_s"}, sort_keys=True)


def facts(methods: Methods) -> Facts:
    mean = lambda m, k: methods[m][k]["mean"]
    average = lambda k: sum(mean(m, k) for m in methods) / len(methods)
    by_drop = sorted(methods, key=lambda m: mean(m, "dropped_frac"))
    groups: dict[str, list[str]] = {}
    for m, e in methods.items():
        groups.setdefault(_strip(e["per_seed"]), []).append(m)
    return Facts(
        average("initial_accuracy"),
        by_drop[0],
        by_drop[-1],
        max(methods, key=lambda m: mean(m, "peak_to_final_drop")),
        average("mismatch_tv_mean"),
        max(mean(m, "mismatch_tv_max") for m in methods),
        average("topk_masks_differ_frac"),
        average("pi_rest_mean"),
        [g for g in groups.values() if len(g) > 1],
    )


def restrict(methods: Methods, seeds: list[int]) -> Methods:
    """The methods' per-seed summaries on a subset of the seeds, with their intervals recomputed."""
    out = {}
    for m, e in methods.items():
        per_seed = {k: {s: v for s, v in vals.items() if s in seeds} for k, vals in e["per_seed"].items()}
        out[m] = {"per_seed": per_seed} | {k: mean_ci(list(v.values())).as_dict() for k, v in per_seed.items() if v}
    return out


def replication(methods: Methods, questions: Questions) -> Replication | None:
    """``questions`` again on two disjoint halves of the seeds; None with fewer than 4 seeds."""
    seeds = sorted(set.intersection(*(set(e["per_seed"]["final_accuracy"]) for e in methods.values())))
    if len(seeds) < 4:
        return None
    halves = [seeds[: len(seeds) // 2], seeds[len(seeds) // 2 :]]
    full = questions.answers()
    per_half = [ask(restrict(methods, h)).answers() for h in halves]
    return Replication(halves, {key: ReplicationRow(full[key], [h.get(key) for h in per_half]) for key in full})
