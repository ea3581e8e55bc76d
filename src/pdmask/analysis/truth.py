"""Ground truth for the direction signals: how a token's own update really changes its divergence.

For a sampled token t with advantage A_t, its own update moves the parameters along
A_t·∇_θ log π_t(a_t) (times the positive factor sg(min(r, c)), which leaves the sign alone). The
first-order change of its divergence D_t = D(π_t, μ_t) along that step is

    ⟨∇_θ D_t, P ⊙ A_t ∇_θ log π_t(a_t)⟩

with P = 1 for a plain gradient step and P = 1/(√v̂ + ε) for Adam's diagonal preconditioner.
Everything here is autograd over an exact (full-vocabulary) divergence: no closed form of the
method is used, so the signals can be checked against it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from pdmask.estimators import KINDS
from pdmask.exact import exact_divergence


def full_divergence(logits: Tensor, mu_logp: Tensor, kind: str) -> Tensor:
    """Exact D(softmax(logits), μ) per row [...] (``pdmask.exact.exact_divergence``), differentiable w.r.t. logits [..., V];
    ``mu_logp`` [..., V] is log μ (−inf where μ is 0)."""
    return exact_divergence(torch.log_softmax(logits, -1), mu_logp, kind)


def own_change(
    forward: Callable[[Tensor], Tensor],
    params: Sequence[Tensor],
    input_ids: Tensor,
    positions: Tensor,
    mu_logp: Tensor,
    advantages: Tensor,
    preconditioners: dict[str, Sequence[Tensor] | None],
    kinds: Sequence[str] = KINDS,
    batch_elems: int = 1 << 26,
    need: Tensor | None = None,
) -> dict[tuple[str, str], Tensor]:
    """First-order change of each sampled token's divergence under its own update, for one sequence.

    Args:
        forward: token ids [L] -> logits [L, V] (temperature applied); row p predicts ``input_ids[p + 1]``.
        params: the parameters θ the update moves (requires_grad).
        input_ids: the sequence [L_total], prompt and response.
        positions: rows p of the sampled tokens [n] (their tokens are ``input_ids[p + 1]``).
        mu_logp: log μ at those rows [n, V].
        advantages: A_t [n].
        preconditioners: name -> per-parameter P (same shapes as ``params``), or None for a plain step.
        kinds: divergences to differentiate.
        batch_elems: bound on gradient elements held at once: the backward passes of several tokens
            run as one vmapped pass while (passes × parameters) stays under it; above it (large models)
            each token takes one backward pass per scalar, and only the kinds ``need`` asks for.
        need: bool [n, len(kinds)], which (token, kind) to measure (default: all); NaN elsewhere.

    Returns:
        (kind, preconditioner name) -> A_t·⟨∇_θ D_t, P ⊙ ∇_θ log π_t(a_t)⟩ [n], float64.
    """
    n = len(positions)
    need = torch.ones(n, len(kinds), dtype=torch.bool) if need is None else need
    out = {(k, name): torch.full((n,), math.nan, dtype=torch.float64) for k in kinds for name in preconditioners}
    if n == 0:
        return out
    params = list(params)
    # Causal model: rows up to the last sampled one need only the tokens up to it.
    logits = forward(input_ids[: int(positions.max()) + 1])[positions]
    logp_a = torch.log_softmax(logits, -1).gather(-1, input_ids[positions + 1, None]).squeeze(-1)
    # Per token: its log-prob, then its divergence of each kind.
    scalars = torch.stack([logp_a, *(full_divergence(logits, mu_logp, k) for k in kinds)], 1)  # [n, 1 + K]
    rows = scalars.shape[1]
    size = sum(p.numel() for p in params)
    if rows * size > batch_elems:
        _own_change_per_token(scalars, params, advantages, preconditioners, kinds, need, out)
        return out
    per_chunk = max(1, batch_elems // (rows * size))
    for start in range(0, n, per_chunk):
        sl = slice(start, min(n, start + per_chunk))
        grads = _batched_grads(scalars[sl].reshape(-1), params, batch_elems)
        inner = {name: torch.zeros(sl.stop - sl.start, len(kinds), dtype=torch.float64) for name in preconditioners}
        for i, g in enumerate(grads):
            g = g.reshape(sl.stop - sl.start, rows, -1)  # [c, 1 + K, numel]
            for name, weight in preconditioners.items():
                step = g[:, :1] if weight is None else g[:, :1] * weight[i].reshape(-1)
                inner[name] += torch.linalg.vecdot(g[:, 1:], step).double()
        for name, value in inner.items():
            for j, kind in enumerate(kinds):
                out[(kind, name)][sl] = torch.where(need[sl, j], advantages[sl].double() * value[:, j], math.nan)
    return out


def _own_change_per_token(
    scalars: Tensor,
    params: list[Tensor],
    advantages: Tensor,
    preconditioners: dict[str, Sequence[Tensor] | None],
    kinds: Sequence[str],
    need: Tensor,
    out: dict[tuple[str, str], Tensor],
) -> None:
    """``own_change`` for large models: per token one backward pass for log π(a), then one per needed kind.

    At most two gradients (one token's ∇ log π(a) and ∇ D) are held at once; P ⊙ ∇ log π(a) is formed one
    parameter at a time.
    """
    for t in range(len(scalars)):
        if not need[t].any():
            continue
        g = torch.autograd.grad(scalars[t, 0], params, retain_graph=True, materialize_grads=True)
        for j, kind in enumerate(kinds):
            if not need[t, j]:
                continue
            gd = torch.autograd.grad(scalars[t, 1 + j], params, retain_graph=True, materialize_grads=True)
            for name, weight in preconditioners.items():
                inner = 0.0
                for i, (x, y) in enumerate(zip(gd, g)):
                    step = y if weight is None else y * weight[i]
                    inner += float(torch.dot(x.reshape(-1), step.reshape(-1)))
                out[(kind, name)][t] = float(advantages[t]) * inner
            del gd


def _batched_grads(targets: Tensor, params: list[Tensor], batch_elems: int) -> list[Tensor]:
    """∇_θ of each entry of ``targets`` [m]: per parameter a [m, *shape] tensor (zeros where unused)."""
    m = len(targets)
    size = sum(p.numel() for p in params)
    if m > 1 and m * size <= batch_elems:
        # One vmapped backward pass over the rows of an identity seed.
        seed = torch.eye(m, dtype=targets.dtype)
        return list(torch.autograd.grad(targets, params, seed, retain_graph=True, materialize_grads=True, is_grads_batched=True))
    # Large models: plain backward passes, one per row (vmap only adds overhead there).
    rows = [torch.autograd.grad(t, params, retain_graph=True, materialize_grads=True) for t in targets]
    return [torch.stack(col) for col in zip(*rows)]


def head_change(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    temperature: float,
    tokens: Tensor,
    mu_logp: Tensor,
    advantages: Tensor,
    kind: str,
    chunk_elems: int = 1 << 24,
) -> Tensor:
    """The same first-order change with θ restricted to the output layer (logits = (W h + b)/T), float64.

    Method.md check 5: here the logits move by (‖h‖² + 1)·(e_a − π)/T², so sign(A·G_full) must match.

    Args:
        hidden: final hidden states h [n, d]; weight: W [V, d]; bias: b [V] or None.
        tokens: a_t [n]; mu_logp: log μ [n, V]; advantages: A_t [n].
        chunk_elems: bound on per-token gradient elements held at once (vmap chunk).
    Returns:
        A_t·⟨∇_{W,b} D_t, ∇_{W,b} log π_t(a_t)⟩ [n], float64.
    """
    w = weight.detach().double()
    b = None if bias is None else bias.detach().double()

    def head_grads(w_: Tensor, b_: Tensor | None, h: Tensor, a: Tensor, mu: Tensor) -> Tensor:
        def z_of(w__: Tensor, b__: Tensor | None) -> Tensor:
            z = w__ @ h
            return (z if b__ is None else z + b__) / temperature

        def logp_a(w__: Tensor, b__: Tensor | None) -> Tensor:
            return torch.log_softmax(z_of(w__, b__), -1)[a]

        def div(w__: Tensor, b__: Tensor | None) -> Tensor:
            return full_divergence(z_of(w__, b__), mu, kind)

        argnums = (0,) if b_ is None else (0, 1)
        g_l = torch.func.grad(logp_a, argnums=argnums)(w_, b_)
        g_d = torch.func.grad(div, argnums=argnums)(w_, b_)
        return sum((x * y).sum() for x, y in zip(g_l, g_d))

    chunk = max(1, chunk_elems // w.numel())
    inner = torch.func.vmap(head_grads, in_dims=(None, None, 0, 0, 0), chunk_size=chunk)(
        w, b, hidden.detach().double(), tokens, mu_logp.double()
    )
    return advantages.double() * inner


def adam_preconditioner(optimizer: torch.optim.Adam, params: Sequence[Tensor]) -> list[Tensor]:
    """Adam's diagonal preconditioner P = 1/(√v̂ + ε), v̂ = exp_avg_sq / (1 − β₂^step), per parameter.

    Raises ValueError if a parameter has no optimizer state yet (take at least one step first).
    """
    group = optimizer.param_groups[0]
    beta2, eps = group["betas"][1], group["eps"]
    out = []
    for p in params:
        state = optimizer.state.get(p)
        if not state:
            raise ValueError("adam_preconditioner needs optimizer state: take at least one Adam step first.")
        step = float(state["step"])
        v_hat = state["exp_avg_sq"] / (1 - beta2**step)
        out.append(1.0 / (v_hat.sqrt() + eps))
    return out
