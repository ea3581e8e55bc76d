"""Ulysses sequence parallelism in verl's FSDP engine, with real torch.distributed (gloo, 2 processes).

Each process runs verl's own ``FSDPEngineWithLMHead.prepare_model_inputs`` (the packed sequence padded and
sliced by rank) and ``prepare_model_outputs`` (``PDMLoss`` called as the logits processor on this rank's
logits, its per-token outputs and the log-probs gathered back over the group), then ``PDMLoss`` as the loss.
The model is a stand-in: a fixed table of logits per packed position, sliced as the engine slices its input,
since verl's Ulysses attention needs flash-attn (``verl/models/transformers/monkey_patch.py:545-551``), which
the CPU lacks. Each rank's masks, statistics and loss must equal the same batch at size 1.
"""

from __future__ import annotations

import os
import tempfile
from types import SimpleNamespace

import torch
import torch.distributed as dist

from conftest import DELTA, K, actor_config, engine_data, loss_capturing_stats, spawn_ranks

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
