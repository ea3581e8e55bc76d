"""trainer.v1.trainer_mode=pdmask_sync: registered with verl's v1 trainer; actor updates carry the processor flag."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

v1 = pytest.importorskip(
    "verl.trainer.ppo.v1", reason="verl's v1 trainer needs TransferQueue, FastAPI, ... (.ci/verl.sh)"
)


def test_registered_as_a_verl_trainer_mode():
    from pdmask.integrations.verl.trainer import PDMTrainerSync

    assert v1.get_trainer_cls("pdmask_sync") is PDMTrainerSync
    assert issubclass(PDMTrainerSync, v1.PPOTrainerSync)


def test_actor_updates_carry_the_processor_flag():
    from pdmask.integrations.verl.trainer import PDMTrainerSync

    sent = []

    class Workers:
        def update_actor(self, batch):
            sent.append(dict(batch.extra_info))
            return {"metrics": {"mfu": 0.5, "pg_loss": 1.0}}

    trainer = PDMTrainerSync.__new__(PDMTrainerSync)
    trainer.config = OmegaConf.create(
        {
            "actor_rollout_ref": {
                "actor": {
                    "calculate_entropy": False,
                    "entropy_coeff": 0.0,
                    "ppo_mini_batch_size": 2,
                    "ppo_epochs": 1,
                    "data_loader_seed": 0,
                    "shuffle": False,
                },
                "rollout": {"n": 2, "temperature": 1.0},
            }
        }
    )
    trainer.actor_rollout_wg = workers = Workers()
    metrics: dict = {}
    trainer._update_actor(SimpleNamespace(extra_info={}), metrics)
    assert sent == [sent[0]] and sent[0]["distillation_use_topk"] is True and sent[0]["distillation_only"] is False
    assert trainer.actor_rollout_wg is workers
    assert metrics["perf/mfu/actor"] == 0.5
