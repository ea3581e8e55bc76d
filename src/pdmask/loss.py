"""The DPPO-form policy loss with a trust-region mask, loss aggregation (verl's modes, one convention apart) and metrics."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from pdmask.estimators import SQ_NORM_ESTIMATORS, divergence, predicted_change
from pdmask.methods import DELTA_TV, MaskDecision, MaskMethod, beyond_threshold, decide, get_method
from pdmask.rollout import RolloutLogprobs, as_bool_mask
from pdmask.stats import policy_stats
from pdmask.types import PolicyStats

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")

#: The count each share in ``mask_metrics`` is a fraction of: pool shares over micro-batches with these
#: weights (a plain mean of shares over-weights small or empty micro-batches).
FRACTION_DENOMINATORS = {
    "mask/dropped_frac": "count/tokens",
    "mask/dropped_frac_pos": "count/pos",
    "mask/dropped_frac_neg": "count/neg",
    "mask/beyond_threshold_frac": "count/tokens",
    "mask/direction_disagree_frac": "count/beyond_threshold",
    "div/mean": "count/tokens",
    "ratio/mean": "count/tokens",
}


def per_token_loss(
    method: str | MaskMethod,
    stats: PolicyStats,
    advantages: Tensor,
    response_mask: Tensor | None = None,
    **thresholds: float | None,
) -> tuple[Tensor, Tensor]:
    """(loss_mat [...], keep [...]) with loss_t = −M_t · sg(min(r, c)) · A · log π(a)."""
    decision = decide(method, stats, advantages, response_mask, **thresholds)
    return decision_loss(decision), decision.keep


def decision_loss(decision: MaskDecision) -> Tensor:
    """loss_mat [...] = −M_t · sg(min(r, c)) · A · log π(a) for a mask decision; only log π(a) has a gradient."""
    stats = decision.stats
    cap = decision.thresholds["ratio_cap"]
    weight = decision.keep.to(stats.logp.dtype) * stats.ratio.clamp(max=cap) * decision.advantages.to(stats.logp.dtype)
    return -weight * stats.logp


def aggregate_loss(
    loss_mat: Tensor,
    response_mask: Tensor,
    agg: str = "token-mean",
    *,
    cu_seqlens: Tensor | None = None,
    norm_length: int | None = None,
    validate: bool = True,
) -> Tensor:
    """Scalar loss from loss_mat [B, T] (or packed [N] / [1, N] with cu_seqlens [num_seqs + 1]), by verl's mode names.

    token-mean: Σ loss / #tokens; seq-mean-token-sum: mean_s Σ_t; seq-mean-token-mean: mean_s mean_t;
    seq-mean-token-sum-norm (Dr. GRPO): Σ loss / norm_length, norm_length = T by default (the longest
    sequence for packed input: pass norm_length to keep one constant); ``validate=False`` skips the check
    that the mask holds only 0 and 1 (a host-device sync). The first three equal verl's
    ``agg_loss`` in one process; seq-mean-token-sum-norm does not: it divides by the length alone, as
    the DPPO research fork does, while verl >= 0.8 divides by (number of sequences × length)
    (``pdmask.integrations.verl`` aggregates with verl's own ``agg_loss``; docs/verl.md). As in verl,
    the seq-mean modes average over sequences with at least one response token. Empty masks give 0, never NaN.
    """
    if agg not in AGG_MODES:
        raise ValueError(f"agg must be one of {', '.join(AGG_MODES)}; got {agg!r}.")
    if norm_length is not None and (not isinstance(norm_length, int) or norm_length < 1):
        raise ValueError(f"norm_length must be a positive int (the Dr. GRPO constant), got {norm_length!r}.")
    mask = as_bool_mask(response_mask, loss_mat.shape, validate).to(loss_mat.dtype)
    if cu_seqlens is not None and loss_mat.dim() == 2:
        if loss_mat.shape[0] != 1:
            raise ValueError(
                f"cu_seqlens describes packed input [N] or [1, N]; loss_mat has shape {tuple(loss_mat.shape)}."
            )
        loss_mat, mask = loss_mat[0], mask[0]
    masked = loss_mat * mask
    if agg == "token-mean":
        return masked.sum() / mask.sum().clamp_min(1.0)
    if loss_mat.dim() == 1:
        if cu_seqlens is None:
            raise ValueError(f"agg={agg!r} on packed 1-D input needs cu_seqlens [num_seqs + 1] (sequence starts).")
        seq_sum, seq_count, seq_len = _packed_sums(masked, mask, cu_seqlens)
    elif loss_mat.dim() == 2:
        seq_sum, seq_count, seq_len = masked.sum(-1), mask.sum(-1), loss_mat.shape[-1]
    else:
        raise ValueError(f"loss_mat must be [B, T] or packed [N] for agg={agg!r}; got shape {tuple(loss_mat.shape)}.")
    num_seqs = (seq_count > 0).sum().clamp_min(1)
    if agg == "seq-mean-token-sum":
        return seq_sum.sum() / num_seqs
    if agg == "seq-mean-token-mean":
        return (seq_sum / seq_count.clamp_min(1.0)).sum() / num_seqs
    return seq_sum.sum() / float(norm_length or max(seq_len, 1))


def _packed_sums(masked: Tensor, mask: Tensor, cu_seqlens: Tensor) -> tuple[Tensor, Tensor, int]:
    if not isinstance(cu_seqlens, Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError("cu_seqlens must be a 1-D tensor [num_seqs + 1] of sequence start offsets.")
    cu = cu_seqlens.long().to(masked.device)
    lengths = cu[1:] - cu[:-1]
    if cu[0] != 0 or cu[-1] != masked.numel() or (lengths < 0).any():
        raise ValueError(
            f"cu_seqlens must rise from 0 to the number of packed tokens ({masked.numel()}); got {cu.tolist()[:8]}..."
        )
    seg = torch.repeat_interleave(torch.arange(lengths.numel(), device=cu.device), lengths)
    zeros = masked.new_zeros(lengths.numel())
    return zeros.index_add(0, seg, masked), zeros.index_add(0, seg, mask), int(lengths.max().item() if lengths.numel() else 0)


def policy_loss(
    method: str | MaskMethod,
    logits: Tensor,
    tokens: Tensor,
    rollout: RolloutLogprobs,
    advantages: Tensor,
    response_mask: Tensor,
    agg: str = "token-mean",
    *,
    cu_seqlens: Tensor | None = None,
    norm_length: int | None = None,
    chunk_size: int | None = None,
    head_weight: Tensor | None = None,
    validate: bool = True,
    tensor_metrics: bool = False,
    **thresholds: float | None,
) -> tuple[Tensor, dict[str, float]] | tuple[Tensor, dict[str, Tensor]]:
    """(loss, metrics) of the masked DPPO-form surrogate −M·sg(min(r, c))·A·log π(a), aggregated by ``agg``.

    logits [B, T, V] with tokens, response_mask and advantages [B, T] (advantages may be per sequence
    [B]); or packed logits [N, V] with tokens, response_mask and advantages [N]. ``logits[:, t]`` scores
    ``tokens[:, t]``: they are already shifted (for a causal LM, ``logits = model(ids).logits[:, :-1]`` and
    ``tokens = ids[:, 1:]``), and the tokens' shape is the one the others are checked against. ``head_weight``: the LM
    head W [V, d] the logits came from, needed by the backbone-aware ``pdm_backbone_*`` methods.
    ``validate=False`` skips the value checks of the inputs (for inputs checked once already); with
    ``tensor_metrics=True`` the metrics stay 0-d tensors on the device (``metrics_to_floats`` reads them
    back in one transfer). Both set, the call makes no host-device sync; the defaults make four: the input
    checks before the pass, the finiteness checks after it, the advantages' checks, the metrics.
    """
    m = get_method(method)
    if agg not in AGG_MODES:
        raise ValueError(f"agg must be one of {', '.join(AGG_MODES)}; got {agg!r}.")
    need_sq = m.needs_sq_norm or rollout.info != "binary"  # the disagreement metric uses G_proportional / G_full
    stats = policy_stats(
        logits,
        tokens,
        rollout,
        chunk_size=chunk_size,
        need_sq_norm=need_sq,
        need_exactpi=m.needs_exactpi,  # asked for up front: without them the exactpi TV raises
        response_mask=response_mask,
        head_weight=head_weight,
        validate=validate,
    )
    decision = decide(m, stats, advantages, response_mask, validate=validate, **thresholds)
    loss = aggregate_loss(  # the mask's values were checked with the statistics
        decision_loss(decision), response_mask, agg, cu_seqlens=cu_seqlens, norm_length=norm_length, validate=False
    )
    metrics = mask_metrics(decision, as_tensors=True) | {"loss/policy": loss.detach()}
    return loss, metrics if tensor_metrics else metrics_to_floats(metrics)


@torch.no_grad()
def mask_metrics(decision: MaskDecision, *, as_tensors: bool = False) -> dict[str, float] | dict[str, Tensor]:
    """Metrics of a ``MaskDecision`` over its response tokens: dropped shares, D, ratio, disagreement.

    The divergence is the method's own (TV at the richest information for ppo_clip and pg_is);
    ``mask/direction_disagree_frac`` is the share of tokens beyond the threshold where sign(π_a − μ_a)
    and sign(G) differ, G from the method's estimator or the best one the rollout allows (0 on binary
    information, where the two coincide). ``count/*`` give each share's denominator, to pool shares
    over micro-batches (``pool_metrics``). Plain floats, read back in one transfer; ``as_tensors=True``
    leaves them float64 0-d tensors on the device (no host-device sync; ``metrics_to_floats`` converts).
    """
    if not isinstance(decision, MaskDecision):
        raise TypeError(
            f"mask_metrics takes a pdmask.MaskDecision, got {type(decision).__name__}: pass "
            "mask_metrics(pdmask.decide(method, stats, advantages, response_mask, ...))."
        )
    m, stats, adv, mask = decision.method, decision.stats, decision.advantages, decision.response
    if decision.divergence is not None and decision.beyond is not None:
        kind, d, beyond = m.kind, decision.divergence, decision.beyond & mask
    else:  # ppo_clip, pg_is: measured with TV at the richest information, against δ_TV
        kind, d = "tv", divergence(stats, "tv", stats.info)
        beyond = beyond_threshold(d, adv, DELTA_TV, DELTA_TV) & mask
    if m.rule == "pdm":
        g = decision.direction
    else:
        estimator = {"full": "full", "topk": "proportional", "binary": None}[stats.info]
        if estimator in SQ_NORM_ESTIMATORS and stats.sq_norm is None:
            estimator = "aggregated" if stats.has_topk else None
        g = None if estimator is None else predicted_change(stats, kind, estimator)
    if g is None:
        disagree = torch.zeros_like(beyond)
    else:
        disagree = beyond & (torch.sign(stats.pi_a - stats.mu_a) != torch.sign(g))
    keep = decision.keep
    pos, neg = mask & (adv > 0), mask & (adv < 0)
    # float64: a ratio past e^88 (μ(a) tiny, a real engine/trainer mismatch) is still a finite number to log.
    ratio = (stats.logp.detach() - stats.rollout_logp).double().exp()
    d = d.float().double()  # D's float32 values, summed in float64
    count = mask.sum()
    metrics = {
        "mask/dropped_frac": _frac(mask & ~keep, mask),
        "mask/dropped_frac_pos": _frac(pos & ~keep, pos),
        "mask/dropped_frac_neg": _frac(neg & ~keep, neg),
        "mask/beyond_threshold_frac": _frac(beyond, mask),
        "mask/direction_disagree_frac": _frac(disagree, beyond),
        "div/mean": _masked_mean(d, mask, count),
        "div/max": _masked_max(d, mask, count),
        "div/p90": _quantile(d, mask, count, 0.9),
        "ratio/mean": _masked_mean(ratio, mask, count),
        "ratio/max": _masked_max(ratio, mask, count),
        "count/tokens": count.double(),
        "count/pos": pos.sum().double(),
        "count/neg": neg.sum().double(),
        "count/beyond_threshold": beyond.sum().double(),
    }
    return metrics if as_tensors else metrics_to_floats(metrics)


def metrics_to_floats(metrics: Mapping[str, Tensor | float]) -> dict[str, float]:
    """A metric dict of 0-d tensors (or floats) as plain floats, read back from the device in one transfer."""
    tensors = [v for v in metrics.values() if isinstance(v, Tensor)]
    values = iter(torch.stack([t.detach().double().reshape(()) for t in tensors]).tolist() if tensors else [])
    return {k: next(values) if isinstance(v, Tensor) else float(v) for k, v in metrics.items()}


def pool_metrics(rows: Sequence[Mapping[str, float]], denominators: Mapping[str, str] = FRACTION_DENOMINATORS) -> dict[str, float]:
    """Pool per-update (or per-process) metric dicts into one: a share weighted by its count
    (``denominators``), ``*/max`` as the maximum, anything else as the mean; ``count/*`` are dropped."""
    out = {}
    for key in rows[0]:
        if key.startswith("count/"):
            continue
        values = [float(r[key]) for r in rows]
        if key.endswith("/max"):
            out[key] = max(values)
        elif key in denominators:  # a mean of shares would over-weight small or empty updates
            weights = [float(r[denominators[key]]) for r in rows]
            total = sum(weights)
            out[key] = sum(v * w for v, w in zip(values, weights)) / total if total else 0.0
        else:
            out[key] = sum(values) / len(values)
    return out


def _frac(part: Tensor, whole: Tensor) -> Tensor:
    """|part| / |whole| (0 when whole is empty) as a float64 0-d tensor."""
    n = whole.sum().double()
    return torch.where(n > 0, part.sum().double() / n.clamp_min(1.0), 0.0)


def _masked_mean(x: Tensor, mask: Tensor, count: Tensor) -> Tensor:
    return torch.where(mask, x, 0.0).sum() / count.clamp_min(1)


def _masked_max(x: Tensor, mask: Tensor, count: Tensor) -> Tensor:
    return torch.where(count > 0, torch.where(mask, x, -torch.inf).amax(), 0.0)


def _quantile(x: Tensor, mask: Tensor, count: Tensor, q: float) -> Tensor:
    """The k-th smallest of x over the mask, k = round(q·(count − 1)) + 1 (0 for an empty mask), by a sort
    with the positions outside the mask last: no value read back (and no size limit, unlike torch.quantile)."""
    ordered = torch.where(mask, x, torch.inf).reshape(-1).sort().values
    if ordered.numel() == 0:
        return count.double()
    k = (q * (count - 1).clamp_min(0).double()).round().long()
    kth = ordered.gather(0, k.clamp(max=ordered.numel() - 1).reshape(1)).reshape(())  # a tensor index, not .item()
    return torch.where(count > 0, kth, 0.0)


__all__ = [
    "AGG_MODES",
    "FRACTION_DENOMINATORS",
    "aggregate_loss",
    "decision_loss",
    "mask_metrics",
    "metrics_to_floats",
    "per_token_loss",
    "policy_loss",
    "pool_metrics",
]
