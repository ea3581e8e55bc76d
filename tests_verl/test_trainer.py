"""trainer.v1.trainer_mode=pdmask_sync: registered with verl's v1 trainer; actor updates carry the processor flag."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from pdmask.integrations.verl import PDMLoss

from conftest import DELTA, TAU, K, engine_data

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


def test_trainer_mode_trains_through_verls_training_worker(model_dir, rollout_batch):
    """on_init_end and _update_actor of PDMTrainerSync against verl's own TrainingWorker (called directly, no Ray):
    the loss function it sets and the non-tensor keys it sends (as verl's TransferQueue layer applies them)."""
    from verl.utils import tensordict_utils as tu

    from pdmask.integrations.verl.trainer import PDMTrainerSync
    from pdmask.testing.verl import build_training_worker

    worker = build_training_worker(model_dir, use_remove_padding=True)
    batch, _ = rollout_batch
    metrics_sent = []

    class Workers:  # the actor worker group: set_loss_fn and update_actor, as ActorRolloutRefWorker forwards them
        def set_loss_fn(self, loss_fn):
            worker.set_loss_fn(loss_fn)

        def update_actor(self, meta):
            data = engine_data(batch, rmpad=True, flag=False)
            tu.assign_non_tensor(data, **meta.extra_info)
            out = tu.get(worker.train_mini_batch(data), "metrics")
            metrics_sent.append(out)
            return {"metrics": out}

    trainer = PDMTrainerSync.__new__(PDMTrainerSync)
    trainer.config = OmegaConf.create(
        {
            "actor_rollout_ref": {
                "actor": {
                    "_target_": "verl.workers.config.ActorConfig",
                    "strategy": "fsdp2",
                    "rollout_n": 2,
                    "ppo_mini_batch_size": 2,
                    "ppo_micro_batch_size_per_gpu": 2,
                    "clip_ratio_low": DELTA,
                    "clip_ratio_high": DELTA,
                    "policy_loss": {
                        "_target_": "verl.workers.config.PolicyLossConfig",
                        "loss_mode": "pdmask_pdm_proportional_tv",
                    },
                    "calculate_entropy": False,
                    "entropy_coeff": 0.0,
                    "ppo_epochs": 1,
                    "data_loader_seed": 0,
                    "shuffle": False,
                },
                "rollout": {"n": 2, "temperature": TAU, "custom": {"pdmask_top_k": K}},
            }
        }
    )
    trainer.checkpoint_manager = SimpleNamespace(update_weights=lambda step: None)
    trainer.global_steps = 0
    trainer.actor_rollout_wg = Workers()
    trainer.on_init_end()
    assert isinstance(worker.loss_fn, PDMLoss) and worker.loss_fn.method.name == "pdm_proportional_tv" and worker.loss_fn.top_k == K
    metrics: dict = {}
    trainer._update_actor(SimpleNamespace(extra_info={}), metrics)
    assert 0 < metrics["actor/pdmask/mask/dropped_frac"] < 1
    assert metrics["actor/pg_loss"] == pytest.approx(metrics["actor/loss"])  # no entropy or KL term
    assert len(metrics_sent) == 1 and metrics["actor/loss"] != 0
