"""Statistics over seeds for the lab's reports: t-based 95% intervals and paired comparisons.

Each run gives one number per metric; methods are compared over seeds with a t-based 95% interval,
and two methods with a paired interval of their per-seed differences (every method sees the same
seeds and data). No scipy: the t quantiles are tabulated.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# Two-sided 97.5% quantiles of Student's t for df = 1..30; 1.96 beyond.
_T975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip

# One-sided 80% quantiles of Student's t for df = 1..30 (the power term of a minimal detectable difference); 0.842 beyond.
_T80 = (
    1.376, 1.061, 0.978, 0.941, 0.920, 0.906, 0.896, 0.889, 0.883, 0.879,
    0.876, 0.873, 0.870, 0.868, 0.866, 0.865, 0.863, 0.862, 0.861, 0.860,
    0.859, 0.858, 0.858, 0.857, 0.856, 0.856, 0.855, 0.855, 0.854, 0.854,
)  # fmt: skip


def _t(table: tuple[float, ...], beyond: float, df: int) -> float:
    return table[df - 1] if df <= len(table) else beyond


@dataclass(frozen=True)
class Interval:
    mean: float
    low: float
    high: float
    n: int

    def fmt(self, digits: int = 3, signed: bool = False) -> str:
        f = f"{{:{'+' if signed else ''}.{digits}f}}".format
        return f(self.mean) if self.n < 2 else f"{f(self.mean)} [{f(self.low)}, {f(self.high)}]"

    @property
    def excludes_zero(self) -> bool:
        return self.n >= 2 and (self.low > 0 or self.high < 0)

    def as_dict(self) -> dict[str, Any]:
        return {"mean": self.mean, "low": self.low, "high": self.high, "n": self.n}


def mean_ci(values: Sequence[float]) -> Interval:
    """Mean and t-based 95% confidence interval over seeds (the interval collapses for n = 1)."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return Interval(mean, mean, mean, n)
    half = _t(_T975, 1.96, n - 1) * sd(values) / math.sqrt(n)
    return Interval(mean, mean - half, mean + half, n)


def sd(values: Sequence[float]) -> float:
    """Sample standard deviation (n − 1), 0 for fewer than two values."""
    n = len(values)
    if n < 2:
        return 0.0
    mean = sum(values) / n
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))


def detectable(spread: float, n: int) -> float:
    """The smallest true mean difference that a paired 95% interval over ``n`` seeds excludes 0 for with 80%
    probability, when the per-seed differences have standard deviation ``spread``: (t₀.₉₇₅ + t₀.₈₀)·spread/√n."""
    if n < 2:
        return math.inf
    return (_t(_T975, 1.96, n - 1) + _t(_T80, 0.842, n - 1)) * spread / math.sqrt(n)


def seeds_needed(spread: float, effect: float, most: int = 1000) -> int | None:
    """The fewest seeds whose ``detectable`` difference is at most ``effect`` (None beyond ``most``)."""
    return next((n for n in range(2, most + 1) if detectable(spread, n) <= effect), None)


def differences(a: dict[int, float], b: dict[int, float]) -> list[float]:
    """The per-seed differences a − b over the seeds both have, in seed order."""
    return [a[s] - b[s] for s in sorted(set(a) & set(b))]


def paired(a: dict[int, float], b: dict[int, float]) -> Interval:
    """Interval of the per-seed differences a − b over the seeds both have."""
    return mean_ci(differences(a, b))


def compare_methods(per_seed: dict[str, dict[int, float]], higher_is_better: bool = True) -> dict[str, Any]:
    """Leader by mean, and each method's paired difference to the leader over the common seeds."""
    means = {m: sum(v.values()) / len(v) for m, v in per_seed.items()}
    order = sorted(means, key=lambda m: means[m], reverse=higher_is_better)
    leader = order[0]
    diffs = {}
    for m in order[1:]:
        d = paired(per_seed[m], per_seed[leader])
        diffs[m] = d.as_dict() | {"clear": d.n >= 2 and (d.high < 0 if higher_is_better else d.low > 0)}
    return {"order": order, "leader": leader, "diff_to_leader": diffs}


def pooled_sd(per_seed: dict[str, dict[int, float]]) -> float:
    """Seed-to-seed standard deviation pooled over methods."""
    variances = [sd(list(v.values())) ** 2 for v in per_seed.values() if len(v) > 1]
    return math.sqrt(sum(variances) / len(variances)) if variances else 0.0
