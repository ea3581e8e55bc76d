"""One analysis run, as repeated rounds whose memory is bounded by one round, resumable after a kill.

Each round (docs/analysis.md), from the same starting weights and a fresh Adam, with its own seed:
1. Sample ``prompts × group_size`` responses with the rollout engine (μ; ``rollout_dtype`` for
   ``mismatch`` and ``both``, fp32 for ``stale``), with μ's full log-probs and top-K, and compute
   advantages (GRPO from the task's rewards, or random ±1 per token).
2. Split the rows into ``stale_steps + 1`` minibatches and take one Adam step on the truncated-IS
   surrogate of each of the first ``stale_steps``. For ``stale`` and ``both`` the steps use ``lr``, so
   π moves away from μ; for ``mismatch`` they use lr = 0, which fills Adam's second moment v (its
   preconditioner) without moving the weights.
3. On the last minibatch (π = the current weights in fp32), per response token with A ≠ 0, in blocks of
   ``block_positions`` positions: the true D, every direction signal (ratio sign, each registered
   estimator of G at each K) and every registered direction mask's decision (``pdmask.decide``).
4. Autograd ground truths only where they decide something: every token beyond δ on which a predictive
   mask and its ratio-sign counterpart decide differently, a uniform sample of the tokens beyond δ
   (the mask view's rates) and a uniform sample of all tokens (the agreement tables, check 5).
5. The actual change of D of every token after one real step on the whole minibatch (Adam with its
   state, and a plain gradient step of the same parameter-space length).
A round keeps only per-token float32/bool vectors (``ROUND_FILE``, written atomically); a rerun with
the same settings loads the finished rounds and continues with the next one.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
from torch import Tensor, nn

from pdmask import METHODS, PolicyStats, RolloutLogprobs, decide, policy_loss, policy_stats, predicted_change
from pdmask.analysis.maskview import direction_methods, mask_decisions
from pdmask.analysis.truth import KINDS, adam_preconditioner, full_divergence, head_change, own_change
from pdmask.lab.files import save_atomic, write_text_atomic
from pdmask.lab.train import grpo_advantages
from pdmask.vocab_pass import row_slices

if TYPE_CHECKING:
    from pdmask.lab.engine import RolloutBatch, RolloutEngine
    from pdmask.lab.tasks import Task

SOURCES = ("mismatch", "stale", "both")
#: Estimators of G that need μ over the whole vocabulary (analysed once) or only its top K (at every K).
_PDM = [m for m in METHODS.values() if m.rule == "pdm"]
FULL_ESTIMATORS = tuple(dict.fromkeys(m.estimator for m in _PDM if m.info == "full"))
TOPK_ESTIMATORS = tuple(dict.fromkeys(m.estimator for m in _PDM if m.info == "topk"))
#: The paper's top-K estimators (docs/method.md): their disagreements with DPPO's ratio sign are the run's target.
PAPER_ESTIMATORS = ("aggregated", "uniform")
#: Estimators whose every disagreement with the ratio sign gets autograd truth (the others' may be sampled).
ALWAYS_MEASURED = (*PAPER_ESTIMATORS, "full")
#: The surrogate of the optimizer steps: truncated IS without a trust region, so every token moves.
STEP_METHOD = "pg_is"
#: Truths by autograd on selected tokens (NaN elsewhere); the step_* truths are measured on every token.
AUTOGRAD_TRUTHS = ("own_sgd", "own_adam", "head")
ROUND_FILE = "round_{:05d}.pt"
#: Settings a rerun may change without starting over: they only say when to stop.
STOPPING = ("rounds", "target_disagreements")
#: Logits of a forward pass held at once (elements): rows per micro-batch = this / (length × V).
LOGIT_BUDGET = 1 << 24


@dataclass
class AnalysisConfig:
    """Everything a run depends on (stored in analysis.json and, for resuming, run.json)."""

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
    prompts: int = 512  # per round
    group_size: int = 8
    temperature: float = 1.0
    advantages: str = "grpo"  # grpo | random
    sample_tokens: int = 2048  # per round: uniform sample of all analysed tokens with autograd truth
    beyond_sample: int = 512  # per round: uniform sample of the tokens beyond δ with autograd truth
    # Per round: uniform sample of the tokens where any predictive mask and the ratio sign decide differently
    # (None: all). The paper's masks' and PDM full's disagreements (ALWAYS_MEASURED) get truth regardless.
    disagree_sample: int | None = None
    rounds: int = 1  # at most this many rounds
    target_disagreements: int | None = None  # stop once the paper's masks disagree with DPPO this often, per kind
    block_positions: int = 256  # positions per block of the per-token statistics (bounds the [block, V] arrays)
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
        for name in ("prompts", "rounds", "block_positions"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}.")
        for name in ("sample_tokens", "beyond_sample", "disagree_sample"):
            if (getattr(self, name) or 0) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}.")
        if self.target_disagreements is not None and self.target_disagreements < 1:
            raise ValueError(f"target_disagreements must be >= 1, got {self.target_disagreements}.")
        if self.prompts * self.group_size < self.stale_steps + 1:
            raise ValueError(
                f"{self.prompts} x {self.group_size} rollouts cannot fill stale_steps + 1 = {self.stale_steps + 1} minibatches."
            )
        return self

    def engine_dtype(self) -> str:
        return "fp32" if self.source == "stale" else self.rollout_dtype


@dataclass
class TokenResults:
    """Per-token arrays over the analysed tokens [M] of all rounds (response tokens with A ≠ 0).

    ``signals[kind][name]`` are the signed predictions A·X (positive = D grows); ``truth[kind][name]``
    the signed true changes, NaN where not measured (autograd truths exist on the sampled and targeted
    tokens only).
    """

    advantage: Tensor
    pi_a: Tensor
    mu_a: Tensor
    div: dict[str, Tensor]
    beyond: dict[str, Tensor]  # bool [M]: the exact D beyond δ for the token's advantage (where a mask acts)
    raw_g: dict[str, dict[str, Tensor]]  # G of each estimator, unsigned (for the top-K tracking)
    signals: dict[str, dict[str, Tensor]]
    truth: dict[str, dict[str, Tensor]]
    sampled: Tensor  # bool [M]: the uniform sample of all tokens with autograd truth
    beyond_sampled: Tensor  # bool [M]: the uniform sample of the tokens beyond δ (for any mask) with autograd truth
    targeted: dict[str, Tensor]  # kind -> bool [M]: a predictive mask and its ratio-sign counterpart decide differently
    disagree_sampled: dict[str, Tensor]  # kind -> bool [M]: the uniform sample of ``targeted`` with truth
    row: Tensor  # [M]: the response each token belongs to (its tokens share A and context), unique over rounds
    masks: dict[str, dict[str, Tensor]]  # method -> {"beyond", "keep"} bool [M] at K = max(ks)
    round_index: Tensor  # [M]: the round each token comes from; rounds have disjoint seeds

    @classmethod
    def from_records(cls, records: Sequence[dict[str, Tensor]], indices: Sequence[int]) -> TokenResults:
        """Concatenates the flat per-round records (``run_round``) of rounds ``indices`` into one result, in float64."""
        if not records:
            raise ValueError("no round has been analysed.")
        if len(indices) != len(records):
            raise ValueError(f"indices names {len(indices)} rounds for {len(records)} records.")
        flat = {key: torch.cat([r[key] for r in records]) for key in records[0]}

        def num(key: str) -> Tensor:
            return flat[key].double()

        def sub(prefix: str) -> dict[str, Tensor]:
            return {k[len(prefix) :]: v for k, v in flat.items() if k.startswith(prefix)}

        adv, pi_a, mu_a = num("adv"), num("pi_a"), num("mu_a")
        raw = {kind: {"ratio": pi_a - mu_a} | {k: v.double() for k, v in sub(f"g/{kind}/").items()} for kind in KINDS}
        return cls(
            advantage=adv,
            pi_a=pi_a,
            mu_a=mu_a,
            div={kind: num(f"div/{kind}") for kind in KINDS},
            beyond={kind: flat[f"beyond/{kind}"] for kind in KINDS},
            raw_g={kind: {k: v for k, v in g.items() if k != "ratio"} for kind, g in raw.items()},
            signals={kind: {signal_name(k): adv * v for k, v in g.items()} for kind, g in raw.items()},
            truth={kind: {k: v.double() for k, v in sub(f"truth/{kind}/").items()} for kind in KINDS},
            sampled=flat["sampled"],
            beyond_sampled=flat["beyond_sampled"],
            targeted={kind: flat[f"targeted/{kind}"] for kind in KINDS},
            disagree_sampled={kind: flat[f"disagree_sampled/{kind}"] for kind in KINDS},
            row=flat["row"],
            masks=record_masks(flat),
            round_index=torch.repeat_interleave(torch.tensor(indices), torch.tensor([len(r["adv"]) for r in records])),
        )

    def select(self, keep: Tensor) -> TokenResults:
        """The tokens where ``keep`` (bool [M]) holds, every per-token array alike."""
        return TokenResults(**{f.name: _take(getattr(self, f.name), keep) for f in fields(self)})


def _take(x: Tensor | dict, keep: Tensor) -> Tensor | dict:
    return x[keep] if isinstance(x, Tensor) else {k: _take(v, keep) for k, v in x.items()}


def signal_name(estimate: str) -> str:
    """Table name of an estimate of G: ``full`` -> ``pdm_full``, ``aggregated@5`` -> ``pdm_aggregated@5``."""
    return estimate if estimate == "ratio" else f"pdm_{estimate}"


@contextmanager
def _captured_hidden(head: nn.Module) -> Iterator[list[Tensor]]:
    """Records the input of the output layer (the final hidden states) during forward passes."""
    seen: list[Tensor] = []
    handle = head.register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
    try:
        yield seen
    finally:
        handle.remove()


def _unembedding(policy: nn.Module) -> tuple[nn.Module, Tensor, Tensor | None]:
    """The output layer ``policy.lm_head`` with its weight W [V, d] and bias [V] (or None)."""
    head = policy.get_submodule("lm_head")
    weight, bias = head.weight, getattr(head, "bias", None)
    if not isinstance(weight, Tensor):
        raise TypeError("policy.lm_head.weight must be the unembedding matrix [V, d].")
    return head, weight, bias if isinstance(bias, Tensor) else None


def _row_chunks(batch: RolloutBatch, vocab: int) -> list[Tensor]:
    """Row indices of micro-batches whose logits [rows, length, V] stay within LOGIT_BUDGET elements."""
    n, length = batch.input_ids.shape
    return list(torch.arange(n).split(max(1, LOGIT_BUDGET // (length * vocab))))


def _accumulate_step_grad(policy: nn.Module, batch: RolloutBatch, adv: Tensor, temperature: float) -> None:
    """Adds ∇ of the minibatch's token-mean surrogate to ``.grad``, one micro-batch at a time."""
    total = batch.response_mask.sum().clamp(min=1)
    for idx in _row_chunks(batch, policy.vocab_size):
        sub = batch.select(idx)
        logits = sub.response_logits(policy) / temperature
        loss, _ = policy_loss(STEP_METHOD, logits, sub.tokens, sub.rollout_logprobs(), adv[idx], sub.response_mask)
        # Weighted by its share of the tokens, the micro-batches' token means add up to the minibatch's.
        (loss * sub.response_mask.sum() / total).backward()


@torch.no_grad()
def _hidden(policy: nn.Module, batch: RolloutBatch) -> Tensor:
    """Final hidden states h [N, R, d] (fp32) at the positions that predict the response."""
    head, _, _ = _unembedding(policy)
    parts = []
    for idx in _row_chunks(batch, policy.vocab_size):
        with _captured_hidden(head) as seen:
            batch.select(idx).response_logits(policy)
        parts.append(seen[-1][:, :-1])  # the output layer's input at the positions response_logits keeps
    return torch.cat(parts)


def _logits(h: Tensor, weight: Tensor, bias: Tensor | None, temperature: float) -> Tensor:
    """z = (h Wᵀ + b)/T [n, V] in float64 (weight and bias already float64)."""
    z = h.double() @ weight.T
    return (z if bias is None else z + bias) / temperature


def _block_stats(
    cfg: AnalysisConfig,
    z: Tensor,
    tokens: Tensor,
    rollout: RolloutLogprobs,
    adv: Tensor,
    weight: Tensor,
) -> dict[str, Tensor]:
    """Everything cheap of one block of positions [B]: D, beyond δ, every estimate of G, every mask's decision.

    ``rollout`` carries μ's top max(ks) and its full log-probs; ``weight`` is the LM head W [V, d] for the
    kernel-aware estimators. Returns the flat record entries of the block.
    """
    out: dict[str, Tensor] = {}
    methods = direction_methods()

    def stats(info: RolloutLogprobs, estimators: Sequence[str]) -> PolicyStats:
        """One pass over the vocabulary with the sums the given estimators need."""
        wanted = [m for m in _PDM if m.estimator in estimators]
        return policy_stats(
            z, tokens, info,
            need_uniform=any(m.needs_uniform for m in wanted),
            head_weight=weight if any(m.needs_head for m in wanted) else None,
        )

    full = stats(rollout, tuple({m.estimator for m in methods if m.estimator is not None}))
    for kind in KINDS:
        exact = decide(f"pdm_full_{kind}", full, adv, delta_low=cfg.delta[kind], delta_high=cfg.delta[kind])
        out[f"div/{kind}"] = cast(Tensor, exact.divergence).float()
        out[f"beyond/{kind}"] = cast(Tensor, exact.beyond)
        for est in FULL_ESTIMATORS:
            out[f"g/{kind}/{est}"] = predicted_change(full, kind, est).float()
    for k_top in cfg.ks:
        assert rollout.topk_ids is not None and rollout.topk_logp is not None
        sub = stats(RolloutLogprobs(rollout.logp, rollout.topk_ids[:, :k_top], rollout.topk_logp[:, :k_top]), TOPK_ESTIMATORS)
        for kind in KINDS:
            for est in TOPK_ESTIMATORS:
                out[f"g/{kind}/{est}@{k_top}"] = predicted_change(sub, kind, est).float()
    # Every direction mask's decision, each from the information it uses (μ's top max(ks), or all of μ).
    for name, dec in mask_decisions(full, adv, cfg.delta).items():
        out[f"mask/{name}/beyond"], out[f"mask/{name}/keep"] = dec["beyond"], dec["keep"]
    out["pi_a"], out["mu_a"] = full.pi_a.float(), full.mu_a.float()
    return out


def disagreements(masks: dict[str, dict[str, Tensor]], kind: str, estimators: Sequence[str] | None = None) -> Tensor:
    """bool [M]: tokens where a predictive mask of ``kind`` (of ``estimators``, default all) and its ratio-sign
    counterpart (``MaskMethod.dppo_counterpart``) decide differently. Both share D, so such tokens are beyond δ."""
    out = torch.zeros_like(next(iter(masks.values()))["keep"])
    for m in direction_methods():
        other = m.dppo_counterpart
        if m.rule != "pdm" or m.kind != kind or m.name not in masks or other not in masks:
            continue
        if estimators is None or m.estimator in estimators:
            out |= masks[m.name]["keep"] != masks[other]["keep"]
    return out


def _uniform(candidates: Tensor, size: int, gen: torch.Generator) -> Tensor:
    """bool mask of ``size`` tokens drawn uniformly without replacement among ``candidates`` (bool [M])."""
    idx = candidates.nonzero().squeeze(-1)
    out = torch.zeros_like(candidates)
    out[idx[torch.randperm(len(idx), generator=gen)[:size]]] = True
    return out


def run_round(
    cfg: AnalysisConfig,
    index: int,
    policy: nn.Module,
    engine: RolloutEngine,
    task: Task,
    progress: Callable[[str, int], Callable[[], None]] | None = None,
) -> tuple[dict[str, Tensor], dict[str, float]]:
    """One round (the module docstring) from the policy's current weights; returns its flat record and timings.

    The record maps names (``adv``, ``div/tv``, ``g/kl/aggregated@5``, ``mask/<method>/keep``,
    ``truth/kl/own_sgd``, ...) to per-token float32/bool/int64 vectors over the round's analysed tokens.
    """
    times: dict[str, float] = {}
    t0 = time.perf_counter()
    # Each round has its own stream: a resumed run draws exactly what an uninterrupted one would.
    gen = torch.Generator().manual_seed(cfg.seed + 1_000_003 * index)
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
    if rollout.full_logp is None:
        raise ValueError("the rollout engine must return μ's full log-probs (RolloutEngine(..., return_full=True)).")
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
    opt = torch.optim.Adam(params, lr=0.0 if cfg.source == "mismatch" else cfg.lr)
    for idx in parts[:-1]:
        opt.zero_grad(set_to_none=True)
        _accumulate_step_grad(policy, rollout.select(idx), adv[idx], cfg.temperature)
        opt.step()
    opt.param_groups[0]["lr"] = cfg.lr
    opt.zero_grad(set_to_none=True)  # the truths and the real step need the memory of the gradients
    batch, batch_adv = rollout.select(parts[-1]), adv[parts[-1]]
    del rollout  # the other minibatches' full μ is no longer needed
    times["stale_steps_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    keep = batch.response_mask & (batch_adv != 0)
    rows_idx, cols_idx = keep.nonzero(as_tuple=True)
    m = len(rows_idx)
    if m == 0:  # every group got equal rewards: nothing to analyse in this round
        return {"adv": torch.zeros(0)}, times
    h = _hidden(policy, batch)[keep]
    assert batch.full_logp is not None
    tokens, a = batch.tokens[keep], batch_adv[keep].double()
    full_logp, mu_logp_a = batch.full_logp[keep], batch.logp[keep]
    top_ids, top_logp = batch.topk_ids[keep], batch.topk_logp[keep]
    _, w, bias = _unembedding(policy)
    w64 = w.detach().double()
    b64 = None if bias is None else bias.detach().double()
    blocks = []
    for sl in row_slices(m, cfg.block_positions):
        info = RolloutLogprobs(mu_logp_a[sl], top_ids[sl], top_logp[sl], full_logp[sl])
        # W in the logits' float64: the core's pass would otherwise convert it for every block of the vocabulary.
        blocks.append(_block_stats(cfg, _logits(h[sl], w64, b64, cfg.temperature), tokens[sl], info, a[sl], w64))
    rec: dict[str, Tensor] = {key: torch.cat([b[key] for b in blocks]) for key in blocks[0]}
    masks = record_masks(rec)
    times["signals_s"] = time.perf_counter() - t0

    # Autograd truth where it decides something (disagreements beyond δ), plus two uniform samples.
    t0 = time.perf_counter()
    none = torch.zeros(m, dtype=torch.bool)
    targeted = {kind: disagreements(masks, kind) for kind in KINDS}
    size = m if cfg.disagree_sample is None else cfg.disagree_sample
    disagree_sampled = {kind: _uniform(targeted[kind], size, gen) for kind in KINDS}
    measured = {kind: disagree_sampled[kind] | disagreements(masks, kind, ALWAYS_MEASURED) for kind in KINDS}
    union_beyond = none.clone()
    for dec in masks.values():
        union_beyond |= dec["beyond"]
    sampled = _uniform(~none, cfg.sample_tokens, gen)
    beyond_sampled = _uniform(union_beyond, cfg.beyond_sample, gen)
    need = torch.stack([sampled | beyond_sampled | measured[kind] for kind in KINDS], 1)  # [M, kinds]
    truth: dict[str, Tensor] = {}
    pick = sampled.nonzero().squeeze(-1)
    for kind in KINDS:
        v = torch.full((m,), float("nan"), dtype=torch.float64)
        v[pick] = head_change(h[pick], w, bias, cfg.temperature, tokens[pick], full_logp[pick], a[pick], kind)
        truth[f"truth/{kind}/head"] = v
    precond: dict[str, Sequence[Tensor] | None] = {"sgd": None, "adam": adam_preconditioner(opt, params)}
    own = {(kind, name): torch.full((m,), float("nan"), dtype=torch.float64) for kind in KINDS for name in precond}
    pick = need.any(1).nonzero().squeeze(-1)
    sample_rows = rows_idx[pick]
    advance = progress("ground truth (autograd)", len(pick)) if progress else None
    for row in sample_rows.unique().tolist():
        sel = pick[sample_rows == row]
        ids, att = batch.input_ids[row], batch.attention_mask[row]

        def forward(x: Tensor, att: Tensor = att) -> Tensor:
            return policy(x[None], att[None, : len(x)])[0] / cfg.temperature

        positions = batch.prompt_len - 1 + cols_idx[sel]
        res = own_change(forward, params, ids, positions, full_logp[sel], a[sel], precond, need=need[sel])
        for key, val in res.items():
            own[key][sel] = val
        if advance:
            for _ in range(len(sel)):
                advance()
    del precond
    for (kind, name), val in own.items():
        truth[f"truth/{kind}/own_{name}"] = val
    times["truth_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    for name, d_after in _after_one_step(policy, opt, params, batch, batch_adv, cfg.temperature, keep, full_logp, cfg).items():
        for kind in KINDS:
            truth[f"truth/{kind}/step_{name}"] = d_after[kind] - rec[f"div/{kind}"].double()
    times["step_s"] = time.perf_counter() - t0

    rec |= {key: val.float() for key, val in truth.items()}
    rec |= {f"targeted/{kind}": t for kind, t in targeted.items()}
    rec |= {f"disagree_sampled/{kind}": t for kind, t in disagree_sampled.items()}
    rec |= {
        "adv": a.float(),
        "sampled": sampled,
        "beyond_sampled": beyond_sampled,
        # Unique over rounds: the clustered intervals treat each response as one cluster.
        "row": rows_idx + index * n_rows,
    }
    return rec, times


def _after_one_step(
    policy: nn.Module,
    opt: torch.optim.Adam,
    params: list[Tensor],
    batch: RolloutBatch,
    adv: Tensor,
    temperature: float,
    keep: Tensor,
    full_logp: Tensor,
    cfg: AnalysisConfig,
) -> dict[str, dict[str, Tensor]]:
    """Exact D of the analysed tokens after one Adam step (with its state) and after a plain gradient step
    of the same length, each on the whole minibatch from the current weights.

    The weights end at the plain step and the optimizer's state is spent: the round is over after this.
    """
    saved = [p.detach().clone() for p in params]
    opt.zero_grad(set_to_none=True)
    _accumulate_step_grad(policy, batch, adv, temperature)
    _, w, bias = _unembedding(policy)

    def measure() -> dict[str, Tensor]:
        h = _hidden(policy, batch)[keep]
        w64 = w.detach().double()
        b64 = None if bias is None else bias.detach().double()
        out = {kind: torch.empty(len(h), dtype=torch.float64) for kind in KINDS}
        for sl in row_slices(len(h), cfg.block_positions):
            z = _logits(h[sl], w64, b64, temperature)
            for kind in KINDS:
                out[kind][sl] = full_divergence(z, full_logp[sl], kind)
        return out

    opt.step()
    result = {"adam": measure()}
    with torch.no_grad():
        length = torch.stack([(p - s).square().sum() for p, s in zip(params, saved)]).sum().sqrt()
        grad_norm = torch.stack([torch.zeros(()) if p.grad is None else p.grad.square().sum() for p in params]).sum().sqrt()
        for p, s in zip(params, saved):
            p.copy_(s if p.grad is None else s - length / grad_norm * p.grad)
    result["sgd"] = measure()
    opt.zero_grad(set_to_none=True)
    return result


def config_dict(cfg: AnalysisConfig) -> dict:
    """The config as plain JSON values."""
    d = asdict(cfg)
    d["ks"] = list(cfg.ks)
    return d


def _check_resumable(cfg: AnalysisConfig, run_file: Path) -> None:
    """Writes run.json for a new run; for an existing one, checks that only the stopping settings changed."""
    import json

    mine = {k: v for k, v in config_dict(cfg).items() if k not in STOPPING}
    if not run_file.exists():
        write_text_atomic(run_file, json.dumps(mine, indent=1))
        return
    theirs = json.loads(run_file.read_text())
    changed = sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))
    if changed:
        raise ValueError(
            f"{run_file.parent} holds finished rounds of a run with other settings ({', '.join(changed)}): "
            "rerun with that run's settings to continue it, or choose another --out."
        )


def record_masks(rec: dict[str, Tensor]) -> dict[str, dict[str, Tensor]]:
    """The masks' decisions {"beyond", "keep"} of a flat record, for the methods it has."""
    names = (m.name for m in direction_methods())
    return {n: {"beyond": rec[f"mask/{n}/beyond"], "keep": rec[f"mask/{n}/keep"]} for n in names if f"mask/{n}/keep" in rec}


def paper_disagreements(rec: dict[str, Tensor]) -> dict[str, int]:
    """Per kind: tokens of a record where one of the paper's top-K predictive estimators (as a mask) and
    DPPO's top-K mask decide differently — all of them get autograd truth; the run's stopping count."""
    masks = record_masks(rec)
    return {kind: int(disagreements(masks, kind, PAPER_ESTIMATORS).sum()) if masks else 0 for kind in KINDS}


def _round_line(index: int, rec: dict[str, Tensor], seconds: float, counts: dict[str, int]) -> str:
    """One line on a finished round: its tokens, those beyond δ, the autograd truths, the running target count."""
    if not len(rec["adv"]):
        return f"round {index}: no token with A != 0; {seconds:.0f} s"
    beyond = ", ".join(f"{k.upper()} {int(rec[f'beyond/{k}'].sum())}" for k in KINDS)
    truths = ", ".join(f"{k.upper()} {int(torch.isfinite(rec[f'truth/{k}/own_sgd']).sum())}" for k in KINDS)
    so_far = ", ".join(f"{k.upper()} {v}" for k, v in counts.items())
    return (f"round {index}: {len(rec['adv'])} tokens, beyond δ {beyond}; own-step truths {truths}; {seconds:.0f} s; "
            f"the paper's masks and DPPO's differed so far on {so_far}")


def _check_same_record(rec: dict[str, Tensor], records: Sequence[dict[str, Tensor]], path: Path) -> None:
    """Raises ValueError if ``rec`` (loaded from, or to be written to, ``path``) holds other quantities than the
    run's earlier non-empty ``records``; an empty round (no token with A != 0) holds nothing to compare.

    Round files outlive the code that wrote them (a long run is continued later, or elsewhere): a version of
    pdmask that records other signals or masks must start a new run instead of mixing its rounds in.
    """
    if not len(rec["adv"]) or not records or rec.keys() == records[0].keys():
        return
    diff = sorted(rec.keys() ^ records[0].keys())
    more = f" and {len(diff) - 3} more" if len(diff) > 3 else ""
    raise ValueError(
        f"{path} records other quantities than the run's earlier rounds ({', '.join(diff[:3])}{more}): "
        "one of them comes from another version of pdmask. Continue the run with the version that wrote its "
        "rounds, or choose another --out."
    )


def check_shard(shard: tuple[int, int]) -> tuple[int, int]:
    """``shard`` unchanged if it is (I, N) with 0 <= I < N; raises ValueError naming it otherwise."""
    worker, workers = shard
    if not 0 <= worker < workers:
        raise ValueError(f"shard must be I/N with 0 <= I < N, got {worker}/{workers}.")
    return shard


def run_analysis(
    cfg: AnalysisConfig,
    policy: nn.Module,
    task: Task,
    engine_factory: Callable[[nn.Module], RolloutEngine],
    out_dir: Path,
    progress: Callable[[str, int], Callable[[], None]] | None = None,
    log: Callable[[str], None] | None = None,
    shard: tuple[int, int] = (0, 1),
) -> tuple[TokenResults, dict[str, float]]:
    """Runs rounds (the module docstring) on a warm-started ``policy`` until ``cfg.rounds`` or the target.

    Finished rounds live in ``out_dir/rounds``; those already there (from a killed run, or another shard,
    with the same settings) are loaded, not recomputed. ``shard = (i, n)`` computes only the rounds whose
    index is i mod n and skips the others' unfinished ones, so n processes can share ``out_dir``; a call
    with the default (0, 1) completes any gap. ``engine_factory(policy)`` builds the rollout engine (the
    lab's RolloutEngine with full log-probs); ``progress(label, total)`` returns a callback that advances
    a progress bar by one (a label seen before resets its bar); ``log(line)`` reports each finished round.
    Returns the results of the rounds seen and the summed timings of the rounds computed in this call.
    """
    cfg.validate()
    worker, workers = check_shard(shard)
    rounds_dir = out_dir / "rounds"
    rounds_dir.mkdir(parents=True, exist_ok=True)
    _check_resumable(cfg, out_dir / "run.json")
    start = {k: v.detach().clone() for k, v in policy.state_dict().items()}
    engine = engine_factory(policy)
    times: dict[str, float] = {}
    records: list[dict[str, Tensor]] = []
    indices: list[int] = []
    counts = dict.fromkeys(KINDS, 0)
    advance = progress("rounds", cfg.rounds) if progress else None
    for index in range(cfg.rounds):
        path = rounds_dir / ROUND_FILE.format(index)
        computed = not path.exists()
        if computed and index % workers != worker:
            continue  # another shard's round, not finished yet
        if computed:
            policy.load_state_dict(start)
            rec, round_times = run_round(cfg, index, policy, engine, task, progress)
        else:
            rec = torch.load(path, weights_only=True)["tokens"]
        _check_same_record(rec, records, path)  # before a computed round is written into the run
        if computed:
            save_atomic({"round": index, "tokens": rec, "timing": round_times}, path)
            for k, v in round_times.items():
                times[k] = times.get(k, 0.0) + v
        if len(rec["adv"]):  # an empty round (every group got equal rewards) holds no token
            records.append(rec)
            indices.append(index)
        if advance:
            advance()
        for kind, c in paper_disagreements(rec).items():
            counts[kind] += c
        if log and computed:
            log(_round_line(index, rec, sum(round_times.values()), counts))
        if cfg.target_disagreements is not None and min(counts.values()) >= cfg.target_disagreements:
            break
    policy.load_state_dict(start)
    if not records:
        raise ValueError(
            "no response token of the analysed minibatches has A != 0 (every group got equal rewards): "
            "use more prompts, a larger group, another seed or --advantages random."
        )
    times["rounds_analysed"] = float(len(records))
    return TokenResults.from_records(records, indices), times
