"""The rollout engine: top-K output against a full softmax, precision, sync, padding, response masks."""

import pytest
import torch

from pdmask import RolloutLogprobs
from pdmask.lab.engine import DTYPES, E4M3_MAX, FP8Linear, RolloutEngine, fake_quant_e4m3, left_pad, sample
from pdmask.lab.models import SIZES, build_policy, num_parameters
from pdmask.lab.tasks import EOS, PAD, build_task

from tiny_llama import tiny_llama_config


@pytest.fixture(scope="module")
def policy():
    torch.manual_seed(0)
    m = build_policy("tiny", vocab_size=64, block_size=32)
    with torch.no_grad():  # sharper than the init so that EOS and the top-K ordering matter
        m.lm_head.weight.mul_(40)
    return m


def _prompts(n=5, length=4):
    g = torch.Generator().manual_seed(1)
    return [[1, *torch.randint(4, 40, (length,), generator=g).tolist(), 2] for _ in range(n)]


def prob_tol(dtype: str) -> float:
    """Tolerance on probabilities (TV per row, top-K mass) when one engine computes the same logits two ways.

    The KV-cache path and a full forward round differently; the logits then differ by a few units of the
    dtype's epsilon, and a TV is at most that logit error. 8 eps covers it on AVX2 and AVX-512 CPUs alike.
    """
    return max(8 * torch.finfo(DTYPES[dtype]).eps, 1e-5)


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_topk_matches_full_softmax_of_engine_weights(policy, dtype):
    engine = RolloutEngine(policy, dtype, top_k_logprobs=7, return_full=True)
    r = engine.generate(
        _prompts(),
        group_size=3,
        temperature=0.7,
        max_new_tokens=6,
        eos_id=EOS,
        pad_id=PAD,
        generator=torch.Generator().manual_seed(0),
    )
    N, R = r.tokens.shape
    assert r.topk_ids.shape == r.topk_logp.shape == (N, R, 7) and r.logp.shape == (N, R) and N == 15
    # Reference: one full forward of the engine's own (low-precision) copy, softmax in float32.
    with torch.no_grad():
        ref = torch.log_softmax(r.response_logits(engine.model).float() / 0.7, dim=-1)
    m, tol = r.response_mask, prob_tol(dtype)
    # What matters is the distribution: compare probabilities (a log-prob of -30 may differ by 0.2 in bf16).
    tv = 0.5 * (r.full_logp.exp() - ref.exp()).abs().sum(-1)
    assert tv[m].max() <= tol
    # The top-K: the returned ids carry the reference's top-K mass, and their probabilities match it.
    ref_topk = ref.topk(7, dim=-1)
    got_mass = ref.exp().gather(-1, r.topk_ids).sum(-1)
    assert (ref_topk.values.exp().sum(-1) - got_mass)[m].max() <= tol
    assert (r.topk_logp.exp() - ref_topk.values.exp())[m].abs().max() <= tol
    if dtype == "fp32":
        assert torch.equal(r.topk_ids[m], ref_topk.indices[m])
    # The top-K log-probs are the largest of the returned full distribution, sorted, and logp is mu(a).
    assert torch.equal(r.topk_logp, r.full_logp.topk(7, dim=-1).values)
    assert torch.equal(r.logp, r.full_logp.gather(-1, r.tokens[..., None]).squeeze(-1))
    # Valid pdmask input.
    RolloutLogprobs(r.logp, r.topk_ids, r.topk_logp).validated(r.tokens, policy.vocab_size, torch.float32)


def test_fp8_quantization_error_is_bounded():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 96, generator=g) * torch.logspace(-3, 2, 96)  # channels over five decades
    for dim in (0, 1):
        q = fake_quant_e4m3(x, dim=dim)
        scale = x.abs().amax(dim=dim, keepdim=True) / E4M3_MAX
        # E4M3: 3 mantissa bits (half a step = 2^-4 relative) for normals; subnormal steps of 2^-9 in units of scale.
        assert ((q - x).abs() <= 2**-4 * x.abs() + 2**-10 * scale + 1e-12).all()
        assert torch.allclose(q.abs().amax(dim=dim), x.abs().amax(dim=dim), rtol=1e-6)  # the largest is kept
        assert torch.allclose(fake_quant_e4m3(q, dim=dim), q, rtol=1e-6)  # idempotent: already on the grid
    assert torch.equal(fake_quant_e4m3(torch.zeros(2, 3), dim=-1), torch.zeros(2, 3))


def test_fp8_engine_quantizes_linears_and_is_deterministic(policy):
    engine = RolloutEngine(policy, "fp8", return_full=True)
    fp8 = [m for m in engine.model.modules() if isinstance(m, FP8Linear)]
    assert len(fp8) == 4 * len(policy.blocks) and type(engine.model.lm_head) is torch.nn.Linear
    w = policy.blocks[0].qkv.weight.detach()
    assert torch.equal(engine.model.blocks[0].qkv.weight, fake_quant_e4m3(w, dim=1))
    runs = [
        engine.generate(
            _prompts(), 2, max_new_tokens=5, eos_id=EOS, pad_id=PAD, generator=torch.Generator().manual_seed(0)
        )
        for _ in range(2)
    ]
    assert torch.equal(runs[0].tokens, runs[1].tokens) and torch.equal(runs[0].full_logp, runs[1].full_logp)
    # Against the float32 trainer at the same weights: a real mismatch, larger than bf16's here, but bounded.
    r = runs[0]
    with torch.no_grad():
        trainer = torch.log_softmax(r.response_logits(policy), dim=-1)
    tv = 0.5 * (trainer.exp() - r.full_logp.exp()).abs().sum(-1)[r.response_mask]
    assert 1e-3 < tv.mean() < 0.2
    # sync requantizes: a changed trainer weight reaches the engine on the E4M3 grid.
    trainer_copy = build_policy("tiny", vocab_size=64, block_size=32)
    engine.sync(trainer_copy)
    assert torch.equal(engine.model.blocks[0].qkv.weight, fake_quant_e4m3(trainer_copy.blocks[0].qkv.weight.detach(), dim=1))


def test_low_precision_engine_disagrees_with_trainer(policy):
    prompts = _prompts()
    out = {}
    for dtype in ("fp32", "bf16"):
        r = RolloutEngine(policy, dtype, return_full=True).generate(
            prompts, 2, max_new_tokens=4, eos_id=EOS, pad_id=PAD, generator=torch.Generator().manual_seed(0)
        )
        with torch.no_grad():
            trainer = torch.log_softmax(r.response_logits(policy), dim=-1)
        out[dtype] = 0.5 * (trainer.exp() - r.full_logp.exp()).abs().sum(-1)[r.response_mask].max().item()
    assert out["fp32"] < 1e-5 < out["bf16"]


def test_response_mask_ends_at_eos():
    torch.manual_seed(0)
    m = build_policy("tiny", vocab_size=16, block_size=16)
    with torch.no_grad():  # EOS almost surely
        m.lm_head.weight.zero_()
        m.lm_head.weight[EOS] = 0
    r = sample(
        m,
        [[1, 5, 2], [1, 6, 2]],
        max_new_tokens=5,
        eos_id=EOS,
        pad_id=PAD,
        temperature=1.0,
        top_k_logprobs=4,
        generator=torch.Generator().manual_seed(0),
    )
    for row, mask in zip(r.tokens.tolist(), r.response_mask.tolist()):
        n = row.index(EOS) + 1 if EOS in row else len(row)
        assert mask == [True] * n + [False] * (len(row) - n)
        assert all(t == PAD for t in row[n:])


def test_sync_copies_trainer_weights(policy):
    engine = RolloutEngine(policy, "bf16")
    trainer = build_policy("tiny", vocab_size=64, block_size=32)
    engine.sync(trainer)
    for a, b in zip(engine.model.state_dict().values(), trainer.state_dict().values()):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b.to(torch.bfloat16))


def test_left_padding_and_kv_cache_match_full_forward(policy):
    ids, mask = left_pad([[1, 5, 6, 2], [1, 7, 2]], PAD)
    assert mask.tolist() == [[1, 1, 1, 1], [0, 1, 1, 1]]
    full = policy(ids, mask)
    alone = policy(torch.tensor([[1, 7, 2]]))
    assert torch.allclose(full[1, 1:], alone[0], atol=1e-5)
    last, cache = policy.prefill(ids[:, :3], mask[:, :3])
    nxt, _ = policy.extend(ids[:, 3], mask, cache)
    assert torch.allclose(last, full[:, 2], atol=1e-5) and torch.allclose(nxt, full[:, 3], atol=1e-5)


def test_sizes_and_unembedding():
    counts = {name: num_parameters(build_policy(name)) for name in SIZES}
    assert 0.05e6 < counts["tiny"] < 0.2e6 and 0.5e6 < counts["small"] < 2e6 and 3e6 < counts["medium"] < 8e6
    m = build_policy("tiny")
    assert m.lm_head.weight.shape == (512, 48)


def test_engine_rejects_k_beyond_vocab(policy):
    with pytest.raises(ValueError, match="top_k"):
        RolloutEngine(policy, "fp32", top_k_logprobs=65)
    with pytest.raises(ValueError, match="rollout_dtype"):
        RolloutEngine(policy, "int8")


def test_task_heldout_is_disjoint_and_scores():
    task = build_task("sort", length=4, num_symbols=8, heldout_size=32)
    held = {p.prompt_ids for p in task.heldout}
    train = task.sample(500, torch.Generator().manual_seed(0))
    assert len(held) == 32 and not held & {p.prompt_ids for p in train}
    p = train[0]
    assert task.score(p, task.answer_ids(p)) == (1.0, True)
    wrong = [task.answer_ids(p)[0], PAD, PAD, PAD, EOS]
    reward, ok = task.score(p, wrong)
    assert not ok and reward == pytest.approx(sum(a == b for a, b in zip(wrong[:4], p.target)) / 4)
    assert task.score(p, [*p.target, 5, EOS])[1] is False  # an extra token is not exact


class _CharTokenizer:
    """Stand-in for a Hugging Face tokenizer: one id per character, no chat template."""

    chat_template = None
    eos_token_id = 0
    pad_token_id = 0

    def __call__(self, text, add_special_tokens=False):
        return type("Enc", (), {"input_ids": [ord(c) for c in text]})

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids if i)


def test_arithmetic_task_parses_last_integer():
    task = build_task("arithmetic", tokenizer=_CharTokenizer(), max_operand=20, heldout_size=16)
    p = task.sample(1, torch.Generator().manual_seed(0))[0]
    say = lambda s: [ord(c) for c in s] + [0]
    assert task.score(p, say(f"The answer is {p.target}.")) == (1.0, True)
    assert task.score(p, say(f"{p.target + 1}")) == (0.0, False)
    assert task.score(p, say("no idea")) == (0.0, False)


@pytest.mark.parametrize("tied", [False, True])
def test_fp8_engine_on_a_hugging_face_model(tied):
    transformers = pytest.importorskip("transformers")
    from pdmask.lab.models import HFPolicy

    torch.manual_seed(0)
    config = tiny_llama_config(48, tied=tied, pad_id=PAD, eos_id=EOS)
    policy = HFPolicy(transformers.LlamaForCausalLM(config).eval(), tokenizer=None)
    engine = RolloutEngine(policy, "fp8", top_k_logprobs=5, return_full=True)
    # q, k, v, o and the three MLP projections per layer; the (possibly tied) output embedding stays bf16.
    assert sum(isinstance(m, FP8Linear) for m in engine.model.modules()) == 7 * 2
    assert not isinstance(engine.model.lm_head, FP8Linear)
    engine.sync(policy)
    r = engine.generate(_prompts(3), 2, max_new_tokens=4, eos_id=EOS, pad_id=PAD, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        trainer = torch.log_softmax(r.response_logits(policy), dim=-1)
    tv = 0.5 * (trainer.exp() - r.full_logp.exp()).abs().sum(-1)[r.response_mask]
    assert 0 < tv.max() < 0.5
