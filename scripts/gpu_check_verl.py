"""GPU check of pdmask's verl integration on one GPU (``bash scripts/gpu_check_verl.sh``; not run on a GPU yet).

Each check prints PASS, FAIL (with the error) or SKIP (a module missing); exit status 1 if any failed.
``--cpu`` dry-runs the same checks on the CPU (gloo, pdmask's CPU platform) to test the script itself; there the
Megatron engine check fails where Megatron-core needs CUDA (docs/verl.md).
1. FSDP: verl's FSDP2 engine on cuda (float32, TF32 off) with the tests' tiny Llama, ``PDMLoss`` through its
   logits-processor hook in the remove-padding and padded layouts: each loss equals ``pdmask.policy_loss`` on
   the same model's float32 logits computed on the CPU (the CPU reference).
2. Megatron hook on cuda: verl's own Megatron engine forward (``gptmodel_forward_model_engine``,
   ``_lm_head_logits_processor``) with the stand-in GPT of ``tests_verl/test_megatron.py``, NCCL, tp = cp = 1.
3. Megatron engine: verl's ``MegatronEngineWithLMHead`` built from the tiny Llama (tp = 1, bfloat16: the engine's
   only precisions are bfloat16 and float16), ``infer_batch`` with ``PDMLoss``, against the CPU reference to a
   bfloat16 tolerance (needs Megatron-core, Transformer Engine and Megatron-Bridge).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests_verl"))
from conftest import DELTA, TAU, K, actor_config, engine_data, make_rollout_batch  # noqa: E402

METHODS = ("pdm_aggregated_kl", "pdm_proportional_tv", "pdm_exactpi_tv", "dppo_topk_kl")
results: list[tuple[str, str, str]] = []


def check(name: str) -> Callable[[Callable[[], None]], None]:
    def run(fn: Callable[[], None]) -> None:
        start = time.time()
        try:
            fn()
            results.append((name, "PASS", f"{time.time() - start:.1f}s"))
        except (ModuleNotFoundError, pytest.skip.Exception) as err:
            results.append((name, "SKIP", repr(err)))
        except Exception as err:  # noqa: BLE001  (a check's failure is reported; the others still run)
            traceback.print_exc()
            results.append((name, "FAIL", repr(err)[:300]))
        print(*results[-1], flush=True)

    return run


def reference(batch: dict, logits: torch.Tensor, method: str) -> torch.Tensor:
    """pdmask.policy_loss on the CPU: the loss verl's engine must give."""
    import pdmask

    rollout = pdmask.RolloutLogprobs(batch["rollout_log_probs"], batch["rollout_topk_ids"], batch["rollout_topk_log_probs"])
    thresholds = {"delta_low": DELTA, "delta_high": DELTA, "ratio_cap": 3.0}
    loss, _ = pdmask.policy_loss(
        method, logits, batch["responses"], rollout, batch["advantages"], batch["response_mask"], **thresholds
    )
    return loss


def loss_fn(method: str, **config: object):
    from verl.workers.config import PolicyLossConfig

    from pdmask.integrations.verl import PDMLoss

    loss_mode = PolicyLossConfig(loss_mode=f"pdmask_{method}")
    return PDMLoss(actor_config(clip_ratio_low=DELTA, clip_ratio_high=DELTA, policy_loss=loss_mode, **config), top_k=K)


def main(device: str) -> int:
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29533", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    for key, value in (env | {"LOCAL_WORLD_SIZE": "1"}).items():
        os.environ.setdefault(key, value)
    if device == "cpu":
        from pdmask.testing.verl import init_cpu_process_group

        init_cpu_process_group()
    else:
        assert torch.cuda.is_available(), "no GPU: this script checks the GPU paths (--cpu dry-runs it)"
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        torch.distributed.init_process_group("nccl", rank=0, world_size=1)
    from pdmask.testing.verl import actor_configs, save_tiny_llama

    model_dir = save_tiny_llama(tempfile.mkdtemp(prefix="pdmask_gpu_check_"))
    batch, logits = make_rollout_batch(model_dir)

    @check(f"FSDP2 engine on {device}: PDMLoss loss = CPU reference")
    def _fsdp() -> None:
        from verl.workers.engine import EngineRegistry

        for rmpad in (True, False):
            torch.manual_seed(0)
            configs = actor_configs(model_dir, use_remove_padding=rmpad)
            engine = EngineRegistry.new(model_type="language_model", backend="fsdp2", **configs)
            engine.initialize()
            for method in METHODS:
                out = engine.infer_batch(engine_data(batch, rmpad=rmpad), loss_function=loss_fn(method))
                got = torch.tensor(sum(out["loss"])).cpu()
                torch.testing.assert_close(got, reference(batch, logits, method), rtol=1e-4, atol=1e-5)

    @check(f"Megatron engine forward + PDMLoss hook on {device} (stand-in GPT, tp = cp = 1) = CPU reference")
    def _megatron_hook() -> None:
        import test_megatron
        from megatron.core import parallel_state as mpu

        mpu.initialize_model_parallel(tensor_model_parallel_size=1, context_parallel_size=1)
        try:
            table = torch.randn(test_megatron.VOCAB, test_megatron.VOCAB, generator=torch.Generator().manual_seed(2)) * 2
            p_len = batch["prompts"].shape[1]
            ref_logits = table[batch["input_ids"][:, p_len - 1 : -1]] / TAU
            for data_format in ("thd", "bshd"):
                for method in METHODS:
                    data = engine_data(batch, rmpad=data_format == "thd", dp_size=1, batch_num_tokens=None).to(device)
                    loss, _ = test_megatron._forward(data, table.to(device), data_format, method)
                    torch.testing.assert_close(
                        loss.detach().cpu(), reference(batch, ref_logits, method), rtol=1e-5, atol=1e-6
                    )
        finally:
            mpu.destroy_model_parallel()

    @check("verl MegatronEngineWithLMHead (tp = 1) + PDMLoss = CPU reference")
    def _megatron_engine() -> None:
        import megatron.core  # noqa: F401
        from verl.workers.config import HFModelConfig, McoreEngineConfig, McoreOptimizerConfig
        from verl.workers.engine import EngineRegistry

        engine = EngineRegistry.new(
            model_type="language_model",
            backend="megatron",
            model_config=HFModelConfig(path=model_dir),
            engine_config=McoreEngineConfig(dtype="bfloat16", sequence_parallel=False, use_distributed_optimizer=False),
            optimizer_config=McoreOptimizerConfig(lr=1e-3),
            checkpoint_config=actor_configs(model_dir, use_remove_padding=True)["checkpoint_config"],
        )
        engine.initialize()
        for method in METHODS:
            data = engine_data(batch, rmpad=True, dp_size=1, batch_num_tokens=None)
            out = engine.infer_batch(data, loss_function=loss_fn(method, strategy="megatron"))
            got = torch.tensor(sum(out["loss"])).float().cpu()
            # verl's Megatron engine computes in bfloat16 or float16 only: a bfloat16 tolerance.
            torch.testing.assert_close(got, reference(batch, logits, method), rtol=5e-2, atol=5e-3)

    failed = [r for r in results if r[1] == "FAIL"]
    print(f"{len(results) - len(failed)} of {len(results)} checks passed or skipped; {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main("cpu" if "--cpu" in sys.argv[1:] else "cuda"))
