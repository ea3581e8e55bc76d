"""DPPO and predictive divergence masks in TRL's ``GRPOTrainer`` (``pip install pdmask[trl]``).

``PDMConfig`` adds one choice, ``mask_method`` (any name in ``pdmask.METHODS``), to TRL's ``GRPOConfig``;
``PDMTrainer`` is TRL's ``GRPOTrainer`` with that trust region. Datasets, rewards, advantages, loss
aggregation, KL and entropy terms, logging and distribution all stay TRL's. What it adds:

- rollout side: with TRL's transformers ``generate``, a forward hook on the policy records at every step
  log μ(a) and the top-K log-probs of μ = softmax(z/τ) (or all of μ for the ``*_full`` methods); with
  ``use_vllm=True``, TRL's vLLM generation is asked for ``logprobs=K`` (processed log-probs) and
  ``pdmask.integrations.logprob_lists.completions_from_lists`` reads log μ(a) and μ's top K from its answer;
- loss side: in the scoring forward TRL already runs, ‖π‖² comes from TRL's fused LM head
  (``log_sum_sq_probs``) and π at S = TopK(μ) ∪ {a} from K+1 gathered rows of the LM head, so no
  [batch, length, vocab] tensor is built. pdmask computes the mask M and the per-token weight
  w = M·sg(min(r, c))·A of its surrogate; TRL's own loss then receives the per-token advantage
  w / r with the rollout log-probs as old log-probs and its PPO clip switched off, so the gradient
  TRL applies is exactly −w·∇log π(a), the gradient of pdmask's DPPO-form surrogate.

Overridden ``GRPOTrainer`` methods (each calls TRL's own): ``_generate_and_score_completions``,
``_compute_loss`` and ``_get_per_token_logps_and_entropies``; with vLLM, the instance's
``vllm_generation.generate`` is wrapped.

Modules: ``config`` (``PDMConfig``), ``trainer`` (``PDMTrainer``), ``recorders`` (μ from TRL's
``generate`` or its vLLM generation) and ``lm_head`` (the LM head's weights and rows, and what the
scoring forward computes besides log π(a)). TRL's version is checked when this package is imported.
"""

from __future__ import annotations

from pdmask.integrations._version import SUPPORTED, in_range

#: TRL releases this integration was written and tested against: [TRL_MIN, TRL_MAX).
TRL_MIN, TRL_MAX = SUPPORTED["trl"]


def check_trl_version(version: str) -> None:
    """Raises ImportError unless ``version`` lies in [TRL_MIN, TRL_MAX)."""
    if not in_range(version, TRL_MIN, TRL_MAX):
        raise ImportError(
            f"pdmask.integrations.trl supports TRL >={TRL_MIN},<{TRL_MAX} but TRL {version} is installed. It overrides "
            "private GRPOTrainer methods, which change between releases: install a supported TRL with "
            "`pip install 'pdmask[trl]'`."
        )


try:
    import trl
except ImportError as err:  # pragma: no cover - exercised only without the extra
    raise ImportError("pdmask.integrations.trl needs TRL: `pip install 'pdmask[trl]'`.") from err
check_trl_version(trl.__version__)

from pdmask.integrations.logprob_lists import VLLM_MAX_LOGPROBS
from pdmask.integrations.trl.config import LOSS_TYPES, PDMConfig
from pdmask.integrations.trl.trainer import PDMTrainer

__all__ = ["LOSS_TYPES", "TRL_MAX", "TRL_MIN", "VLLM_MAX_LOGPROBS", "PDMConfig", "PDMTrainer", "check_trl_version"]
