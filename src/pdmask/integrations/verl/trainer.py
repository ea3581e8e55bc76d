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

from pdmask.integrations.logprob_lists import check_logprobs_mode
from pdmask.integrations.verl.agent_loop import TOPK_AGENT_LOOP
from pdmask.integrations.verl.cpu import on_cpu_platform, use_host_weight_sync
from pdmask.integrations.verl.cpu_attention import ATTENTION as CPU_ATTENTION
from pdmask.integrations.verl.losses import loss_name, method_of
from pdmask.integrations.verl.rollout import LOGPROBS_FIX, rollout_top_k
from pdmask.integrations.verl.topk import PROCESSOR_FLAG, TOPK_METHODS, PDMLoss

#: The ``trainer.v1.trainer_mode`` this module registers.
TRAINER_MODE = "pdmask_sync"


@register_trainer(TRAINER_MODE)
class PDMTrainerSync(PPOTrainerSync):
    """``PPOTrainerSync`` whose actor computes a top-K pdmask loss (``actor.policy_loss.loss_mode=pdmask_<method>``)."""

    def _build_replay_buffer(self) -> Any:
        # verl's base trainer picks the synchronous replay buffer, checkpoint contents and refill rules by the
        # mode's name, "sync" (its __init__ calls this right after reading the name): this mode is verl's sync.
        self.trainer_mode = "sync"
        return super()._build_replay_buffer()

    def _setup(self) -> None:
        check_topk_config(self.config)
        from pdmask.integrations.verl.vllm_server import use_topk_replica  # imports vLLM

        use_topk_replica()
        if on_cpu_platform():  # verl's shared-memory weight sync fails on the CPU; pdmask's host-tensor one instead
            use_host_weight_sync()
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


def check_topk_config(config: Any) -> None:
    """Refuses, before anything starts, a config whose top-K path cannot work: one line naming each override.

    Checked: a top-K ``loss_mode``; logits the loss can read (no fused kernels); a rollout that
    brings μ's top K (pdmask's vLLM server, not a custom one, with a cap of at least K; the top-K agent loop;
    log-probs of the sampled distribution). K itself is one setting, ``rollout.custom.pdmask_top_k``, read by
    the server, the agent loop and ``PDMLoss`` alike.
    """
    ref = config.actor_rollout_ref
    rollout, actor = ref.rollout, ref.actor
    top_k = rollout_top_k(rollout)
    mode = (actor.get("policy_loss") or {}).get("loss_mode")
    method = method_of(mode)
    if method is None or method.name not in TOPK_METHODS:
        modes = ", ".join(sorted(loss_name(m) for m in TOPK_METHODS))
        raise ValueError(
            f"trainer_mode=pdmask_sync runs the top-K methods; actor_rollout_ref.actor.policy_loss.loss_mode is "
            f"{mode!r}: set it to one of {modes} (binary methods run in verl's own trainer_mode=sync)."
        )
    max_logprobs = ((rollout.get("engine_kwargs") or {}).get("vllm") or {}).get("max_logprobs")
    fixes = {
        "actor_rollout_ref.model.use_fused_kernels=False (fused kernels never materialise the logits PDMLoss reads)": (
            not ref.model.get("use_fused_kernels", False)
        ),
        "actor_rollout_ref.rollout.name=vllm (SGLang's server is not extended)": rollout.get("name") == "vllm",
        "actor_rollout_ref.rollout.agent.custom_async_server.path=null (pdmask's vLLM server returns the top K)": not (
            ((rollout.get("agent") or {}).get("custom_async_server") or {}).get("path")
        ),
        f"actor_rollout_ref.rollout.engine_kwargs.vllm.max_logprobs>={top_k} (the server's cap, below K)": (
            max_logprobs is None or max_logprobs >= top_k
        ),
        "actor_rollout_ref.rollout.calculate_log_probs=True": bool(rollout.get("calculate_log_probs")),
        f"actor_rollout_ref.rollout.agent.default_agent_loop={TOPK_AGENT_LOOP}": (
            (rollout.get("agent") or {}).get("default_agent_loop") == TOPK_AGENT_LOOP
        ),
        "actor_rollout_ref.rollout.disaggregation.enabled=False": not (rollout.get("disaggregation") or {}).get(
            "enabled", False
        ),
    }
    if actor.get("ulysses_sequence_parallel_size", 1) > 1:
        attention = (ref.model.get("override_config") or {}).get("attn_implementation", "flash_attention_2")
        cpu = on_cpu_platform()
        fixes[
            f"+actor_rollout_ref.model.override_config.attn_implementation="
            f"{CPU_ATTENTION if cpu else 'flash_attention_2'} (Ulysses sequence parallelism needs an "
            f"attention that gathers the sequence; {attention} does not" + (" on the CPU)" if cpu else ")")
        ] = gathers_sequence(attention, cpu)
    missing = [fix for fix, ok in fixes.items() if not ok]
    if missing:
        raise ValueError(f"trainer_mode=pdmask_sync needs μ's top K in the actor's loss: set {'; '.join(missing)}.")
    check_logprobs_mode(rollout.get("logprobs_mode"), rollout.get("temperature"), fix=LOGPROBS_FIX)


def gathers_sequence(attention: str, cpu: bool) -> bool:
    """Whether ``attn_implementation=attention`` runs Ulysses' all-to-all (``cpu``: on ``CPUPlatform``). verl puts
    it into transformers' flash-attention path (``_flash_attention_forward``, ``verl/models/transformers/monkey_patch.py``):
    every attention that goes through transformers' ``flash_attention_forward`` (flash-attn 2, 3, 4). Any other
    attention would attend within the rank's slice of the sequence, silently. On the CPU, flash-attn has no build;
    ``pdmask_cpu_varlen`` does the same all-to-all there."""
    if cpu:
        return attention == CPU_ATTENTION
    from transformers import AttentionInterface
    from transformers.integrations.flash_attention import flash_attention_forward

    registry = AttentionInterface()
    return attention in registry and registry[attention] is flash_attention_forward


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


__all__ = ["TRAINER_MODE", "PDMTrainerSync", "check_topk_config", "gathers_sequence"]
