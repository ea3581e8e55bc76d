"""The rollout engine: a low-precision copy of the policy that samples like vLLM with ``logprobs=K``.

It returns, per response position, the sampled token's log-prob log μ(a) and the top-K ids and
log-probs of μ (K configurable), all computed in float32 from the engine's logits, which come out of
a forward pass in the engine's precision (fp32, bf16, fp16 or fp8). The trainer keeps float32 weights,
so the two really disagree, as vLLM and FSDP do. ``sync`` copies the trainer's weights (cast, and
quantized for fp8) before each rollout batch.

``fp8`` simulates an FP8 rollout engine (vLLM ``quantization="fp8"``): every ``nn.Linear`` except the
output embedding runs with E4M3 weights (one scale per output channel) and E4M3 activations (one scale
per token), the product accumulated in float32 and returned in bf16; everything else runs in bf16.

``sample(policy, prompts, ...)`` is the same sampler without a copy (for evaluation, greedy with
temperature 0).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch
from torch import Tensor, nn

from pdmask import RolloutLogprobs

#: Rollout precision -> the dtype the engine's non-quantized parts run in (fp8: its Linear layers are E4M3).
DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp8": torch.bfloat16,
}
E4M3_MAX = 448.0  # largest finite float8_e4m3fn


def dtype_supported(name: str) -> bool:
    """Whether this CPU/torch build runs the ops a transformer needs in that precision."""
    dt = DTYPES[name]
    try:
        x = torch.randn(2, 3, 8).to(dt)
        y = torch.nn.functional.scaled_dot_product_attention(x[:, None], x[:, None], x[:, None], is_causal=True)
        torch.nn.functional.layer_norm(y, (8,)) @ torch.randn(8, 4).to(dt)
        if name == "fp8":
            fake_quant_e4m3(x.float(), dim=-1)
        return True
    except (RuntimeError, AttributeError):  # AttributeError: a torch without float8_e4m3fn
        return False


def _e4m3_values() -> Tensor | None:
    """The float32 value of each of the 256 float8_e4m3fn bit patterns (None without float8 support)."""
    try:
        return torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    except (RuntimeError, AttributeError):
        return None


_E4M3_VALUES = _e4m3_values()


def e4m3_to_float(q: Tensor) -> Tensor:
    """``q.float()`` for a float8_e4m3fn tensor, by table look-up: the same values, several times faster on CPU."""
    return _E4M3_VALUES.index_select(0, q.view(torch.uint8).flatten().int()).view(q.shape)


def fake_quant_e4m3(x: Tensor, dim: int) -> Tensor:
    """x rounded to E4M3 with one scale per slice along ``dim`` (s = amax|x| / 448), dequantized.

    The round trip x -> fp8(x / s) * s is what an FP8 GEMM sees; it is computed in float32 and the result
    is float32. x may be bf16/fp16: |x| and its max are exact in x's dtype, so this equals passing x.float().
    """
    # In-place on fresh tensors: the same arithmetic as (x / s).clamp(..) etc., without the temporaries.
    scale = x.abs().amax(dim=dim, keepdim=True).float().clamp_(min=1e-12).div_(E4M3_MAX)
    q = torch.div(x, scale).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return e4m3_to_float(q).mul_(scale)


class FP8Linear(nn.Module):
    """An ``nn.Linear`` as an FP8 engine runs it: E4M3 weights per output channel, E4M3 activations per token.

    ``weight`` holds the dequantized E4M3 values in float32 (refreshed by ``load``); the product is
    accumulated in float32 and returned in the input's dtype, like an FP8 GEMM with a bf16 output.
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty_like(linear.weight, dtype=torch.float32), requires_grad=False)
        self.bias = None
        if linear.bias is not None:
            self.bias = nn.Parameter(linear.bias.detach().float().clone(), requires_grad=False)
        self.load(linear.weight)

    @torch.no_grad()
    def load(self, weight: Tensor) -> None:
        """Quantize ``weight`` [out, in] per output channel into ``self.weight``."""
        self.weight.copy_(fake_quant_e4m3(weight.detach().float(), dim=1))

    def forward(self, x: Tensor) -> Tensor:
        y = nn.functional.linear(fake_quant_e4m3(x, dim=-1), self.weight, self.bias)
        return y.to(x.dtype)


def _to_fp8(model: nn.Module) -> None:
    """Replace every nn.Linear but the output embedding by an FP8Linear (vLLM keeps lm_head unquantized)."""
    head = model.lm_head if hasattr(model, "lm_head") else None
    head = head.weight if isinstance(head, nn.Module) else None
    for module in list(model.modules()):
        for name, child in module.named_children():
            if isinstance(child, nn.Linear) and child.weight is not head:
                setattr(module, name, FP8Linear(child))


@dataclass
class RolloutBatch:
    """A batch of N = prompts × group_size sampled sequences (prompt length P, response length R)."""

    input_ids: Tensor  # [N, P + R] int64: left-padded prompt, then response (pad after EOS)
    attention_mask: Tensor  # [N, P + R] int64: 0 on left padding
    tokens: Tensor  # [N, R] int64: the response tokens
    response_mask: Tensor  # [N, R] bool: generated tokens up to and including EOS
    logp: Tensor  # [N, R] float32: log mu(a) of the sampled token
    topk_ids: Tensor  # [N, R, K] int64: the engine's K most likely tokens
    topk_logp: Tensor  # [N, R, K] float32: their log-probs
    full_logp: Tensor | None = None  # [N, R, V] float32 when the engine was asked for it

    @property
    def prompt_len(self) -> int:
        return self.input_ids.shape[1] - self.tokens.shape[1]

    def response_logits(self, policy: nn.Module) -> Tensor:
        """The policy's logits that predict the response [N, R, V] (its output layer runs on those positions only)."""
        return policy(self.input_ids, self.attention_mask, first=self.prompt_len - 1)[:, :-1]

    def rollout_logprobs(self, with_full: bool = False) -> RolloutLogprobs:
        """What the trainer knows about mu, as pdmask.RolloutLogprobs (top-K; full only if asked and present)."""
        return RolloutLogprobs(
            self.logp, topk_ids=self.topk_ids, topk_logp=self.topk_logp, full_logp=self.full_logp if with_full else None
        )

    def select(self, index: Tensor) -> RolloutBatch:
        """The sub-batch of rows ``index`` [n]."""
        return RolloutBatch(
            **{f.name: None if getattr(self, f.name) is None else getattr(self, f.name)[index] for f in fields(self)}
        )


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """Prompts of different lengths -> input_ids, attention_mask [n, P_max] with padding on the left."""
    P = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), P), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), P), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, P - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[i, P - len(p) :] = 1
    return ids, mask


@torch.no_grad()
def sample(
    policy: nn.Module,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    eos_id: int,
    pad_id: int,
    temperature: float = 1.0,
    top_k_logprobs: int = 20,
    generator: torch.Generator | None = None,
    return_full: bool = False,
    group_size: int = 1,
) -> RolloutBatch:
    """Sample ``group_size`` responses per prompt (temperature 0 = greedy; log-probs are then at temperature 1).

    Rows are grouped: row i answers prompt i // group_size (as if each prompt were repeated group_size times).
    The log-probs are log_softmax(logits.float() / temperature), i.e. of the distribution sampled from.
    """
    prompt_ids, prompt_mask = left_pad(prompts, pad_id)
    # A group shares its prompt: its prefill is computed once and repeated (the same numbers as per row).
    logits, cache = policy.prefill(prompt_ids, prompt_mask, repeats=group_size)
    prompt_ids, prompt_mask = prompt_ids.repeat_interleave(group_size, 0), prompt_mask.repeat_interleave(group_size, 0)
    n, P = prompt_ids.shape
    scale = temperature if temperature > 0 else 1.0
    # The mask of every position the responses can reach; step i's model sees its first P + i + 1 columns.
    attention_mask = torch.cat([prompt_mask, torch.ones(n, max_new_tokens, dtype=torch.long)], dim=1)
    done = torch.zeros(n, dtype=torch.bool)
    out: dict[str, list[Tensor]] = {"tokens": [], "mask": [], "logp": [], "ids": [], "topk": [], "full": []}
    for i in range(max_new_tokens):
        logp_all = torch.log_softmax(logits.float() / scale, dim=-1)  # [n, V]
        if temperature > 0:
            tok = torch.multinomial(logp_all.exp(), 1, generator=generator).squeeze(1)
        else:
            tok = logp_all.argmax(-1)
        tok = tok.masked_fill(done, pad_id)
        topk_logp, topk_ids = logp_all.topk(top_k_logprobs, dim=-1)
        out["tokens"].append(tok)
        out["mask"].append(~done)
        out["logp"].append(logp_all.gather(-1, tok[:, None]).squeeze(1))
        out["ids"].append(topk_ids)
        out["topk"].append(topk_logp)
        if return_full:
            out["full"].append(logp_all)
        done = done | (tok == eos_id)
        if done.all():
            break
        logits, cache = policy.extend(tok, attention_mask[:, : P + i + 1], cache)
    tokens = torch.stack(out["tokens"], 1)
    return RolloutBatch(
        input_ids=torch.cat([prompt_ids, tokens], dim=1),
        attention_mask=attention_mask[:, : P + tokens.shape[1]].contiguous(),
        tokens=tokens,
        response_mask=torch.stack(out["mask"], 1),
        logp=torch.stack(out["logp"], 1),  # at padding: the pad token's log-prob (consistent with top-K)
        topk_ids=torch.stack(out["ids"], 1),
        topk_logp=torch.stack(out["topk"], 1),
        full_logp=torch.stack(out["full"], 1) if return_full else None,
    )


class RolloutEngine:
    """A copy of the policy in ``dtype`` ("fp32" | "bf16" | "fp16" | "fp8") that generates groups of responses."""

    def __init__(
        self, policy: nn.Module, dtype: str = "bf16", top_k_logprobs: int = 20, return_full: bool = False
    ) -> None:
        if dtype not in DTYPES:
            raise ValueError(f"rollout_dtype: unknown precision {dtype!r}; choose one of {', '.join(DTYPES)}")
        if not 1 <= top_k_logprobs <= policy.vocab_size:
            raise ValueError(f"top_k: must be in [1, vocab size {policy.vocab_size}], got {top_k_logprobs}")
        self.dtype, self.top_k_logprobs, self.return_full = dtype, top_k_logprobs, return_full
        self.model = copy.deepcopy(policy).to(DTYPES[dtype]).eval().requires_grad_(False)
        if dtype == "fp8":
            _to_fp8(self.model)
            self.sync(policy)

    @torch.no_grad()
    def sync(self, policy: nn.Module | dict[str, Tensor]) -> None:
        """Load the trainer's weights (a module or its state dict), cast or quantized, like a vLLM weight update."""
        source = policy if isinstance(policy, dict) else policy.state_dict()
        for dst, src in zip(self.model.state_dict().values(), source.values(), strict=True):
            dst.copy_(src)
        for m in self.model.modules():
            if isinstance(m, FP8Linear):  # the copy above loaded raw float32 weights: quantize them
                m.load(m.weight)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        group_size: int,
        temperature: float = 1.0,
        top_k_logprobs: int | None = None,
        *,
        max_new_tokens: int,
        eos_id: int,
        pad_id: int,
        generator: torch.Generator | None = None,
    ) -> RolloutBatch:
        """group_size responses per prompt; rows are grouped: row i belongs to prompt i // group_size."""
        return sample(
            self.model,
            prompts,
            max_new_tokens=max_new_tokens,
            eos_id=eos_id,
            pad_id=pad_id,
            temperature=temperature,
            top_k_logprobs=top_k_logprobs or self.top_k_logprobs,
            generator=generator,
            return_full=self.return_full,
            group_size=group_size,
        )
