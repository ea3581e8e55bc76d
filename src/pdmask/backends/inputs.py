"""The validated inputs of a pass (``Prepared``): tokens, μ and S checked against the source's shape and vocabulary.

Positions are flat [n]; every value check is read back in one transfer (``validate=False``: none, no
host-device sync); shapes are measured against the tokens, the reference shape.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from pdmask.backends.shard import VocabShard
from pdmask.rollout import Checks, RolloutLogprobs, _check_no_nan_or_pos_inf, as_bool_mask, check_tokens
from pdmask.types import even_mu

#: Where the tokens stand relative to the logits, said wherever a shape disagrees.
ALIGNMENT = (
    "logits[..., t, :] must score tokens[..., t] (already shifted: for a causal LM, "
    "logits = model(ids).logits[:, :-1] and tokens = ids[:, 1:])"
)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a pass computes in: float64 for float64 inputs, float32 for every other float dtype."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def set_columns(tokens: Tensor, rollout: RolloutLogprobs) -> tuple[Tensor, Tensor]:
    """(set_valid, set_mu) [..., C] for S = TopK ∪ {a} (or {a}); a's own column is invalid when a ∈ TopK."""
    if rollout.topk_ids is None or rollout.topk_logp is None:
        return torch.ones(tokens.shape + (1,), dtype=torch.bool, device=tokens.device), rollout.logp.exp().unsqueeze(-1)
    a_in_topk = torch.eq(rollout.topk_ids, tokens.unsqueeze(-1)).any(-1, keepdim=True)
    set_valid = torch.cat([torch.ones_like(rollout.topk_ids, dtype=torch.bool), ~a_in_topk], -1)
    set_mu = torch.cat([rollout.topk_logp.exp(), rollout.logp.exp().unsqueeze(-1)], -1).masked_fill(~set_valid, 0.0)
    return set_valid, set_mu


def tail_count(set_valid: Tensor, vocab: int, dtype: torch.dtype) -> Tensor:
    """T = V − |S| [...], the number of distinct ids off S."""
    return (vocab - set_valid.sum(-1)).to(dtype)


@dataclass
class Prepared:
    """Validated inputs of a pass: flat [n] positions, S's ids [n, C] and what is known of μ there."""

    shape: tuple[int, ...]
    vocab: int
    tokens: Tensor  # [...]
    rollout: RolloutLogprobs  # validated, in the compute dtype (a full μ: this rank's real columns)
    set_ids: Tensor  # [n, C], a last
    set_valid: Tensor  # [..., C]
    set_mu: Tensor  # [..., C]
    tail_count: Tensor  # [...]
    full_logp: Tensor | None  # [n, real columns of this rank]
    response: Tensor | None = None  # [...] bool, the response mask when one was given

    @property
    def n(self) -> int:
        return self.tokens.numel()

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype the inputs were prepared in."""
        return self.set_mu.dtype

    @property
    def flat_tokens(self) -> Tensor:
        return self.tokens.reshape(self.n)

    @property
    def flat_even_mu(self) -> Tensor:
        """u [n] of the exactpi estimator."""
        return even_mu(self.set_mu, self.tail_count).reshape(self.n)

    def where(self, bad: Tensor) -> str:
        """Where the flat positions bad [n] (bool, at least one True) lie: their count, the first, and whether it is
        in the response (an error path: reads values back)."""
        flat = bad.nonzero()
        first = tuple(int(i) for i in torch.unravel_index(flat[0, 0], self.shape)) if self.shape else ()
        inside = "" if self.response is None else (
            ", inside the response mask" if bool(self.response.reshape(-1)[flat[0, 0]]) else
            ", outside the response mask (it would still poison the loss through 0·NaN)"
        )
        return f"{flat.shape[0]} position{'s' if flat.shape[0] > 1 else ''}, the first at {first}{inside}"


def prepare(
    tokens: Tensor,
    rollout: RolloutLogprobs,
    response_mask: Tensor | None,
    source: str,
    source_shape: tuple[int, ...],
    shard: VocabShard,
    dtype: torch.dtype,
    validate: bool = True,
) -> Prepared:
    """Checks tokens, rollout and response_mask against the ``source`` tensor of ``source_shape`` [..., x] (named
    in errors) and ``shard``'s vocabulary; positions outside ``response_mask`` become the neutral token 0 with
    μ(0) = 1. A full μ (``rollout.full_logp`` [..., V] or this rank's shard [..., width]) is cut to this rank's
    real columns. The value checks are read back in one transfer; ``validate=False`` reads nothing back."""
    if not isinstance(rollout, RolloutLogprobs):
        raise TypeError(f"rollout must be a pdmask.RolloutLogprobs, got {type(rollout).__name__}.")
    shape = check_leading_shape(tokens, rollout, response_mask, source, source_shape)
    full = rollout.full_logp
    if full is not None:
        rollout = replace(rollout, full_logp=None)
    checks = Checks() if validate else False  # every value check read back at once, before the pass
    valid = None
    if response_mask is not None:
        valid = as_bool_mask(response_mask, shape, checks)
        tokens = torch.where(valid, check_tokens(tokens, None, shape, source), 0)
        rollout = rollout.masked(valid)
    tokens = check_tokens(tokens, shard.vocab, shape, source, checks)
    rollout = rollout.validated(tokens, shard.vocab, dtype, checks)
    local = None if full is None else _full_on_shard(full, shard, tokens, rollout.logp, valid, dtype, checks)
    if isinstance(checks, Checks):
        checks.read()
    n = tokens.numel()
    flat_tokens = tokens.reshape(n)
    set_ids = flat_tokens[:, None] if rollout.topk_ids is None else torch.cat(
        [rollout.topk_ids.reshape(n, -1), flat_tokens[:, None]], -1
    )
    set_valid, set_mu = set_columns(tokens, rollout)
    return Prepared(
        shape, shard.vocab, tokens, replace(rollout, full_logp=local), set_ids, set_valid, set_mu,
        tail_count(set_valid, shard.vocab, dtype), None if local is None else local.reshape(n, shard.real), valid,
    )


def check_leading_shape(
    tokens: object, rollout: RolloutLogprobs, response_mask: object, source: str, source_shape: tuple[int, ...]
) -> tuple[int, ...]:
    """The tokens' shape [...], once the source's leading shape equals it. When they differ the error names the odd
    one: the tokens when every other per-token input (rollout.logp, response_mask) agrees with the source, else
    the source, measured against the tokens."""
    check_tokens(tokens, None, tuple(getattr(tokens, "shape", ())), source, False)  # a tensor of ids
    assert isinstance(tokens, Tensor)
    shape, lead = tuple(tokens.shape), source_shape[:-1]
    if lead == shape:
        return shape
    others = {name: tuple(x.shape) for name, x in (("rollout.logp", rollout.logp), ("response_mask", response_mask))
              if isinstance(x, Tensor)}  # fmt: skip
    if all(o == lead for o in others.values()):  # rollout.logp is always there: the tokens are the odd one
        agree = " and ".join(others)
        raise ValueError(
            f"tokens has shape {shape}; expected the {source}' leading shape {lead}, as {agree} "
            f"{'have' if len(others) > 1 else 'has'}: {ALIGNMENT}."
        )
    name, last = ("hidden", "d") if source == "hidden states" else (source, "V")
    raise ValueError(
        f"{name} has shape {source_shape}; expected {shape + source_shape[-1:]} = tokens' shape {shape} + ({last},): "
        f"{ALIGNMENT}."
    )


def _full_on_shard(
    full: Tensor, shard: VocabShard, tokens: Tensor, logp: Tensor, valid: Tensor | None, dtype: torch.dtype,
    checks: Checks | bool,
) -> Tensor:
    """log μ [..., real] on this rank's real columns, neutral (token 0, μ(0) = 1) outside the response."""
    shape = tuple(tokens.shape)
    if tuple(full.shape) not in (shape + (shard.vocab,), shape + (shard.width,)):
        expected = f"{shape + (shard.vocab,)}"
        if shard.world > 1:
            expected += f" (the whole vocabulary) or {shape + (shard.width,)} (this rank's shard)"
        raise ValueError(f"rollout.full_logp has shape {tuple(full.shape)}; expected {expected}.")
    cols = slice(0, shard.real) if full.shape[-1] == shard.width else slice(shard.start, shard.start + shard.real)
    local = full[..., cols].to(device=tokens.device)
    if valid is not None:  # as RolloutLogprobs.masked
        neutral = torch.full((shard.real,), -torch.inf, dtype=local.dtype, device=local.device)
        neutral[0] = 0.0 if shard.start == 0 else -torch.inf
        local = torch.where(valid.unsqueeze(-1), local, neutral)
    with Checks.using(checks) as added:
        if added is not None:
            _check_no_nan_or_pos_inf("rollout.full_logp", local, added)
            owned = shard.owned(tokens)
            at_a = local.gather(-1, shard.local(tokens, 0).unsqueeze(-1)).squeeze(-1).to(dtype)
            gap = torch.where(owned, (at_a - logp).abs(), 0.0)
            added.add(
                (gap > 1e-3).any(),
                lambda: f"rollout.logp disagrees with rollout.full_logp at the sampled token by up to {gap.max().item():.3g}; "
                "both must come from the same distribution μ.",
            )
    return local


__all__ = ["ALIGNMENT", "Prepared", "check_leading_shape", "compute_dtype", "prepare", "set_columns", "tail_count"]
