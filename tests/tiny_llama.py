"""The tiny random Llama of the CPU tests (a module of its own: tests_vllm imports test_trl next to its own conftest)."""

from __future__ import annotations


def tiny_llama_config(vocab_size: int, tied: bool = False, pad_id: int = 0, eos_id: int = 1):
    """A two-layer Llama config small enough for CPU unit tests (needs transformers)."""
    import transformers

    return transformers.LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=pad_id,
        eos_token_id=eos_id,
        bos_token_id=None,
        tie_word_embeddings=tied,
    )
