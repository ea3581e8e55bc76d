"""One RL run: GRPO advantages, a low-precision rollout engine, minibatch updates with a pdmask loss.

Per step: sync the engine from the trainer, sample ``prompts_per_step`` x ``group_size`` responses,
score them, normalise rewards within each group, and take ``epochs x minibatches`` Adam steps on the
masked DPPO-form loss (the later minibatches are stale: the staleness knob). With ``rollout_lag = L``
the engine is synced instead from the weights the trainer had at the start of step t − L (as in
asynchronous RL; the SFT weights while t < L); those L snapshots are part of the checkpoint. μ is the
engine's log-probs (top-K, like vLLM ``logprobs=K``) or, with ``mu="recompute"``, the trainer's π_old.

A run directory holds ``config.json`` (resolved), ``metrics.jsonl`` (one row per step), TensorBoard
events and ``checkpoint.pt`` (written atomically after every ``checkpoint_every`` steps, after that
step's metrics row). ``train(..., resume=True)`` continues from the checkpoint and drops metrics
rows past it, so a kill at any moment loses at most the steps since the last checkpoint. Every random
draw comes from a generator seeded by (seed, step), so the same seed gives the same metrics on CPU.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

import pdmask
from pdmask import METHODS, RolloutLogprobs, jsonio
from pdmask.estimators import PAPER_TOPK_ESTIMATORS
from pdmask.exact import exact_divergence
from pdmask.lab.config import Config, ConfigError
from pdmask.lab.engine import RolloutBatch, RolloutEngine, sample
from pdmask.lab.files import save_atomic, write_text_atomic
from pdmask.lab.models import is_pretrained
from pdmask.lab.sft import initial_policy, sft_path, warm_start
from pdmask.lab.tasks import Task, build_task

FULL_LOGP_BUDGET = 2**25  # floats: above this the engine returns top-K only and mismatch is a top-K estimate

#: The top-K predictive estimators whose masks ``tail_metrics`` compares: the paper's two, then pdmask's.
TAIL_ESTIMATORS = (*PAPER_TOPK_ESTIMATORS, "proportional", "exactpi")
#: Shares logged by ``tail_metrics``, pooled over a step's updates by their token counts.
TAIL_DENOMINATORS = {
    "topk/masks_differ_frac": "count/tokens",
    "topk/paper_tails_differ_frac": "count/tokens",
    **{f"topk/vs_dppo_{e}_frac": "count/tokens" for e in TAIL_ESTIMATORS},
    "topk/pi_rest_mean": "count/tokens",
    "topk/mu_rest_mean": "count/tokens",
}


def step_generator(seed: int, step: int) -> torch.Generator:
    """The random stream of one step (data, sampling, minibatch order): resume-safe and seed-reproducible."""
    return torch.Generator().manual_seed(seed * 1_000_003 + step)


def grpo_advantages(rewards: Tensor, group_size: int, eps: float = 1e-6) -> Tensor:
    """rewards [N] grouped by consecutive group_size rows -> (r - group mean) / (group std + eps), [N]."""
    r = rewards.view(-1, group_size)
    return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + eps)).view(-1)


@torch.no_grad()
def evaluate(
    policy: nn.Module,
    task: Task,
    batch_size: int = 256,
    *,
    samples: int = 0,
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
) -> dict[str, float]:
    """Held-out accuracy and reward of the trainer's (float32) policy: greedy, and (``samples`` > 0) the
    mean accuracy of ``samples`` responses per prompt sampled at ``temperature`` (what RL optimises)."""
    was_training = policy.training
    policy.eval()

    def score(problems: list, temp: float, group: int = 1) -> tuple[list[float], list[bool]]:
        """group responses per problem, in batches of batch_size responses (batch_size // group problems)."""
        rewards, correct = [], []
        per_batch = batch_size // group
        for i in range(0, len(problems), per_batch):
            part = problems[i : i + per_batch]
            r = sample(
                policy,
                [p.prompt_ids for p in part],
                max_new_tokens=task.max_new_tokens,
                eos_id=task.eos_id,
                pad_id=task.pad_id,
                temperature=temp,
                top_k_logprobs=1,
                generator=generator,
                group_size=group,
            )
            for j, resp in enumerate(r.tokens.tolist()):
                reward, ok = task.score(part[j // group], resp)
                rewards.append(reward)
                correct.append(ok)
        return rewards, correct

    rewards, correct = score(list(task.heldout), 0.0)
    out = {"eval/accuracy": sum(correct) / len(correct), "eval/reward": sum(rewards) / len(rewards)}
    if samples > 0:
        # The samples of a prompt share one prefill; batches stay those of the prompts repeated in order
        # (the same random draws) when batch_size is a multiple of samples.
        if batch_size % samples == 0:
            _, sampled = score(list(task.heldout), temperature, group=samples)
        else:
            _, sampled = score([p for p in task.heldout for _ in range(samples)], temperature)
        out["eval/sampled_accuracy"] = sum(sampled) / len(sampled)
    policy.train(was_training)
    return out


def _select(mu: RolloutLogprobs, index: Tensor) -> RolloutLogprobs:
    pick = lambda t: None if t is None else t[index]
    return RolloutLogprobs(mu.logp[index], pick(mu.topk_ids), pick(mu.topk_logp), pick(mu.full_logp))


def _recomputed_mu(logp_old: Tensor, tokens: Tensor, k: int) -> RolloutLogprobs:
    """μ = the trainer's own π_old (full information) from its log-probs [N, R, V]."""
    topk_logp, topk_ids = logp_old.topk(k, dim=-1)
    return RolloutLogprobs(logp_old.gather(-1, tokens[..., None]).squeeze(-1), topk_ids, topk_logp, full_logp=logp_old)


@torch.no_grad()
def mismatch_metrics(logits: Tensor, mb: RolloutBatch) -> dict[str, float]:
    """The trainer's π (logits [n, R, V]) against the engine's μ on a minibatch: TV (DPPO's top-K estimate when
    the engine returned top-K only), mean |log π(a) − log μ(a)|, entropy of π; means over response tokens."""
    logits = logits.float()
    logp = torch.log_softmax(logits, dim=-1)
    p = logp.exp()
    if mb.full_logp is not None:
        tv = exact_divergence(logp, mb.full_logp, "tv")
    else:
        tv = pdmask.divergence(pdmask.policy_stats(logits, mb.tokens, mb.rollout_logprobs()), "tv", "topk")
    mask = mb.response_mask
    logp_a = logp.gather(-1, mb.tokens[..., None]).squeeze(-1)
    return {
        "mismatch/tv_mean": tv[mask].mean().item(),
        "mismatch/tv_max": tv[mask].max().item(),
        "mismatch/logp_abs": (logp_a - mb.logp)[mask].abs().mean().item(),
        "policy/entropy": -(p * logp).sum(-1)[mask].mean().item(),
    }


def topk_kind(cfg: Config) -> str:
    """The divergence ``tail_metrics`` compares the estimators with: the method's, TV for ppo_clip and pg_is."""
    return METHODS[cfg.method].kind or "tv"


@torch.no_grad()
def tail_metrics(cfg: Config, stats: pdmask.PolicyStats, advantages: Tensor, response_mask: Tensor) -> dict[str, float]:
    """How much the top-K predictive estimators' masks differ on one update, and the mass off S = TopK(μ) ∪ {a}.

    The masks are those of pdm_{aggregated,uniform,proportional,exactpi}_{kind} (``topk_kind``) with
    the run's thresholds, on the update's own statistics (they must carry μ's top K and ‖π‖², and for a TV kind
    the exactpi sums: ``need_exactpi=True``); they can
    only differ where π or μ keeps mass off S. ``topk/masks_differ_frac``: share of response tokens on
    which they do not all agree; ``topk/paper_tails_differ_frac``: on which the paper's aggregated-tail
    and uniform-tail masks differ; ``topk/vs_dppo_{estimator}_frac``: on which pdm_{estimator}_{kind} and
    dppo_topk_{kind} decide differently (the tokens where a PDM-vs-DPPO comparison can differ at all; the
    paper's is ``aggregated``); ``topk/pi_rest_mean`` / ``topk/mu_rest_mean``: mean π_R and μ_R.
    """
    kind = topk_kind(cfg)
    names = {e: f"pdm_{e}_{kind}" for e in TAIL_ESTIMATORS}
    keep = {
        e: pdmask.trust_region_mask(n, stats, advantages, response_mask, **cfg.replace(method=n).thresholds())
        for e, n in names.items()
    }
    valid = response_mask.bool()
    n = max(int(valid.sum()), 1)
    share = lambda x: (x & valid).sum().item() / n
    first = next(iter(keep.values()))
    dppo = f"dppo_topk_{kind}"
    dppo_keep = pdmask.trust_region_mask(dppo, stats, advantages, response_mask, **cfg.replace(method=dppo).thresholds())
    out = {
        "topk/masks_differ_frac": share(torch.stack([k != first for k in keep.values()]).any(0)),
        "topk/paper_tails_differ_frac": share(keep["aggregated"] != keep["uniform"]),
        **{f"topk/vs_dppo_{e}_frac": share(k != dppo_keep) for e, k in keep.items()},
        "topk/pi_rest_mean": stats.rest_mass[valid].sum().item() / n,
        "topk/mu_rest_mean": stats.rollout_rest_mass[valid].sum().item() / n,
    }
    return out


class Run:
    """The state of one run: config, task, trainer policy, rollout engine, optimizer, run directory."""

    def __init__(self, cfg: Config, run_dir: str | Path, resume: bool = False) -> None:
        self.cfg = cfg.validate()
        self.dir = Path(run_dir)
        self._check_dir(resume)
        torch.set_num_threads(cfg.threads)
        self.policy = initial_policy(cfg)
        # RL updates run without dropout (as verl and TRL do), so π and the engine's μ share one forward.
        self.policy.eval()
        self.task = build_task(cfg.task, tokenizer=getattr(self.policy, "tokenizer", None), **cfg.task_kwargs())
        V = self.policy.vocab_size
        if cfg.top_k > V:
            raise ConfigError(f"top_k: K = {cfg.top_k} is larger than the vocabulary ({V})")
        self.method = METHODS[cfg.method]
        # The backbone-aware masks read the LM head W [V, d] (logits = h Wᵀ); the others never need it.
        self.head_weight = self.policy.lm_head.weight if self.method.needs_head else None
        self.dir.mkdir(parents=True, exist_ok=True)
        write_text_atomic(self.dir / "config.json", jsonio.dumps(cfg.to_dict(), indent=2))
        if not is_pretrained(cfg.model) and cfg.sft_steps > 0 and not self.checkpoint_path.exists():
            warm_start(cfg, self.policy, self.task)
        return_full = self.method.needs == "full" or V * cfg.batch_size * self.task.max_new_tokens <= FULL_LOGP_BUDGET
        if cfg.engine == "vllm":
            from pdmask.lab.vllm_engine import VLLMEngine

            self.engine: RolloutEngine | VLLMEngine = VLLMEngine(self.policy, cfg.rollout_dtype, cfg.top_k, cfg.seed)
        else:
            self.engine = RolloutEngine(self.policy, cfg.rollout_dtype, cfg.top_k, return_full=return_full)
        self.optimizer = torch.optim.Adam(self.policy.parameters(), lr=cfg.lr, fused=True)
        self.step = 0
        # rollout_lag: the trainer's weights at the start of the last steps, oldest first (at most L).
        self.lagged: list[dict[str, Tensor]] = []
        restored = resume and self.checkpoint_path.exists()
        if restored:
            ckpt = torch.load(self.checkpoint_path, weights_only=True)
            self.policy.load_state_dict(ckpt["model"])
            self.optimizer.load_state_dict(ckpt["optimizer"])
            self.step = int(ckpt["step"])
            self.lagged = ckpt.get("lagged", [])
        # Rows up to the checkpoint are kept; later ones (and all, without a checkpoint) are redone.
        self._truncate_metrics(self.step if restored else -1)
        self.writer = None
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step drops events of the steps that are redone, so curves have no duplicates.
            self.writer = SummaryWriter(str(self.dir / "tb"), purge_step=self.step + 1 if restored else 0)

    # ------------------------------------------------------------------ run directory
    @property
    def checkpoint_path(self) -> Path:
        return self.dir / "checkpoint.pt"

    @property
    def metrics_path(self) -> Path:
        return self.dir / "metrics.jsonl"

    def _check_dir(self, resume: bool) -> None:
        """An existing run may only be resumed, and only with the same config."""
        config_path = self.dir / "config.json"
        if not config_path.exists():
            return
        if not resume:
            raise ConfigError(
                f"run directory {self.dir} already holds a run; pass --resume to continue it or choose another directory"
            )
        old, new = json.loads(config_path.read_text()), self.cfg.to_dict()
        if old != new:
            diff = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
            raise ConfigError(f"--resume: the config differs from the one in {config_path} in {', '.join(diff)}")

    def _truncate_metrics(self, last_step: int) -> None:
        """Keep complete rows up to last_step (a kill may leave later rows and a torn last line)."""
        if not self.metrics_path.exists():
            return
        kept = []
        for line in self.metrics_path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                break
            if row["step"] <= last_step:
                kept.append(line + "\n")
        write_text_atomic(self.metrics_path, "".join(kept))

    def _log(self, row: dict[str, Any]) -> None:
        with open(self.metrics_path, "a") as f:
            f.write(jsonio.dumps(row) + "\n")
        if self.writer is not None:
            for k, v in row.items():
                if k != "step" and isinstance(v, (int, float)) and math.isfinite(v):
                    self.writer.add_scalar(k, v, row["step"])
            self.writer.flush()

    def save_checkpoint(self) -> None:
        state = {
            "step": self.step,
            "model": self.policy.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "lagged": self.lagged,
        }
        save_atomic(state, self.checkpoint_path)

    # ------------------------------------------------------------------ RL
    def train_step(self) -> dict[str, float]:
        """One rollout batch and its minibatch updates; returns the step's metrics."""
        cfg, task = self.cfg, self.task
        t0 = time.perf_counter()
        g = step_generator(cfg.seed, self.step)
        problems = task.sample(cfg.prompts_per_step, g)
        self.engine.sync(self._rollout_weights())
        ro = self.engine.generate(
            [p.prompt_ids for p in problems],
            cfg.group_size,
            cfg.temperature,
            max_new_tokens=task.max_new_tokens,
            eos_id=task.eos_id,
            pad_id=task.pad_id,
            generator=g,
        )
        scores = [task.score(problems[i // cfg.group_size], resp) for i, resp in enumerate(ro.tokens.tolist())]
        rewards = torch.tensor([s for s, _ in scores])
        advantages = grpo_advantages(rewards, cfg.group_size)
        t_rollout = time.perf_counter() - t0

        metrics = {
            "reward/mean": rewards.mean().item(),
            "reward/correct": sum(ok for _, ok in scores) / len(scores),
            "response/length": ro.response_mask.sum(-1).float().mean().item(),
        }
        if cfg.mu == "recompute":
            mu = self._recomputed(ro)
        else:
            mu = ro.rollout_logprobs(with_full=self.method.needs == "full")

        updates = []
        for _ in range(cfg.epochs):
            for idx in torch.randperm(cfg.batch_size, generator=g).chunk(cfg.minibatches):
                mb = ro.select(idx)
                logits = mb.response_logits(self.policy) / cfg.temperature
                if not updates:  # before the step's first update: π at the start of the step, on its first minibatch
                    metrics |= mismatch_metrics(logits, mb)
                # One pass gives the loss, its metrics and the tail metrics (which compare the top-K estimators).
                stats = pdmask.policy_stats(
                    logits, mb.tokens, _select(mu, idx), need_sq_norm=True, need_exactpi=topk_kind(cfg) == "tv",
                    response_mask=mb.response_mask, head_weight=self.head_weight,
                )  # fmt: skip
                decision = pdmask.decide(self.method, stats, advantages[idx], mb.response_mask, **cfg.thresholds())
                loss = pdmask.aggregate_loss(pdmask.decision_loss(decision), mb.response_mask, cfg.agg)
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                # foreach: one fused pass over the gradients on CPU too (the same norm and scaling, bit for bit)
                grad_norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), cfg.grad_clip, foreach=True)
                self.optimizer.step()
                m = pdmask.mask_metrics(decision) | {"loss/policy": loss.item(), "grad/norm": grad_norm.item()}
                updates.append(m | tail_metrics(cfg, stats, advantages[idx], mb.response_mask))
        metrics |= pdmask.pool_metrics(updates, pdmask.FRACTION_DENOMINATORS | TAIL_DENOMINATORS)
        metrics["grad/max"] = max(u["grad/norm"] for u in updates)
        metrics["time/rollout"] = t_rollout
        metrics["time/step"] = time.perf_counter() - t0
        return metrics

    def _rollout_weights(self) -> nn.Module | dict[str, Tensor]:
        """What the engine samples this step with: the trainer now, or its weights rollout_lag steps ago."""
        lag = self.cfg.rollout_lag
        if lag == 0:
            return self.policy
        self.lagged.append({k: v.detach().clone() for k, v in self.policy.state_dict().items()})
        weights = self.lagged[0]  # the start of step max(0, step - lag)
        if len(self.lagged) > lag:  # no later step needs it
            self.lagged.pop(0)
        return weights

    @torch.no_grad()
    def _recomputed(self, ro: RolloutBatch) -> RolloutLogprobs:
        """μ = the trainer's π_old at the start of the step, from one forward over the whole batch."""
        logits = ro.response_logits(self.policy).float() / self.cfg.temperature
        return _recomputed_mu(torch.log_softmax(logits, dim=-1), ro.tokens, self.cfg.top_k)

    def _initial_evaluation(self) -> dict[str, float]:
        """Step 0's held-out metrics. From an SFT start every method of a seed starts from the same weights
        and draws the same evaluation stream, so they are computed once and cached beside the SFT weights."""
        cfg = self.cfg
        if is_pretrained(cfg.model) or cfg.sft_steps == 0:
            return self._evaluate()
        # Keyed by the run's seed too: seeds that share a warm start (sft_seed) draw their own evaluation streams.
        path = sft_path(cfg).with_suffix(f".eval-{cfg.reward}-{cfg.eval_samples}x-t{cfg.temperature:g}-s{cfg.seed}.json")
        if path.exists():
            return json.loads(path.read_text())
        metrics = self._evaluate()
        write_text_atomic(path, jsonio.dumps(metrics))
        return metrics

    def _evaluate(self) -> dict[str, float]:
        """Held-out metrics now; the sampled ones draw from their own stream, keyed by (seed, step)."""
        cfg = self.cfg
        g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + 500_000 + self.step)
        return evaluate(self.policy, self.task, samples=cfg.eval_samples, temperature=cfg.temperature, generator=g)

    def run(self, on_step: Callable[[int, dict[str, float]], None] | None = None) -> list[dict[str, Any]]:
        """Train until cfg.steps; returns all metrics rows of the run (including earlier sessions)."""
        cfg = self.cfg
        if self.step == 0:
            self._log({"step": 0} | self._initial_evaluation())
        while self.step < cfg.steps:
            metrics = self.train_step()
            self.step += 1
            if self.step % cfg.eval_every == 0 or self.step == cfg.steps:
                metrics |= self._evaluate()
            self._log({"step": self.step} | metrics)
            if self.step % cfg.checkpoint_every == 0 or self.step == cfg.steps:
                self.save_checkpoint()
            if on_step is not None:
                on_step(self.step, metrics)
        if self.writer is not None:
            self.writer.close()
        return read_metrics(self.dir)


def train(
    cfg: Config,
    run_dir: str | Path,
    resume: bool = False,
    on_step: Callable[[int, dict[str, float]], None] | None = None,
) -> list[dict[str, Any]]:
    """Run (or resume) one run; returns its metrics rows."""
    return Run(cfg, run_dir, resume=resume).run(on_step)


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def is_complete(run_dir: str | Path, cfg: Config) -> bool:
    """Whether run_dir holds this config's finished run."""
    rows = read_metrics(run_dir)
    config_path = Path(run_dir) / "config.json"
    return (
        bool(rows)
        and rows[-1]["step"] >= cfg.steps
        and config_path.exists()
        and json.loads(config_path.read_text()) == cfg.to_dict()
    )
