#!/usr/bin/env bash
# GRPO on GSM8K with Qwen2.5-0.5B-Instruct on one GPU, trust region = a pdmask mask (default: DPPO binary TV).
# NOT RUN on a GPU in pdmask's CI or by its authors (no GPU there); it follows verl 0.9.1's own GSM8K GRPO recipe.
# CI composes and validates its configuration with verl's own Hydra config code (tests_verl/test_e2e_config.py),
# and examples/verl_cpu_e2e.sh runs the top-K path on CPU.
# Setup: pip install 'pdmask[verl]' 'verl[vllm]==0.9.1'
#        python examples/data_preprocess/gsm8k.py --local_save_dir ~/data/gsm8k   (in a clone of verl v0.9.1; not in the wheel)
# pdmask registers its losses when verl is imported (entry point group verl.plugins): no code to add.
set -euo pipefail
DATA=${DATA:-$HOME/data/gsm8k}
METHOD=${METHOD:-dppo_binary_tv}   # pdmask_<METHOD>: ppo_clip, pg_is, dppo_binary_{tv,kl}, or a top-K one: pdm_*, dppo_topk_*
DELTA=${DELTA:-0.15}               # δ_TV (use 0.05 for the KL methods); ε for ppo_clip
K=${K:-20}                         # top-K methods: μ's top log-probs per token from vLLM (its default cap is 20)

TOPK=()
case "$METHOD" in
  ppo_clip | pg_is | dppo_binary_*) ;;  # binary methods: verl's own trainer, nothing more
  *) TOPK=(                          # top-K methods: pdmask's trainer mode, vLLM server and agent loop (docs/verl.md)
      trainer.v1.trainer_mode=pdmask_sync
      actor_rollout_ref.model.use_fused_kernels=False
      actor_rollout_ref.rollout.agent.default_agent_loop=pdmask_topk_single_turn
      "+actor_rollout_ref.rollout.custom.pdmask_top_k=$K") ;;
esac

python3 -m verl.trainer.main_ppo \
    algorithm.adv_estimator=grpo \
    algorithm.rollout_correction.bypass_mode=True \
    data.train_files="$DATA/train.parquet" \
    data.val_files="$DATA/test.parquet" \
    data.train_batch_size=64 \
    data.max_prompt_length=512 \
    data.max_response_length=512 \
    actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct \
    actor_rollout_ref.model.use_remove_padding=True \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.actor.ppo_mini_batch_size=16 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8 \
    actor_rollout_ref.actor.policy_loss.loss_mode="pdmask_${METHOD}" \
    actor_rollout_ref.actor.clip_ratio_low="$DELTA" \
    actor_rollout_ref.actor.clip_ratio_high="$DELTA" \
    actor_rollout_ref.actor.clip_ratio_c=10.0 \
    actor_rollout_ref.actor.loss_agg_mode=token-mean \
    actor_rollout_ref.actor.use_kl_loss=False \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.n=8 \
    actor_rollout_ref.rollout.calculate_log_probs=True \
    actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.5 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16 \
    trainer.n_gpus_per_node=1 \
    trainer.nnodes=1 \
    trainer.total_epochs=3 \
    trainer.logger='["console"]' \
    trainer.project_name=pdmask \
    trainer.experiment_name="gsm8k_qwen0.5b_${METHOD}" "${TOPK[@]}" "$@"
