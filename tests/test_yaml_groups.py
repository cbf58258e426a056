"""YAML sections: seed 003's parallel: / training: in every script, one-line refusal of group.key, its three configs."""

from __future__ import annotations

import importlib

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
def test_sections_set_flat_fields(script, tmp_path, capsys):
    """(A key a section does not take is a cell of the fault matrix, tests/test_faults.py.)"""
    good = write(tmp_path, "parallel:\n  num_workers: 3\ntraining:\n  seed: 7\n")
    main = importlib.import_module(script.removesuffix(".py")).main
    assert main(["--env-id", "CartPole-v1", "--config", str(good), "--validate-only"]) == 0
    out = capsys.readouterr().out
    assert "num_workers: 3" in out and "seed: 7" in out


def test_the_population_keeps_its_own_group_names(tmp_path, capsys):
    import train_ppo_multiprocess

    config = write(tmp_path, "TRAIN_KWARGS:\n  num_workers: 3\n")
    assert train_ppo_multiprocess.main(["--config", str(config), "--env-id", "CartPole-v1", "--validate-only"]) == 0
    assert "num_workers: 3" in capsys.readouterr().out
    config = write(tmp_path, "TRAIN_KWARGS:\n  gamma: 0.9\n")
    with pytest.raises(SystemExit) as exit_:
        train_ppo_multiprocess.main(["--config", str(config), "--validate-only"])
    assert exit_.value.code == 2 and "unknown key 'TRAIN_KWARGS.gamma'" in capsys.readouterr().err


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", SEED_003)
def test_seed_003_configs_validate_and_run(name, tmp_path):
    import train_parallel_timed

    config = ROOT / "configs" / f"{name}.yaml"
    assert train_parallel_timed.main(["--config", str(config), "--validate-only"]) == 0
    # A short run: one update of the file's own rollout shape.
    result = run_script("train_parallel_timed.py", "--config", config, "--total-timesteps", 1, "--no-tensorboard",
                        "--output-dir", tmp_path / "run", timeout=200)
    assert result.returncode == 0, result.stderr[-2000:]
    summary = (tmp_path / "run" / "summary.json").read_text()
    assert '"updates": 1' in summary
