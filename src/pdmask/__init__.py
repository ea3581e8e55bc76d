"""pdmask: predictive divergence masks (PDM), DPPO and PPO trust-region masks for RL of LLMs."""

from pdmask.estimators import divergence, predicted_change
from pdmask.hidden import policy_stats_from_hidden
from pdmask.loss import AGG_MODES, FRACTION_DENOMINATORS, aggregate_loss, mask_metrics, per_token_loss, policy_loss
from pdmask.methods import METHODS, MaskMethod, get_method, trust_region_mask
from pdmask.rollout import RolloutLogprobs
from pdmask.stats import FullReductions, PolicyStats, policy_stats, stats_from_set

__version__ = "0.1.0"

__all__ = [
    "AGG_MODES",
    "FRACTION_DENOMINATORS",
    "METHODS",
    "FullReductions",
    "MaskMethod",
    "PolicyStats",
    "RolloutLogprobs",
    "aggregate_loss",
    "divergence",
    "get_method",
    "mask_metrics",
    "per_token_loss",
    "policy_loss",
    "policy_stats",
    "policy_stats_from_hidden",
    "predicted_change",
    "stats_from_set",
    "trust_region_mask",
]
