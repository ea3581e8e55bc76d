"""CPU smoke run of the verl integration: three ``train_batch`` steps of verl's own FSDP engine with ``pdm_proportional_tv``.

One process, gloo, world size 1, a random 2-layer Llama. The rollout policy μ samples 4 prompts × 4
completions at τ = 0.8 and records its top-K (what pdmask's vLLM adapter would return); verl's GRPO
advantage function scores them; the engine then takes three optimizer steps on the same batch, so the
later steps are off-policy and the mask has tokens to drop. Run: ``python examples/verl_cpu_smoke.py``
in an environment with ``pdmask[verl]``.
"""

from __future__ import annotations

import tempfile
import time
from types import SimpleNamespace

import numpy as np
import torch
from tensordict import TensorDict
from transformers import AutoModelForCausalLM
from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage
from verl.utils import tensordict_utils as tu
from verl.workers.config import ActorConfig, PolicyLossConfig
from verl.workers.utils.padding import left_right_2_no_padding

from pdmask import RolloutLogprobs
from pdmask.integrations.verl import PDMLoss, enable_topk_forward
from pdmask.integrations.verl.rollout import topk_batch_fields
from pdmask.testing.verl import build_actor_engine, padded_batch, save_tiny_llama

METHOD, K, TAU, RESPONSE_LENGTH, GROUPS, GROUP_SIZE = "pdm_proportional_tv", 8, 0.8, 6, 4, 4


def sample(model, prompts: list[list[int]], generator: torch.Generator) -> SimpleNamespace:
    """μ = softmax(z / τ) of ``model``: completions of RESPONSE_LENGTH tokens with log μ(a) and μ's top K."""
    tokens, logps, top_ids, top_logps = [], [], [], []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        rows = []
        with torch.no_grad():
            for _ in range(RESPONSE_LENGTH):
                logp = torch.log_softmax(model(input_ids=ids).logits[0, -1] / TAU, -1)
                token = torch.multinomial(logp.exp(), 1, generator=generator)
                rows.append((token.item(), logp[token].item(), *logp.topk(K)[::-1]))
                ids = torch.cat([ids, token[None]], 1)
        tokens.append([r[0] for r in rows])
        logps.append([r[1] for r in rows])
        top_ids.append(torch.stack([r[2] for r in rows]))
        top_logps.append(torch.stack([r[3] for r in rows]))
    mask = torch.ones(len(prompts), RESPONSE_LENGTH, dtype=torch.bool)
    rollout = RolloutLogprobs(torch.tensor(logps), torch.stack(top_ids), torch.stack(top_logps))
    return SimpleNamespace(tokens=torch.tensor(tokens), rollout=rollout, response_mask=mask)


def main(model_dir: str) -> None:
    start = time.time()
    generator = torch.Generator().manual_seed(0)
    save_tiny_llama(model_dir)
    engine = build_actor_engine(model_dir, use_remove_padding=True, lr=0.1)
    rollout_policy = AutoModelForCausalLM.from_pretrained(model_dir)

    prompts = [torch.randint(4, 64, (int(n),), generator=generator).tolist() for n in torch.randint(2, 6, (GROUPS,))]
    prompts = [p for p in prompts for _ in range(GROUP_SIZE)]
    completions = sample(rollout_policy, prompts, generator)
    reward = (completions.tokens % 2 == 0).float().mean(-1)  # toy task: even token ids
    batch = padded_batch(prompts, completions.tokens.tolist(), **topk_batch_fields(completions, RESPONSE_LENGTH))
    token_rewards = torch.zeros(len(prompts), RESPONSE_LENGTH)
    token_rewards[:, -1] = reward
    index = np.repeat(np.arange(GROUPS), GROUP_SIZE)
    advantages, _ = compute_grpo_outcome_advantage(token_rewards, batch["response_mask"], index)
    batch |= {"old_log_probs": batch["rollout_log_probs"], "advantages": advantages}

    config = ActorConfig(
        strategy="fsdp2",
        rollout_n=GROUP_SIZE,
        ppo_micro_batch_size_per_gpu=8,
        clip_ratio_low=0.05,  # δ: small, so that the toy run's second and third steps drop tokens
        clip_ratio_high=0.05,
        clip_ratio_c=10.0,
        policy_loss=PolicyLossConfig(loss_mode=f"pdmask_{METHOD}"),
    )
    loss_fn = PDMLoss(config, top_k=K)
    print(f"setup {time.time() - start:.1f}s; reward mean {reward.mean():.3f}; method {METHOD}, K = {K}")
    for step in (1, 2, 3):
        data = left_right_2_no_padding(TensorDict(dict(batch), batch_size=[len(prompts)]))
        tu.assign_non_tensor(
            data,
            temperature=TAU,
            use_remove_padding=True,
            use_dynamic_bsz=False,
            micro_batch_size_per_gpu=8,
            use_fused_kernels=False,
            global_batch_size=len(prompts),
        )
        out = engine.train_batch(enable_topk_forward(data), loss_function=loss_fn)
        m = {key: value.aggregate() if hasattr(value, "aggregate") else value for key, value in out["metrics"].items()}
        print(
            f"step {step}: loss {sum(out['loss']):+.4f}  grad_norm {float(m['grad_norm']):.3f}  "
            f"dropped {m['actor/pdmask/mask/dropped_frac']:.3f} (A>0 {m['actor/pdmask/mask/dropped_frac_pos']:.3f}, "
            f"A<0 {m['actor/pdmask/mask/dropped_frac_neg']:.3f})  TV mean {m['actor/pdmask/div/mean']:.4f}  "
            f"ratio max {m['actor/pdmask/ratio/max']:.3f}  [{time.time() - start:.1f}s]"
        )
    print(f"done in {time.time() - start:.1f}s")


if __name__ == "__main__":
    with tempfile.TemporaryDirectory(prefix="pdmask_verl_smoke_") as tmp:
        main(tmp)
