"""What the trainer knows about the rollout policy μ at each response position."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor

#: Log-probabilities may exceed 0 by this much (rounding in the engine); they are clamped to 0.
LOGP_TOL = 1e-4
#: The probability mass of S = TopK ∪ {a} may exceed 1 by this much before it is an error.
MASS_TOL = 1e-3


@dataclass
class RolloutLogprobs:
    """Log-probabilities of the rollout policy μ, as a rollout engine returns them.

    Args:
        logp: log μ(a) of the sampled token, shape [...].
        topk_ids: ids of μ's K most likely tokens, int64 [..., K] (vLLM/SGLang ``logprobs=K``).
            The sampled token may or may not be among them.
        topk_logp: their log-probabilities, [..., K]. ``-inf`` means probability zero.
        full_logp: log μ over the whole vocabulary, [..., V] (a simulated engine, or a recomputed
            π_old). ``-inf`` means probability zero.

    The same class serves when μ is a recomputed π_old: pass π_old's log-probs instead.
    """

    logp: Tensor
    topk_ids: Tensor | None = None
    topk_logp: Tensor | None = None
    full_logp: Tensor | None = None

    def __post_init__(self) -> None:
        _require_tensor("rollout.logp", self.logp, floating=True)
        if (self.topk_ids is None) != (self.topk_logp is None):
            raise ValueError(
                "rollout.topk_ids and rollout.topk_logp come together: pass both (top-K information) or neither."
            )
        if self.topk_ids is not None:
            assert self.topk_logp is not None
            _require_tensor("rollout.topk_ids", self.topk_ids, floating=False)
            _require_tensor("rollout.topk_logp", self.topk_logp, floating=True)
            if self.topk_ids.shape != self.topk_logp.shape:
                raise ValueError(
                    f"rollout.topk_ids has shape {tuple(self.topk_ids.shape)} but rollout.topk_logp has shape "
                    f"{tuple(self.topk_logp.shape)}; both must be [..., K]."
                )
            if self.topk_ids.dim() == 0 or self.topk_ids.shape[-1] == 0:
                raise ValueError(
                    "rollout.topk_ids has K = 0 columns: pass topk_ids=None and topk_logp=None for binary "
                    "information, or K >= 1 top log-probs."
                )
        if self.full_logp is not None:
            _require_tensor("rollout.full_logp", self.full_logp, floating=True)

    @property
    def info(self) -> str:
        """The richest information available: "full", "topk" or "binary"."""
        if self.full_logp is not None:
            return "full"
        return "topk" if self.topk_ids is not None else "binary"

    @property
    def k(self) -> int:
        """K, the number of top log-probs (0 without top-K information)."""
        return 0 if self.topk_ids is None else int(self.topk_ids.shape[-1])

    def masked(self, valid: Tensor) -> RolloutLogprobs:
        """A copy whose positions outside ``valid`` [...] are neutral (token 0 with μ(0) = 1), so that
        padding (zeros, -100, repeated ids) is never validated nor used."""
        shape = tuple(valid.shape)
        for name, x, lead in (("logp", self.logp, 0), ("topk_ids", self.topk_ids, 1), ("full_logp", self.full_logp, 1)):
            if x is not None and tuple(x.shape[: x.dim() - lead]) != shape:
                raise ValueError(f"rollout.{name} has shape {tuple(x.shape)}; its leading shape must be {shape}.")
        logp = torch.where(valid, self.logp, 0.0)
        topk_ids = topk_logp = full_logp = None
        if self.topk_ids is not None and self.topk_logp is not None:
            col = valid.unsqueeze(-1)
            topk_ids = torch.where(col, self.topk_ids, torch.arange(self.k, device=valid.device))
            topk_logp = torch.where(col, self.topk_logp, torch.where(topk_ids == 0, 0.0, -torch.inf))
        if self.full_logp is not None:
            vocab = self.full_logp.shape[-1]
            one_hot0 = torch.full((vocab,), -torch.inf, dtype=self.full_logp.dtype, device=valid.device)
            one_hot0[0] = 0.0
            full_logp = torch.where(valid.unsqueeze(-1), self.full_logp, one_hot0)
        return RolloutLogprobs(logp, topk_ids, topk_logp, full_logp)

    def validated(
        self, tokens: Tensor, vocab_size: int, dtype: torch.dtype, check_values: bool | Checks = True
    ) -> RolloutLogprobs:
        """Checks against the trainer's tokens [...] and vocabulary; returns a copy in ``dtype``.

        Raises ValueError naming the argument for every inconsistency; clamps log-probs within LOGP_TOL of 0.
        The value checks read their verdicts back to the host in one transfer (one device sync);
        ``check_values=False`` checks the shapes only (no sync), for a caller who checked the same values
        once already; a ``Checks`` collects them for the caller to read with its own.
        """
        shape = tuple(tokens.shape)
        if tuple(self.logp.shape) != shape:
            raise ValueError(f"rollout.logp has shape {tuple(self.logp.shape)}; expected the tokens' shape {shape}.")
        logp = self.logp.to(device=tokens.device, dtype=dtype)
        topk_ids = topk_logp = full_logp = None
        if self.topk_ids is not None and self.topk_logp is not None:
            if tuple(self.topk_ids.shape[:-1]) != shape:
                raise ValueError(
                    f"rollout.topk_ids has shape {tuple(self.topk_ids.shape)}; expected {shape + ('K',)}."
                )
            if self.k > vocab_size:
                raise ValueError(f"rollout has K = {self.k} top log-probs but the vocabulary has only {vocab_size} tokens.")
            topk_ids = self.topk_ids.to(device=tokens.device, dtype=torch.long)
            topk_logp = self.topk_logp.to(device=tokens.device, dtype=dtype)
        if self.full_logp is not None:
            if tuple(self.full_logp.shape) != shape + (vocab_size,):
                raise ValueError(
                    f"rollout.full_logp has shape {tuple(self.full_logp.shape)}; expected {shape + (vocab_size,)}."
                )
            full_logp = self.full_logp.to(device=tokens.device)
        out = RolloutLogprobs(logp, topk_ids, topk_logp, full_logp)
        with Checks.using(check_values) as checks:
            if checks is not None:
                out._check_values(tokens, vocab_size, checks)
        out.logp = logp.clamp(max=0.0)
        out.topk_logp = None if topk_logp is None else topk_logp.clamp(max=0.0)
        return out

    def _check_values(self, tokens: Tensor, vocab_size: int, checks: Checks) -> None:
        """Adds the value checks of ``validated`` to ``checks``, on shape-checked tensors."""
        logp = self.logp
        _check_logp("rollout.logp", logp, False, checks)
        if self.topk_ids is not None and self.topk_logp is not None:
            topk_ids, topk_logp = self.topk_ids, self.topk_logp
            _check_ids("rollout.topk_ids", topk_ids, vocab_size, checks)
            if self.k > 1:
                sorted_ids = topk_ids.sort(dim=-1).values
                checks.add(
                    (sorted_ids[..., 1:] == sorted_ids[..., :-1]).any(),
                    lambda: "rollout.topk_ids has a duplicate id at some position; top-K ids must be distinct.",
                )
            _check_logp("rollout.topk_logp", topk_logp, True, checks)
            in_topk = topk_ids == tokens.unsqueeze(-1)
            gap = (topk_logp - logp.unsqueeze(-1)).abs()
            checks.add(
                (in_topk & (gap > 1e-3)).any(),
                lambda: "rollout.logp disagrees with rollout.topk_logp at the sampled token by up to "
                f"{gap[in_topk].max().item():.3g}; both must come from the same distribution μ.",
            )
            mass = topk_logp.exp().sum(-1) + torch.where(in_topk.any(-1), 0.0, logp.exp())
            checks.add(
                (mass > 1 + MASS_TOL).any(),
                lambda: f"rollout top-K probabilities (with the sampled token) sum to {mass.max().item():.6f} > 1 at some "
                "position: pass normalised log-probs (log-softmax over the whole vocabulary), not raw logits.",
            )
        if self.full_logp is not None:
            _check_no_nan_or_pos_inf("rollout.full_logp", self.full_logp, checks)
            # Clamped: out-of-range tokens fail their own check, read back before anything else uses them.
            at_a = self.full_logp.gather(-1, tokens.clamp(0, vocab_size - 1).unsqueeze(-1)).squeeze(-1).to(logp.dtype)
            full_gap = (at_a - logp).abs()
            checks.add(
                (full_gap > 1e-3).any(),
                lambda: "rollout.logp disagrees with rollout.full_logp at the sampled token by up to "
                f"{full_gap.max().item():.3g}; both must come from the same distribution μ.",
            )


class Checks:
    """Value checks whose verdicts stay on the device until ``read``: one transfer for all of them (one host-device
    sync), then the first failing check raises its ValueError (its message may read more values: an error path)."""

    def __init__(self) -> None:
        self._bad: list[Tensor] = []
        self._messages: list[Callable[[], str]] = []

    def add(self, bad: Tensor, message: Callable[[], str]) -> None:
        """A check that fails where the 0-d bool ``bad`` is True, with the error ``message()``."""
        self._bad.append(bad.reshape(()))
        self._messages.append(message)

    def read(self) -> None:
        """Reads every verdict back at once and raises the first failure's ValueError."""
        if not self._bad:
            return
        verdicts = torch.stack([b.to(self._bad[0].device) for b in self._bad]).tolist()
        self._bad, messages = [], self._messages
        self._messages = []
        for failed, message in zip(verdicts, messages):
            if failed:
                raise ValueError(message())

    @staticmethod
    @contextmanager
    def using(check_values: bool | Checks) -> Iterator[Checks | None]:
        """The ``Checks`` to add to for a ``check_values`` argument: the caller's own, a fresh one read on leaving
        (True), or None (False: no value checks)."""
        if isinstance(check_values, Checks):
            yield check_values
        elif check_values:
            checks = Checks()
            yield checks
            checks.read()
        else:
            yield None


def _require_tensor(name: str, x: object, *, floating: bool) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}.")
    if floating and not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor of log-probabilities, got dtype {x.dtype}.")
    if not floating and (x.is_floating_point() or x.is_complex() or x.dtype == torch.bool):
        raise TypeError(f"{name} must be an integer tensor of token ids, got dtype {x.dtype}.")


def _check_ids(name: str, ids: Tensor, vocab_size: int, checks: Checks) -> None:
    outside = (ids < 0) | (ids >= vocab_size)
    checks.add(outside.any(), lambda: f"{name} contains id {ids[outside][0].item()}, outside the vocabulary [0, {vocab_size}).")


def _check_no_nan_or_pos_inf(name: str, x: Tensor, checks: Checks) -> None:
    checks.add(
        (torch.isnan(x) | torch.isposinf(x)).any(),
        lambda: f"{name} contains NaN or +inf; log-probabilities must be finite (or -inf for probability 0).",
    )


def _check_logp(name: str, logp: Tensor, allow_neg_inf: bool, checks: Checks) -> None:
    _check_no_nan_or_pos_inf(name, logp, checks)
    if not allow_neg_inf:
        checks.add(
            torch.isneginf(logp).any(),
            lambda: f"{name} contains -inf: a sampled token must have positive probability under μ.",
        )
    checks.add(
        (logp > LOGP_TOL).any(),
        lambda: f"{name} has a value {logp.max().item():.4g} > 0; pass log-probabilities (<= 0), not probabilities or logits.",
    )


def check_tokens(
    tokens: object, vocab_size: int | None, shape: tuple[int, ...], source: str = "logits", check_values: bool | Checks = True
) -> Tensor:
    """Checks sampled token ids [...] against the leading shape of ``source`` and (unless None, or
    ``check_values=False``: no host-device sync) the vocabulary; ``check_values`` as for ``validated``."""
    _require_tensor("tokens", tokens, floating=False)
    assert isinstance(tokens, Tensor)
    if tuple(tokens.shape) != shape:
        raise ValueError(f"tokens has shape {tuple(tokens.shape)}; expected the {source}' leading shape {shape}.")
    tokens = tokens.long()
    if vocab_size is not None:
        with Checks.using(check_values) as checks:
            if checks is not None:
                _check_ids("tokens", tokens, vocab_size, checks)
    return tokens


def as_bool_mask(response_mask: object, shape: tuple[int, ...] | torch.Size, check_values: bool | Checks = True) -> Tensor:
    """response_mask [...] of 0/1 or bool, checked against ``shape`` (and, unless ``check_values=False``,
    for values other than 0 and 1: a host-device sync; ``check_values`` as for ``validated``), as bool."""
    if not isinstance(response_mask, Tensor):
        raise TypeError(f"response_mask must be a torch.Tensor of 0/1 or bool, got {type(response_mask).__name__}.")
    if tuple(response_mask.shape) != tuple(shape):
        raise ValueError(f"response_mask has shape {tuple(response_mask.shape)}; expected {tuple(shape)}.")
    if response_mask.dtype != torch.bool:
        with Checks.using(check_values) as checks:
            if checks is not None:
                bad = ((response_mask != 0) & (response_mask != 1)).any()
                checks.add(bad, lambda: "response_mask must hold only 0 and 1 (or be bool).")
        response_mask = response_mask != 0
    return response_mask


__all__ = ["LOGP_TOL", "MASS_TOL", "Checks", "RolloutLogprobs", "as_bool_mask", "check_tokens"]
