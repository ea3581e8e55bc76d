"""DPPO and predictive divergence masks in TRL's ``GRPOTrainer`` (``pip install pdmask[trl]``).

``PDMConfig`` adds one choice, ``mask_method`` (any name in ``pdmask.METHODS``), to TRL's ``GRPOConfig``;
``PDMTrainer`` is TRL's ``GRPOTrainer`` with that trust region. Datasets, rewards, advantages, loss
aggregation, KL and entropy terms, logging and distribution all stay TRL's. What it adds:

- rollout side: with TRL's transformers ``generate``, a forward hook on the policy records at every step
  log μ(a) and the top-K log-probs of μ = softmax(z/τ) (or all of μ for the ``*_full`` methods); with
  ``use_vllm=True``, TRL's vLLM generation is asked for ``logprobs=K`` (processed log-probs) and
  ``pdmask.integrations.entries.completions_from_lists`` reads log μ(a) and μ's top K from its answer;
- loss side: in the scoring forward TRL already runs, ‖π‖² comes from TRL's fused LM head
  (``log_sum_sq_probs``) and π at S = TopK(μ) ∪ {a} from K+1 gathered rows of the LM head, so no
  [batch, length, vocab] tensor is built. pdmask computes the mask M and the per-token weight
  w = M·sg(min(r, c))·A of its surrogate; TRL's own loss then receives the per-token advantage
  w / r with the rollout log-probs as old log-probs and its PPO clip switched off, so the gradient
  TRL applies is exactly −w·∇log π(a), the gradient of pdmask's DPPO-form surrogate.

Overridden ``GRPOTrainer`` methods (each calls TRL's own): ``_generate_and_score_completions``,
``_compute_loss`` and ``_get_per_token_logps_and_entropies``; with vLLM, the instance's
``vllm_generation.generate`` is wrapped.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, cast

import torch
from torch import Tensor

from pdmask import (
    MaskDecision,
    MaskMethod,
    PolicyStats,
    RolloutLogprobs,
    decide,
    decision_loss,
    get_method,
    mask_metrics,
    method_thresholds,
    policy_stats_from_hidden,
    pool_metrics,
)
from pdmask.integrations._version import in_range
from pdmask.stats import stats_from_set

#: TRL releases this integration was written and tested against: [TRL_MIN, TRL_MAX).
TRL_MIN, TRL_MAX = "1.16", "1.17"


def check_trl_version(version: str) -> None:
    """Raises ImportError unless ``version`` lies in [TRL_MIN, TRL_MAX)."""
    if not in_range(version, TRL_MIN, TRL_MAX):
        raise ImportError(
            f"pdmask.integrations.trl supports TRL >={TRL_MIN},<{TRL_MAX} but TRL {version} is installed. It overrides "
            "private GRPOTrainer methods, which change between releases: install a supported TRL with "
            "`pip install 'pdmask[trl]'`."
        )


try:
    import trl
except ImportError as err:  # pragma: no cover - exercised only without the extra
    raise ImportError("pdmask.integrations.trl needs TRL: `pip install 'pdmask[trl]'`.") from err
check_trl_version(trl.__version__)

from accelerate.utils import is_peft_model
from torch.distributed.tensor import DTensor
from transformers import PreTrainedModel
from trl import GRPOConfig, GRPOTrainer
from trl.trainer.utils import add_fused_lm_head, maybe_gather_lm_head_ctx

#: TRL loss types whose per-token loss is −min(r·A, clip(r)·A): with the clip off it is −r·A.
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
#: Config attributes that make TRL's fused head transform the logits beyond dividing by τ.
_LOGIT_TRANSFORMS = (
    "final_logit_softcapping",
    "logit_scale",
    "output_multiplier",
    "lm_head_multiplier",
    "logits_scaling",
)
#: vLLM's default ``max_logprobs``, which TRL's colocated engine keeps.
VLLM_MAX_LOGPROBS = 20
#: Memory budget for the float32 temporaries of one chunk of LM-head rows.
_CHUNK_BYTES = 64 << 20


@dataclass
class PDMConfig(GRPOConfig):
    """``GRPOConfig`` plus the trust-region mask.

    With a divergence method (``dppo_*``, ``pdm_*``) or ``pg_is`` the mask replaces PPO's clip: the
    config then sets ``epsilon=1`` and ``epsilon_high=inf`` (TRL's clip never binds) and rejects other
    values. With ``ppo_clip`` the loss is GRPO's own, clipped with ``epsilon``/``epsilon_high``.
    """

    mask_method: str = field(
        default="pdm_proportional_tv",
        metadata={"help": "Trust-region mask: any name in pdmask.METHODS (ppo_clip, dppo_binary_tv, pdm_proportional_tv…)."},
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


class PDMTrainer(GRPOTrainer):
    """TRL's ``GRPOTrainer`` with the trust-region mask ``args.mask_method``; takes GRPOTrainer's arguments."""

    def __init__(self, model: Any, reward_funcs: Any = None, args: PDMConfig | None = None, **kwargs: Any) -> None:
        if not isinstance(args, PDMConfig):
            raise TypeError(f"PDMTrainer needs args=PDMConfig(...), got {type(args).__name__}.")
        method = get_method(args.mask_method)
        if method.rule != "ppo_clip":
            for name in ("tools", "rollout_func", "environment_factory"):
                if kwargs.get(name) is not None:
                    raise NotImplementedError(
                        f"PDMTrainer with mask_method={method.name!r} does not support `{name}` yet: the rollout "
                        "policy is recorded for single-turn transformers generation only."
                    )
        super().__init__(model, reward_funcs, args, **kwargs)
        self.mask_method: MaskMethod = method
        self._thresholds = args.mask_thresholds
        # The module whose forward TRL patched with its fused LM head (under PEFT, the base model).
        model = cast(Any, self.model)
        self._policy = cast(PreTrainedModel, model.get_base_model() if is_peft_model(model) else model)
        self._top_k = args.mask_top_k
        self._pending: _LateInputs | None = None
        self._vllm: _VLLMRecorder | None = None
        if args.use_vllm and method.rule != "ppo_clip":
            self._vllm = _VLLMRecorder(self.vllm_generation, self._top_k, self.temperature, args.vllm_mode)
        if method.needs != "binary":
            if not isinstance(self._policy.get_output_embeddings(), torch.nn.Linear):
                raise NotImplementedError(
                    f"mask_method={method.name!r} reads rows of the LM head, which must be a plain nn.Linear "
                    "(no adapter on lm_head)."
                )
            config = self._policy.config.get_text_config()
            for name in _LOGIT_TRANSFORMS:
                if getattr(config, name, None) not in (None, 1.0):
                    raise NotImplementedError(
                        f"mask_method={method.name!r} needs π at the rollout's top-K tokens, computed from LM-head "
                        f"rows as logits/τ; this model's config sets {name}, which that path does not apply yet."
                    )
            # TRL's head computes log-probs and entropy; ask it also for log Σπ², in the same tiles. The
            # second patch wraps the first, which only still runs for calls without `fused_lm_head`.
            add_fused_lm_head(
                self._policy,
                temperature=self.temperature,
                cast_lm_head_to_fp32=args.cast_lm_head_to_fp32,
                outputs=("log_probs", "entropy", "log_sum_sq_probs"),
            )

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        """TRL's generation and scoring, plus μ at every completion token ([B, T], [B, T, K] or [B, T, V])."""
        if self.mask_method.rule == "ppo_clip":
            return super()._generate_and_score_completions(inputs)
        if self._vllm is not None:
            self._vllm.pending.clear()
            output = super()._generate_and_score_completions(inputs)
            output.update(self._vllm.finish(output["completion_ids"], output["completion_mask"]))
            return output
        recorder = _RolloutRecorder(self.temperature, self._top_k, full=self.mask_method.needs == "full")
        handle = self._policy.register_forward_hook(recorder, with_kwargs=True)
        try:
            output = super()._generate_and_score_completions(inputs)
        finally:
            handle.remove()
        output.update(recorder.finish(output["completion_ids"], output["completion_mask"]))
        return output

    def _compute_loss(self, model: Any, inputs: dict[str, Any]) -> Tensor:
        """TRL's loss on a batch whose advantages and old log-probs the scoring forward fills in."""
        batch = _LateInputs(inputs, late=self.mask_method.rule != "ppo_clip")
        self._pending = batch
        try:
            loss = super()._compute_loss(model, batch)
        finally:
            unscored, self._pending = self._pending, None
        if unscored is not None:
            raise RuntimeError(
                "TRL's _compute_loss did not score the batch through _get_per_token_logps_and_entropies; this TRL "
                "version is incompatible with PDMTrainer."
            )
        return loss

    def _get_per_token_logps_and_entropies(
        self, model: Any, input_ids: Tensor, attention_mask: Tensor, logits_to_keep: int, *args: Any, **kwargs: Any
    ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """TRL's scoring forward; in the loss pass it also captures ‖π‖² and the final hidden states."""
        if self._pending is None or model is self.ref_model:  # old-policy and reference passes stay TRL's own
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, *args, **kwargs
            )
        batch, self._pending = self._pending, None
        with _capture_scoring(self._policy, hidden=self.mask_method.needs != "binary") as caught:
            logps, entropies, aux_loss = super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, *args, **kwargs
            )
        self._apply_mask(batch, logps, caught, logits_to_keep)
        return logps, entropies, aux_loss

    def _apply_mask(
        self, batch: _LateInputs, logps: Tensor, caught: dict[str, list[Tensor]], logits_to_keep: int
    ) -> None:
        """Computes M, logs pdmask's metrics and fills the batch's per-token advantages and old log-probs."""
        tokens = batch.early("completion_ids")
        mask = batch.early("completion_mask")
        if "tool_mask" in batch:
            mask = mask * batch.early("tool_mask")
        logp = logps.detach().float()
        advantages = batch.early("advantages")
        advantages = (advantages.unsqueeze(1) if advantages.dim() == 1 else advantages).expand_as(logp).float()
        needs = self.mask_method.needs  # what the scoring pass was set up for, whatever the batch carries
        if self.mask_method.rule == "ppo_clip":
            # GRPO's own clipped loss trains; the mask is measured against the same old log-probs it uses.
            old = batch.early("old_per_token_logps")
            rollout = RolloutLogprobs(logp if old is None else old.float())
        else:
            rollout = RolloutLogprobs(
                batch.early("pdm_rollout_logps"),
                topk_ids=batch.early("pdm_topk_ids") if needs == "topk" else None,
                topk_logp=batch.early("pdm_topk_logps") if needs == "topk" else None,
                full_logp=batch.early("pdm_full_logps") if needs == "full" else None,
            )
        stats = self._policy_stats(rollout, tokens, mask, logp, caught, logits_to_keep)
        if self.mask_method.rule == "ppo_clip":
            self._log_mask_metrics(decide(self.mask_method, stats, advantages, mask, **self._thresholds))
            return
        leaf = stats.logp.detach().requires_grad_(True)
        decision = decide(self.mask_method, replace(stats, logp=leaf), advantages, mask, **self._thresholds)
        with torch.enable_grad():
            # The per-token weight w = M·sg(min(r, c))·A, read off pdmask's surrogate so its formula lives there.
            (neg_weight,) = torch.autograd.grad(decision_loss(decision).sum(), leaf)
        # log μ handed to TRL is floored at log π − 80, so TRL's own r = exp(log π − old) stays finite in float32.
        old_logp = torch.maximum(stats.rollout_logp, stats.logp.detach() - 80.0)
        ratio = (stats.logp.detach() - old_logp).exp()
        # TRL multiplies the advantage by r = exp(log π − old) with old = log μ; dividing by r here leaves w.
        per_token_advantages = torch.where(ratio > 0, -neg_weight / ratio, torch.zeros_like(ratio))
        self._log_mask_metrics(decision)
        batch.fill(advantages=per_token_advantages, old_per_token_logps=old_logp)

    def _policy_stats(
        self,
        rollout: RolloutLogprobs,
        tokens: Tensor,
        mask: Tensor,
        logp: Tensor,
        caught: dict[str, list[Tensor]],
        logits_to_keep: int,
    ) -> PolicyStats:
        """PolicyStats [B, T] from TRL's log π(a), its fused head's ‖π‖² and LM-head rows at S.

        Binary and top-K methods build no [B, T, V] tensor. The ``*_full`` methods need the recorded
        μ over the whole vocabulary, so they hold [B, T, V] anyway and pdmask scores full logits.
        """
        head = cast(torch.nn.Linear, self._policy.get_output_embeddings())
        needs = rollout.info
        valid = mask.bool()
        tokens = torch.where(valid, tokens, 0)  # padding becomes the neutral token of RolloutLogprobs.masked
        rollout = rollout.masked(valid).validated(tokens, head.weight.shape[0], torch.float32)
        if needs != "binary":
            # The hidden state before each completion token is the one that predicts it.
            hidden = torch.cat([h[:, -logits_to_keep - 1 : -1] for h in caught["hidden"]])
        if needs == "full" or self.mask_method.needs_uniform:
            # The uniform tail's sums and full μ need every logit: read them from the hidden states in
            # blocks, so no [B, T, V] logits are held (log π(a) stays TRL's own, with its gradient).
            with torch.no_grad(), _head_weights(head) as (weight, bias):
                stats = policy_stats_from_hidden(
                    hidden.float(),
                    weight.float(),
                    tokens,
                    rollout,
                    bias=None if bias is None else bias.float(),
                    temperature=self.temperature,
                    need_uniform=self.mask_method.needs_uniform,
                    response_mask=valid,
                )
            return replace(stats, logp=logp)
        if needs == "topk":
            assert rollout.topk_ids is not None
            set_ids = torch.cat([rollout.topk_ids, tokens.unsqueeze(-1)], -1)  # S: the top-K ids, then a
            z = _head_logits_at(head, hidden, set_ids) / self.temperature
            # log π(a) = z_a − lse(z) gives the normaliser without a pass over the vocabulary.
            set_logp = z - (z[..., -1] - logp.detach()).unsqueeze(-1)
        else:
            set_logp = logp.detach().unsqueeze(-1)
        sq_norm = None
        if caught["log_sum_sq_probs"]:
            sq_norm = torch.cat([x[:, -logits_to_keep:] for x in caught["log_sum_sq_probs"]]).float().exp()
        return stats_from_set(logp, tokens, rollout, set_logp, sq_norm=sq_norm, vocab_size=head.weight.shape[0])

    def _log_mask_metrics(self, decision: MaskDecision) -> None:
        """pdmask's metrics into TRL's ``_metrics`` as ``pdmask/...``, pooled over all processes by ``pool_metrics``."""
        metrics = mask_metrics(decision)
        local = torch.tensor(list(metrics.values()), device=self.accelerator.device)
        rows = [dict(zip(metrics, row.tolist())) for row in self.accelerator.gather(local).view(-1, len(metrics))]
        mode = "train" if self._policy.training else "eval"
        for key, value in pool_metrics(rows).items():
            self._metrics[mode][f"pdmask/{key}"].append(value)


class _LateInputs(dict):
    """A batch whose ``advantages`` and ``old_per_token_logps`` the scoring forward fills in.

    TRL reads both only after it has scored the batch. Should a release read them earlier, this raises
    instead of letting TRL train silently on the unmasked values.
    """

    LATE = ("advantages", "old_per_token_logps")

    def __init__(self, batch: dict[str, Any], *, late: bool) -> None:
        super().__init__(batch)
        self.filled = not late

    def fill(self, **values: Tensor) -> None:
        self.update(values)
        self.filled = True

    def early(self, key: str) -> Any:
        """The value as TRL produced it (None when absent), readable before filling."""
        return dict.get(self, key)

    def _check(self, key: str) -> None:
        if key in self.LATE and not self.filled:
            raise RuntimeError(
                f"TRL read inputs[{key!r}] before scoring the batch; this TRL version is incompatible with PDMTrainer."
            )

    def __getitem__(self, key: str) -> Any:
        self._check(key)
        return super().__getitem__(key)

    def get(self, key: str, default: Any = None) -> Any:
        self._check(key)
        return super().get(key, default)


class _RolloutRecorder:
    """Forward hook on the policy recording μ = softmax(z/τ) at each step of transformers' ``generate``.

    Step t's logits give μ for completion token t; step t+1's input is the token sampled at step t, which
    gives log μ(a_t). TRL's fused scoring forward returns no logits and is skipped.
    """

    def __init__(self, temperature: float, top_k: int, *, full: bool) -> None:
        self.temperature, self.top_k, self.full = temperature, top_k, full
        self._rows: list[tuple[Tensor, ...]] = []  # per step: (top-K log μ, top-K ids) or (log μ,), [B, ·]
        self._sampled: list[Tensor] = []  # per step but the last: log μ(a) [B]
        self._fed: list[Tensor] = []  # per step but the last: a [B]
        self._last: Tensor | None = None  # the latest step's log μ [B, V]

    def __call__(self, module: torch.nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
        logits = getattr(output, "logits", None)
        if logits is None:
            return
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        if input_ids is None:
            raise NotImplementedError("PDMTrainer records generation from input_ids; inputs_embeds is not supported.")
        with torch.no_grad():
            logp = torch.log_softmax(logits[:, -1].float() / self.temperature, dim=-1)
            if self._last is not None:
                fed = input_ids[:, -1]
                self._fed.append(fed)
                self._sampled.append(self._last.gather(-1, fed.unsqueeze(-1)).squeeze(-1))
            self._last = logp
            self._rows.append((logp,) if self.full else tuple(logp.topk(min(self.top_k, logp.shape[-1]), dim=-1)))

    def finish(self, completion_ids: Tensor, completion_mask: Tensor) -> dict[str, Tensor]:
        """The recorded μ aligned to TRL's completions [B, T]; columns beyond the last step get a uniform μ."""
        if self._last is None:
            raise RuntimeError("no generation step of the policy was recorded; PDMTrainer needs TRL's generate path.")
        steps, width = len(self._rows), completion_ids.shape[1]
        if steps > width:
            raise RuntimeError(f"recorded {steps} generation steps for completions of length {width}.")
        # A token TRL kept that differs from the one generate fed back means the two are misaligned.
        if self._fed:
            fed = torch.stack(self._fed, 1)
            kept = completion_mask[:, : steps - 1].bool()
            if (fed != completion_ids[:, : steps - 1])[kept].any():
                raise RuntimeError("generation steps do not line up with TRL's completion tokens.")
        last = self._last.gather(-1, completion_ids[:, steps - 1 : steps]).squeeze(-1)
        logp = torch.stack([*self._sampled, last], 1)
        columns = [torch.stack(c, 1) for c in zip(*self._rows)]
        pad = width - steps
        vocab = self._last.shape[-1]
        uniform = -math.log(vocab)
        logp = torch.nn.functional.pad(logp, (0, pad), value=uniform)
        if self.full:
            return {"pdm_rollout_logps": logp, "pdm_full_logps": _pad_steps(columns[0], pad, uniform)}
        top_logp, ids = columns
        filler = torch.arange(ids.shape[-1], device=ids.device).expand(ids.shape[0], pad, -1)
        return {
            "pdm_rollout_logps": logp,
            "pdm_topk_ids": torch.cat([ids, filler], 1),
            "pdm_topk_logps": _pad_steps(top_logp, pad, uniform),
        }


class _VLLMRecorder:
    """Wraps TRL's ``VLLMGeneration.generate`` so that it asks for ``logprobs=K`` and keeps μ's top K.

    TRL keeps the first entry of each position's log-probs as the sampled token's (right for
    ``logprobs=0`` only): the wrapper hands TRL log μ(a) there, read by ``completions_from_lists``.
    """

    def __init__(self, generation: Any, top_k: int, temperature: float, mode: str) -> None:
        from pdmask.integrations.entries import check_logprobs_mode, completions_from_lists

        if mode == "server" and getattr(generation, "vllm_client", None) is not None:
            info = generation.vllm_client.get_server_info()
            check_logprobs_mode(info["model_config"]["logprobs_mode"], temperature)
        self._convert, self.top_k = completions_from_lists, top_k
        self.pending: list[Any] = []  # Completions of the generation calls of one batch
        self._generate = generation.generate
        generation.logprobs = top_k
        generation.generate = self

    def __call__(self, *args: Any, **kwargs: Any) -> tuple[Any, Any, list, None]:
        prompt_ids, completion_ids, logprobs, token_ids = self._generate(*args, **kwargs)
        if logprobs is None or token_ids is None:
            raise RuntimeError("TRL's vLLM generation returned no log-probs; PDMTrainer needs logprobs=K from vLLM.")
        done = self._convert(completion_ids, token_ids, logprobs, self.top_k)
        self.pending.append(done)
        sampled = [[[x] for x in row[: len(ids)].tolist()] for row, ids in zip(done.rollout.logp, completion_ids)]
        return prompt_ids, completion_ids, sampled, None

    def finish(self, completion_ids: Tensor, completion_mask: Tensor) -> dict[str, Tensor]:
        """The recorded μ aligned to TRL's completions [B, T]."""
        if len(self.pending) != 1:
            raise RuntimeError(f"expected one vLLM generation per batch, recorded {len(self.pending)}.")
        done = self.pending.pop()
        (rows, steps), width = done.tokens.shape, completion_ids.shape[1]
        if rows != completion_ids.shape[0] or steps > width:
            raise RuntimeError(f"vLLM returned {rows} x {steps} tokens for TRL's completions {tuple(completion_ids.shape)}.")
        kept = completion_mask[:, :steps].bool().cpu() & done.response_mask
        if (done.tokens != completion_ids[:, :steps].cpu())[kept].any():
            raise RuntimeError("vLLM's tokens do not line up with TRL's completion tokens.")
        pad, device = width - steps, completion_ids.device
        return {  # columns past vLLM's longest completion are padding, neutralised before use
            "pdm_rollout_logps": torch.nn.functional.pad(done.rollout.logp, (0, pad)).to(device),
            "pdm_topk_ids": _pad_steps(done.rollout.topk_ids, pad, 0).to(device),
            "pdm_topk_logps": _pad_steps(done.rollout.topk_logp, pad, 0.0).to(device),
        }


def _pad_steps(x: Tensor, pad: int, value: float) -> Tensor:
    """Pads [B, steps, C] to [B, steps + pad, C] with ``value``."""
    return torch.nn.functional.pad(x, (0, 0, 0, pad), value=value)


@contextmanager
def _capture_scoring(policy: PreTrainedModel, *, hidden: bool) -> Iterator[dict[str, list[Tensor]]]:
    """Collects, per forward of TRL's scoring loop, the fused head's log Σπ² and the backbone's last hidden state."""
    caught: dict[str, list[Tensor]] = {"log_sum_sq_probs": [], "hidden": []}

    def on_policy(module: torch.nn.Module, args: tuple, output: Any) -> None:
        if getattr(output, "log_sum_sq_probs", None) is not None:
            caught["log_sum_sq_probs"].append(output.log_sum_sq_probs.detach())

    def on_backbone(module: torch.nn.Module, args: tuple, output: Any) -> None:
        caught["hidden"].append(output.last_hidden_state.detach())

    handles = [policy.register_forward_hook(on_policy)]
    if hidden:
        handles.append(cast(torch.nn.Module, policy.base_model).register_forward_hook(on_backbone))
    try:
        yield caught
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def _head_weights(head: torch.nn.Linear) -> Iterator[tuple[Tensor, Tensor | None]]:
    """The LM head's whole weight [V, d] and bias [V]: gathered under ZeRO-3 (TRL's context) or FSDP2 (DTensor)."""
    params = cast(list[torch.nn.Parameter], [head.weight, head.bias])
    with torch.no_grad(), maybe_gather_lm_head_ctx(*params):
        weight: Tensor = head.weight
        bias: Tensor | None = head.bias
        if isinstance(weight, DTensor):
            weight = weight.full_tensor()
            bias = bias.full_tensor() if isinstance(bias, DTensor) else bias
        yield weight, bias


def _head_logits_at(head: torch.nn.Linear, hidden: Tensor, ids: Tensor) -> Tensor:
    """Logits [..., S] = h·W[ids] (+ b[ids]) in float32 for hidden [..., d] and ids [..., S], in chunks (no grad)."""
    flat_h, flat_ids = hidden.reshape(-1, hidden.shape[-1]), ids.reshape(-1, ids.shape[-1])
    rows = max(1, _CHUNK_BYTES // (4 * flat_ids.shape[1] * flat_h.shape[1]))
    out = torch.empty(flat_ids.shape, dtype=torch.float32, device=hidden.device)
    with _head_weights(head) as (weight, bias):
        for start in range(0, flat_h.shape[0], rows):
            sl = slice(start, start + rows)
            rows_w = weight[flat_ids[sl]].float()  # [rows, S, d]
            out[sl] = torch.linalg.vecdot(rows_w, flat_h[sl].float().unsqueeze(1))
            if bias is not None:
                out[sl] += bias[flat_ids[sl]].float()
    return out.reshape(ids.shape)


__all__ = ["LOSS_TYPES", "TRL_MAX", "TRL_MIN", "VLLM_MAX_LOGPROBS", "PDMConfig", "PDMTrainer", "check_trl_version"]
