"""95% intervals for the analysis' rates: Wilson for independent tokens, and Wilson on the effective
number of tokens when tokens come in clusters (the tokens of one response share its advantage and context).

Undefined values (a rate over no tokens) are None, never 0 or NaN.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

Z95 = 1.959963984540054


def wilson(k: float, n: float, z: float = Z95) -> tuple[float | None, float | None]:
    """Wilson score interval of a binomial proportion k/n ((None, None) for n = 0); n may be an effective size."""
    if n <= 0:
        return None, None
    p = k / n
    denom = 1 + z * z / n
    center = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    # The interval contains p; clamping keeps rounding from putting p outside it.
    return max(0.0, min(p, center - half)), min(1.0, max(p, center + half))


def effective_size(hits: Tensor, clusters: Tensor) -> float:
    """n / deff for the share of True in ``hits`` [n] when tokens are grouped by ``clusters`` [n] (ids).

    deff = Var_cluster(p̂) / (p̂(1 − p̂)/(n − 1)), with the between-cluster (ratio-estimator) variance
    Var_cluster = m/(m − 1) · Σ_c (k_c − p̂ n_c)² / n² over the m clusters: one token per cluster gives
    deff = 1 exactly. deff is floored at 1, so clustering only ever widens the interval. One cluster
    counts as one observation; when p̂ is 0 or 1 the variance says nothing about clustering and n is kept.
    """
    n = len(hits)
    if n == 0:
        return 0.0
    ids, inverse = clusters.unique(return_inverse=True)
    m = len(ids)
    if m < 2:
        return 1.0
    k = float(hits.sum())
    p = k / n
    if p in (0.0, 1.0):
        return float(n)
    n_c = torch.bincount(inverse, minlength=m).double()
    k_c = torch.bincount(inverse, weights=hits.double(), minlength=m)
    var_cluster = m / (m - 1) * float((k_c - p * n_c).square().sum()) / n**2
    return n / max(1.0, var_cluster / (p * (1 - p) / (n - 1)))


def clustered_rate(hits: Tensor, clusters: Tensor) -> dict:
    """Share of True in ``hits`` [n] with a 95% Wilson interval on the effective size of ``clusters`` [n].

    Returns {"rate", "lo", "hi", "k", "n", "n_eff"}; rate and bounds are None when n = 0.
    """
    n, k = len(hits), int(hits.sum())
    n_eff = effective_size(hits, clusters)
    lo, hi = wilson(k / n * n_eff if n else 0.0, n_eff)
    return {"rate": k / n if n else None, "lo": lo, "hi": hi, "k": k, "n": n, "n_eff": n_eff if n else None}
