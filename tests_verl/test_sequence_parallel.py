"""Ulysses sequence parallelism in verl's FSDP engine, with real torch.distributed (gloo, 2 processes).

Two checks, each rank's masks, statistics and loss against the same batch at size 1: verl's FSDP2 engine at
``ulysses_sequence_parallel_size=2`` on the tiny Llama, whose attention runs under Ulysses through pdmask's CPU
stand-in for flash-attn (``pdmask_cpu_varlen``: verl's all-to-all, SDPA over the packed sequences); and verl's own
``prepare_model_inputs``/``prepare_model_outputs`` on a stand-in table of logits per packed position (the
processor on this rank's slice, its outputs gathered back), which pins the layout alone.
"""

from __future__ import annotations

import os
import tempfile
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from conftest import DELTA, TAU, K, actor_config, captured_stats, engine_data, loss_capturing_stats, spawn_ranks

SP = 2


def _engine(sp: int):
    """verl's FSDP engine class with only the state its input and output preparation read (no model, no FSDP)."""
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    engine = FSDPEngineWithLMHead.__new__(FSDPEngineWithLMHead)
    engine.pad_to_length = False
    engine.use_ulysses_sp = sp > 1
    engine.ulysses_sequence_parallel_size = sp
    engine.module = SimpleNamespace(config=SimpleNamespace())
    engine.engine_config = SimpleNamespace()
    return engine


def _run(batch, table, sp: int, method: str):
    """(loss, [captured PolicyStats], model_output) of one micro-batch at Ulysses size ``sp`` on this rank."""
    from verl.utils.ulysses import get_ulysses_sequence_parallel_rank
    from verl.workers.config import PolicyLossConfig

    from pdmask.integrations.verl import PDMLoss

    engine = _engine(sp)
    data = engine_data(batch, rmpad=True, dp_size=1, batch_num_tokens=None)
    inputs, output_args = engine.prepare_model_inputs(data)
    n = table.shape[0]
    local = inputs["input_ids"].shape[-1]
    padded = torch.cat([table, table.new_zeros(sp * local - n, table.shape[1])])  # verl pads the sequence with id 0
    rank = get_ulysses_sequence_parallel_rank() if sp > 1 else 0
    logits = padded[rank * local : (rank + 1) * local].unsqueeze(0).clone().requires_grad_(True)
    config = actor_config(
        clip_ratio_low=DELTA, clip_ratio_high=DELTA, policy_loss=PolicyLossConfig(loss_mode=f"pdmask_{method}")
    )
    loss_fn = PDMLoss(config, top_k=K)
    output = engine.prepare_model_outputs(SimpleNamespace(logits=logits), output_args, data, loss_fn)
    loss, seen = loss_capturing_stats(loss_fn, output, data)
    return loss, seen, logits


METHODS = ("pdm_aggregated_kl", "pdm_proportional_tv", "pdm_exactpi_tv")  # exactpi_tv: the [2, ...] tail sums


def _worker(rank: int, store: str, path: str) -> None:
    from verl.plugin.platform import set_platform
    from verl.utils.ulysses import set_ulysses_sequence_parallel_group

    from pdmask.integrations.verl.cpu import CPUPlatform

    set_platform(CPUPlatform())
    dist.init_process_group("gloo", store=dist.FileStore(store, SP), rank=rank, world_size=SP)
    try:
        saved = torch.load(path)
        batch, table = saved["batch"], saved["table"]
        group = dist.new_group(list(range(SP)))
        for method in METHODS:
            set_ulysses_sequence_parallel_group(group)
            loss2, seen2, logits2 = _run(batch, table, SP, method)
            loss2.backward()
            set_ulysses_sequence_parallel_group(None)
            loss1, seen1, _ = _run(batch, table, 1, method)
            _compare(rank, method, loss2, seen2, logits2, loss1, seen1)
    finally:
        dist.destroy_process_group()


def _compare(rank, method, loss2, seen2, logits2, loss1, seen1) -> None:
    """Size 2 (this rank) against size 1: identical masks, equal statistics, loss and a finite gradient."""
    import pdmask

    (stats2, adv, mask), (stats1, _, _) = seen2[0], seen1[0]
    thresholds = {"delta_low": DELTA, "delta_high": DELTA, "ratio_cap": 3.0}
    keep2 = pdmask.trust_region_mask(method, stats2, adv, mask, **thresholds)
    keep1 = pdmask.trust_region_mask(method, stats1, adv, mask, **thresholds)
    assert torch.equal(keep2, keep1), f"rank {rank}, {method}: masks differ at Ulysses size {SP}"
    assert 0 < (~keep1 & mask).sum() < mask.sum(), f"{method}: the mask has no work to do"
    for name in ("logp", "rollout_logp", "set_logp", "set_mu", "rest_mass", "sq_norm"):
        got, want = getattr(stats2, name).detach(), getattr(stats1, name).detach()
        torch.testing.assert_close(got[mask], want[mask], rtol=1e-6, atol=1e-7, msg=lambda m, name=name: f"{name}: {m}")
    torch.testing.assert_close(loss2.detach(), loss1.detach(), rtol=1e-6, atol=1e-7)
    assert logits2.grad is not None and torch.isfinite(logits2.grad).all()


def test_ulysses_size_2_masks_equal_size_1(rollout_batch):
    batch, _ = rollout_batch
    from pdmask.integrations.verl.layout import local_rows  # noqa: F401  (the module under test imports in the workers)

    n = int(batch["attention_mask"].sum())
    g = torch.Generator().manual_seed(1)
    table = torch.randn(n, 64, generator=g) * 2  # logits per packed position; 64 = the tiny model's vocabulary
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "batch.pt")
        torch.save({"batch": dict(batch), "table": table}, path)
        spawn_ranks(_worker, SP, os.path.join(tmp, "store"), path)


def _engine_worker(rank: int, store: str, path: str) -> None:
    """verl's FSDP2 engine at Ulysses size 2 on the tiny Llama (pdmask's CPU attention): per method, the loss and
    the masks of one ``infer_batch`` against ``pdmask.policy_loss`` on the whole batch's logits; then the gradient
    norm of one ``train_batch`` against the single-process autograd one."""
    from verl.workers.config import PolicyLossConfig

    import pdmask
    from pdmask.integrations.verl import PDMLoss
    from pdmask.integrations.verl.cpu_attention import ATTENTION
    from pdmask.testing.verl import build_actor_engine

    dist.init_process_group("gloo", store=dist.FileStore(store, SP), rank=rank, world_size=SP)
    try:
        saved = torch.load(path)
        batch, logits = saved["batch"], saved["logits"]
        engine = build_actor_engine(saved["model_dir"], use_remove_padding=True, ulysses=SP, attention=ATTENTION)
        mask, thresholds = batch["response_mask"], {"delta_low": DELTA, "delta_high": DELTA, "ratio_cap": 3.0}
        rollout = pdmask.RolloutLogprobs(batch["rollout_log_probs"], batch["rollout_topk_ids"], batch["rollout_topk_log_probs"])
        for method in METHODS:
            config = actor_config(
                clip_ratio_low=DELTA, clip_ratio_high=DELTA, policy_loss=PolicyLossConfig(loss_mode=f"pdmask_{method}")
            )
            # engine.eval_mode() is where verl's engine sets its Ulysses group, as its workers call it.
            with captured_stats() as seen, engine.eval_mode():
                out = engine.infer_batch(engine_data(batch, rmpad=True), loss_function=PDMLoss(config, top_k=K))
            ref, _ = pdmask.policy_loss(method, logits, batch["responses"], rollout, batch["advantages"], mask, **thresholds)
            torch.testing.assert_close(torch.tensor(sum(out["loss"])), ref, rtol=1e-5, atol=1e-6)
            ref_stats = pdmask.policy_stats(logits, batch["responses"], rollout, response_mask=mask, need_exactpi=True)
            keep = torch.cat([pdmask.trust_region_mask(method, s, a, k, **thresholds) for s, a, k in seen])
            ref_keep = pdmask.trust_region_mask(method, ref_stats, batch["advantages"], mask, **thresholds)
            assert torch.equal(keep, ref_keep), f"rank {rank}, {method}: masks differ at Ulysses size {SP}"
        with engine.train_mode():
            out = engine.train_batch(engine_data(batch, rmpad=True), loss_function=PDMLoss(config, top_k=K))
        if rank == 0:  # verl's engine reports metrics from the Ulysses group's first rank
            assert out["metrics"]["grad_norm"] == pytest.approx(saved["grad_norm"], rel=1e-4)
    finally:
        dist.destroy_process_group()


def test_ulysses_size_2_in_verls_engine_on_a_real_model(model_dir, rollout_batch, monkeypatch):
    """The model's attention runs under Ulysses (verl's all-to-all in ``pdmask_cpu_varlen``), not a stand-in table."""
    monkeypatch.setenv("VERL_PLATFORM", "pdmask_cpu")  # the ranks' verl modules read the device at import
    from transformers import AutoModelForCausalLM

    import pdmask

    batch, logits = rollout_batch
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager")
    p_len = batch["prompts"].shape[1]
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"])
    rollout = pdmask.RolloutLogprobs(batch["rollout_log_probs"], batch["rollout_topk_ids"], batch["rollout_topk_log_probs"])
    thresholds = {"delta_low": DELTA, "delta_high": DELTA, "ratio_cap": 3.0}
    loss, _ = pdmask.policy_loss(
        METHODS[-1], out.logits[:, p_len - 1 : -1] / TAU, batch["responses"], rollout, batch["advantages"],
        batch["response_mask"], **thresholds,
    )
    loss.backward()
    grad_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None]))
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "batch.pt")
        torch.save({"batch": dict(batch), "logits": logits, "model_dir": model_dir, "grad_norm": float(grad_norm)}, path)
        spawn_ranks(_engine_worker, SP, os.path.join(tmp, "store"), path)


def test_cpu_attention_on_packed_sequences_equals_each_alone(model_dir):
    """``pdmask_cpu_varlen`` in one process: a packed pair of sequences gives each one's logits alone (GQA heads)."""
    from transformers import AutoModelForCausalLM

    from pdmask.integrations.verl.cpu_attention import ATTENTION, register_cpu_attention, varlen_attention

    register_cpu_attention()
    packed_model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation=ATTENTION).eval()
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()
    g = torch.Generator().manual_seed(2)
    a, b = torch.randint(0, 64, (1, 7), generator=g), torch.randint(0, 64, (1, 5), generator=g)
    positions = torch.cat([torch.arange(7), torch.arange(5)]).unsqueeze(0)
    with torch.no_grad():
        packed = packed_model(input_ids=torch.cat([a, b], 1), position_ids=positions).logits
        alone = torch.cat([model(input_ids=a).logits, model(input_ids=b).logits], 1)
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)
    q = torch.zeros(1, 2, 3, 4)
    with pytest.raises(ValueError, match="needs position_ids"):
        varlen_attention(packed_model, q, q, q, None)


def _attention_worker(rank: int, store: str) -> None:
    """``varlen_attention`` at Ulysses size 2 on 15 packed positions (odd: verl pads one, with position 0) equals
    size 1, for kv heads fewer than (repeated), equal to and a multiple of the group size."""
    from verl.utils.ulysses import set_ulysses_sequence_parallel_group, ulysses_pad

    from pdmask.integrations.verl.cpu_attention import varlen_attention

    dist.init_process_group("gloo", store=dist.FileStore(store, SP), rank=rank, world_size=SP)
    try:
        positions = torch.cat([torch.arange(6), torch.arange(4), torch.arange(5)]).unsqueeze(0)
        n, module = positions.shape[1], SimpleNamespace(training=False)
        for kv_heads in (1, 2, 4):
            g = torch.Generator().manual_seed(kv_heads)
            q = torch.randn(1, 4, n, 8, generator=g)
            k, v = torch.randn(2, 1, kv_heads, n, 8, generator=g)
            set_ulysses_sequence_parallel_group(None)
            whole = varlen_attention(module, q, k, v, None, position_ids=positions)[0]
            _, padded_positions, pad = ulysses_pad(torch.zeros_like(positions), positions, sp_size=SP)
            assert pad == 1
            local = padded_positions.shape[1] // SP
            part = slice(rank * local, (rank + 1) * local)
            q_, k_, v_ = (torch.nn.functional.pad(t, (0, 0, 0, pad))[:, :, part] for t in (q, k, v))
            set_ulysses_sequence_parallel_group(dist.group.WORLD)
            mine = varlen_attention(module, q_, k_, v_, None, position_ids=padded_positions[:, part])[0]
            real = min(local, n - rank * local)  # the padded position's output is dropped by verl
            torch.testing.assert_close(mine[:, :real], whole[:, rank * local : rank * local + real])
    finally:
        set_ulysses_sequence_parallel_group(None)
        dist.destroy_process_group()


def test_cpu_attention_at_ulysses_size_2_with_padding_equals_size_1():
    with tempfile.TemporaryDirectory() as tmp:
        spawn_ranks(_attention_worker, SP, os.path.join(tmp, "store"))
