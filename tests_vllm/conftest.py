"""The vLLM integration tests, for their own environment (.venv-vllm, built by .ci/vllm.sh; the main suite does not
collect them). One in-process vLLM CPU engine per session, over a tiny random Llama saved to a temporary directory.

The engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): no spawned process has
to re-import pytest's ``__main__``, and tests can reach the engine's model.
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import pytest
import torch
import transformers

from pdmask.integrations.vllm import engine_kwargs

#: K of the engine: max_logprobs, and the top K the tests ask for.
K = 5
VOCAB = 512


def tiny_llama(seed: int = 0, **overrides) -> transformers.LlamaForCausalLM:
    """Head size 64 (a size vLLM's CPU attention supports); a wide init so μ is peaked enough that the sampled
    token falls both inside and outside the top K. ``overrides``: LlamaConfig fields."""
    torch.manual_seed(seed)
    fields = {
        "vocab_size": VOCAB,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "initializer_range": 0.2,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
    }
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**(fields | overrides))).eval()


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_llama().save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def reference(model_dir) -> transformers.LlamaForCausalLM:
    """The same weights in transformers, float32."""
    return transformers.LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def llm(model_dir):
    from vllm import LLM

    return LLM(
        model=model_dir,
        dtype="float32",
        max_model_len=512,
        enforce_eager=True,
        skip_tokenizer_init=True,  # prompts are token ids; the tiny model has no tokenizer
        seed=0,
        **engine_kwargs(K),
    )
