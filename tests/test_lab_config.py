"""Bad configs fail with a clear message before any work starts."""

import json

import pytest

from pdmask import METHODS
from pdmask.cli import main
from pdmask.lab.config import Config, ConfigError, config_from, load_config
from pdmask.lab.presets import PRESETS


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"method": "dppo_magic"}, "method: unknown method 'dppo_magic'"),
        ({"top_k": 600}, "top_k: K = 600 is larger than the vocabulary"),
        ({"group_size": 1}, "group_size: must be >= 2"),
        ({"minibatches": 3}, "minibatches: 3 does not divide"),
        ({"rollout_dtype": "int8"}, "rollout_dtype: unknown precision"),
        ({"rollout_lag": -1}, "rollout_lag: must be >= 0"),
        ({"model": "huge"}, "model: unknown policy"),
        ({"task": "arithmetic"}, "does not fit model"),
        ({"model": "smollm2-135m"}, "does not fit model"),
        ({"vocab_size": 20}, "vocab_size: 20 is too small"),
        ({"mu": "guess"}, "mu: must be"),
        ({"lr": 0.0}, "lr: must be > 0"),
        ({"delta_tv": -0.1}, "delta_tv: must be > 0"),
        ({"steps": 0}, "steps: must be >= 1"),
        ({"agg": "sum"}, "agg: must be one of"),
        ({"sft_seed": -1}, "sft_seed: must be >= 0"),
        ({"task": "class_sort", "class_size": 0}, "class_size: must be between 1 and num_symbols"),
        ({"task": "class_sort", "class_size": 33}, "class_size: must be between 1 and num_symbols"),
    ],
)
def test_bad_config(changes, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        config_from(changes)


def test_unknown_field_and_bad_value():
    with pytest.raises(ConfigError, match="learning_rate: unknown config field"):
        config_from({"learning_rate": 1e-3})
    with pytest.raises(ConfigError, match="steps: cannot read 'many'"):
        config_from({"steps": "many"})


def test_config_files(tmp_path):
    (tmp_path / "a.toml").write_text('method = "ppo_clip"\nsteps = 7\ndelta_tv = 0.2\n')
    cfg = load_config(tmp_path / "a.toml", ["seed=3", "tensorboard=false"])
    assert (cfg.method, cfg.steps, cfg.delta_tv, cfg.seed, cfg.tensorboard) == ("ppo_clip", 7, 0.2, 3, False)
    (tmp_path / "b.json").write_text(json.dumps({"method": "pdm_proportional_kl", "delta_kl": 0.1}))
    assert load_config(tmp_path / "b.json").thresholds() == {"delta_low": 0.1, "delta_high": 0.1}
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.json")


def test_thresholds_follow_the_method_kind():
    cfg = Config(delta_tv=0.2, delta_kl=0.01, eps_high=0.3)
    assert cfg.replace(method="dppo_topk_tv").thresholds() == {"delta_low": 0.2, "delta_high": 0.2}
    assert cfg.replace(method="pdm_aggregated_kl").thresholds() == {"delta_low": 0.01, "delta_high": 0.01}
    assert cfg.replace(method="ppo_clip").thresholds() == {"eps_high": 0.3}
    assert cfg.replace(method="pg_is").thresholds() == {}


def test_presets_are_valid_and_fair():
    for sweep in PRESETS.values():
        configs = sweep.validate().configs()
        varying = {"method", "seed", "rollout_dtype"}
        for model in sweep.models:  # within a model (a setting), only the method, seed and precision vary
            shared = [{k: v for k, v in c.to_dict().items() if k not in varying} for c in configs if c.model == model]
            assert all(s == shared[0] for s in shared)
    default = PRESETS["default"]  # the paper's comparison, enough seeds for a verdict
    assert {"pg_is", "dppo_topk_kl", "pdm_aggregated_kl", "pdm_uniform_kl"} <= set(default.methods)
    assert len(default.seeds) >= 12 and default.rollout_dtypes == ("fp8",) and default.accuracy == "sampled"
    assert default.base.task == "class_sort" and default.base.delta_kl is None and default.base.top_k == 20  # δ_KL 0.05
    assert PRESETS["sort"].base.task == "sort" and set(PRESETS["sort"].seeds) == set(range(12))
    assert {"dppo_topk_tv", "pdm_aggregated_tv", "pdm_uniform_tv"} <= set(PRESETS["tv"].methods)
    long = PRESETS["long"]
    assert len(long.seeds) >= 32 and not set(long.seeds) & (set(default.seeds) | set(PRESETS["sort"].seeds))
    assert set(long.rollout_dtypes) == {"fp8", "bf16"}
    long_fp8 = {c.method for c in long.configs() if c.rollout_dtype == "fp8"}
    assert {"pg_is", "dppo_topk_kl", "pdm_aggregated_kl", "pdm_uniform_kl"} <= long_fp8
    sizes = PRESETS["sizes"]
    assert set(sizes.models) == {"tiny", "small", "medium"} and len(sizes.rollout_dtypes) >= 2
    assert {"pg_is", "ppo_clip", "dppo_topk_tv", "dppo_topk_kl", "pdm_aggregated_kl", "pdm_proportional_tv"} <= set(sizes.methods)
    assert len(sizes.seeds) >= 3
    assert {c.steps for c in sizes.configs() if c.model == "medium"} == {sizes.model_overrides["medium"]["steps"]}
    grid = PRESETS["grid"]
    assert len(grid.models) == 3 and set(grid.rollout_dtypes) >= {"fp32", "bf16", "fp16"} and len(grid.seeds) == 5
    assert set(grid.methods) == set(METHODS) and "paper" not in PRESETS


def test_set_wins_over_per_model_settings(tmp_path):
    import argparse

    from pdmask.lab.compare_cli import add_arguments, build_sweep

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    sweep = build_sweep(parser.parse_args(["--preset", "sizes", "--set", "steps=7"]))
    assert {c.steps for c in sweep.configs()} == {7}


def test_cli_reports_config_errors_without_work(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--set", "group_size=1", "--out", str(out)]) == 2
    assert "group_size: must be >= 2" in capsys.readouterr().err
    assert not out.exists()
    assert main(["compare", "--methods", "ppo_clip,nope", "--out", str(tmp_path / "cmp")]) == 2
    assert "unknown method 'nope'" in capsys.readouterr().err
    assert main(["compare", "--preset", "huge", "--out", str(tmp_path / "cmp")]) == 2
    assert main(["compare", "--set", "model=small", "--out", str(tmp_path / "cmp")]) == 2
    assert "use --models instead" in capsys.readouterr().err
    assert not (tmp_path / "cmp").exists()
