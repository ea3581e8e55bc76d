"""Statistics on a vocabulary split over ranks (pdmask.sharded): real torch.distributed (gloo), several processes.

Each test spawns tp processes that compute on their shard of the same inputs; the parent compares every rank's
results with the unsharded call. Uneven positions, a padded vocabulary (tp·w > V, random logits at the padding),
float32, every registered method, and the gradients of log π(a).
"""

from __future__ import annotations

import os
import tempfile
import time
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pdmask import METHODS, RolloutLogprobs, decide, policy_stats
from pdmask.sharded import count_traffic

from conftest import make_case, rollout_of

VOCAB = {2: (90, 48), 4: (90, 24)}  # tp: (real V, shard width w); tp·w = 96
SHAPE = (3, 5)  # 15 positions: uneven against every chunk size used
K, D = 4, 6
TIMEOUT = 120.0


def run_ranks(world: int, fn, *args) -> list:
    """fn(rank, world, *args) on ``world`` gloo processes; each rank's return value, or ("error", type, message)
    for an exception. Fails the test if a rank is still running after TIMEOUT seconds (a hang)."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_worker, args=(rank, world, tmp, fn, args)) for rank in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + TIMEOUT
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        assert not hung, f"ranks {hung} still running after {TIMEOUT} s: a collective hangs"
        out = []
        for rank in range(world):
            result = torch.load(os.path.join(tmp, f"{rank}.pt"), weights_only=False)
            if result[0] == "crash":
                pytest.fail(f"rank {rank} crashed:\n{result[1]}")
            out.append(result[1] if result[0] == "ok" else result)
        return out


def _worker(rank: int, world: int, tmp: str, fn, args) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        result = ("ok", fn(rank, world, *args))
    except (ValueError, TypeError) as e:
        result = ("error", type(e).__name__, str(e))
    except Exception:  # noqa: BLE001 - reported to the parent, which fails the test
        result = ("crash", traceback.format_exc())
    torch.save(result, os.path.join(tmp, f"{rank}.pt"))
    dist.destroy_process_group()


def inputs(world: int, seed: int = 0):
    """Padded logits z [3, 5, tp·w] (random at the padding), tokens, a top-K + full rollout over the real V,
    an LM head W [tp·w, d] with bias and hidden states h [3, 5, d] whose logits are h Wᵀ + b, and advantages."""
    vocab, width = VOCAB[world]
    padded = world * width
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(*SHAPE, D, generator=g, dtype=torch.float64)
    w = torch.randn(padded, D, generator=g, dtype=torch.float64) * 0.9
    b = torch.randn(padded, generator=g, dtype=torch.float64)
    z = h @ w.T + b
    _, logmu, a, ids, vals = make_case(15, vocab, K, seed=seed + 1)
    logmu = torch.log_softmax(z[..., :vocab].reshape(15, vocab) + 0.8 * logmu, -1)  # μ near π
    a = torch.multinomial(logmu.exp(), 1, generator=g).squeeze(-1)
    top = logmu.topk(K, -1)
    rollout = rollout_of(logmu.reshape(*SHAPE, vocab), a.reshape(SHAPE), top.indices.reshape(*SHAPE, K),
                         top.values.reshape(*SHAPE, K), full=True)  # fmt: skip
    adv = torch.randn(SHAPE, generator=g)
    f32 = lambda x: x.float()
    return vocab, width, f32(z), a.reshape(SHAPE), rollout, f32(h), f32(w), f32(b), adv, torch.randn(SHAPE, generator=g)


def outcomes(stats, adv) -> dict:
    """Every method's mask, D and direction, and the statistics, detached."""
    out = {"logp": stats.logp.detach(), "set_logp": stats.set_logp, "rest": stats.rest_mass, "sq": stats.sq_norm}
    for name in METHODS:
        if METHODS[name].needs == "full" and not stats.has_full or METHODS[name].needs == "topk" and not stats.has_topk:
            continue
        d = decide(name, stats, adv)
        out[name] = (d.keep, d.divergence, d.direction)
    return out


def assert_same(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for key, w in want.items():
        for g_, w_ in zip(got[key] if isinstance(w, tuple) else (got[key],), w if isinstance(w, tuple) else (w,)):
            if w_ is None:
                assert g_ is None, key
            elif w_.dtype == torch.bool:
                assert torch.equal(g_, w_), key  # masks identical
            else:
                assert torch.allclose(g_, w_, rtol=1e-4, atol=2e-6), (key, (g_ - w_).abs().max())


def _logits_rank(rank: int, world: int, variant: str) -> dict:
    vocab, width, z, a, rollout, _, w, _, adv, g = inputs(world)
    cols = slice(rank * width, (rank + 1) * width)
    if variant == "topk":
        rollout = rollout_of(rollout.full_logp, a, rollout.topk_ids, rollout.topk_logp)
    elif variant == "binary":
        rollout = rollout_of(rollout.full_logp, a)
    elif variant == "full_shard":  # μ given as this rank's shard, padded like the logits
        pad = torch.full(SHAPE + (world * width - vocab,), -torch.inf, dtype=torch.float64)
        shard_mu = torch.cat([rollout.full_logp, pad], -1)[..., cols]
        rollout = RolloutLogprobs(rollout.logp, rollout.topk_ids, rollout.topk_logp, shard_mu)
    shard = z[..., cols].clone().requires_grad_(True)
    with count_traffic() as traffic:
        stats = policy_stats(shard, a, rollout, tp_group=dist.group.WORLD, vocab_size=vocab, chunk_size=4,
                             head_weight=w[cols], need_uniform=variant == "eager")  # fmt: skip
    out = outcomes(stats, adv)
    (stats.logp * g).sum().backward()
    return out | {"grad": shard.grad, "pass_bytes": sum(traffic)}


def _reference(world: int, variant: str) -> tuple[dict, torch.Tensor]:
    vocab, width, z, a, rollout, _, w, _, adv, g = inputs(world)
    if variant == "topk":
        rollout = rollout_of(rollout.full_logp, a, rollout.topk_ids, rollout.topk_logp)
    elif variant == "binary":
        rollout = rollout_of(rollout.full_logp, a)
    full = z[..., :vocab].clone().requires_grad_(True)
    stats = policy_stats(full, a, rollout, head_weight=w[:vocab])
    out = outcomes(stats, adv)
    (stats.logp * g).sum().backward()
    grad = torch.cat([full.grad, torch.zeros(SHAPE + (world * width - vocab,))], -1)
    return out, grad


@pytest.mark.parametrize("world", [2, 4])
def test_logits_shards_give_the_unsharded_statistics_masks_and_gradients(world):
    variants = ["lazy", "eager", "topk", "binary", "full_shard"] if world == 2 else ["lazy", "binary"]
    results = run_ranks(world, _sweep_variants, variants)
    width = VOCAB[world][1]
    for variant in variants:
        want, grad = _reference(world, "lazy" if variant in ("eager", "full_shard") else variant)
        for rank, got in enumerate(results):
            got = got[variant]
            assert_same({k: v for k, v in got.items() if k in want}, want)
            assert torch.allclose(got["grad"], grad[..., rank * width : (rank + 1) * width], atol=1e-6), (variant, rank)
    # The pass's traffic (docs/sharded.md): 4·(1 + 3 + C + d) bytes per position with the head (C = K + 1),
    # then 4·(5 + 2d) more with a full μ; never O(V).
    c = 1 if world == 4 else K + 1
    assert results[0]["binary" if world == 4 else "topk"]["pass_bytes"] == 15 * 4 * (1 + 3 + c + D)
    assert results[0]["lazy"]["pass_bytes"] == 15 * 4 * (1 + 3 + K + 1 + D + 5 + 2 * D)


def _sweep_variants(rank: int, world: int, variants: list[str]) -> dict:
    return {v: _logits_rank(rank, world, v) for v in variants}
