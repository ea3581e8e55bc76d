"""Binary-information masks as verl policy losses ``pdmask_<method>``, drop-in for verl's ``dppo_tv``/``dppo_kl``.

A registered verl policy loss sees log π(a) (``log_prob``), the anchor's log μ(a) (``old_log_prob``: the
rollout engine's log-probs in verl's bypass mode, else the recomputed π_old), advantages and the
response mask, and nothing else, so only methods that need μ(a) alone can be one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from verl.trainer.ppo.core_algos import agg_loss, register_policy_loss
from verl.utils.torch_functional import masked_mean

from pdmask.backends.inputs import compute_dtype
from pdmask.loss import decision_loss, mask_metrics
from pdmask.methods import METHODS, MaskMethod, decide, get_method, method_thresholds
from pdmask.rollout import RolloutLogprobs
from pdmask.stats import stats_from_set
from pdmask.types import PolicyStats

#: The ratio cap verl's ``dppo_tv``/``dppo_kl`` fall back to when a config lacks ``clip_ratio_c``. verl's
#: ActorConfig always sets that key (default 3.0), so in a verl run the cap is the config's.
VERL_DPPO_RATIO_CAP = 20.0
#: The pdmask methods registered as verl policy losses, each under ``pdmask_<name>``.
BINARY_METHODS = tuple(name for name, m in METHODS.items() if m.needs == "binary")
#: Metric keys: verl's own names for its dashboards, then pdmask's under this prefix.
METRIC_PREFIX = "actor/pdmask/"


def loss_name(method: str | MaskMethod) -> str:
    """The verl ``loss_mode`` of a pdmask method: ``pdmask_<name>``."""
    return f"pdmask_{get_method(method).name}"


def method_of(loss_mode: Any) -> MaskMethod | None:
    """The pdmask method of a verl ``loss_mode`` ``pdmask_<name>`` , else None."""
    if not isinstance(loss_mode, str) or not loss_mode.startswith("pdmask_"):
        return None
    name = loss_mode.removeprefix("pdmask_")
    return get_method(name) if name in METHODS else None


def verl_thresholds(method: MaskMethod, config: Any) -> dict[str, float]:
    """pdmask thresholds read from verl's actor config exactly as verl's ``dppo_tv``/``dppo_kl`` read them.

    ``clip_ratio_low``/``clip_ratio_high`` (None: ``clip_ratio``) are δ_low/δ_high for divergence
    methods and ε_low/ε_high for ``ppo_clip``; ``clip_ratio_c`` is the ratio cap c everywhere.
    """
    if config is None:
        raise ValueError(f"{loss_name(method)} reads its thresholds from verl's actor config; config is None.")
    low = config.clip_ratio_low if config.clip_ratio_low is not None else config.clip_ratio
    high = config.clip_ratio_high if config.clip_ratio_high is not None else config.clip_ratio
    cap = config.get("clip_ratio_c", VERL_DPPO_RATIO_CAP)
    # verl's config always carries clip_ratio, so pg_is (which takes no low/high) ignores it.
    return method_thresholds(method, low, high, cap, ignore_unused=True)


def binary_stats(log_prob: Tensor, old_log_prob: Tensor, response_mask: Tensor) -> PolicyStats:
    """PolicyStats [B, T] from log π(a) (keeps its gradient) and log μ(a) alone, S = {a}.

    A registered loss sees no token ids; binary statistics need none, so every position gets id 0.
    """
    mask = response_mask.bool()
    dtype = compute_dtype(log_prob.dtype)
    tokens = torch.zeros(mask.shape, dtype=torch.long, device=log_prob.device)
    rollout = RolloutLogprobs(old_log_prob).masked(mask).validated(tokens, 1, dtype)
    logp = torch.where(mask, log_prob.to(dtype), 0.0)  # padding may hold anything; it gets no weight
    return stats_from_set(logp, tokens, rollout, logp.detach().unsqueeze(-1))


def masked_policy_loss(
    method: MaskMethod,
    stats: PolicyStats,
    advantages: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str,
    config: Any,
    rollout_is_weights: Tensor | None,
) -> tuple[Tensor, dict[str, Any]]:
    """(loss, metrics): pdmask's −M·sg(min(r, c))·A·log π(a), times verl's rollout-correction weights,
    aggregated by verl's own ``agg_loss`` (with its global-batch normalisation)."""
    thresholds = verl_thresholds(method, config)
    mask = response_mask.bool()
    decision = decide(method, stats, advantages, mask, **thresholds)
    loss_mat, keep = decision_loss(decision), decision.keep
    if rollout_is_weights is not None:
        loss_mat = loss_mat * rollout_is_weights
    loss = agg_loss(loss_mat=loss_mat, loss_mask=mask, loss_agg_mode=loss_agg_mode, **config.global_batch_info)
    with torch.no_grad():
        log_ratio = (stats.logp.detach() - stats.rollout_logp).clamp(-20.0, 20.0)
        metrics: dict[str, Any] = {
            "actor/pg_clipfrac": masked_mean((~keep).float(), mask).item(),
            "actor/ppo_kl": masked_mean(-log_ratio, mask).item(),
            "actor/pg_clipfrac_lower": masked_mean(
                ((log_ratio.exp() > decision.thresholds["ratio_cap"]) & keep).float(), mask
            ).item(),
        }
    pdm = mask_metrics(decision)
    metrics |= {METRIC_PREFIX + key: value for key, value in pdm.items() if not key.startswith("count/")}
    return loss, metrics


def register(method: MaskMethod, stats_of: Callable[[Tensor, Tensor, Tensor], PolicyStats], doc: str) -> None:
    """Registers ``pdmask_<method>`` with verl; stats: ``stats_of(log_prob, old_log_prob, response_mask)``."""

    def policy_loss(
        old_log_prob: Tensor,
        log_prob: Tensor,
        advantages: Tensor,
        response_mask: Tensor,
        loss_agg_mode: str = "token-mean",
        config: Any = None,
        rollout_is_weights: Tensor | None = None,
    ) -> tuple[Tensor, dict[str, Any]]:
        stats = stats_of(log_prob, old_log_prob, response_mask)
        return masked_policy_loss(method, stats, advantages, response_mask, loss_agg_mode, config, rollout_is_weights)

    policy_loss.__name__ = policy_loss.__qualname__ = loss_name(method)
    policy_loss.__doc__ = f"verl policy loss for pdmask's {method.name!r}{doc}: {method.description}"
    register_policy_loss(loss_name(method))(policy_loss)


for _name in BINARY_METHODS:
    register(METHODS[_name], binary_stats, "")

__all__ = ["BINARY_METHODS", "binary_stats", "loss_name", "masked_policy_loss", "method_of", "register", "verl_thresholds"]
