"""The registry of trust-region mask methods and the mask itself (True = keep the token)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import torch
from torch import Tensor

from pdmask.backbone import BACKBONE_ESTIMATORS, require_head
from pdmask.estimators import (
    ESTIMATORS,
    FULL_ESTIMATORS,
    PAPER_ESTIMATORS,
    SQ_NORM_ESTIMATORS,
    divergence,
    predicted_change,
)
from pdmask.rollout import Checks, as_bool_mask
from pdmask.types import PolicyStats

DELTA_TV = 0.15
DELTA_KL = 0.05
EPS_LOW = 0.2
EPS_HIGH = 0.28
RATIO_CAP = 10.0


@dataclass(frozen=True)
class MaskMethod:
    """One mask rule with its divergence, estimator and default thresholds.

    rule: "ppo_clip" (ratio band), "none" (keep all), "dppo" (D > δ and A·(π_a − μ_a) > 0 drops),
    "pdm" (D > δ and A·G > 0 drops).
    """

    name: str
    rule: str
    description: str
    kind: str | None = None
    info: str | None = None
    estimator: str | None = None
    defaults: Mapping[str, float] = field(default_factory=dict)

    @property
    def needs(self) -> str:
        """The least information about μ the method needs: "binary", "topk" or "full"."""
        if self.estimator in FULL_ESTIMATORS or self.info == "full":
            return "full"
        if self.estimator is not None or self.info == "topk":
            return "topk"
        return "binary"

    @property
    def needs_sq_norm(self) -> bool:
        return self.estimator in SQ_NORM_ESTIMATORS

    @property
    def dppo_counterpart(self) -> str:
        """The ratio-sign mask with this method's divergence and information about μ (itself for ``dppo_*``):
        ``pdm_aggregated_kl`` -> ``dppo_topk_kl``. Both compute the same D, so they differ only in direction."""
        if self.kind is None:
            raise ValueError(f"method {self.name!r} has no divergence, so no DPPO counterpart.")
        return f"dppo_{self.info}_{self.kind}"

    @property
    def needs_head(self) -> bool:
        """Whether the statistics must carry the LM head's sums (``head_weight=W`` / ``need_backbone=True``)."""
        return self.estimator in BACKBONE_ESTIMATORS

    @property
    def needs_exactpi(self) -> bool:
        """Whether the pass should sum the ``exactpi`` estimator's thresholded tail (its TV form)."""
        return self.estimator == "exactpi" and self.kind == "tv"

    @property
    def origin(self) -> str:
        """Where the method comes from: "paper" (DPPO, PPO or the PDM paper), or "pdmask" (an extension)."""
        if self.rule != "pdm":
            return "paper"
        return "paper" if self.kind == "kl" and self.estimator in PAPER_ESTIMATORS else "pdmask"


def _divergence_defaults(kind: str) -> Mapping[str, float]:
    delta = DELTA_TV if kind == "tv" else DELTA_KL
    return MappingProxyType({"delta_low": delta, "delta_high": delta, "ratio_cap": RATIO_CAP})


_KIND_WORDS = {"tv": "total variation", "kl": "KL(μ‖π)"}
_INFO_WORDS = {
    "binary": "from μ(a) alone (binary)",
    "topk": "on the K+1 buckets of μ's top-K (DPPO's top-K estimate)",
    "full": "over the whole vocabulary",
}
_ESTIMATOR_WORDS = {
    "full": "exact G over the whole vocabulary",
    "aggregated": "the paper's aggregated-tail G on the K+1 buckets TopK ∪ {a} ∪ rest",
    "uniform": "the paper's uniform-tail G, both tails spread evenly over the ids off TopK ∪ {a}",
    "proportional": "pdmask's refinement: exact ‖π‖², μ's tail taken proportional to π's tail",
    "exactpi": "pdmask's refinement: exact π, μ's unseen tail spread evenly over the ids off TopK ∪ {a}",
    "backbone_full": "pdmask's backbone-aware G_W = ⟨Wᵀ∇_z D, Wᵀ(e_a − π)⟩ through the LM head W, exact μ",
    "backbone_topk": "pdmask's backbone-aware G_W through the LM head W, μ's tail proportional to π's",
}


def _registry() -> dict[str, MaskMethod]:
    methods = [
        MaskMethod(
            "ppo_clip",
            "ppo_clip",
            "PPO/GRPO clipping as a mask: drop A>0 tokens with r > 1+ε_high and A<0 tokens with r < 1−ε_low.",
            defaults=MappingProxyType({"eps_low": EPS_LOW, "eps_high": EPS_HIGH, "ratio_cap": RATIO_CAP}),
        ),
        MaskMethod(
            "pg_is",
            "none",
            "No trust region: truncated importance sampling min(r, c) only.",
            defaults=MappingProxyType({"ratio_cap": RATIO_CAP}),
        ),
    ]
    for kind in ("tv", "kl"):
        for info in ("binary", "topk", "full"):
            methods.append(
                MaskMethod(
                    f"dppo_{info}_{kind}",
                    "dppo",
                    f"DPPO: drop if {_KIND_WORDS[kind]} {_INFO_WORDS[info]} exceeds δ and A·(π_a − μ_a) > 0.",
                    kind=kind,
                    info=info,
                    defaults=_divergence_defaults(kind),
                )
            )
        for estimator in ESTIMATORS:
            methods.append(
                MaskMethod(
                    f"pdm_{estimator}_{kind}",
                    "pdm",
                    f"PDM: drop if {_KIND_WORDS[kind]} exceeds δ and A·G > 0, {_ESTIMATOR_WORDS[estimator]}.",
                    kind=kind,
                    info="full" if estimator in FULL_ESTIMATORS else "topk",
                    estimator=estimator,
                    defaults=_divergence_defaults(kind),
                )
            )
    return {m.name: m for m in methods}


#: Every mask method by name. Adding a method is one MaskMethod entry.
METHODS: Mapping[str, MaskMethod] = MappingProxyType(_registry())


def get_method(method: str | MaskMethod) -> MaskMethod:
    """Looks a method up by name (or passes a MaskMethod through); an unknown name raises ValueError listing them."""
    if isinstance(method, MaskMethod):
        return method
    if not isinstance(method, str) or method not in METHODS:
        raise ValueError(f"unknown mask method {method!r}; choose one of: {', '.join(METHODS)}.")
    return METHODS[method]


def resolve_thresholds(method: MaskMethod, overrides: Mapping[str, float | None]) -> dict[str, float]:
    """The method's defaults with the given overrides (None means default); rejects unknown or bad values."""
    allowed = set(method.defaults)
    values = dict(method.defaults)
    for key, value in overrides.items():
        if value is None:
            continue
        if key not in allowed:
            raise ValueError(
                f"method {method.name!r} takes thresholds {sorted(allowed)}; got unexpected {key}={value!r}."
            )
        if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ValueError(f"threshold {key} must be a finite number >= 0, got {value!r}.")
        values[key] = float(value)
    if "ratio_cap" in values and values["ratio_cap"] <= 0:
        raise ValueError(f"ratio_cap must be > 0, got {values['ratio_cap']}.")
    return values


def check_information(method: MaskMethod, stats: PolicyStats) -> None:
    """Raises unless the rollout gave what the method needs (top-K ids for top-K, full_logp for full)."""
    missing = (method.needs == "topk" and not stats.has_topk) or (method.needs == "full" and not stats.has_full)
    if missing:
        hint = "topk_ids=..., topk_logp=..." if method.needs == "topk" else "full_logp=..."
        raise ValueError(
            f"method {method.name!r} needs {method.needs} information about μ, which the rollout does not have: "
            f"pass RolloutLogprobs({hint})."
        )
    if method.needs_head:
        require_head(stats)


def beyond_threshold(divergence_value: Tensor, advantages: Tensor, delta_low: float, delta_high: float) -> Tensor:
    """D > δ_high where A > 0, D > δ_low where A < 0, never where A = 0; bool [...]."""
    return ((advantages > 0) & (divergence_value > delta_high)) | ((advantages < 0) & (divergence_value > delta_low))


@dataclass(frozen=True)
class MaskDecision:
    """One method's mask and its reasons, each [...] and detached; None where the rule has no such part.

    ``keep`` is M (True = keep; False outside the response); a token is dropped when it is ``beyond``
    (D > δ for its advantage's sign) and A·``direction`` > 0, with direction π_a − μ_a (DPPO) or G (PDM).
    """

    method: MaskMethod
    stats: PolicyStats
    advantages: Tensor  # A at every position, in μ's float dtype
    response: Tensor  # bool: the response positions (all True when no response mask was given)
    thresholds: Mapping[str, float]  # the method's defaults with the caller's overrides
    keep: Tensor
    divergence: Tensor | None = None
    beyond: Tensor | None = None
    direction: Tensor | None = None


def decide(
    method: str | MaskMethod,
    stats: PolicyStats,
    advantages: Tensor,
    response_mask: Tensor | None = None,
    *,
    validate: bool = True,
    **thresholds: float | None,
) -> MaskDecision:
    """The mask of one method with its reasons (``MaskDecision``), each quantity computed once.

    Thresholds (keyword, None = default): delta_low, delta_high for divergence methods; eps_low,
    eps_high for ``ppo_clip``; ratio_cap everywhere (used by the loss, not by the mask).
    ``validate=False`` skips the checks of values (finite advantages, a 0/1 response mask), which read
    them back from the device: the decision then runs without a host-device sync.
    """
    m = get_method(method)
    check_information(m, stats)
    t = resolve_thresholds(m, thresholds)
    checks = Checks() if validate else False  # both checks read back at once
    adv = _broadcast_advantages(advantages, stats.logp.shape, checks).to(stats.rollout_logp.dtype)
    shape = stats.logp.shape
    response = (
        torch.ones(shape, dtype=torch.bool, device=adv.device) if response_mask is None
        else as_bool_mask(response_mask, shape, checks)
    )
    if isinstance(checks, Checks):
        checks.read()
    d = beyond = direction = None
    with torch.no_grad():
        if m.rule == "none":
            drop = torch.zeros_like(adv, dtype=torch.bool)
        elif m.rule == "ppo_clip":
            r = stats.ratio
            drop = ((adv > 0) & (r > 1 + t["eps_high"])) | ((adv < 0) & (r < 1 - t["eps_low"]))
        else:
            assert m.kind is not None and m.info is not None
            d = divergence(stats, m.kind, m.info)
            beyond = beyond_threshold(d, adv, t["delta_low"], t["delta_high"])
            if m.rule == "dppo":
                direction = stats.pi_a - stats.mu_a
            else:
                assert m.estimator is not None
                direction = predicted_change(stats, m.kind, m.estimator)
            drop = beyond & (adv * direction > 0)
    return MaskDecision(m, stats, adv, response, MappingProxyType(t), ~drop & response, d, beyond, direction)


def trust_region_mask(
    method: str | MaskMethod,
    stats: PolicyStats,
    advantages: Tensor,
    response_mask: Tensor | None = None,
    **thresholds: float | None,
) -> Tensor:
    """M [...] (bool, True = keep) of one method; positions outside ``response_mask`` are False.

    Thresholds as in ``decide``; ``decide`` also gives the reasons (D, beyond δ, the direction).
    """
    return decide(method, stats, advantages, response_mask, **thresholds).keep


def method_thresholds(
    method: str | MaskMethod,
    low: float | None = None,
    high: float | None = None,
    cap: float | None = None,
    *,
    ignore_unused: bool = False,
) -> dict[str, float]:
    """A host's (low, high, cap) as the method's threshold keywords; None leaves the method's default.

    low/high are ε_low/ε_high for ``ppo_clip`` and δ_low/δ_high for divergence methods; cap is the
    ratio cap c. ``pg_is`` has no low/high: given ones raise, unless ``ignore_unused`` (a host whose
    config always carries them, such as verl's clip_ratio).
    """
    m = get_method(method)
    if m.rule == "none":
        if not ignore_unused and (low is not None or high is not None):
            raise ValueError(f"method {m.name!r} keeps every token and takes no low/high threshold; leave them unset.")
        names: dict[str, float | None] = {}
    elif m.rule == "ppo_clip":
        names = {"eps_low": low, "eps_high": high}
    else:
        names = {"delta_low": low, "delta_high": high}
    values = {k: float(v) for k, v in (names | {"ratio_cap": cap}).items() if v is not None}
    resolve_thresholds(m, values)
    return values


def _broadcast_advantages(advantages: Tensor, shape: torch.Size, checks: Checks | bool) -> Tensor:
    if not isinstance(advantages, Tensor) or not advantages.is_floating_point():
        raise TypeError("advantages must be a floating-point torch.Tensor, per token [...] or per sequence [B].")
    if tuple(advantages.shape) != tuple(shape):
        if len(shape) == 2 and tuple(advantages.shape) in ((shape[0],), (shape[0], 1)):
            advantages = advantages.reshape(shape[0], 1).expand(shape)
        else:
            raise ValueError(
                f"advantages has shape {tuple(advantages.shape)}; expected per-token {tuple(shape)}"
                + (f" or per-sequence ({shape[0]},)." if len(shape) == 2 else ".")
            )
    if isinstance(checks, Checks):
        checks.add(
            ~torch.isfinite(advantages).all(), lambda: "advantages contain NaN or inf; normalise rewards with a guard against zero std."
        )
    return advantages


__all__ = [
    "METHODS",
    "MaskDecision",
    "MaskMethod",
    "beyond_threshold",
    "decide",
    "get_method",
    "method_thresholds",
    "trust_region_mask",
]
