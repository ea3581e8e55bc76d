"""PDMLoss on verl's Megatron engine path (logits processor with ``data_format=``), real torch.distributed (gloo).

The forward is verl 0.9.1's own: ``gptmodel_forward_model_engine`` (verl's sequence packing or padding, the
context-parallel split and the gathering of the processor's outputs) and
``MegatronEngineWithLMHead._lm_head_logits_processor`` (temperature, Megatron's vocab-parallel log-probs, then
``PDMLoss`` as the processor), with Megatron-core's parallel state. The GPT model is a stand-in: logits are a
fixed table of each input token's row (so any layout gives the same logits per token), its vocabulary
split over the tensor-parallel ranks as Megatron's output layer splits it. Masks, statistics and the loss
must equal ``pdmask.policy_loss`` on the same logits, unsharded.
"""

from __future__ import annotations

import os
import tempfile
from functools import partial
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from conftest import DELTA, TAU, K, actor_config, engine_data, loss_capturing_stats, spawn_ranks

pytest.importorskip("megatron.core", reason="the Megatron path needs megatron-core (pip install megatron-core)")

VOCAB = 64


class TableGPT(torch.nn.Module):
    """Megatron GPTModel's interface as verl's engine forward calls it; logits [b, s, V/tp] = this rank's columns of
    a fixed table's rows at the input tokens."""

    def __init__(self, table: torch.Tensor, tp_rank: int, tp: int) -> None:
        super().__init__()
        width = table.shape[1] // tp
        self.table = table[:, tp_rank * width : (tp_rank + 1) * width]
        self.pre_process = self.post_process = True
        self.config = SimpleNamespace(fp8=None)

    def forward(self, input_ids, attention_mask=None, position_ids=None, packed_seq_params=None, **kwargs):
        return self.table[input_ids].clone()


def _forward(data, table, data_format: str, method: str):
    """(loss, captured stats) of one micro-batch through verl's Megatron engine forward and PDMLoss."""
    from megatron.core import parallel_state as mpu
    from verl.models.mcore.model_forward import gptmodel_forward_model_engine
    from verl.utils import torch_functional as verl_F
    from verl.workers.config import PolicyLossConfig
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead

    from pdmask.integrations.verl import PDMLoss

    config = actor_config(
        clip_ratio_low=DELTA, clip_ratio_high=DELTA, policy_loss=PolicyLossConfig(loss_mode=f"pdmask_{method}")
    )
    loss_fn = PDMLoss(config, top_k=K)
    engine = SimpleNamespace(engine_config=SimpleNamespace())  # read only when entropy is asked for
    input_ids = data["input_ids"]
    temperature = torch.full((input_ids.shape[0],), TAU)
    processor = partial(
        MegatronEngineWithLMHead._lm_head_logits_processor,
        engine,
        calculate_sum_pi_squared=False,
        calculate_entropy=False,
        distillation_use_topk=True,
        distillation_only=False,
        logits_processor_func=loss_fn,
        batch=data,
        data_format=data_format,
    )
    args = {"label": input_ids.clone(), "temperature": verl_F.expand_as_nested(temperature, input_ids)}
    model = TableGPT(table, mpu.get_tensor_model_parallel_rank(), mpu.get_tensor_model_parallel_world_size())
    output = gptmodel_forward_model_engine(
        model, input_ids, {}, logits_processor=processor, logits_processor_args=args, pad_token_id=0,
        data_format=data_format,
    )  # fmt: skip
    loss, seen = loss_capturing_stats(loss_fn, output, data)
    return loss, seen[0]


def _worker(rank: int, world: int, tp: int, cp: int, store: str, path: str, data_format: str, method: str) -> None:
    from megatron.core import parallel_state as mpu
    from verl.plugin.platform import set_platform

    import pdmask
    from pdmask.integrations.verl.cpu import CPUPlatform

    set_platform(CPUPlatform())
    own = not dist.is_initialized()  # in process (world 1) the session's one-process group may exist already
    if own:
        dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    try:
        mpu.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)
        saved = torch.load(path)
        batch, table = saved["batch"], saved["table"]
        data = engine_data(batch, rmpad=data_format == "thd", dp_size=1, batch_num_tokens=None)
        loss, (stats, adv, mask) = _forward(data, table, data_format, method)
        # The reference: the unsharded logits that predict each response token, table[previous token] / τ.
        p_len = batch["prompts"].shape[1]
        logits = table[batch["input_ids"][:, p_len - 1 : -1]] / TAU
        rollout = pdmask.RolloutLogprobs(batch["rollout_log_probs"], batch["rollout_topk_ids"], batch["rollout_topk_log_probs"])
        thresholds = {"delta_low": DELTA, "delta_high": DELTA, "ratio_cap": 3.0}
        want = pdmask.policy_stats(logits, batch["responses"], rollout, response_mask=batch["response_mask"], need_exactpi=True)
        keep = pdmask.trust_region_mask(method, stats, adv, mask, **thresholds)
        want_keep = pdmask.trust_region_mask(method, want, batch["advantages"], batch["response_mask"], **thresholds)
        assert torch.equal(keep, want_keep), f"rank {rank}: masks differ (tp = {tp}, cp = {cp}, {data_format})"
        assert 0 < (~keep & mask).sum() < mask.sum(), "the mask has no work to do"
        for name in ("logp", "rollout_logp", "set_logp", "set_mu", "rest_mass", "sq_norm"):
            got, ref = getattr(stats, name).detach(), getattr(want, name).detach()
            torch.testing.assert_close(got[mask], ref[mask], rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
        ref_loss, _ = pdmask.policy_loss(
            method, logits, batch["responses"], rollout, batch["advantages"], batch["response_mask"], **thresholds
        )
        torch.testing.assert_close(loss.detach(), ref_loss.detach(), rtol=1e-5, atol=1e-6)
    finally:
        mpu.destroy_model_parallel()
        if own:
            dist.destroy_process_group()


def _spawn(batch, tp: int, cp: int, data_format: str, method: str) -> None:
    world = tp * cp
    table = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(2)) * 2
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "batch.pt")
        torch.save({"batch": dict(batch), "table": table}, path)
        store = os.path.join(tmp, "store")
        args = (world, tp, cp, store, path, data_format, method)
        if world == 1:
            _worker(0, *args)
            return
        spawn_ranks(_worker, world, *args)


@pytest.mark.parametrize("data_format", ["thd", "bshd"])
@pytest.mark.parametrize("method", ["pdm_aggregated_kl", "pdm_exactpi_tv"])
def test_megatron_hook_at_tp1_cp1_equals_pdmask(rollout_batch, data_format, method):
    _spawn(rollout_batch[0], 1, 1, data_format, method)


def test_megatron_hook_with_context_parallelism_2(rollout_batch):
    """cp = 2: verl's load-balanced (zigzag) split of each sequence; μ's rows are split the same way."""
    _spawn(rollout_batch[0], 1, 2, "thd", "pdm_aggregated_kl")


def test_megatron_hook_with_tensor_parallelism_2(rollout_batch):
    _spawn(rollout_batch[0], 2, 1, "thd", "pdm_aggregated_kl")


