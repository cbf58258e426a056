"""YAML sections: seed 003's parallel: / training: in every script, one-line refusal of group.key, its three configs."""

from __future__ import annotations

import pytest
from conftest import ROOT, run_script

SCRIPTS = ["train_parallel_timed.py", "ultra_parallel_train_dqn.py", "parallel_train_dqn.py",
           "train_ppo_multiprocess.py"]
SEED_003 = ["ppo_parallel", "ppo_parallel_max_throughput", "ppo_parallel_memory_constrained"]


def write(tmp_path, text: str):
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("script", SCRIPTS)
def test_sections_set_flat_fields_and_refuse_unknown_keys_by_name(script, tmp_path):
    good = write(tmp_path, "parallel:\n  num_workers: 3\ntraining:\n  seed: 7\n")
    result = run_script(script, "--env-id", "CartPole-v1", "--config", good, "--validate-only", timeout=60)
    assert result.returncode == 0, result.stderr
    assert "num_workers: 3" in result.stdout and "seed: 7" in result.stdout
    for text, key in (("parallel:\n  seed: 7\n", "parallel.seed"), ("training:\n  bogus: 1\n", "training.bogus")):
        result = run_script(script, "--config", write(tmp_path, text), "--validate-only", timeout=60)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1 and f"unknown key '{key}'" in lines[0], result.stderr


def test_the_population_keeps_its_own_group_names(tmp_path):
    result = run_script("train_ppo_multiprocess.py", "--config", write(tmp_path, "TRAIN_KWARGS:\n  num_workers: 3\n"),
                        "--env-id", "CartPole-v1", "--validate-only", timeout=60)
    assert result.returncode == 0 and "num_workers: 3" in result.stdout, result.stderr
    result = run_script("train_ppo_multiprocess.py", "--config", write(tmp_path, "TRAIN_KWARGS:\n  gamma: 0.9\n"),
                        "--validate-only", timeout=60)
    assert result.returncode == 2 and "unknown key 'TRAIN_KWARGS.gamma'" in result.stderr


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", SEED_003)
def test_seed_003_configs_validate_and_run(name, tmp_path):
    config = ROOT / "configs" / f"{name}.yaml"
    result = run_script("train_parallel_timed.py", "--config", config, "--validate-only", timeout=60)
    assert result.returncode == 0, result.stderr
    # A short run: one update of the file's own rollout shape.
    result = run_script("train_parallel_timed.py", "--config", config, "--total-timesteps", 1, "--no-tensorboard",
                        "--output-dir", tmp_path / "run", timeout=200)
    assert result.returncode == 0, result.stderr[-2000:]
    summary = (tmp_path / "run" / "summary.json").read_text()
    assert '"updates": 1' in summary
