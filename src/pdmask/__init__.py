"""pdmask: predictive divergence masks (PDM), DPPO and PPO trust-region masks for RL of LLMs."""

from pdmask.estimators import divergence, predicted_change
from pdmask.exact import exact_divergence
from pdmask.loss import (
    AGG_MODES,
    FRACTION_DENOMINATORS,
    aggregate_loss,
    decision_loss,
    mask_metrics,
    metrics_to_floats,
    per_token_loss,
    policy_loss,
    pool_metrics,
)
from pdmask.methods import METHODS, MaskDecision, MaskMethod, decide, get_method, method_thresholds, trust_region_mask
from pdmask.rollout import RolloutLogprobs
from pdmask.stats import policy_stats, policy_stats_from_hidden, stats_from_set
from pdmask.types import FullReductions, PolicyStats

__version__ = "0.2.0"

__all__ = [
    "AGG_MODES",
    "FRACTION_DENOMINATORS",
    "METHODS",
    "FullReductions",
    "MaskDecision",
    "MaskMethod",
    "PolicyStats",
    "RolloutLogprobs",
    "aggregate_loss",
    "decide",
    "decision_loss",
    "divergence",
    "exact_divergence",
    "get_method",
    "mask_metrics",
    "metrics_to_floats",
    "method_thresholds",
    "per_token_loss",
    "policy_loss",
    "policy_stats",
    "policy_stats_from_hidden",
    "pool_metrics",
    "predicted_change",
    "stats_from_set",
    "trust_region_mask",
]
