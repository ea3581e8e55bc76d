"""log π(a) against Megatron-core's ``vocab_parallel_cross_entropy`` (with its gradient) and ‖π‖² against verl's
``vocab_parallel_sum_pi_squared``, on the same logits shards, tp = 2 and 4 gloo processes on the CPU; and the
host mode (``stats_from_shard``) fed with those two functions' own outputs against pdmask's sharded pass.

No pdmask code runs on the other side: Megatron's parallel_state is initialised by Megatron itself, and verl's
module is loaded from its file (it imports only torch and megatron.core; verl's package __init__ pulls in Ray).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
import torch.distributed as dist

from pdmask import METHODS, RolloutLogprobs, decide, policy_stats
from pdmask.sharded import stats_from_shard
from pdmask.tools.gloo import run_gloo

N, K = 13, 5
HOST_METHODS = [m for m, x in METHODS.items() if x.needs == "topk" and not x.needs_head and not x.needs_exactpi]


def verl_tensor_parallel():
    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("verl is not installed")
    path = os.path.join(spec.submodule_search_locations[0], "utils", "megatron", "tensor_parallel.py")
    module_spec = importlib.util.spec_from_file_location("verl_megatron_tensor_parallel", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def case(world: int, vocab: int, width: int):
    g = torch.Generator().manual_seed(world)
    z = torch.randn(N, world * width, generator=g) * 2.5
    logmu = torch.log_softmax(z[:, :vocab].double() + torch.randn(N, vocab, generator=g, dtype=torch.float64), -1)
    a = torch.multinomial(logmu.exp(), 1, generator=g).squeeze(-1)
    top = logmu.topk(K, -1)
    rollout = RolloutLogprobs(logmu.gather(-1, a[:, None]).squeeze(-1), top.indices, top.values)
    return z, a, rollout, torch.randn(N, generator=g), torch.randn(N, generator=g)


def _rank(rank: int, world: int, vocab: int, width: int) -> dict:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    verl_tp = verl_tensor_parallel()
    z, a, rollout, adv, g = case(world, vocab, width)
    cols = slice(rank * width, (rank + 1) * width)
    # The hosts include every column of their shard: give them the padded ids at -inf (probability 0).
    logits = z[:, cols].clone()
    logits[:, max(0, vocab - rank * width) :] = -torch.inf
    verl_sq = verl_tp.vocab_parallel_sum_pi_squared(logits)
    host_shard = logits.clone().requires_grad_(True)  # Megatron's forward works in place on its input's storage
    megatron_logp = -vocab_parallel_cross_entropy(host_shard, a)
    (megatron_logp * g).sum().backward()
    ours_shard = z[:, cols].clone().requires_grad_(True)  # padding left random: vocab_size keeps it out of π
    stats = policy_stats(ours_shard, a, rollout, tp_group=dist.group.WORLD, vocab_size=vocab)
    (stats.logp * g).sum().backward()
    host = stats_from_shard(logits, a, rollout, megatron_logp.detach(), tp_group=dist.group.WORLD,
                            vocab_size=vocab, sq_norm=verl_sq, methods=HOST_METHODS)  # fmt: skip
    masks = {m: (decide(m, stats, adv).keep, decide(m, host, adv).keep) for m in HOST_METHODS}
    parallel_state.destroy_model_parallel()
    return {
        "logp": (stats.logp.detach(), megatron_logp.detach()),
        "grad": (ours_shard.grad, host_shard.grad),
        "sq_norm": (stats.sq_norm, verl_sq),
        "masks": masks,
    }


@pytest.mark.parametrize(("world", "vocab", "width"), [(2, 200, 128), (4, 250, 64)])
def test_sharded_statistics_match_megatron_and_verl(world, vocab, width):
    for got in run_gloo(world, _rank, vocab, width):
        for key in ("logp", "grad", "sq_norm"):
            ours, theirs = got[key]
            assert torch.allclose(ours, theirs.to(ours.dtype), rtol=1e-5, atol=1e-6), (key, (ours - theirs).abs().max())
        for name, (ours, host) in got["masks"].items():
            assert torch.equal(ours, host), name
    # float64 reference for the same numbers, unsharded
    z, a, *_ = case(world, vocab, width)
    logp = torch.log_softmax(z[:, :vocab].double(), -1)
    assert torch.allclose(got["logp"][0].double(), logp.gather(-1, a[:, None]).squeeze(-1), atol=1e-5)
    assert torch.allclose(got["sq_norm"][0].double(), logp.exp().square().sum(-1), atol=1e-6)
