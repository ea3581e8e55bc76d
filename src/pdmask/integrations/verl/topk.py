"""Top-K methods in verl's FSDP and Megatron engines: the actor's loss function doubles as a logits processor.

verl's engines call the actor's loss function twice per micro-batch when the batch carries the
non-tensor flag ``distillation_use_topk`` (the hook of its top-K distillation): first as a logits
processor on the temperature-scaled logits this rank holds, then as the loss. The FSDP engine passes the
packed logits [1, N, V] (under Ulysses sequence parallelism this rank's slice [1, ⌈N/sp⌉, V]); the Megatron
engine passes ``data_format=`` and vocab-parallel logits [b, s/cp, V/tp]. ``PDMLoss`` lays μ's rows out on
this rank as the engine laid out its sequence (``pdmask.integrations.verl.layout``), reads π at
S = TopK(μ) ∪ {a}, π's rest mass and ‖π‖² there with ``pdmask.policy_stats`` (one chunked pass, no second
[N, V] tensor; across tensor-parallel ranks with its ``tp_group``) and hands them back as per-token outputs,
which the engine gathers like its log-probs; as the loss it runs verl's own ``ppo_loss`` (entropy and KL
terms, global-batch aggregation, metrics), whose policy loss ``pdmask_<method>`` takes these statistics and
verl's log π(a) with its gradient.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
from tensordict import TensorDict
from torch import Tensor
from verl.utils import tensordict_utils as tu
from verl.workers.utils.losses import ppo_loss
from verl.workers.utils.padding import no_padding_2_padding

from pdmask.integrations.verl.layout import local_rows, tensor_parallel_group
from pdmask.integrations.verl.losses import loss_name, method_of, register
from pdmask.methods import METHODS, MaskMethod
from pdmask.rollout import RolloutLogprobs
from pdmask.stats import policy_stats
from pdmask.types import PolicyStats

#: Batch keys of the rollout's top-K, response-aligned [batch, response_len, K]: ids (int) and log μ.
TOPK_IDS = "rollout_topk_ids"
TOPK_LOGP = "rollout_topk_log_probs"
#: The non-tensor flag that makes verl's engine call the loss function as a logits processor.
PROCESSOR_FLAG = "distillation_use_topk"
#: Methods run by ``PDMLoss``: those that need μ's top-K (full μ has no rollout engine to come from).
TOPK_METHODS = tuple(name for name, m in METHODS.items() if m.needs == "topk" and not m.needs_head)
#: The backbone-aware methods need the final hidden states and the LM head, which verl's loss never sees.
HEAD_METHODS = tuple(name for name, m in METHODS.items() if m.needs_head)
#: Prefix of the per-token outputs the processor hands back through verl's model output.
_OUT = "pdmask_stat/"
#: PolicyStats fields laid out [2, ...] rather than [..., C].
_LEADING_PAIR = ("exactpi_sums",)

_current: ContextVar[PolicyStats | None] = ContextVar("pdmask_verl_topk_stats", default=None)


def sampled_logp(data: TensorDict) -> Tensor:
    """log μ(a) [B, R]: ``rollout_log_probs``, or ``old_log_probs`` in verl's bypass mode (where verl renames it)."""
    key = "rollout_log_probs" if "rollout_log_probs" in data.keys() else "old_log_probs"
    return _padded(data[key]).float()


def rollout_from_batch(data: TensorDict, method: MaskMethod, top_k: int | None = None) -> RolloutLogprobs:
    """μ [B, R(, K)] from the batch's response-aligned fields; one-line errors for missing fields or a K mismatch."""
    missing = [key for key in (TOPK_IDS, TOPK_LOGP) if key not in data.keys()]
    if missing:
        raise ValueError(
            f"{loss_name(method)} needs the rollout's top-K: the batch lacks {', '.join(missing)} "
            "[batch, response_len, K]. "
            "Add them at rollout time (pdmask.integrations.verl.rollout) or use a binary method (pdmask_dppo_binary_*)."
        )
    ids, logp = _padded(data[TOPK_IDS]), _padded(data[TOPK_LOGP])
    if top_k is not None and ids.shape[-1] != top_k:
        raise ValueError(
            f"the batch's {TOPK_IDS} has K = {ids.shape[-1]} columns but PDMLoss was built with top_k={top_k}: "
            "ask the rollout for the same K (logprobs=K) as the loss."
        )
    return RolloutLogprobs(sampled_logp(data), topk_ids=ids.long(), topk_logp=logp.float())


class PDMLoss:
    """verl engine loss function for a top-K pdmask method: ``ppo_loss`` with π's statistics at S.

    Args:
        config: verl's actor config (``ActorConfig``); ``config.policy_loss.loss_mode`` must be
            ``pdmask_<method>`` of a top-K method (``pdmask_pdm_aggregated_kl``, ``pdmask_dppo_topk_kl``...).
        top_k: K the rollout was asked for (checked against the batch); None accepts any K.
    Set it as the actor's loss function (``actor_rollout_wg.set_loss_fn(PDMLoss(config))``) and mark each
    actor batch with ``enable_topk_forward``.
    """

    def __init__(self, config: Any, top_k: int | None = None) -> None:
        mode = config.policy_loss.get("loss_mode", "vanilla")
        method = method_of(mode)
        if method is not None and method.needs_head:
            _no_head(method)
        if method is None or method.name not in TOPK_METHODS:
            raise ValueError(
                f"PDMLoss runs the top-K methods; actor.policy_loss.loss_mode is {mode!r}. Set it to one of "
                f"{', '.join(sorted(loss_name(m) for m in TOPK_METHODS))} (binary methods need no PDMLoss)."
            )
        if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
            raise ValueError(f"top_k must be a positive int or None, got {top_k!r}.")
        self.config, self.method, self.top_k = config, method, top_k

    def __call__(
        self,
        model_output: dict[str, Tensor] | None = None,
        data: TensorDict | None = None,
        dp_group: Any = None,
        student_logits: Tensor | None = None,
        data_format: str | None = None,
    ) -> Any:
        """verl's engine calls it as the logits processor (``student_logits``; the Megatron engine adds
        ``data_format``), then as the loss (``model_output``, ``dp_group``)."""
        assert data is not None
        if student_logits is not None:
            return self.logits_processor(student_logits, data, data_format)
        assert model_output is not None
        if not any(key.startswith(_OUT) for key in model_output):
            fused = tu.get_non_tensor_data(data=data, key="use_fused_kernels", default=False)
            raise RuntimeError(
                f"{loss_name(self.method)} reads π at the rollout's top-K ids from the logits, but verl's engine did "
                "not call PDMLoss on them: "
                + (
                    "fused kernels never materialise the logits; set actor_rollout_ref.model.use_fused_kernels=False."
                    if fused
                    else "mark the actor batch with pdmask.integrations.verl.enable_topk_forward "
                    f"(flag {PROCESSOR_FLAG})."
                )
            )
        stats = self._stats(model_output, data)
        with _stats_for_policy_loss(stats):
            return ppo_loss(self.config, model_output, data, dp_group)

    def logits_processor(self, student_logits: Tensor, data: TensorDict, data_format: str | None = None) -> dict[str, Tensor]:
        """Per token of this rank's logits [..., V] (FSDP: [1, N] or Ulysses [1, ⌈N/sp⌉]; Megatron: [1, N'/cp] or
        [B, S/cp], vocabulary split over tensor-parallel ranks): each tensor field of pdmask's PolicyStats but
        log π(a), column by column."""
        logits = student_logits.detach()
        tokens = torch.roll(data["input_ids"].values(), shifts=-1, dims=0).to(logits.device)
        packed = pack_rollout(data, tokens, self.method, self.top_k)
        mu = packed.rollout
        assert mu.topk_ids is not None and mu.topk_logp is not None
        rows = [local_rows(x, data, data_format) for x in (tokens, packed.mask.long(), mu.logp, mu.topk_ids, mu.topk_logp)]
        shape = tuple(logits.shape[:-1])
        if tuple(rows[0].shape) != shape:
            raise NotImplementedError(
                f"PDMLoss laid μ's rows out as {tuple(rows[0].shape)} but this rank's logits are {shape}: verl's "
                "engine padded or split the sequence in a way pdmask does not follow (pad_to_length, FP8 padding, "
                "dynamic context parallelism); turn it off for pdmask's top-K methods."
            )
        # Under Megatron tp the logits are this rank's vocabulary shard; every padded column counts in π (no
        # vocab_size), as in verl's own log-probs, whose log π(a) the policy loss puts beside these statistics.
        tp_group = tensor_parallel_group(data_format)
        stats = policy_stats(
            logits,
            rows[0],
            RolloutLogprobs(rows[2].float(), rows[3].long(), rows[4].float()),
            need_sq_norm=True,  # proportional, exactpi and the direction-disagreement metric use ‖π‖²
            need_exactpi=self.method.needs_exactpi,
            response_mask=rows[1].bool(),
            tp_group=tp_group,
        )
        return dict(_flatten(stats, shape))

    def _stats(self, model_output: dict[str, Tensor], data: TensorDict) -> PolicyStats:
        """PolicyStats [B, R] from the processor's per-token outputs; log π(a) is set by the policy loss."""
        fields = stats_fields({k: no_padding_2_padding(v, data) for k, v in model_output.items() if k.startswith(_OUT)})
        # log π(a) with its gradient is verl's own; the policy loss puts it in place of this stand-in.
        return PolicyStats(logp=fields["rollout_logp"], has_topk=True, has_full=False, **fields)


def stats_fields(outputs: dict[str, Tensor]) -> dict[str, Tensor]:
    """PolicyStats' tensor fields but log π(a) from the processor's outputs (``_flatten``'s inverse): per token
    [...] as ``name``, C columns as ``name/j`` → [..., C] (``exactpi_sums``: [2, ...])."""
    singles: dict[str, Tensor] = {}
    columns: dict[str, dict[int, Tensor]] = {}
    for key, value in outputs.items():
        if not key.startswith(_OUT):
            raise ValueError(f"{key!r} is not an output of PDMLoss's logits processor (keys start with {_OUT!r}).")
        name, _, col = key[len(_OUT) :].partition("/")
        if col:
            columns.setdefault(name, {})[int(col)] = value
        else:
            singles[name] = value
    for name, cols in columns.items():
        singles[name] = torch.stack([cols[j] for j in range(len(cols))], 0 if name in _LEADING_PAIR else -1)
    singles["set_valid"] = singles["set_valid"].bool()
    return singles


@dataclasses.dataclass(frozen=True)
class PackedRollout:
    """μ at the N packed tokens of a micro-batch, and where each response token sits among them.

    ``rollout``: log μ(a) [N], μ's top K [N, K] (neutral rows off the responses); ``mask`` [N]: response tokens;
    ``where`` [B, R]: packed index of the logits that predict response token t of sample b; ``valid`` [B, R].
    """

    rollout: RolloutLogprobs
    mask: Tensor
    where: Tensor
    valid: Tensor


def pack_rollout(data: TensorDict, tokens: Tensor, method: MaskMethod, top_k: int | None) -> PackedRollout:
    """μ's response-aligned rows [B, R(, K)] laid out on verl's packed sequence [N] (``tokens``: its next tokens)."""
    n, device = tokens.shape[0], tokens.device
    # Packed position of each response token (the logits before it): verl's own response slicing, inverted.
    where = no_padding_2_padding(torch.arange(1, n + 1, device=device), data).long() - 1
    rollout = rollout_from_batch(data, method, top_k)
    valid = (where >= 0) & _padded(data["response_mask"]).bool().to(device)
    at = where[valid]
    mask = torch.zeros(n, dtype=torch.bool, device=device)
    mask[at] = True
    k = rollout.k
    ids = torch.arange(k, device=device).expand(n, k).clone()
    ids[at] = rollout.topk_ids.to(device)[valid]  # type: ignore[union-attr]  # rollout_from_batch sets the top K
    topk_logp = torch.zeros(n, k, device=device)
    topk_logp[at] = rollout.topk_logp.to(device)[valid]  # type: ignore[union-attr]
    logp = torch.zeros(n, device=device)
    logp[at] = rollout.logp.to(device)[valid]
    return PackedRollout(RolloutLogprobs(logp, ids, topk_logp), mask, where, valid)


def enable_topk_forward(data: TensorDict) -> TensorDict:
    """Marks an actor batch so that verl's FSDP engine calls ``PDMLoss`` on the logits (``distillation_use_topk``)."""
    tu.assign_non_tensor(data, **{PROCESSOR_FLAG: True})
    return data


@contextmanager
def _stats_for_policy_loss(stats: PolicyStats) -> Iterator[None]:
    token = _current.set(stats)
    try:
        yield
    finally:
        _current.reset(token)


def _flatten(stats: PolicyStats, shape: tuple[int, ...]) -> Iterator[tuple[str, Tensor]]:
    """(key, ``shape``) for every tensor field but log π(a): a per-token field as ``name``, one with C columns as
    ``name/j`` (verl's engine carries per-token outputs only)."""
    for f in dataclasses.fields(stats):
        value = getattr(stats, f.name)
        if f.name == "logp" or not isinstance(value, Tensor):
            continue
        if value.dim() == len(shape):
            yield f"{_OUT}{f.name}", value
            continue
        cols = value.unbind(0) if f.name in _LEADING_PAIR else value.unbind(-1)
        for j, col in enumerate(cols):
            yield f"{_OUT}{f.name}/{j}", col


def _padded(x: Tensor) -> Tensor:
    """A jagged batch field padded with zeros to its longest row. Padded by the rows themselves: a jagged tensor
    that came through verl's TransferQueue can carry a larger cached max length (``to_padded_tensor`` pads to it)."""
    return torch.nn.utils.rnn.pad_sequence(list(x.unbind()), batch_first=True) if x.is_nested else x


def _stats_under_pdm_loss(method: MaskMethod) -> Callable[[Tensor, Tensor, Tensor], PolicyStats]:
    """The statistics ``PDMLoss`` computed for this micro-batch, with verl's log π(a) (and its gradient) in place."""

    def stats_of(log_prob: Tensor, old_log_prob: Tensor, response_mask: Tensor) -> PolicyStats:
        stats = _current.get()
        if stats is None:
            raise RuntimeError(
                f"{loss_name(method)} needs π at the rollout's top-K ids, which verl's default ppo_loss does not "
                "compute: "
                "set the actor's loss function to pdmask.integrations.verl.PDMLoss(config) (docs/verl.md, top-K mode)."
            )
        return dataclasses.replace(stats, logp=torch.where(response_mask.bool(), log_prob.float(), 0.0))

    return stats_of


def _no_head(method: MaskMethod, *_: Tensor) -> PolicyStats:
    raise ValueError(
        f"{loss_name(method)} needs the final hidden states and the LM head, which verl's policy loss does not "
        "see (it gets logits): use it through pdmask's TRL trainer or the lab, or pick a top-K method such as "
        "pdmask_pdm_proportional_kl."
    )


for _name in TOPK_METHODS:
    register(METHODS[_name], _stats_under_pdm_loss(METHODS[_name]), " (top-K, under PDMLoss)")
for _name in HEAD_METHODS:  # registered so that choosing one gives the reason, not "unknown loss mode"
    register(METHODS[_name], functools.partial(_no_head, METHODS[_name]), " (not available in verl)")

__all__ = [
    "PDMLoss",
    "TOPK_IDS",
    "TOPK_LOGP",
    "HEAD_METHODS",
    "TOPK_METHODS",
    "PackedRollout",
    "enable_topk_forward",
    "pack_rollout",
    "rollout_from_batch",
    "sampled_logp",
    "stats_fields",
]
