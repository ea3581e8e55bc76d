#!/usr/bin/env bash
# verl's own trainer (python -m verl.trainer.main_ppo, unchanged) with a top-K predictive mask on CPU: Ray, pdmask's
# top-K vLLM server (a real CPU vLLM engine), the pdmask_topk_single_turn agent loop, TransferQueue, verl's FSDP2
# actor with PDMLoss, verl's weight sync into vLLM after every update (on the CPU through pdmask's host-tensor
# transfer, pdmask.integrations.verl.cpu_weights), a checkpoint at step 2 and a resumed step 3; with SP=2, Ulysses
# sequence parallelism over two actor processes. Exit status 0 when the run and the checks pass; prints each step's
# metrics and the final metrics line. Environment: .ci/verl.sh (install lines in docs/verl.md).
#   [SP=2] bash examples/verl_cpu_e2e.sh [WORKDIR]      (default: a temporary folder, removed at the end)
set -euo pipefail
cd "$(dirname "$0")/.."
LOSS_MODE=${LOSS_MODE:-pdmask_pdm_aggregated_kl}   # any top-K pdmask method: pdmask_pdm_*, pdmask_dppo_topk_*
K=${K:-8}                                          # μ's top K per token, from vLLM to the loss
SP=${SP:-1}                                        # Ulysses sequence-parallel size: SP actor processes in one group
WORK=${1:-}
if [[ -z "$WORK" ]]; then WORK="$(mktemp -d)"; trap 'rm -rf "$WORK"' EXIT; fi
mkdir -p "$WORK"

# The CPU shim (docs/verl.md): pdmask's verl platform in every process (Ray workers inherit the environment), verl's
# FSDP engine class (registered for cuda/npu only, device-agnostic) and vLLM's CPU KV cache size (GiB); below, logical
# Ray GPUs as worker slots, the workers' gloo group, SDPA attention (pdmask's packed-sequence attention with verl's
# Ulysses all-to-all when SP > 1, pdmask.integrations.verl.cpu_attention), vLLM without sleep mode.
export VERL_PLATFORM=pdmask_cpu VERL_ENGINE_DEVICE=cuda VLLM_CPU_KVCACHE_SPACE=1
export PDMASK_VERL_RECORD="$WORK/record"           # the server and PDMLoss record μ's top K for the checks
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=1
python examples/verl_cpu_e2e.py prepare "$WORK"
export PYTHONPATH="$WORK/shim${PYTHONPATH:+:$PYTHONPATH}"   # the `vllm` distribution record prepare wrote, if needed

if [[ "$SP" == 1 ]]; then ATTENTION=sdpa; else ATTENTION=pdmask_cpu_varlen; fi

train() {  # train STEPS LOG: verl's entry point, resuming from $WORK/ckpt when a checkpoint is there
  local start=$SECONDS
  PDMASK_VERL_STEPS="$1" timeout 900 python -m verl.trainer.main_ppo \
    trainer.v1.trainer_mode=pdmask_sync \
    algorithm.adv_estimator=grpo \
    algorithm.rollout_correction.bypass_mode=True \
    data.train_files="$WORK/train.parquet" \
    data.val_files="$WORK/val.parquet" \
    data.train_batch_size=4 \
    data.max_prompt_length=16 \
    data.max_response_length=8 \
    data.dataloader_num_workers=0 \
    data.shuffle=False \
    actor_rollout_ref.model.path="$WORK/model" \
    actor_rollout_ref.model.use_remove_padding=True \
    actor_rollout_ref.model.use_fused_kernels=False \
    +actor_rollout_ref.model.override_config.attn_implementation="$ATTENTION" \
    actor_rollout_ref.actor.ulysses_sequence_parallel_size="$SP" \
    actor_rollout_ref.actor.strategy=fsdp2 \
    actor_rollout_ref.actor.optim.lr=1e-2 \
    actor_rollout_ref.actor.ppo_mini_batch_size=2 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 \
    actor_rollout_ref.actor.policy_loss.loss_mode="$LOSS_MODE" \
    actor_rollout_ref.actor.clip_ratio_low=0.005 \
    actor_rollout_ref.actor.clip_ratio_high=0.005 \
    actor_rollout_ref.actor.clip_ratio_c=10.0 \
    actor_rollout_ref.actor.use_kl_loss=False \
    actor_rollout_ref.actor.use_torch_compile=False \
    actor_rollout_ref.actor.fsdp_config.use_torch_compile=False \
    +actor_rollout_ref.actor.fsdp_config.mixed_precision='{param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}' \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.n=2 \
    actor_rollout_ref.rollout.temperature=1.0 \
    actor_rollout_ref.rollout.calculate_log_probs=True \
    actor_rollout_ref.rollout.agent.default_agent_loop=pdmask_topk_single_turn \
    actor_rollout_ref.rollout.agent.num_workers=1 \
    +actor_rollout_ref.rollout.custom.pdmask_top_k="$K" \
    actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
    actor_rollout_ref.rollout.dtype=float32 \
    actor_rollout_ref.rollout.enforce_eager=True \
    actor_rollout_ref.rollout.free_cache_engine=False \
    +actor_rollout_ref.rollout.enable_sleep_mode=False \
    actor_rollout_ref.rollout.load_format=auto \
    actor_rollout_ref.rollout.max_model_len=64 \
    actor_rollout_ref.rollout.max_num_seqs=8 \
    actor_rollout_ref.rollout.max_num_batched_tokens=512 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4 \
    reward.num_workers=1 \
    reward.custom_reward_function.path=examples/verl_cpu_e2e.py \
    reward.custom_reward_function.name=compute_score \
    transfer_queue.backend.SimpleStorage.num_data_storage_units=1 \
    trainer.device=cpu \
    trainer.n_gpus_per_node="$SP" \
    trainer.nnodes=1 \
    trainer.total_training_steps="$1" \
    trainer.save_freq=2 \
    trainer.test_freq=-1 \
    trainer.val_before_train=False \
    trainer.logger='["console"]' \
    trainer.project_name=pdmask \
    trainer.experiment_name=verl_cpu_e2e \
    trainer.default_local_dir="$WORK/ckpt" \
    trainer.resume_mode=auto \
    hydra.run.dir="$WORK/hydra" \
    ray_kwargs.ray_init.num_cpus=8 \
    +ray_kwargs.ray_init.num_gpus="$SP" \
    +ray_kwargs.ray_init.runtime_env.worker_process_setup_hook=pdmask.testing.verl_record.worker_setup \
    +ray_kwargs.ray_init.include_dashboard=False >"$2" 2>&1 || { tail -n 60 "$2"; echo "verl run failed: see $2" >&2; return 1; }
  echo "verl run to step $1: $((SECONDS - start)) s"
}

train 2 "$WORK/run1.log"                               # steps 1 and 2; checkpoint at step 2
test -d "$WORK/ckpt/global_step_2/actor" || { echo "no checkpoint at step 2 in $WORK/ckpt" >&2; exit 1; }
train 3 "$WORK/run2.log"                               # a new process: resumes from step 2, runs step 3
grep -q "Resuming from .*global_step_2" "$WORK/run2.log" || { echo "run 2 did not resume from step 2" >&2; exit 1; }
python examples/verl_cpu_e2e.py check "$WORK" "$K" "$SP" "$LOSS_MODE" "$WORK/run1.log" "$WORK/run2.log"
