"""The lab's rollout engine on a real vLLM engine (``engine=vllm``, pretrained models; ``pip install pdmask[vllm]``).

Same interface as ``pdmask.lab.engine.RolloutEngine``: ``sync`` loads the trainer's weights before
every rollout batch, ``generate`` returns a ``RolloutBatch`` with log μ(a) and μ's top K, read from vLLM's
processed log-probs by ``pdmask.integrations.vllm.rollout_from_outputs``. The engine runs its own
implementation (kernels, attention, KV cache) in its own precision, so the mismatch the lab measures
is the real one between two implementations.

vLLM runs inside this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so weights pass by reference
and a script needs no ``__main__`` guard. Two traps of vLLM's CPU backend are handled here:
- its linear layers compute from weights prepacked at load time, so ``model.load_weights`` alone
  leaves them stale; ``sync`` uses the worker's ``reload_weights``, which repacks;
- its worker replaces ``torch.set_num_threads`` by a no-op in the whole process; the engine puts it
  back, so the trainer's ``threads`` setting still applies.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from torch import Tensor, nn

from pdmask.lab.engine import RolloutBatch, left_pad

#: Rollout precision -> vLLM ``dtype``.
VLLM_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


class VLLMEngine:
    """A vLLM engine over a copy of an ``HFPolicy``, in ``dtype`` ("fp32" | "bf16" | "fp16" where vLLM runs it).

    ``max_model_len`` (prompt plus response) defaults to the model's own limit. vLLM seeds the global
    torch generator with ``seed`` when it starts; the lab's draws use their own generators.
    """

    def __init__(
        self,
        policy: nn.Module,
        dtype: str = "fp32",
        top_k_logprobs: int = 20,
        seed: int = 0,
        max_model_len: int | None = None,
    ) -> None:
        if dtype not in VLLM_DTYPES:
            raise ValueError(f"rollout_dtype: engine=vllm runs {', '.join(VLLM_DTYPES)}, not {dtype!r}")
        model = getattr(policy, "model", None)
        if not hasattr(model, "config"):
            raise ValueError("engine=vllm serves Hugging Face policies (smollm2-135m, hf:PATH), not TinyGPT")
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process: sync passes tensors by reference
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vLLM's CPU default is 4
        # First: without vLLM this raises ImportError naming the extra to install.
        from vllm import LLM

        from pdmask.integrations.vllm import PROCESSED, engine_kwargs, rollout_from_outputs, sampling_params

        self._convert, self._params, self._mode = rollout_from_outputs, sampling_params, PROCESSED
        self.dtype, self.top_k_logprobs = dtype, top_k_logprobs
        self.vocab_size = int(policy.vocab_size)
        set_num_threads, threads = torch.set_num_threads, torch.get_num_threads()
        with tempfile.TemporaryDirectory(prefix="pdmask-vllm-") as path:
            # Only the architecture goes to disk (without the GGUF quantization a smollm2-135m policy was
            # loaded from): vLLM starts from dummy weights and sync loads the trainer's.
            config = model.config.to_dict()
            config.pop("quantization_config", None)
            (Path(path) / "config.json").write_text(json.dumps(config))
            try:
                self.llm = LLM(
                    model=path,
                    load_format="dummy",
                    dtype=VLLM_DTYPES[dtype],
                    max_model_len=max_model_len,
                    enforce_eager=True,
                    skip_tokenizer_init=True,  # prompts are token ids
                    seed=seed,
                    **engine_kwargs(top_k_logprobs),
                )
            finally:
                torch.set_num_threads = set_num_threads
                torch.set_num_threads(threads)
        self.sync(policy)
        got = str(self.llm.llm_engine.model_config.dtype).removeprefix("torch.")
        if got != VLLM_DTYPES[dtype]:
            raise ValueError(f"rollout_dtype: vLLM runs this model in {got} here, not {VLLM_DTYPES[dtype]}; choose fp32 or bf16")

    @torch.no_grad()
    def sync(self, policy: nn.Module | Mapping[str, Tensor]) -> None:
        """Load the trainer's weights (the policy or its state dict, ``model.``-prefixed names) into vLLM."""
        state = policy.state_dict() if isinstance(policy, nn.Module) else policy
        weights = [(name.removeprefix("model."), tensor) for name, tensor in state.items()]
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        self.llm.reset_prefix_cache()  # cached prefixes hold keys and values of the old weights

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
        from vllm.inputs import TokensPrompt

        k = top_k_logprobs or self.top_k_logprobs
        seeds = torch.randint(2**31 - 1, (len(prompts),), generator=generator).tolist()
        params = [
            self._params(
                k,
                temperature,
                n=group_size,
                max_tokens=max_new_tokens,
                stop_token_ids=[eos_id],  # the task's end; vLLM has no tokenizer to know another
                seed=seed,
                detokenize=False,
            )
            for seed in seeds
        ]
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)
        done = self._convert(outputs, k, logprobs_mode=self._mode, temperature=temperature)
        mask = done.response_mask
        # Positions past a response's end become the lab's padding: the pad token, with μ(pad) = 1.
        tokens = torch.where(mask, done.tokens, pad_id)
        pad_ids = (pad_id + torch.arange(k)) % self.vocab_size
        pad_logp = torch.full((k,), -torch.inf)
        pad_logp[0] = 0.0
        col = mask.unsqueeze(-1)
        prompt_ids, prompt_mask = left_pad([p for p in prompts for _ in range(group_size)], pad_id)
        return RolloutBatch(
            input_ids=torch.cat([prompt_ids, tokens], 1),
            attention_mask=torch.cat([prompt_mask, torch.ones_like(tokens)], 1),
            tokens=tokens,
            response_mask=mask,
            logp=torch.where(mask, done.rollout.logp, 0.0),
            topk_ids=torch.where(col, done.rollout.topk_ids, pad_ids),
            topk_logp=torch.where(col, done.rollout.topk_logp, pad_logp),
        )
