"""The top-K mode in verl's v1 trainer: ``trainer.v1.trainer_mode=pdmask_sync``.

verl's synchronous trainer (``PPOTrainerSync``, registered as ``sync``) with three changes, each through
verl's own extension points: ``rollout.name=vllm`` launches pdmask's vLLM server, which returns μ's
top K (verl's replica registry; the agent loop ``pdmask_topk_single_turn`` puts them in the batch);
after initialisation the actor's loss function becomes ``PDMLoss`` (``set_loss_fn`` on the worker
group); and every actor update carries the flag that makes the FSDP engine call it on the logits.
Binary methods need none of this: they run in verl's own trainer.
"""

from __future__ import annotations

from typing import Any

from verl.trainer.ppo.v1 import PPOTrainerSync, register_trainer
from verl.utils.config import omega_conf_to_dataclass

from pdmask.integrations.entries import check_logprobs_mode
from pdmask.integrations.verl.agent_loop import TOPK_AGENT_LOOP
from pdmask.integrations.verl.rollout import LOGPROBS_FIX, rollout_top_k
from pdmask.integrations.verl.topk import PROCESSOR_FLAG, PDMLoss

#: The ``trainer.v1.trainer_mode`` this module registers.
TRAINER_MODE = "pdmask_sync"


@register_trainer(TRAINER_MODE)
class PDMTrainerSync(PPOTrainerSync):
    """``PPOTrainerSync`` whose actor computes a top-K pdmask loss (``actor.policy_loss.loss_mode=pdmask_<method>``)."""

    def _setup(self) -> None:
        check_topk_rollout(self.config.actor_rollout_ref.rollout)
        from pdmask.integrations.verl.vllm_server import use_topk_replica  # imports vLLM

        use_topk_replica()
        super()._setup()

    def on_init_end(self) -> None:
        super().on_init_end()
        actor_config = omega_conf_to_dataclass(self.config.actor_rollout_ref.actor)
        top_k = rollout_top_k(self.config.actor_rollout_ref.rollout)
        self.actor_rollout_wg.set_loss_fn(PDMLoss(actor_config, top_k=top_k))

    def _update_actor(self, batch: Any, metrics: dict) -> Any:
        workers = self.actor_rollout_wg
        self.actor_rollout_wg = _FlaggedUpdates(workers)
        try:
            return super()._update_actor(batch, metrics)
        finally:
            self.actor_rollout_wg = workers


def check_topk_rollout(rollout: Any) -> None:
    """Refuses, with the override that fixes it, a rollout config that cannot bring μ's top K to the actor."""
    rollout_top_k(rollout)
    fixes = {
        "actor_rollout_ref.rollout.name=vllm (SGLang's server is not extended)": rollout.get("name") == "vllm",
        "actor_rollout_ref.rollout.calculate_log_probs=True": bool(rollout.get("calculate_log_probs")),
        f"actor_rollout_ref.rollout.agent.default_agent_loop={TOPK_AGENT_LOOP}": (
            (rollout.get("agent") or {}).get("default_agent_loop") == TOPK_AGENT_LOOP
        ),
        "actor_rollout_ref.rollout.disaggregation.enabled=False": not (rollout.get("disaggregation") or {}).get(
            "enabled", False
        ),
    }
    missing = [fix for fix, ok in fixes.items() if not ok]
    if missing:
        raise ValueError(f"trainer_mode=pdmask_sync needs the rollout's top K: set {'; '.join(missing)}.")
    check_logprobs_mode(rollout.get("logprobs_mode"), rollout.get("temperature"), fix=LOGPROBS_FIX)


class _FlaggedUpdates:
    """The actor worker group, with ``update_actor`` batches marked for the engine's logits-processor call.

    verl's ``_update_actor`` sets the flag itself (False unless top-K distillation is on) just before
    sending the batch; this sets it to True after that.
    """

    def __init__(self, workers: Any) -> None:
        self._workers = workers

    def __getattr__(self, name: str) -> Any:
        return getattr(self._workers, name)

    def update_actor(self, batch: Any) -> Any:
        batch.extra_info[PROCESSOR_FLAG] = True
        return self._workers.update_actor(batch)


__all__ = ["TRAINER_MODE", "PDMTrainerSync", "check_topk_rollout"]
