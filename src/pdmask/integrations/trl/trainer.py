"""``PDMTrainer``: TRL's ``GRPOTrainer`` whose scoring forward computes pdmask's mask and hands TRL the
per-token advantages and old log-probs that make its loss pdmask's surrogate."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, cast

import torch
from accelerate.utils import is_peft_model
from torch import Tensor
from transformers import PreTrainedModel
from trl import GRPOTrainer
from trl.trainer.utils import add_fused_lm_head

from pdmask import (
    MaskDecision,
    MaskMethod,
    PolicyStats,
    RolloutLogprobs,
    decide,
    decision_loss,
    get_method,
    mask_metrics,
    policy_stats_from_hidden,
    pool_metrics,
)
from pdmask.integrations.trl.config import PDMConfig
from pdmask.integrations.trl.lm_head import capture_scoring, head_logits_at, head_weights
from pdmask.integrations.trl.recorders import RolloutRecorder, VLLMRecorder
from pdmask.stats import stats_from_set

#: Config attributes that make TRL's fused head transform the logits beyond dividing by τ.
_LOGIT_TRANSFORMS = (
    "final_logit_softcapping",
    "logit_scale",
    "output_multiplier",
    "lm_head_multiplier",
    "logits_scaling",
)


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
        self._pending: LateInputs | None = None
        self._vllm: VLLMRecorder | None = None
        if args.use_vllm and method.rule != "ppo_clip":
            self._vllm = VLLMRecorder(self.vllm_generation, self._top_k, self.temperature, args.vllm_mode)
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
        recorder = RolloutRecorder(self.temperature, self._top_k, full=self.mask_method.needs == "full")
        handle = self._policy.register_forward_hook(recorder, with_kwargs=True)
        try:
            output = super()._generate_and_score_completions(inputs)
        finally:
            handle.remove()
        output.update(recorder.finish(output["completion_ids"], output["completion_mask"]))
        return output

    def _compute_loss(self, model: Any, inputs: dict[str, Any]) -> Tensor:
        """TRL's loss on a batch whose advantages and old log-probs the scoring forward fills in."""
        batch = LateInputs(inputs, late=self.mask_method.rule != "ppo_clip")
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
        with capture_scoring(self._policy, hidden=self.mask_method.needs != "binary") as caught:
            logps, entropies, aux_loss = super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, *args, **kwargs
            )
        self._apply_mask(batch, logps, caught, logits_to_keep)
        return logps, entropies, aux_loss

    def _apply_mask(
        self, batch: LateInputs, logps: Tensor, caught: dict[str, list[Tensor]], logits_to_keep: int
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
        if needs == "full" or self.mask_method.needs_exactpi or self.mask_method.needs_head:
            # The exactpi estimator's TV sums, full μ and the backbone-aware sums need every logit: read them from the
            # hidden states in blocks, so no [B, T, V] logits are held (log π(a) stays TRL's own, with its gradient).
            with torch.no_grad(), head_weights(head) as (weight, bias):
                # One dtype for both, no float32 copies: the pass makes float32 logits of bf16 inputs block by block.
                dtype = torch.promote_types(hidden.dtype, weight.dtype)
                stats = policy_stats_from_hidden(
                    hidden.to(dtype),
                    weight.to(dtype),
                    tokens,
                    rollout,
                    bias=None if bias is None else bias.to(dtype),
                    temperature=self.temperature,
                    need_exactpi=self.mask_method.needs_exactpi,
                    response_mask=valid,
                    need_backbone=self.mask_method.needs_head,
                )
            return replace(stats, logp=logp)
        if needs == "topk":
            assert rollout.topk_ids is not None
            set_ids = torch.cat([rollout.topk_ids, tokens.unsqueeze(-1)], -1)  # S: the top-K ids, then a
            z = head_logits_at(head, hidden, set_ids) / self.temperature
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
        metrics = mask_metrics(decision, as_tensors=True)  # read back once, after the gather
        local = torch.stack(list(metrics.values())).to(self.accelerator.device)
        rows = [dict(zip(metrics, row.tolist())) for row in self.accelerator.gather(local).view(-1, len(metrics))]
        mode = "train" if self._policy.training else "eval"
        for key, value in pool_metrics(rows).items():
            self._metrics[mode][f"pdmask/{key}"].append(value)


class LateInputs(dict):
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


__all__ = ["LateInputs", "PDMTrainer"]
