"""One analysis run: roll out, pull π and μ apart, compute every direction signal and every ground truth.

Recipe (docs/analysis.md):
1. Sample ``prompts × group_size`` responses with the rollout engine (μ; bf16/fp16 for ``mismatch``
   and ``both``, fp32 for ``stale``), with μ's full log-probs and top-K, and compute advantages
   (GRPO from the task's rewards, or random ±1 per token).
2. Split the rows into ``stale_steps + 1`` minibatches and take one Adam step on the truncated-IS
   surrogate of each of the first ``stale_steps``. For ``stale`` and ``both`` the steps use ``lr``, so
   π moves away from μ; for ``mismatch`` they use lr = 0, which fills Adam's second moment v (its
   preconditioner) without moving the weights.
3. On the last minibatch (π = the current weights in fp32), per response token with A ≠ 0: the signals
   (ratio sign, PDM full and each top-K estimator at each K, G_W) and the true D; on a sample of them the autograd
   ground truth (plain, Adam-preconditioned, output layer only); on all of them the actual change of D
   after one real step on the whole minibatch (Adam with its state, and a plain gradient step of the
   same parameter-space length), and every direction mask's decision (``maskview``).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, cast

import torch
from torch import Tensor, nn

from pdmask import (
    METHODS,
    RolloutLogprobs,
    decide,
    policy_loss,
    policy_stats,
    predicted_change,
)
from pdmask.analysis.kernel import kernel_change
from pdmask.analysis.maskview import mask_decisions
from pdmask.analysis.truth import (
    KINDS,
    adam_preconditioner,
    full_divergence,
    head_change,
    own_change,
)
from pdmask.lab.train import grpo_advantages

if TYPE_CHECKING:
    from pdmask.lab.engine import RolloutBatch, RolloutEngine
    from pdmask.lab.tasks import Task

SOURCES = ("mismatch", "stale", "both")
#: The top-K estimators of G that the registry's predictive masks use, each analysed at every K.
TOPK_ESTIMATORS = tuple(dict.fromkeys(m.estimator for m in METHODS.values() if m.rule == "pdm" and m.info == "topk"))
#: The surrogate of the optimizer steps: truncated IS without a trust region, so every token moves.
STEP_METHOD = "pg_is"


@dataclass
class AnalysisConfig:
    """Everything a run depends on (stored in analysis.json)."""

    model: str = "small"
    task: str = "sort"
    # Graded reward: a warm-started TinyGPT rarely gets a whole answer right, so 0/1 rewards leave
    # most groups without any advantage.
    reward: str = "partial"
    source: str = "both"  # how π and μ come apart: mismatch | stale | both
    rollout_dtype: str = "bf16"  # the engine's precision for mismatch / both
    stale_steps: int = 3  # Adam steps on other minibatches before the analysed one
    # Adam's first steps move every weight by about lr whatever its gradient: right after the warm
    # start, 1e-3 puts the median TV near 0.5, far outside any trust region; 1e-4 puts it near 0.04.
    lr: float = 1e-4
    prompts: int = 512
    group_size: int = 8
    temperature: float = 1.0
    advantages: str = "grpo"  # grpo | random
    sample_tokens: int = 2048  # uniform sample with autograd ground truth (and cap on targeted tokens)
    ks: tuple[int, ...] = (1, 5, 20)
    sft_steps: int | None = None  # None: the lab's default warm start (TinyGPT only)
    seed: int = 0
    delta: dict[str, float] = field(
        default_factory=lambda: {k: METHODS[f"pdm_full_{k}"].defaults["delta_high"] for k in KINDS}
    )

    def validate(self) -> AnalysisConfig:
        """Raises ValueError naming the setting, before any model is built."""
        if self.source not in SOURCES:
            raise ValueError(f"source must be one of {', '.join(SOURCES)}, got {self.source!r}.")
        if self.stale_steps < 1:
            raise ValueError("stale_steps must be >= 1: Adam's preconditioner needs at least one step of state.")
        if self.advantages not in ("grpo", "random"):
            raise ValueError(f"advantages must be 'grpo' or 'random', got {self.advantages!r}.")
        if not self.ks or min(self.ks) < 1:
            raise ValueError(f"ks must be positive top-K sizes, got {self.ks}.")
        for name in ("prompts", "sample_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}.")
        if self.prompts * self.group_size < self.stale_steps + 1:
            raise ValueError(
                f"{self.prompts} x {self.group_size} rollouts cannot fill stale_steps + 1 = {self.stale_steps + 1} minibatches."
            )
        return self

    def engine_dtype(self) -> str:
        return "fp32" if self.source == "stale" else self.rollout_dtype


@dataclass
class TokenResults:
    """Per-token arrays over the analysed tokens [M] (response tokens with A ≠ 0 of the last minibatch).

    ``signals[kind][name]`` are the signed predictions A·X (positive = D grows); ``truth[kind][name]``
    the signed true changes, NaN where not measured (autograd truths exist on ``sampled | targeted`` only).
    """

    advantage: Tensor
    pi_a: Tensor
    mu_a: Tensor
    div: dict[str, Tensor]
    beyond: dict[str, Tensor]  # bool [M]: the exact D beyond δ for the token's advantage (where a mask acts)
    raw_g: dict[str, dict[str, Tensor]]  # G of each estimator, unsigned (for the top-K tracking)
    signals: dict[str, dict[str, Tensor]]
    truth: dict[str, dict[str, Tensor]]
    sampled: Tensor  # bool [M]: the uniform sample with autograd truth
    targeted: Tensor  # bool [M]: tokens added because PDM full and the ratio sign disagree there
    row: Tensor  # [M]: the response each token belongs to (its tokens share A and context)
    masks: dict[str, dict[str, Tensor]]  # method -> {"beyond", "keep"} bool [M] at K = max(ks) (maskview)


@contextmanager
def _captured_hidden(head: nn.Module) -> Iterator[list[Tensor]]:
    """Records the input of the output layer (the final hidden states) during forward passes."""
    seen: list[Tensor] = []
    handle = head.register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
    try:
        yield seen
    finally:
        handle.remove()


def _step_loss(policy: nn.Module, batch: RolloutBatch, adv: Tensor, temperature: float) -> Tensor:
    logits = batch.response_logits(policy(batch.input_ids, batch.attention_mask)) / temperature
    loss, _ = policy_loss(STEP_METHOD, logits, batch.tokens, batch.rollout_logprobs(), adv, batch.response_mask)
    return loss


def _unembedding(policy: nn.Module) -> tuple[nn.Module, Tensor, Tensor | None]:
    """The output layer ``policy.lm_head`` with its weight W [V, d] and bias [V] (or None)."""
    head = policy.get_submodule("lm_head")
    weight, bias = head.weight, getattr(head, "bias", None)
    if not isinstance(weight, Tensor):
        raise TypeError("policy.lm_head.weight must be the unembedding matrix [V, d].")
    return head, weight, bias if isinstance(bias, Tensor) else None


def _head_logits(policy: nn.Module, batch: RolloutBatch, temperature: float) -> tuple[Tensor, Tensor]:
    """(z [N, R, V] float64 from the fp32 hidden states, h [N, R, d]) of the response positions."""
    head, weight, bias = _unembedding(policy)
    with torch.no_grad(), _captured_hidden(head) as seen:
        policy(batch.input_ids, batch.attention_mask)
    h = batch.response_logits(seen[-1])
    z = h.double() @ weight.double().T
    if bias is not None:
        z = z + bias.double()
    return z / temperature, h


def run_analysis(
    cfg: AnalysisConfig,
    policy: nn.Module,
    task: Task,
    engine_factory: Callable[[nn.Module], RolloutEngine],
    progress: Callable[[str, int], Callable[[], None]] | None = None,
) -> tuple[TokenResults, dict[str, float]]:
    """Runs the recipe of the module docstring on a warm-started ``policy``; returns per-token results and timings.

    ``engine_factory(policy)`` builds the rollout engine (the lab's RolloutEngine with full log-probs).
    ``progress(label, total)`` returns a callback to advance a progress bar by one.
    """
    cfg.validate()
    times: dict[str, float] = {}
    t0 = time.perf_counter()
    gen = torch.Generator().manual_seed(cfg.seed)
    engine = engine_factory(policy)
    problems = task.sample(cfg.prompts, gen)
    rollout = engine.generate(
        [p.prompt_ids for p in problems],
        cfg.group_size,
        cfg.temperature,
        max(cfg.ks),
        max_new_tokens=task.max_new_tokens,
        eos_id=task.eos_id,
        pad_id=task.pad_id,
        generator=gen,
    )
    mask = rollout.response_mask
    if cfg.advantages == "grpo":
        rows = [p for p in problems for _ in range(cfg.group_size)]
        rewards = torch.tensor([task.score(p, t[m].tolist())[0] for p, t, m in zip(rows, rollout.tokens, mask)])
        adv = grpo_advantages(rewards, cfg.group_size)[:, None].expand_as(mask).clone()
    else:
        adv = torch.randint(0, 2, mask.shape, generator=gen).float() * 2 - 1
    adv = adv * mask
    times["rollout_s"] = time.perf_counter() - t0

    # Minibatches of whole rows; the last one is analysed after Adam steps on the others.
    t0 = time.perf_counter()
    n_rows = rollout.tokens.shape[0]
    parts = torch.randperm(n_rows, generator=gen).tensor_split(cfg.stale_steps + 1)
    params: list[Tensor] = [p for p in policy.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=cfg.lr)
    opt.param_groups[0]["lr"] = 0.0 if cfg.source == "mismatch" else cfg.lr
    for idx in parts[:-1]:
        opt.zero_grad(set_to_none=True)
        _step_loss(policy, rollout.select(idx), adv[idx], cfg.temperature).backward()
        opt.step()
    opt.param_groups[0]["lr"] = cfg.lr
    times["stale_steps_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    batch, batch_adv = rollout.select(parts[-1]), adv[parts[-1]]
    z, h = _head_logits(policy, batch, cfg.temperature)
    keep = batch.response_mask & (batch_adv != 0)
    rows_idx, cols_idx = keep.nonzero(as_tuple=True)
    if len(rows_idx) == 0:
        raise ValueError(
            "no response token of the analysed minibatch has A != 0 (every group got equal rewards): "
            "use more prompts, a larger group, another seed or --advantages random."
        )
    if batch.full_logp is None:
        raise ValueError("the rollout engine must return μ's full log-probs (RolloutEngine(..., return_full=True)).")
    tokens, a = batch.tokens[keep], batch_adv[keep].double()
    zf, hf = z[keep], h[keep]
    full_logp = batch.full_logp[keep]
    mu_logp_a = batch.logp[keep]
    full = policy_stats(zf, tokens, RolloutLogprobs(mu_logp_a, full_logp=full_logp))
    _, w, bias = _unembedding(policy)
    # The exact decision per kind (pdm_full): D, the tokens beyond δ and the exact G, from the core.
    exact = {k: decide(f"pdm_full_{k}", full, a, delta_low=cfg.delta[k], delta_high=cfg.delta[k]) for k in KINDS}
    div = {k: cast(Tensor, exact[k].divergence) for k in KINDS}
    raw: dict[str, dict[str, Tensor]] = {k: {"full": cast(Tensor, exact[k].direction)} for k in KINDS}
    for k_top in cfg.ks:
        sub = RolloutLogprobs(mu_logp_a, batch.topk_ids[keep][:, :k_top], batch.topk_logp[keep][:, :k_top])
        st = policy_stats(zf, tokens, sub)
        for kind in KINDS:
            for est in TOPK_ESTIMATORS:
                raw[kind][f"{est}@{k_top}"] = predicted_change(st, kind, est)
    top = RolloutLogprobs(mu_logp_a, batch.topk_ids[keep], batch.topk_logp[keep], full_logp)
    # Every mask method's decision, each from the information it uses (μ's top max(ks), or all of μ).
    masks = mask_decisions(policy_stats(zf, tokens, top), a, cfg.delta)
    for kind in KINDS:
        raw[kind]["gw_full"] = kernel_change(zf, tokens, top, w, kind, "full")
        raw[kind][f"gw_proportional@{max(cfg.ks)}"] = kernel_change(zf, tokens, top, w, kind, "proportional")
    ratio_dir = (full.pi_a - full.mu_a).double()
    signals = {
        kind: {"ratio": a * ratio_dir}
        | {("pdm_" + n if not n.startswith("gw") else n): a * g.double() for n, g in raw[kind].items()}
        for kind in KINDS
    }

    # Autograd truth on a uniform sample (unbiased rates) plus the tokens where PDM full and the ratio
    # sign disagree (where the choice matters; few, so all of them up to the same cap).
    m = len(tokens)
    sampled = torch.zeros(m, dtype=torch.bool)
    sampled[torch.randperm(m, generator=gen)[: cfg.sample_tokens]] = True
    differ = torch.zeros(m, dtype=torch.bool)
    for kind in KINDS:
        differ |= torch.sign(signals[kind]["ratio"]) != torch.sign(signals[kind]["pdm_full"])
    candidates = differ.nonzero().squeeze(-1)
    targeted = torch.zeros(m, dtype=torch.bool)
    targeted[candidates[torch.randperm(len(candidates), generator=gen)[: cfg.sample_tokens]]] = True
    pick = (sampled | targeted).nonzero().squeeze(-1)
    truth: dict[str, dict[str, Tensor]] = {kind: {} for kind in KINDS}
    times["signals_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    for kind in KINDS:
        v = torch.full((m,), float("nan"), dtype=torch.float64)
        v[pick] = head_change(hf[pick], w, bias, cfg.temperature, tokens[pick],
                              full_logp[pick], a[pick], kind)
        truth[kind]["head"] = v
    precond: dict[str, Sequence[Tensor] | None] = {"sgd": None, "adam": adam_preconditioner(opt, params)}
    own = {(kind, name): torch.full((m,), float("nan"), dtype=torch.float64) for kind in KINDS for name in precond}
    prompt_len = batch.prompt_len
    sample_rows = rows_idx[pick]
    advance = progress("ground truth (autograd)", len(pick)) if progress else None
    for row in sample_rows.unique().tolist():
        sel = pick[sample_rows == row]
        ids, att = batch.input_ids[row], batch.attention_mask[row]

        def forward(x: Tensor, att: Tensor = att) -> Tensor:
            return policy(x[None], att[None, : len(x)])[0] / cfg.temperature

        res = own_change(forward, params, ids, prompt_len - 1 + cols_idx[sel], full_logp[sel], a[sel], precond)
        for key, val in res.items():
            own[key][sel] = val
        if advance:
            for _ in range(len(sel)):
                advance()
    for (kind, name), val in own.items():
        truth[kind][f"own_{name}"] = val
    times["truth_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    for name, d_after in _after_one_step(policy, opt, params, batch, batch_adv, cfg.temperature, keep, full_logp).items():
        for kind in KINDS:
            truth[kind][f"step_{name}"] = (d_after[kind] - div[kind]).double()
    times["step_s"] = time.perf_counter() - t0

    results = TokenResults(
        advantage=a,
        pi_a=full.pi_a.double(),
        mu_a=full.mu_a.double(),
        div={k: v.double() for k, v in div.items()},
        beyond={k: cast(Tensor, exact[k].beyond) for k in KINDS},
        raw_g={k: {n: g.double() for n, g in d.items()} for k, d in raw.items()},
        signals=signals,
        truth=truth,
        sampled=sampled,
        targeted=targeted,
        row=rows_idx,
        masks=masks,
    )
    return results, times


def _after_one_step(
    policy: nn.Module,
    opt: torch.optim.Adam,
    params: list[Tensor],
    batch: RolloutBatch,
    adv: Tensor,
    temperature: float,
    keep: Tensor,
    full_logp: Tensor,
) -> dict[str, dict[str, Tensor]]:
    """D of the analysed tokens after one Adam step (with its state) and after a plain gradient step of
    the same length, each on the whole minibatch from the current weights; the weights are restored."""
    saved = [p.detach().clone() for p in params]
    opt_state = copy.deepcopy(opt.state_dict())
    opt.zero_grad(set_to_none=True)
    _step_loss(policy, batch, adv, temperature).backward()
    grads = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in params]
    out: dict[str, dict[str, Tensor]] = {}

    def measure() -> dict[str, Tensor]:
        z, _ = _head_logits(policy, batch, temperature)
        return {k: full_divergence(z[keep], full_logp, k) for k in KINDS}

    opt.step()
    with torch.no_grad():
        length = torch.stack([(p - s).square().sum() for p, s in zip(params, saved)]).sum().sqrt()
    out["adam"] = measure()
    grad_norm = torch.stack([g.square().sum() for g in grads]).sum().sqrt()
    with torch.no_grad():
        for p, s, g in zip(params, saved, grads):
            p.copy_(s - length / grad_norm * g)
    out["sgd"] = measure()
    with torch.no_grad():
        for p, s in zip(params, saved):
            p.copy_(s)
    opt.load_state_dict(opt_state)
    opt.zero_grad(set_to_none=True)
    return out


def config_dict(cfg: AnalysisConfig) -> dict:
    """The config as plain JSON values."""
    d = asdict(cfg)
    d["ks"] = list(cfg.ks)
    return d
