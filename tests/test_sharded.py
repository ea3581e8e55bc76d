"""Statistics on a vocabulary split over ranks (pdmask.sharded): real torch.distributed (gloo), several processes.

For each tp, one spawn of tp processes (``pdmask.tools.gloo.run_gloo``, which fails on a hang) computes on its
shards of the same inputs; the parent compares every rank's results with the unsharded call. Uneven positions,
a padded vocabulary (tp·w > V, random logits at the padding), float32, every registered method, and the
gradients of log π(a).
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

from pdmask import METHODS, RolloutLogprobs, decide, policy_stats, policy_stats_from_hidden
from pdmask.sharded import count_traffic, sequence_shard, shard_rollout, stats_from_shard
from pdmask.tools.gloo import run_gloo

from conftest import make_case, rollout_of

VOCAB = {2: (90, 48), 4: (90, 24)}  # tp: (real V, shard width w); tp·w = 96
SHAPE = (3, 5)  # 15 positions: uneven against every chunk size used
K, D = 4, 6
TIMEOUT = 120.0


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
        m = METHODS[name]
        if m.needs == "full" and not stats.has_full or m.needs == "topk" and not stats.has_topk or m.needs_head and stats.head is None:
            continue
        if m.needs_exactpi and stats.exactpi_sums is None:  # asked for up front (need_exactpi=True) or not at all
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


def variant_inputs(world: int, variant: str):
    """(tokens, rollout, response_mask) of a variant: the rollout's information, and padding outside a response mask."""
    vocab, width, _, a, rollout, *_ = inputs(world)
    mask = None
    if variant == "topk":
        rollout = rollout_of(rollout.full_logp, a, rollout.topk_ids, rollout.topk_logp)
    elif variant == "binary":
        rollout = rollout_of(rollout.full_logp, a)
    elif variant == "masked":  # padding outside the response: token -100, junk top-K, NaN in the full μ
        mask = torch.ones(SHAPE, dtype=torch.bool)
        mask[0, 3:], mask[2, 0] = False, False
        a = a.masked_fill(~mask, -100)
        full = rollout.full_logp.masked_fill(~mask.unsqueeze(-1), float("nan"))
        rollout = RolloutLogprobs(rollout.logp.masked_fill(~mask, 3.0), rollout.topk_ids.masked_fill(~mask.unsqueeze(-1), 7),
                                  rollout.topk_logp, full)  # fmt: skip
    return a, rollout, mask


def _logits_rank(rank: int, world: int, variant: str) -> dict:
    vocab, width, z, _, _, _, w, _, adv, g = inputs(world)
    a, rollout, mask = variant_inputs(world, variant)
    cols = slice(rank * width, (rank + 1) * width)
    if variant == "full_shard":  # μ given as this rank's shard, padded like the logits
        pad = torch.full(SHAPE + (world * width - vocab,), -torch.inf, dtype=torch.float64)
        shard_mu = torch.cat([rollout.full_logp, pad], -1)[..., cols]
        rollout = RolloutLogprobs(rollout.logp, rollout.topk_ids, rollout.topk_logp, shard_mu)
    shard = z[..., cols].clone().requires_grad_(True)
    with count_traffic() as traffic:
        stats = policy_stats(shard, a, rollout, tp_group=dist.group.WORLD, vocab_size=vocab, chunk_size=4,
                             head_weight=w[cols], need_exactpi=variant == "eager", response_mask=mask)  # fmt: skip
    out = outcomes(stats, adv)
    (stats.logp * g).sum().backward()
    assert torch.equal(shard.detach(), z[..., cols]), "the backward changed the logits"
    return out | {"grad": shard.grad, "pass_bytes": sum(traffic)}


def _reference(world: int, variant: str) -> tuple[dict, torch.Tensor]:
    vocab, width, z, _, _, _, w, _, adv, g = inputs(world)
    a, rollout, mask = variant_inputs(world, "lazy" if variant in ("eager", "full_shard") else variant)
    full = z[..., :vocab].clone().requires_grad_(True)
    stats = policy_stats(full, a, rollout, head_weight=w[:vocab], response_mask=mask, need_exactpi=variant == "eager")
    out = outcomes(stats, adv)
    (stats.logp * g).sum().backward()
    grad = torch.cat([full.grad, torch.zeros(SHAPE + (world * width - vocab,))], -1)
    return out, grad


def _rank_main(rank: int, world: int) -> dict:
    """Everything one rank computes, in one spawn per tp (starting processes is the slow part)."""
    out = {"logits": {v: _logits_rank(rank, world, v) for v in VARIANTS[world]}, "hidden": _hidden_rank(rank, world)}
    if world == 2:
        out["host"] = _host_rank(rank, world)
        out["bad"] = {}
        for bad, _ in BAD:  # after an agreed error every rank is at the same collective, so the next case can run
            try:
                _bad_rank(rank, world, bad)
                out["bad"][bad] = ("ok",)
            except (ValueError, TypeError) as e:
                out["bad"][bad] = ("error", type(e).__name__, str(e))
    return out


@functools.cache
def results_for(world: int) -> list[dict]:
    return run_gloo(world, _rank_main, timeout=TIMEOUT)


VARIANTS = {2: ["lazy", "eager", "topk", "binary", "full_shard", "masked"], 4: ["lazy", "binary"]}


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_logits_shards_give_the_unsharded_statistics_masks_and_gradients(world):
    variants = VARIANTS[world]
    results = [r["logits"] for r in results_for(world)]
    width = VOCAB[world][1]
    for variant in variants:
        want, grad = _reference(world, variant)
        for rank, got in enumerate(results):
            got = got[variant]
            assert_same({k: v for k, v in got.items() if k in want}, want)
            assert torch.allclose(got["grad"], grad[..., rank * width : (rank + 1) * width], atol=1e-6), (variant, rank)
    # The pass's traffic (docs/sharded.md): 4·(1 + 3 + C + d) bytes per position with the head (C = K + 1), then
    # the head's rows at S, 4·4d with top-K (none with binary information), and 4·(5 + 2d) more with a full μ;
    # never O(V). The masks communicate nothing.
    assert results[0]["binary" if world == 4 else "topk"]["pass_bytes"] == 15 * 4 * (
        (1 + 3 + 1 + D) if world == 4 else (1 + 3 + K + 1 + D + 4 * D)
    )
    assert results[0]["lazy"]["pass_bytes"] == 15 * 4 * (1 + 3 + K + 1 + D + 5 + 2 * D + 4 * D)



def _hidden_rank(rank: int, world: int) -> dict:
    vocab, width, _, a, rollout, h, w, b, adv, g = inputs(world)
    cols = slice(rank * width, (rank + 1) * width)
    out = {}
    for reduce in (True, False):
        hidden, ws, bs = (x.clone().requires_grad_(True) for x in (h, w[cols], b[cols]))
        stats = policy_stats_from_hidden(hidden, ws, a, rollout, bias=bs, temperature=0.8, need_backbone=True, block_rows=4,
                                         block_vocab=10, tp_group=dist.group.WORLD, vocab_size=vocab,
                                         reduce_hidden_grad=reduce)  # fmt: skip
        res = outcomes(stats, adv)
        (stats.logp * g).sum().backward()
        out[reduce] = res | {"h": hidden.grad, "w": ws.grad, "b": bs.grad}
    return out


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_hidden_and_head_shards_give_the_unsharded_statistics_and_gradients(world):
    results = [r["hidden"] for r in results_for(world)]
    vocab, width, _, a, rollout, h, w, b, adv, g = inputs(world)
    hidden, wr, br = (x.clone().requires_grad_(True) for x in (h, w[:vocab], b[:vocab]))
    stats = policy_stats_from_hidden(hidden, wr, a, rollout, bias=br, temperature=0.8, need_backbone=True)
    want = outcomes(stats, adv)
    (stats.logp * g).sum().backward()
    pad = world * width - vocab
    grad_w = torch.cat([wr.grad, torch.zeros(pad, D)])
    grad_b = torch.cat([br.grad, torch.zeros(pad)])
    for reduce in (True, False):
        for rank, got in enumerate(results):
            got = got[reduce]
            assert_same({k: v for k, v in got.items() if k in want}, want)
            cols = slice(rank * width, (rank + 1) * width)
            assert torch.allclose(got["w"], grad_w[cols], atol=1e-5) and torch.allclose(got["b"], grad_b[cols], atol=1e-5)
        # reduce_hidden_grad=True: every rank's hidden.grad is the unsharded one; False: this rank's share, which
        # the host's region (Megatron's copy_to_tensor_model_parallel_region) sums over the ranks.
        grads = [got[reduce]["h"] for got in results]
        for got_h in grads if reduce else [sum(grads)]:
            assert torch.allclose(got_h, hidden.grad, atol=1e-5), reduce
    assert not torch.allclose(results[0][False]["h"], hidden.grad, atol=1e-5)


def _bad_rank(rank: int, world: int, bad: str):
    vocab, width, z, a, rollout, *_ = inputs(world)
    shard = z[..., rank * width : (rank + 1) * width].clone()
    kwargs = {"tp_group": dist.group.WORLD, "vocab_size": vocab}
    if rank == world - 1:  # the bad input is on one rank only
        if bad == "token":
            a = a.clone()
            a[1, 2] = vocab  # a padded id
        elif bad == "topk":
            rollout = RolloutLogprobs(rollout.logp, rollout.topk_ids.clone().index_fill_(-1, torch.tensor([0]), vocab + 1),
                                      rollout.topk_logp)  # fmt: skip
        elif bad == "nan":
            shard[0, 0, 3] = float("nan")
        elif bad == "positions":
            shard, a = shard[:, :4], a[:, :4]
            rollout = RolloutLogprobs(rollout.logp[:, :4], rollout.topk_ids[:, :4], rollout.topk_logp[:, :4])
        elif bad == "vocab_size":
            kwargs["vocab_size"] = 10 * vocab
        elif bad == "width":  # a shard one id narrower: id rank·width would belong to no rank
            shard, kwargs["vocab_size"] = shard[..., 1:], vocab - 1
        elif bad == "dtype":  # a TypeError on one rank is agreed on too
            a = a.float()
    if bad != "positions":
        rollout = RolloutLogprobs(rollout.logp, rollout.topk_ids, rollout.topk_logp)
    return policy_stats(shard, a, rollout, **kwargs).logp


BAD = [
    ("token", "tokens contains id 90, outside the vocabulary [0, 90). (on rank 1 of tp_group)"),
    ("topk", "rollout.topk_ids contains id 91, outside the vocabulary [0, 90). (on rank 1 of tp_group)"),
    ("nan", "logits contain NaN or +inf"),
    ("positions", "the ranks of tp_group were given inputs of different sizes"),
    ("vocab_size", "vocab_size must be the real vocabulary V"),
    ("width", "every shard must be equally wide"),
    ("dtype", "tokens must be an integer tensor"),
]


@pytest.mark.parametrize(("bad", "message"), BAD)
def test_bad_input_on_one_rank_fails_every_rank_with_one_error(bad, message):
    results = [r["bad"][bad] for r in results_for(2)]
    assert all(r[0] == "error" and r[1] in ("ValueError", "TypeError") for r in results), results
    assert len({r[1] for r in results}) == 1, results
    assert len({r[2] for r in results}) == 1 and message in results[0][2], results


#: The methods stats_from_shard serves (π at S, π_R, ‖π‖² and V), and some it refuses.
HOST_METHODS = [m for m, x in METHODS.items() if x.needs != "full" and not x.needs_head and not x.needs_exactpi]


def _host_rank(rank: int, world: int) -> dict:
    vocab, width, z, a, rollout, *_, adv, g = inputs(world)
    rollout = RolloutLogprobs(rollout.logp, rollout.topk_ids, rollout.topk_logp)
    shard = z[..., rank * width : (rank + 1) * width].clone().requires_grad_(True)
    group = dist.group.WORLD
    # What the host already has: log π(a) with its gradient and ‖π‖² (here from pdmask's pass; the peer tests use
    # Megatron's and verl's own functions).
    host = policy_stats(shard, a, rollout, tp_group=group, vocab_size=vocab)
    try:
        stats_from_shard(shard, a, rollout, host.logp, tp_group=group, vocab_size=vocab, methods=["pdm_full_kl", "pdm_exactpi_tv"])
    except ValueError as e:
        refused = str(e)
    with count_traffic() as traffic:
        stats = stats_from_shard(shard, a, rollout, host.logp, tp_group=group, vocab_size=vocab, sq_norm=host.sq_norm,
                                 methods=HOST_METHODS)  # fmt: skip
    out = {m: tuple(getattr(decide(m, stats, adv), f) for f in ("keep", "divergence", "direction")) for m in HOST_METHODS}
    (stats.logp * g).sum().backward()
    return out | {"refused": refused, "bytes": sum(traffic), "grad": shard.grad}


def test_host_mode_builds_the_statistics_from_log_pi_a_sq_norm_and_the_logits_at_S():
    results = [r["host"] for r in results_for(2)]
    vocab, width, z, a, rollout, *_, adv, g = inputs(2)
    full = z[..., :vocab].clone().requires_grad_(True)
    stats = policy_stats(full, a, RolloutLogprobs(rollout.logp, rollout.topk_ids, rollout.topk_logp))
    want = {m: tuple(getattr(decide(m, stats, adv), f) for f in ("keep", "divergence", "direction")) for m in HOST_METHODS}
    (stats.logp * g).sum().backward()
    for rank, got in enumerate(results):
        assert_same({m: got[m] for m in HOST_METHODS}, want)
        assert "pdm_full_kl, pdm_exactpi_tv sum over the vocabulary" in got["refused"]
        assert got["bytes"] == 15 * 4 * (K + 1)  # one all-reduce of the logits at S
        assert torch.allclose(got["grad"], torch.cat([full.grad, torch.zeros(3, 5, 6)], -1)[..., rank * width : (rank + 1) * width])


@pytest.mark.parametrize("layout", ["contiguous", "load_balanced"])
def test_statistics_on_a_sequence_shard_are_the_shard_of_the_statistics(layout):
    """Context/sequence parallelism: tokens, logits and the rollout sliced alike give the same per-token results."""
    _, _, z, a, rollout, *_ = inputs(2)
    z, a, adv = z[..., :90], a.repeat(1, 4), torch.randn(3, 20)
    z = z.repeat(1, 4, 1)
    rollout = RolloutLogprobs(*(x.repeat(1, 4, *([1] * (x.dim() - 2))) for x in (rollout.logp, rollout.topk_ids, rollout.topk_logp)))
    want = outcomes(policy_stats(z, a, rollout), adv)
    world = 2
    for rank in range(world):
        cut = functools.partial(sequence_shard, rank=rank, world=world, layout=layout)
        got = outcomes(policy_stats(cut(z), cut(a), shard_rollout(rollout, rank, world, layout=layout)), cut(adv))
        cut_all = lambda v, cut=cut: tuple(None if x is None else cut(x) for x in v) if isinstance(v, tuple) else cut(v)
        assert_same(got, {k: cut_all(v) for k, v in want.items()})
    chunks = a.chunk(4, 1)
    assert torch.equal(sequence_shard(a, 0, 2, layout="load_balanced"), torch.cat([chunks[0], chunks[3]], 1))
    assert torch.equal(sequence_shard(a, 1, 2, layout="contiguous"), a[:, 10:])
    with pytest.raises(ValueError, match="not a multiple of 6"):
        sequence_shard(a, 0, 3, layout="load_balanced")


def test_a_padded_vocabulary_on_one_rank_gives_the_real_vocabulary_statistics():
    """vocab_size without tp_group: Megatron's padding at tp = 1 (the padded columns hold random logits)."""
    vocab, width, z, a, rollout, h, w, b, adv, _ = inputs(2)
    want = outcomes(policy_stats(z[..., :vocab], a, rollout, head_weight=w[:vocab]), adv)
    assert_same(outcomes(policy_stats(z, a, rollout, head_weight=w, vocab_size=vocab), adv), want)
    want = outcomes(policy_stats_from_hidden(h, w[:vocab], a, rollout, bias=b[:vocab], need_backbone=True), adv)
    assert_same(outcomes(policy_stats_from_hidden(h, w, a, rollout, bias=b, need_backbone=True, vocab_size=vocab), adv), want)
    with pytest.raises(ValueError, match="tokens contains id 95, outside the vocabulary"):
        policy_stats(z, torch.full_like(a, 95), rollout, vocab_size=vocab)
