"""Each example in examples/ runs, briefly, as a user runs it from a fresh clone: ``python examples/NAME.py``
in a copy of the repository's files, with no PYTHONPATH."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import ROOT


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    """The files a clone has (tracked, and new ones git does not ignore), copied: nothing else on the path."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.split("\0")
    target = tmp_path_factory.mktemp("clone")
    for name in filter(None, listed):
        if (ROOT / name).is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, target / name)
    return target


def clean_env() -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return env


def run_example(clone: Path, name: str, *args: str) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, f"examples/{name}", *args], cwd=clone, env=clean_env(),
                            capture_output=True, text=True, timeout=280)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result


@pytest.mark.timeout(300)
def test_parallel_training_example_trains_its_own_model_on_its_own_env(clone):
    out = run_example(clone, "parallel_training_example.py", "--iterations", "3").stdout
    assert "env examples.parallel_training_example:Nim {'heap_size': 21, 'max_take': 3}: observations (22,), " \
           "3 actions, action mask: True" in out
    games, version = map(int, re.search(r"iteration 3: (\d+) games, .* model version (\d+)", out).groups())
    assert games >= 3 * 32 and version == 4  # a batch of 32 games or more an iteration; the first weights + 3 syncs
    before, after = map(float, re.search(r"win rate against the random player: ([\d.]+) before training, "
                                         r"([\d.]+) after", out).groups())
    assert 0 < before < 1 and 0 < after <= 1 and "0 restarts" in out


@pytest.mark.timeout(300)
def test_train_custom_env_trains_an_unregistered_env_with_train_config(clone):
    run_dir = clone / "runs" / "custom"
    out = run_example(clone, "train_custom_env.py", "--timesteps", "1024", "--output-dir", str(run_dir)).stdout
    assert f"run directory: {run_dir}" in out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["env_id"], summary["global_step"], summary["exit_code"]) == \
           ("examples.train_custom_env:Corridor", 1024, 0)
    assert summary["episodes"] > 0 and (run_dir / "checkpoints" / "latest.pt").is_file()
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert (saved["env_id"], saved["env_kwargs"]) == ("examples.train_custom_env:Corridor", ["length=8"])
    # the id names the env for a later program too: the evaluation, started from the clone's root, makes it again
    evaluation = subprocess.run([sys.executable, "-m", "common.evaluate", str(run_dir), "--episodes", "3"], cwd=clone,
                                env=clean_env(), capture_output=True, text=True, timeout=120)
    assert evaluation.returncode == 0, evaluation.stderr[-2000:]
    assert "examples.train_custom_env:Corridor, 3 greedy episodes" in evaluation.stdout
