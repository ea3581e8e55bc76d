"""The settings of one analysis run (``pdmask analyze``), validated before any model is built."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from pdmask import METHODS
from pdmask.estimators import KINDS

SOURCES = ("mismatch", "stale", "both")
#: Settings a rerun may change without starting over: they only say when to stop.
STOPPING = ("rounds", "target_disagreements")


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



def config_dict(cfg: AnalysisConfig) -> dict:
    """The config as plain JSON values."""
    d = asdict(cfg)
    d["ks"] = list(cfg.ks)
    return d

