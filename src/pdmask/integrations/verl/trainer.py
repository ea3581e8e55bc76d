"""The top-K mode in verl's v1 trainer: ``trainer.v1.trainer_mode=pdmask_sync``.

verl's synchronous trainer (``PPOTrainerSync``, registered as ``sync``) with two changes, both through
verl's own extension points: after initialisation the actor's loss function becomes ``PDMLoss``
(``set_loss_fn`` on the worker group), and every actor update carries the flag that makes the FSDP
engine call it on the logits. Binary methods need none of this: they run in verl's own trainer.
"""

from __future__ import annotations

from typing import Any

from verl.trainer.ppo.v1 import PPOTrainerSync, register_trainer
from verl.utils.config import omega_conf_to_dataclass

from pdmask.integrations.verl.topk import PROCESSOR_FLAG, PDMLoss

#: The ``trainer.v1.trainer_mode`` this module registers.
TRAINER_MODE = "pdmask_sync"


@register_trainer(TRAINER_MODE)
class PDMTrainerSync(PPOTrainerSync):
    """``PPOTrainerSync`` whose actor computes a top-K pdmask loss (``actor.policy_loss.loss_mode=pdmask_<method>``)."""

    def on_init_end(self) -> None:
        super().on_init_end()
        actor_config = omega_conf_to_dataclass(self.config.actor_rollout_ref.actor)
        self.actor_rollout_wg.set_loss_fn(PDMLoss(actor_config))

    def _update_actor(self, batch: Any, metrics: dict) -> Any:
        workers = self.actor_rollout_wg
        self.actor_rollout_wg = _FlaggedUpdates(workers)
        try:
            return super()._update_actor(batch, metrics)
        finally:
            self.actor_rollout_wg = workers


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


__all__ = ["TRAINER_MODE", "PDMTrainerSync"]
