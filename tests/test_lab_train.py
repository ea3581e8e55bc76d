"""The RL loop: one short run per method, same seed -> same metrics, resume after a kill."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import pdmask
from pdmask import METHODS
from pdmask.lab.engine import RolloutEngine
from pdmask.lab.train import Run, grpo_advantages, read_metrics, tail_metrics, train

from conftest import TINY, make_case, rollout_of


@pytest.fixture(autouse=True)
def _cache(monkeypatch, tmp_path_factory):
    monkeypatch.setenv("PDMASK_CACHE", str(tmp_path_factory.getbasetemp() / "pdmask-cache"))


def _without_time(rows):
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]


@pytest.mark.parametrize("method", list(METHODS))
def test_short_run_per_method(method, tmp_path):
    rows = train(TINY.replace(method=method, steps=2), tmp_path / "run")
    assert [r["step"] for r in rows] == [0, 1, 2]
    last = rows[-1]
    for key in (
        "reward/mean",
        "eval/accuracy",
        "mask/dropped_frac_pos",
        "mask/dropped_frac_neg",
        "div/mean",
        "div/max",
        "mismatch/tv_mean",
        "mismatch/tv_max",
        "policy/entropy",
        "grad/norm",
        "mask/direction_disagree_frac",
        "time/step",
    ):
        assert key in last and last[key] == last[key], key  # present and not NaN
    assert 0 <= last["mask/dropped_frac"] <= 1
    if method == "pg_is":
        assert last["mask/dropped_frac"] == 0
    assert (tmp_path / "run" / "config.json").exists() and (tmp_path / "run" / "checkpoint.pt").exists()


def test_recomputed_mu_and_fp32_engine(tmp_path):
    rows = train(TINY.replace(mu="recompute", rollout_dtype="fp32", steps=1), tmp_path / "run")
    assert rows[-1]["mismatch/tv_mean"] < 1e-5


def test_same_seed_same_metrics(tmp_path):
    a = train(TINY.replace(tensorboard=True), tmp_path / "a")
    b = train(TINY.replace(tensorboard=True), tmp_path / "b")
    c = train(TINY.replace(seed=1), tmp_path / "c")
    assert _without_time(a) == _without_time(b)
    assert _without_time(a) != _without_time(c)
    assert list((tmp_path / "a" / "tb").iterdir())


@pytest.mark.parametrize(("die_at", "lag"), [(1, 0), (3, 0), (3, 2)])
def test_resume_after_kill_between_metrics_and_checkpoint(tmp_path, monkeypatch, die_at, lag):
    cfg = TINY.replace(steps=4, tensorboard=True, rollout_lag=lag)
    reference = train(cfg, tmp_path / "ref")
    original = Run.save_checkpoint
    calls = {"n": 0}

    def dying_save(self):
        calls["n"] += 1
        if calls["n"] == die_at:  # that step's metrics row is written, its checkpoint never is
            raise KeyboardInterrupt
        original(self)

    monkeypatch.setattr(Run, "save_checkpoint", dying_save)
    with pytest.raises(KeyboardInterrupt):
        train(cfg, tmp_path / "killed")
    monkeypatch.setattr(Run, "save_checkpoint", original)
    with open(tmp_path / "killed" / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "reward/me')  # and a torn line, as a kill mid-write leaves
    resumed = train(cfg, tmp_path / "killed", resume=True)
    assert _without_time(resumed) == _without_time(reference)


def test_full_disk_on_checkpoint_names_the_fix_and_leaves_no_partial_file(tmp_path, monkeypatch):
    cfg = TINY.replace(steps=2)
    reference = train(cfg, tmp_path / "ref")
    real_save = torch.save

    def full_disk(obj, path):
        Path(path).write_bytes(b"partial")
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 1486976832 vs 1486976724")

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(RuntimeError, match="GiB free on its disk.*free disk space"):
        train(cfg, tmp_path / "run")
    assert not list((tmp_path / "run").glob("checkpoint*"))  # neither a checkpoint nor its temporary file
    monkeypatch.setattr(torch, "save", real_save)
    assert _without_time(train(cfg, tmp_path / "run", resume=True)) == _without_time(reference)


def test_existing_run_needs_resume_and_same_config(tmp_path):
    from pdmask.lab.config import ConfigError

    train(TINY.replace(steps=1), tmp_path / "run")
    with pytest.raises(ConfigError, match="--resume"):
        Run(TINY.replace(steps=1), tmp_path / "run")
    with pytest.raises(ConfigError, match="lr"):
        Run(TINY.replace(steps=1, lr=0.5), tmp_path / "run", resume=True)


def test_sft_seed_shares_one_warm_start_across_run_seeds(tmp_path, monkeypatch):
    monkeypatch.setenv("PDMASK_CACHE", str(tmp_path / "cache"))
    shared = [Run(TINY.replace(seed=s, sft_seed=7), tmp_path / f"shared{s}") for s in (0, 1)]
    own = Run(TINY.replace(seed=7), tmp_path / "own")  # sft_seed unset: the run's seed, so seed 7's warm start
    assert TINY.replace(seed=0, sft_seed=7).sft_key() == TINY.replace(seed=7).sft_key() != TINY.sft_key()
    assert len(list((tmp_path / "cache" / "sft").glob("*.pt"))) == 1
    for run in (shared[1], own):
        for p, q in zip(shared[0].policy.parameters(), run.policy.parameters()):
            assert torch.equal(p, q)
    # The step-0 evaluation is cached per run seed: seeds sharing a start draw their own sampled responses.
    evals = [run.run()[0] for run in shared]
    assert evals[0]["eval/accuracy"] == evals[1]["eval/accuracy"]  # greedy: the same start
    assert len(list((tmp_path / "cache" / "sft").glob("*.json"))) == 2


def test_grpo_advantages():
    adv = grpo_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0, 0.5, 0.5]), group_size=2)
    assert torch.allclose(adv[:4], torch.tensor([0.7071, -0.7071, 0.7071, -0.7071]), atol=1e-3)
    assert torch.equal(adv[4:], torch.zeros(2))


@pytest.mark.slow
def test_resume_after_sigkill(tmp_path):
    """A real `pdmask train` process killed with SIGKILL mid-run continues with --resume to the same metrics."""
    cfg = TINY.replace(steps=40, eval_every=10)
    (tmp_path / "cfg.json").write_text(json.dumps({k: v for k, v in cfg.to_dict().items()}))
    env = os.environ | {"PYTHONPATH": os.pathsep.join(sys.path)}
    cmd = [sys.executable, "-m", "pdmask.cli", "train", str(tmp_path / "cfg.json"), "--out", str(tmp_path / "killed")]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics = tmp_path / "killed" / "metrics.jsonl"
    # The kill waits for an event (the 6th metrics line: mid-run, past a checkpoint), not for a time; the
    # bound only turns a hang into a failure.
    hang_guard = time.monotonic() + 900
    while not metrics.exists() or metrics.read_text().count("\n") < 6:
        if proc.poll() is not None or time.monotonic() > hang_guard:
            proc.kill()
            pytest.fail(f"`pdmask train` wrote no 6th metrics line (exit code {proc.returncode}).")
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert 0 < len(read_metrics(tmp_path / "killed")) < 41
    subprocess.run([*cmd, "--resume"], env=env, check=True, stdout=subprocess.DEVNULL)
    reference = train(cfg, tmp_path / "ref")
    assert _without_time(read_metrics(tmp_path / "killed")) == _without_time(reference)


def test_step_metrics_pool_shares_over_updates():
    from pdmask import pool_metrics

    # Two updates: 1 of 10 beyond-threshold tokens disagree, then no token is beyond the threshold.
    rows = [
        {"mask/direction_disagree_frac": 0.1, "count/beyond_threshold": 10.0, "div/max": 0.3, "grad/norm": 1.0},
        {"mask/direction_disagree_frac": 0.0, "count/beyond_threshold": 0.0, "div/max": 0.5, "grad/norm": 3.0},
    ]
    out = pool_metrics(rows)
    assert out["mask/direction_disagree_frac"] == pytest.approx(0.1)
    assert out["div/max"] == 0.5 and out["grad/norm"] == 2.0 and "count/beyond_threshold" not in out


def test_rollout_lag_samples_with_the_weights_of_lag_steps_ago(tmp_path, monkeypatch):
    lag, steps = 2, 5
    starts, synced = [], []
    original_step, original_sync = Run.train_step, RolloutEngine.sync

    def step(self):
        starts.append({k: v.clone() for k, v in self.policy.state_dict().items()})
        return original_step(self)

    def sync(self, weights):
        synced.append({k: v.clone() for k, v in (weights if isinstance(weights, dict) else weights.state_dict()).items()})
        original_sync(self, weights)

    monkeypatch.setattr(Run, "train_step", step)
    monkeypatch.setattr(RolloutEngine, "sync", sync)
    train(TINY.replace(steps=steps, rollout_lag=lag), tmp_path / "run")
    assert len(synced) == len(starts) == steps
    for t in range(steps):
        want = starts[max(0, t - lag)]
        assert all(torch.equal(synced[t][k], want[k]) for k in want), t
    assert not all(torch.equal(synced[-1][k], starts[-1][k]) for k in starts[-1])  # really stale
    ckpt = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)
    assert len(ckpt["lagged"]) == lag  # the weights later steps will sample with


def test_rollout_lag_adds_staleness_to_the_mismatch(tmp_path):
    rows = {lag: train(TINY.replace(steps=3, lr=3e-3, rollout_lag=lag), tmp_path / f"lag{lag}") for lag in (0, 1)}
    assert rows[0][1]["mismatch/tv_mean"] == rows[1][1]["mismatch/tv_mean"]  # step 1 samples the same weights
    assert rows[1][-1]["mismatch/tv_mean"] > 2 * rows[0][-1]["mismatch/tv_mean"]


def test_tail_metrics_count_where_the_estimators_masks_differ():
    """Random logits far from a random μ, every token beyond a tiny δ: the paper's two tails' masks differ on some."""
    z, logmu, a, topk_ids, topk_logp = make_case(400, 64, 3, drift=2.0, dtype=torch.float32)
    mu = rollout_of(logmu.float(), a, topk_ids, topk_logp.float())
    adv = torch.randn(400, generator=torch.Generator().manual_seed(1))
    valid = torch.ones(400, dtype=torch.bool)
    cfg = TINY.replace(method="pdm_proportional_tv", delta_tv=1e-3)
    stats = pdmask.policy_stats(z, a, mu, need_sq_norm=True, need_exactpi=True)
    out = tail_metrics(cfg, stats, adv, valid)
    keep = {
        e: pdmask.trust_region_mask(f"pdm_{e}_tv", stats, adv, valid, delta_low=1e-3, delta_high=1e-3)
        for e in ("aggregated", "uniform")
    }
    differ = (keep["aggregated"] != keep["uniform"]).double().mean().item()
    assert differ > 0.05 and out["topk/paper_tails_differ_frac"] == pytest.approx(differ)
    assert out["topk/masks_differ_frac"] >= out["topk/paper_tails_differ_frac"]
    assert out["topk/pi_rest_mean"] == pytest.approx(stats.rest_mass.mean().item(), rel=1e-5)
    # Padding does not count, and a method without a divergence (pg_is) is measured with TV.
    half = valid.clone()
    half[200:] = False
    assert tail_metrics(cfg.replace(method="pg_is"), stats, adv, half)["topk/paper_tails_differ_frac"] == pytest.approx(
        (keep["aggregated"] != keep["uniform"])[:200].double().mean().item()
    )
