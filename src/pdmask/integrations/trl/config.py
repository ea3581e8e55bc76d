"""``PDMConfig``: TRL's ``GRPOConfig`` plus the trust-region mask and its thresholds."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

from trl import GRPOConfig

from pdmask import get_method, method_thresholds
from pdmask.integrations.logprob_lists import VLLM_MAX_LOGPROBS

#: TRL loss types whose per-token loss is −min(r·A, clip(r)·A): with the clip off it is −r·A.
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")


@dataclass
class PDMConfig(GRPOConfig):
    """``GRPOConfig`` plus the trust-region mask.

    With a divergence method (``dppo_*``, ``pdm_*``) or ``pg_is`` the mask replaces PPO's clip: the
    config then sets ``epsilon=1`` and ``epsilon_high=inf`` (TRL's clip never binds) and rejects other
    values. With ``ppo_clip`` the loss is GRPO's own, clipped with ``epsilon``/``epsilon_high``.
    """

    mask_method: str = field(
        default="pdm_aggregated_kl",
        metadata={"help": "Trust-region mask: a pdmask.METHODS name (default: the paper's pdm_aggregated_kl; ppo_clip, dppo_topk_kl...)."},
    )
    # Not `top_k`: GRPOConfig.top_k is the sampler's top-k filter.
    mask_top_k: int = field(default=20, metadata={"help": "K: top log-probs of the rollout policy kept per token."})
    delta_low: float | None = field(default=None, metadata={"help": "Divergence threshold for A < 0 (None: default)."})
    delta_high: float | None = field(default=None, metadata={"help": "Divergence threshold for A > 0 (None: default)."})
    ratio_cap: float | None = field(default=None, metadata={"help": "c in sg(min(r, c)) (None: default 10)."})

    def __post_init__(self) -> None:
        method = get_method(self.mask_method)
        if not isinstance(self.mask_top_k, int) or self.mask_top_k < 1:
            raise ValueError(f"mask_top_k must be an int >= 1, got {self.mask_top_k!r}.")
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"PDMConfig supports loss_type in {LOSS_TYPES}; got {self.loss_type!r}.")
        if self.importance_sampling_level != "token":
            raise ValueError("PDMConfig masks tokens: importance_sampling_level must be 'token'.")
        if getattr(self, "off_policy_mask_threshold", None) is not None:
            raise ValueError(
                "off_policy_mask_threshold is TRL's own sequence mask; with PDMConfig the trust region is "
                "mask_method. Leave it unset."
            )
        gen = dict(self.generation_kwargs or {})
        if "temperature" in gen and gen["temperature"] != self.temperature:
            raise ValueError(
                f"generation_kwargs temperature={gen['temperature']} differs from temperature={self.temperature}: "
                "μ would be recorded at one temperature and sampled at another. Set `temperature` only."
            )
        if method.rule != "ppo_clip":
            clip_off = self.epsilon == 1.0 and self.epsilon_high == math.inf  # set by an earlier __post_init__
            if self.delta is not None or (not clip_off and (self.epsilon != 0.2 or self.epsilon_high is not None)):
                raise ValueError(
                    f"epsilon, epsilon_high and delta are PPO-clip settings; with mask_method={method.name!r} the "
                    "mask replaces the clip. Leave them unset and use delta_low, delta_high and ratio_cap."
                )
            if self.use_transformers_continuous_batching:
                raise NotImplementedError(
                    f"mask_method={method.name!r} records the rollout policy in TRL's transformers `generate` or vLLM "
                    "path; continuous batching is not supported yet. Use ppo_clip there."
                )
            if self.use_vllm:
                if method.needs == "full":
                    raise NotImplementedError(
                        f"mask_method={method.name!r} needs all of μ, but vLLM returns its top K: use a top-K method "
                        "(pdm_proportional_*, dppo_topk_*) with use_vllm=True."
                    )
                if self.vllm_mode == "colocate" and self.mask_top_k > VLLM_MAX_LOGPROBS:
                    raise ValueError(
                        f"mask_top_k={self.mask_top_k}: TRL starts its colocated vLLM with max_logprobs="
                        f"{VLLM_MAX_LOGPROBS}; use mask_top_k <= {VLLM_MAX_LOGPROBS}."
                    )
                # pdmask's ratio is already π/μ against vLLM's μ; TRL's correction would apply a second one.
                self.vllm_importance_sampling_correction = False
            # The clip band [1 - 1, 1 + inf) contains every ratio, so TRL's loss becomes -r·A.
            self.epsilon, self.epsilon_high = 1.0, math.inf
            reshaping = {"top_k", "top_p", "min_p", "repetition_penalty", "suppress_tokens", "bad_words_ids"}
            if self.top_k or self.top_p < 1 or self.min_p or self.repetition_penalty != 1 or reshaping & gen.keys():
                warnings.warn(
                    "top_k, top_p, min_p, repetition_penalty and generation_kwargs that filter tokens change the "
                    "sampler's distribution; the mask measures against softmax(logits / temperature), the "
                    "distribution TRL's own importance ratios use.",
                    stacklevel=2,
                )
        _ = self.mask_thresholds  # raises on thresholds the method does not take
        super().__post_init__()

    @property
    def mask_thresholds(self) -> dict[str, float]:
        """Threshold keywords for pdmask's mask functions (unset = the method's default): TRL's
        epsilon/epsilon_high for ppo_clip, delta_low/delta_high/ratio_cap otherwise."""
        method = get_method(self.mask_method)
        if method.rule == "ppo_clip":
            if any(v is not None for v in (self.delta_low, self.delta_high, self.ratio_cap)):
                raise ValueError(
                    "ppo_clip clips with epsilon/epsilon_high: leave delta_low, delta_high and ratio_cap unset."
                )
            if self.delta is not None:
                raise ValueError(
                    "ppo_clip with delta (TRL's two-sided clip) is not the mask pdmask measures: leave delta unset."
                )
            high = self.epsilon if self.epsilon_high is None else self.epsilon_high
            return method_thresholds(method, self.epsilon, high)
        return method_thresholds(method, self.delta_low, self.delta_high, self.ratio_cap)


__all__ = ["LOSS_TYPES", "PDMConfig"]
