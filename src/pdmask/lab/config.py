"""Run configuration: one flat dataclass, validated before any work starts, and its parsing (files, ``--set``).

The sweeps over it and the named presets are in ``pdmask.lab.presets``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdmask import AGG_MODES, METHODS, method_thresholds
from pdmask.lab.engine import DTYPES, dtype_supported
from pdmask.lab.models import POLICY_NAMES, SIZES, is_pretrained
from pdmask.lab.tasks import TASK_NAMES


class ConfigError(ValueError):
    """A bad configuration, reported before any work starts."""


@dataclass(frozen=True)
class Config:
    """One lab run. ``Config()`` is a quick check on the tiny policy (lr 1e-4, exact reward: the earlier setting
    in which every mask only slows a collapse, docs/lab.md); the calibrated setting in which RL learns is
    ``pdmask.lab.presets.LEARNS``, the base of the ``sort`` and ``long`` presets; ``FORKS`` (LEARNS on ``class_sort``)
    is the base of ``default`` and ``tv``."""

    # What a sweep varies.
    method: str = "pdm_aggregated_kl"  # any key of pdmask.METHODS; default: the paper's configuration
    seed: int = 0
    model: str = "tiny"  # tiny | small | medium | smollm2-135m | hf:PATH
    rollout_dtype: str = "bf16"  # the rollout engine's precision: fp32 | bf16 | fp16 | fp8 (trainer: fp32)
    # Task.
    task: str = "sort"  # copy | reverse | sort | class_sort (TinyGPT) | arithmetic (pretrained chat models)
    task_length: int = 6
    num_symbols: int = 32
    class_size: int = 4  # class_sort: symbols per class (the symbols of a class may come in any order)
    reward: str = "exact"  # exact (0/1) | partial (share of positions right); sequence tasks
    max_operand: int = 50  # arithmetic: a + b with a, b in [0, max_operand]
    heldout_size: int = 256
    vocab_size: int = 512  # TinyGPT vocabulary (symbols use the first ids; the rest is the tail)
    # Rollout.
    top_k: int = 20  # top-K log-probs the engine returns (vLLM logprobs=K)
    temperature: float = 1.0
    mu: str = "rollout"  # rollout: the engine's log-probs | recompute: the trainer's pi_old (full)
    engine: str = "local"  # local: a copy of the policy in rollout_dtype | vllm: a real vLLM engine (pretrained models)
    # RL. The defaults (those of the default sweep) make staleness matter: 2 epochs x 8 minibatches
    # = 16 Adam steps per rollout batch, the last one 15 steps off-policy.
    steps: int = 150
    prompts_per_step: int = 16
    group_size: int = 8
    epochs: int = 2  # passes over each rollout batch
    minibatches: int = 8  # optimizer steps per pass: staleness = epochs * minibatches - 1 steps at most
    # Asynchronous RL: step t's rollouts come from the weights the trainer had at the start of step
    # t - rollout_lag (the SFT weights while t < rollout_lag), i.e. rollout_lag rollout batches and
    # rollout_lag * epochs * minibatches optimizer steps behind the first update of step t.
    rollout_lag: int = 0
    lr: float = 1e-4
    grad_clip: float = 1.0
    agg: str = "token-mean"
    # Thresholds shared by every method of a kind; None = the method's default (method.md).
    delta_tv: float | None = None
    delta_kl: float | None = None
    eps_low: float | None = None
    eps_high: float | None = None
    ratio_cap: float | None = None
    # Evaluation every eval_every steps (and at the start and the end): greedy held-out accuracy, and the
    # accuracy of eval_samples responses per held-out prompt sampled at the rollout temperature (0 = off).
    eval_every: int = 15
    eval_samples: int = 0
    # SFT warm start (TinyGPT only), cached on disk keyed by the fields it depends on.
    sft_steps: int = 200
    sft_lr: float = 3e-3
    sft_batch: int = 64
    # The warm start's seed (its init and data); None = the run's seed. A preset that sets it starts every
    # seed from one SFT checkpoint, as RL papers start every seed from one base model (with sft_steps = 0:
    # from one random init).
    sft_seed: int | None = None
    # Infrastructure.
    threads: int = 1  # torch threads for this run
    checkpoint_every: int = 1
    tensorboard: bool = True

    # ------------------------------------------------------------------ derived values
    @property
    def batch_size(self) -> int:
        return self.prompts_per_step * self.group_size

    def thresholds(self) -> dict[str, float]:
        """Keyword thresholds for pdmask.policy_loss (only those the method takes; None = default)."""
        m = METHODS[self.method]
        # The lab's shared fields per family: δ by divergence, ε for ppo_clip (pg_is reads neither).
        low, high = {"tv": (self.delta_tv,) * 2, "kl": (self.delta_kl,) * 2, None: (self.eps_low, self.eps_high)}[m.kind]
        return method_thresholds(m, low, high, self.ratio_cap, ignore_unused=True)

    def task_kwargs(self) -> dict[str, Any]:
        if self.task == "arithmetic":
            return {"max_operand": self.max_operand, "heldout_size": self.heldout_size}
        if self.task == "class_sort":
            return {"class_size": self.class_size} | self._sequence_kwargs()
        return self._sequence_kwargs()

    def _sequence_kwargs(self) -> dict[str, Any]:
        return {
            "length": self.task_length,
            "num_symbols": self.num_symbols,
            "reward": self.reward,
            "heldout_size": self.heldout_size,
        }

    def block_size(self) -> int:
        return self.task_length + 2 + self.task_length + 2  # prompt + longest response

    @property
    def warm_start_seed(self) -> int:
        """The seed of the SFT warm start: ``sft_seed``, or the run's seed."""
        return self.seed if self.sft_seed is None else self.sft_seed

    def sft_key(self) -> str:
        """Hash of everything the SFT warm start depends on (not the method, dtype or RL settings)."""
        keys = (
            "model",
            "task",
            "task_length",
            "num_symbols",
            "vocab_size",
            "sft_steps",
            "sft_lr",
            "sft_batch",
            "heldout_size",
        )
        keys += ("class_size",) if self.task == "class_sort" else ()  # the other tasks' warm starts keep their keys
        blob = json.dumps({"seed": self.warm_start_seed} | {k: getattr(self, k) for k in keys}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> Config:
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ validation
    def validate(self) -> Config:
        """Raise ConfigError naming the field for every bad setting; cheap (no model is built)."""

        def bad(msg: str) -> None:
            raise ConfigError(msg)

        if self.method not in METHODS:
            bad(f"method: unknown method {self.method!r}; choose one of {', '.join(METHODS)}")
        if self.model not in SIZES and self.model != "smollm2-135m" and not self.model.startswith("hf:"):
            bad(f"model: unknown policy {self.model!r}; choose one of {', '.join(POLICY_NAMES)}")
        if self.rollout_dtype not in DTYPES:
            bad(f"rollout_dtype: unknown precision {self.rollout_dtype!r}; choose one of {', '.join(DTYPES)}")
        if not dtype_supported(self.rollout_dtype):
            bad(f"rollout_dtype: {self.rollout_dtype} is not supported on this CPU/torch build")
        if self.task not in TASK_NAMES:
            bad(f"task: unknown task {self.task!r}; choose one of {', '.join(TASK_NAMES)}")
        if is_pretrained(self.model) != (self.task == "arithmetic"):
            bad(
                f"task: {self.task!r} does not fit model {self.model!r} "
                "(token tasks need tiny/small/medium; 'arithmetic' needs a pretrained model)"
            )
        if self.task != "arithmetic":
            if self.task == "class_sort" and not 1 <= self.class_size <= self.num_symbols:
                bad(f"class_size: must be between 1 and num_symbols ({self.num_symbols}), got {self.class_size}")
            if self.vocab_size < 4 + self.num_symbols:
                bad(f"vocab_size: {self.vocab_size} is too small for {self.num_symbols} symbols plus 4 special tokens")
            if self.top_k > self.vocab_size:
                bad(f"top_k: K = {self.top_k} is larger than the vocabulary ({self.vocab_size})")
            if self.task_length < 1 or self.num_symbols < 2:
                bad("task_length must be >= 1 and num_symbols >= 2")
            if self.num_symbols**self.task_length < 4 * self.heldout_size:
                bad(
                    f"heldout_size: {self.heldout_size} held-out prompts need a task space of at least 4x that "
                    f"({self.num_symbols}^{self.task_length})"
                )
        elif (self.max_operand + 1) ** 2 < 4 * self.heldout_size:
            bad(
                f"heldout_size: {self.heldout_size} held-out prompts need max_operand >= {math.isqrt(4 * self.heldout_size)}"
            )
        if self.reward not in ("partial", "exact"):
            bad(f"reward: must be 'partial' or 'exact', got {self.reward!r}")
        if self.top_k < 1:
            bad(f"top_k: must be >= 1, got {self.top_k}")
        if self.engine not in ("local", "vllm"):
            bad(f"engine: must be 'local' or 'vllm', got {self.engine!r}")
        if self.engine == "vllm":
            if not is_pretrained(self.model):
                bad(f"engine: vllm serves pretrained models (smollm2-135m, hf:PATH); {self.model!r} runs on engine=local")
            if self.rollout_dtype not in ("fp32", "bf16", "fp16"):
                bad(f"rollout_dtype: engine=vllm runs fp32, bf16 or fp16, not {self.rollout_dtype!r}")
            if METHODS[self.method].needs == "full" and self.mu == "rollout":
                bad(f"method: {self.method} needs all of μ but vLLM returns its top K; use mu=recompute or a top-K method")
        if self.mu not in ("rollout", "recompute"):
            bad(f"mu: must be 'rollout' or 'recompute', got {self.mu!r}")
        if self.agg not in AGG_MODES:
            bad(f"agg: must be one of {', '.join(AGG_MODES)}, got {self.agg!r}")
        if self.group_size < 2:
            bad(f"group_size: must be >= 2 (group-normalised advantages need a group), got {self.group_size}")
        for name in (
            "steps",
            "prompts_per_step",
            "epochs",
            "minibatches",
            "eval_every",
            "threads",
            "checkpoint_every",
            "heldout_size",
            "sft_batch",
        ):
            if getattr(self, name) < 1:
                bad(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.eval_samples < 0:
            bad(f"eval_samples: must be >= 0 (0 turns the sampled held-out accuracy off), got {self.eval_samples}")
        if self.sft_steps < 0:
            bad(f"sft_steps: must be >= 0, got {self.sft_steps}")
        if self.sft_seed is not None and self.sft_seed < 0:
            bad(f"sft_seed: must be >= 0, or unset for the run's own seed, got {self.sft_seed}")
        if self.rollout_lag < 0:
            bad(f"rollout_lag: must be >= 0 (rollout batches the engine's weights trail the trainer), got {self.rollout_lag}")
        if self.batch_size % self.minibatches:
            bad(
                f"minibatches: {self.minibatches} does not divide the batch of "
                f"{self.prompts_per_step} x {self.group_size} = {self.batch_size} sequences"
            )
        if not self.temperature > 0:
            bad(f"temperature: must be > 0, got {self.temperature}")
        for name in ("lr", "grad_clip", "sft_lr"):
            if not getattr(self, name) > 0:
                bad(f"{name}: must be > 0, got {getattr(self, name)}")
        for name in ("delta_tv", "delta_kl", "eps_low", "eps_high", "ratio_cap"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                bad(f"{name}: must be > 0 (or unset for the method default), got {value}")
        return self


def _coerce(name: str, raw: Any) -> Any:
    """A value from a file or ``--set key=value`` converted to the field's type."""
    fields = {f.name: f for f in dataclasses.fields(Config)}
    if name not in fields:
        raise ConfigError(f"{name}: unknown config field; known fields: {', '.join(fields)}")
    default = fields[name].default
    if not isinstance(raw, str):
        return raw
    if raw.lower() in ("none", "null") and (default is None or name.startswith(("delta", "eps", "ratio"))):
        return None
    try:
        if isinstance(default, bool):
            if raw.lower() not in ("true", "false", "1", "0"):
                raise ValueError
            return raw.lower() in ("true", "1")
        if isinstance(default, int):
            return int(raw)
        if isinstance(default, float) or default is None:
            return float(raw)
    except ValueError:
        raise ConfigError(
            f"{name}: cannot read {raw!r} as {type(default).__name__ if default is not None else 'float'}"
        ) from None
    return raw


def config_from(values: dict[str, Any], base: Config | None = None) -> Config:
    """A validated Config from a dict of field values over ``base`` (default: Config())."""
    base = base or Config()
    try:
        cfg = base.replace(**{k: _coerce(k, v) for k, v in values.items()})
    except TypeError as e:
        raise ConfigError(str(e)) from None
    return cfg.validate()


def load_config(path: str | Path, overrides: list[str] = ()) -> Config:
    """Read a .json or .toml config file, apply ``key=value`` overrides, validate."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"config file {path} does not exist")
    if path.suffix == ".toml":
        if sys.version_info < (3, 11):
            raise ConfigError("TOML configs need Python 3.11+; use a .json config")
        import tomllib

        values = tomllib.loads(path.read_text())
    elif path.suffix == ".json":
        values = json.loads(path.read_text())
    else:
        raise ConfigError(f"config file {path}: expected .json or .toml")
    return config_from({**values, **parse_overrides(overrides)})


def add_set_option(parser: Any, help: str) -> None:
    """The repeatable ``--set KEY=VALUE`` option of `pdmask train` and `pdmask compare`."""
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help=help)


def parse_seeds(spec: str) -> tuple[int, ...]:
    """``--seeds``: "N" (seeds 0..N-1), "A-B" (A..B inclusive) or a comma list "3,5,8"."""
    spec = str(spec).strip()
    try:
        if "," in spec:
            seeds = tuple(int(x) for x in spec.split(",") if x.strip())
        elif "-" in spec.lstrip("-"):
            lo, hi = (int(x) for x in spec.split("-", 1))
            seeds = tuple(range(lo, hi + 1))
        else:
            seeds = tuple(range(int(spec)))
    except ValueError:
        raise ConfigError(f"--seeds {spec!r}: expected N, A-B or a comma list such as 3,5,8") from None
    if not seeds or min(seeds) < 0:
        raise ConfigError(f"--seeds {spec!r}: give at least one seed, none negative")
    return seeds


def parse_overrides(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--set {item!r}: expected key=value")
        out[key.strip()] = value.strip()
    return out
