"""Fixtures for the verl integration tests (run in .venv-verl by .ci/verl.sh; the main suite does not collect them)."""

from __future__ import annotations

from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("verl", reason="the verl tests need `pip install 'pdmask[verl]'` (.ci/verl.sh)")

from tensordict import TensorDict  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.utils.padding import left_right_2_no_padding  # noqa: E402

import pdmask  # noqa: E402
from pdmask.integrations.verl import enable_topk_forward  # noqa: E402
from pdmask.integrations.verl.rollout import topk_batch_fields  # noqa: E402
from pdmask.testing.verl import padded_batch, save_tiny_llama  # noqa: E402

#: The rollout's K, its sampling temperature and the divergence threshold of the engine tests.
K, TAU, DELTA = 4, 0.8, 0.1


def actor_config(**overrides):
    """verl's own ActorConfig, as its trainer builds it, with the given fields."""
    from verl.workers.config import ActorConfig

    return ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, **overrides)


@pytest.fixture
def binary_batch():
    """(old_log_prob, log_prob leaf, advantages, response_mask) [6, 9]: ratios well spread, some A = 0."""
    g = torch.Generator().manual_seed(0)
    shape = (6, 9)
    old = torch.log(torch.rand(shape, generator=g) * 0.98 + 0.01)
    new = torch.log(torch.rand(shape, generator=g) * 0.98 + 0.01).requires_grad_(True)
    adv = torch.randn(shape, generator=g)
    mask = torch.rand(shape, generator=g) > 0.2
    mask[2] = False  # one empty sequence: verl's seq-mean modes skip it
    return old, new, adv, mask


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    return save_tiny_llama(str(tmp_path_factory.mktemp("tiny_llama")))


@pytest.fixture(scope="session")
def rollout_batch(model_dir):
    return make_rollout_batch(model_dir)


def make_rollout_batch(model_dir):
    """A padded verl batch, μ the model's distribution at τ perturbed, with its top K; and the reference logits."""
    g = torch.Generator().manual_seed(0)
    lengths = [(5, 6), (3, 4), (4, 1), (2, 5)]
    prompts = [torch.randint(4, 64, (p,), generator=g).tolist() for p, _ in lengths]
    responses = [torch.randint(4, 64, (r,), generator=g).tolist() for _, r in lengths]
    width = 7  # verl pads every response to rollout.response_length
    batch = padded_batch(prompts, responses, response_length=width)
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager")
    p_len = batch["prompts"].shape[1]
    with torch.no_grad():
        out = model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"]
        )
    logits = out.logits[:, p_len - 1 : -1] / TAU  # the logits that predict each response token
    mu = torch.log_softmax(logits + 0.7 * torch.randn(logits.shape, generator=g), -1)
    # What pdmask's vLLM adapter returns (Completions), here from μ itself, up to the longest completion.
    longest = max(r for _, r in lengths)
    mask = batch["response_mask"][:, :longest].bool()
    top_logp, top_ids = mu[:, :longest].topk(K, -1)
    tokens = batch["responses"][:, :longest]
    sampled = mu[:, :longest].gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    completions = SimpleNamespace(
        tokens=tokens, rollout=pdmask.RolloutLogprobs(sampled, top_ids, top_logp).masked(mask), response_mask=mask
    )
    fields = topk_batch_fields(completions, width)
    adv = torch.randn(len(lengths), generator=g).unsqueeze(1) * batch["response_mask"]
    batch |= fields | {"old_log_probs": fields["rollout_log_probs"], "advantages": adv}
    return batch, logits


def engine_data(batch, *, rmpad, flag=True, **extra):
    """The batch as verl's trainer hands it to the actor: no-padding layout, the non-tensor keys, the processor flag."""
    td = left_right_2_no_padding(TensorDict(dict(batch), batch_size=[batch["input_ids"].shape[0]]))
    defaults = {
        "temperature": TAU,
        "use_remove_padding": rmpad,
        "use_dynamic_bsz": False,
        "micro_batch_size_per_gpu": 2,
        "use_fused_kernels": False,
        "global_batch_size": td.batch_size[0],
    }
    tu.assign_non_tensor(td, **(defaults | extra))
    return enable_topk_forward(td) if flag else td


@contextmanager
def captured_stats():
    """[(PolicyStats, advantages, mask)]: what reaches pdmask's masked loss inside the block."""
    from pdmask.integrations.verl import losses

    seen, real = [], losses.masked_policy_loss

    def capture(m, stats, adv, mask, agg, cfg, weights):
        seen.append((stats, adv, mask))
        return real(m, stats, adv, mask, agg, cfg, weights)

    losses.masked_policy_loss = capture
    try:
        yield seen
    finally:
        losses.masked_policy_loss = real


def loss_capturing_stats(loss_fn, output, data):
    """(loss, [(PolicyStats, advantages, mask)]): ``loss_fn`` on an engine's output, with what reached pdmask's masked loss."""
    with captured_stats() as seen:
        loss, _ = loss_fn(model_output=output, data=data, dp_group=None)
    return loss, seen


def spawn_ranks(worker, world, *args, timeout=300):
    """worker(rank, *args) in ``world`` spawned processes; fails unless every rank exits 0 within ``timeout`` s."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=worker, args=(r, *args)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=timeout)
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.is_alive():
            p.kill()
    assert codes == [0] * world, f"worker exit codes {codes} (a failing rank prints its traceback above)"
