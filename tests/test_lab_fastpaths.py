"""The lab's fast paths give the same tensors, bit for bit, as the simple computations they replace.

A run's metrics must not depend on them: the grouped prefill (one prefill per prompt, repeated over its
group), the causal attention without a bias tensor, and the FP8 layer's cheaper quantization.
"""

import pytest
import torch
from torch import nn

from pdmask.lab.engine import E4M3_MAX, FP8Linear, RolloutEngine, e4m3_to_float, fake_quant_e4m3, left_pad, sample
from pdmask.lab.models import attention_bias, build_policy
from pdmask.lab.tasks import EOS, PAD


def _prompts(n: int, length: int = 6) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [[1, *torch.randint(4, 36, (length,), generator=g).tolist(), 2] for _ in range(n)]


@pytest.fixture(scope="module")
def small():
    torch.manual_seed(0)
    return build_policy("small", vocab_size=512, block_size=16)


def test_e4m3_table_matches_cast():
    q = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).reshape(16, 16)
    ref, fast = q.float(), e4m3_to_float(q)
    assert torch.equal(fast.isnan(), ref.isnan())
    assert torch.equal(fast[~ref.isnan()], ref[~ref.isnan()])


def _simple_fake_quant(x: torch.Tensor, dim: int) -> torch.Tensor:
    """The plain float32 round trip that fake_quant_e4m3 computes with fewer temporaries."""
    scale = x.abs().amax(dim=dim, keepdim=True).clamp(min=1e-12) / E4M3_MAX
    return (x / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float() * scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fake_quant_and_fp8_linear_match_simple_path(dtype):
    torch.manual_seed(0)
    x = (torch.randn(3, 5, 32) * torch.logspace(-3, 4, 5)[:, None]).to(dtype)
    x[1, 2] = 0  # an all-zero token: the scale's floor
    for dim in (-1, 1):
        assert torch.equal(fake_quant_e4m3(x, dim), _simple_fake_quant(x.float(), dim))
    layer = FP8Linear(nn.Linear(32, 24))
    simple = nn.functional.linear(_simple_fake_quant(x.float(), -1), layer.weight, layer.bias).to(dtype)
    assert torch.equal(layer(x), simple)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_causal_attention_without_bias_matches_bias(small, dtype):
    block = small.blocks[0].to(dtype)
    try:
        x = torch.randn(8, 6, 128, dtype=dtype, requires_grad=True)
        ones = torch.ones(8, 6, dtype=torch.long)
        (y_bias, kv), (y_fast, _) = block(x, attention_bias(ones, 6, dtype), None), block(x, None, None)
        assert torch.equal(y_bias, y_fast)
        g = torch.randn_like(y_bias)
        assert torch.equal(*(torch.autograd.grad(y, x, g)[0] for y in (y_bias, y_fast)))
        step = x[:, -1:].detach()  # one more token against the cache: every key is visible
        ones = torch.ones(8, 7, dtype=torch.long)
        assert torch.equal(block(step, attention_bias(ones, 1, dtype), kv)[0], block(step, None, kv)[0])
    finally:
        block.float()


@pytest.mark.parametrize("dtype", ["fp32", "fp8"])
def test_grouped_prefill_matches_repeated_prompts(small, dtype):
    """The preset's shapes (16 prompts x 8 samples): GEMM rows are independent, so a group's prefill is shared."""
    model = RolloutEngine(small, dtype).model
    ids, mask = left_pad(_prompts(16), PAD)
    logits, cache = model.prefill(ids, mask, repeats=8)
    ref_logits, ref_cache = model.prefill(ids.repeat_interleave(8, 0), mask.repeat_interleave(8, 0))
    assert torch.equal(logits, ref_logits)
    assert all(torch.equal(a, b) for layer, ref in zip(cache, ref_cache) for a, b in zip(layer, ref))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_grouped_sample_matches_repeated_prompts(small, temperature):
    prompts = _prompts(16)
    kwargs = dict(max_new_tokens=8, eos_id=EOS, pad_id=PAD, temperature=temperature, return_full=True)
    grouped = sample(small, prompts, group_size=4, generator=torch.Generator().manual_seed(0), **kwargs)
    repeated = [p for p in prompts for _ in range(4)]
    ref = sample(small, repeated, generator=torch.Generator().manual_seed(0), **kwargs)
    for name in ("input_ids", "attention_mask", "tokens", "response_mask", "logp", "topk_ids", "topk_logp", "full_logp"):
        assert torch.equal(getattr(grouped, name), getattr(ref, name)), name


@pytest.mark.parametrize("family", ["tinygpt", "hf"])
def test_first_keeps_the_logits_of_the_later_positions(small, family):
    """policy(ids, mask, first=k) equals the full forward's positions k.., with left padding too."""
    if family == "hf":
        transformers = pytest.importorskip("transformers")
        from pdmask.lab.models import HFPolicy

        from tiny_llama import tiny_llama_config

        torch.manual_seed(0)
        policy = HFPolicy(transformers.LlamaForCausalLM(tiny_llama_config(48, pad_id=PAD)).eval(), tokenizer=None)
    else:
        policy = small
    ids = torch.tensor([[1, 5, 6, 7, 2, 8], [PAD, PAD, 1, 9, 2, 8]])
    mask = (torch.arange(6) >= torch.tensor([[0], [2]])).long()  # the second row is left-padded
    with torch.no_grad():
        full = policy(ids, mask)
        for k in (0, 3, 5):
            torch.testing.assert_close(policy(ids, mask, first=k), full[:, k:])
