"""Peak host memory of one verl FSDP engine forward + loss on the CPU: logits materialised vs verl's fused kernels.

    python scripts/verl_logits_memory.py MODE [fsdp|fsdp2]   (MODE: topk | binary | fused | hidden_stats | logits_stats)

Each MODE runs in a fresh process (peak RSS only grows): a random 2-layer Llama with a large vocabulary
(V = 32,768, d = 64, LM head tied to the embedding), 8 sequences of 256 tokens, float32, world size 1. ``topk``: ``PDMLoss``
(``pdm_aggregated_kl``) through the logits-processor hook; ``binary``: verl's ``ppo_loss`` with
``pdmask_dppo_binary_kl`` on the same materialised logits; ``fused``: the same binary loss with
``use_fused_kernels=True`` (verl's torch backend; no [N, V] logits); ``hidden_stats`` / ``logits_stats``:
``pdmask.policy_stats_from_hidden`` on the final hidden states and the LM head vs ``pdmask.policy_stats`` on
the materialised logits, outside verl (what a fused top-K path would compute). Prints the peak RSS above
the one after setup, in MiB.
"""

from __future__ import annotations

import dataclasses
import resource
import sys
import tempfile
from types import SimpleNamespace

import torch

sys.path.insert(0, __file__.rsplit("/scripts/", 1)[0] + "/tests_verl")
VOCAB, HIDDEN, SEQS, PROMPT, RESPONSE, K = 32768, 64, 8, 128, 128, 8


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def batch_for(model_dir: str):
    from transformers import AutoModelForCausalLM

    import pdmask
    from pdmask.integrations.verl.rollout import topk_batch_fields
    from pdmask.testing.verl import padded_batch

    from conftest import TAU

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, VOCAB, (PROMPT,), generator=g).tolist() for _ in range(SEQS)]
    responses = [torch.randint(4, VOCAB, (RESPONSE,), generator=g).tolist() for _ in range(SEQS)]
    batch = padded_batch(prompts, responses)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():  # μ: the model itself at τ, its top K from chunks (no [N, V] kept)
        hidden = model.model(input_ids=batch["input_ids"]).last_hidden_state[:, PROMPT - 1 : -1]
        top_logp, top_ids, sampled = [], [], []
        for b in range(SEQS):
            logp = torch.log_softmax(model.lm_head(hidden[b]) / TAU, -1)
            v, i = logp.topk(K, -1)
            top_logp.append(v), top_ids.append(i)
            sampled.append(logp.gather(-1, batch["responses"][b].unsqueeze(-1)).squeeze(-1))
    mask = batch["response_mask"].bool()
    rollout = pdmask.RolloutLogprobs(torch.stack(sampled), torch.stack(top_ids), torch.stack(top_logp))
    fields = topk_batch_fields(SimpleNamespace(rollout=rollout, response_mask=mask), RESPONSE)
    adv = torch.randn(SEQS, generator=g).unsqueeze(1) * batch["response_mask"]
    return batch | fields | {"old_log_probs": fields["rollout_log_probs"], "advantages": adv}, model, hidden


def main(mode: str) -> None:
    from verl.workers.config import PolicyLossConfig
    from verl.workers.engine import EngineRegistry
    from verl.workers.utils.losses import ppo_loss

    import pdmask
    from pdmask.integrations.verl import PDMLoss
    from pdmask.testing.verl import actor_configs, init_cpu_process_group, save_tiny_llama

    from conftest import DELTA, TAU, actor_config, engine_data

    # Tied embeddings: verl 0.9.1 shards an untied LM head as its own FSDP2 unit (``_select_fsdp2_wrap_targets``),
    # which its fused forward never calls, so the head's weight stays a DTensor there and the fused path fails.
    model_dir = save_tiny_llama(tempfile.mkdtemp(), vocab_size=VOCAB, hidden_size=HIDDEN, tied=True)
    batch, model, hidden = batch_for(model_dir)
    fused = mode == "fused"
    if mode in ("hidden_stats", "logits_stats"):
        rollout = pdmask.RolloutLogprobs(batch["rollout_log_probs"], batch["rollout_topk_ids"], batch["rollout_topk_log_probs"])
        weight = model.lm_head.weight.detach()
        logits = (hidden @ weight.T / TAU) if mode == "logits_stats" else None
        base = peak_mib()
        if logits is None:
            pdmask.policy_stats_from_hidden(
                hidden, weight, batch["responses"], rollout, temperature=TAU, response_mask=batch["response_mask"]
            )
        else:
            pdmask.policy_stats(logits, batch["responses"], rollout, response_mask=batch["response_mask"])
        print(f"{mode}: peak +{peak_mib() - base:.0f} MiB over setup (N = {SEQS * RESPONSE}, V = {VOCAB})")
        return
    init_cpu_process_group()
    configs = actor_configs(model_dir, use_remove_padding=True)
    if fused:
        from verl.workers.config import HFModelConfig

        configs["model_config"] = HFModelConfig(
            path=model_dir,
            use_remove_padding=True,
            override_config={"attn_implementation": "sdpa"},
            use_fused_kernels=True,
            fused_kernel_options={"impl_backend": "torch"},
        )
    strategy = sys.argv[2] if len(sys.argv) > 2 else "fsdp2"
    configs["engine_config"] = dataclasses.replace(configs["engine_config"], strategy=strategy)
    engine = EngineRegistry.new(model_type="language_model", backend=strategy, **configs)
    engine.initialize()
    method = "pdm_aggregated_kl" if mode == "topk" else "dppo_binary_kl"
    config = actor_config(clip_ratio_low=DELTA, clip_ratio_high=DELTA, policy_loss=PolicyLossConfig(loss_mode=f"pdmask_{method}"))
    loss_fn = PDMLoss(config, top_k=K) if mode == "topk" else (lambda **kw: ppo_loss(config, **kw))
    data = engine_data(batch, rmpad=True, flag=mode == "topk", micro_batch_size_per_gpu=SEQS, use_fused_kernels=fused)
    base = peak_mib()
    out = engine.infer_batch(data, loss_function=loss_fn)
    tokens = SEQS * (PROMPT + RESPONSE)
    print(f"{mode}: peak +{peak_mib() - base:.0f} MiB over setup; loss {sum(out['loss']):+.4f} (N = {tokens} tokens, V = {VOCAB})")


if __name__ == "__main__":
    main(sys.argv[1])
