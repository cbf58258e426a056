"""``--env-kwargs KEY=VALUE`` reaches every env of every script: the main process's and the workers'.

Catch-v0 with ``rows=12`` is a taller board: every episode lasts exactly 11 steps (the ball falls
row by row), which only the workers' envs can show (metrics.csv), and frames are 48 x 40, which
the buffer the main process allocates from its own probe of the env shows (its storage log line).
"""

from __future__ import annotations

import csv

import pytest
from conftest import run_script

LENGTH, FRAME = 11.0, "(1, 48, 40)"  # rows=12: 11 steps per episode, 12 x 4 pixel rows
RUNS = {
    "train_parallel_timed.py": ["--num-workers", "1", "--num-envs-per-worker", "4", "--n-steps", "16",
                                "--batch-size", "64", "--n-epochs", "1", "--total-timesteps", "256",
                                "--target-return", "none"],
    "train_ppo_multiprocess.py": ["--num-workers", "1", "--num-envs-per-worker", "4", "--n-steps", "16",
                                  "--batch-size", "64", "--n-epochs", "1", "--max-steps-per-worker", "256",
                                  "--eval-episodes", "2", "--eval-num-envs", "2", "--no-eval-random-baseline"],
    "parallel_train_dqn.py": ["--num-workers", "1", "--episodes-per-batch", "4", "--total-episodes", "24",
                              "--total-timesteps", "none", "--buffer-size", "1000", "--learning-starts", "50",
                              "--batch-size", "32", "--eval-interval", "0", "--eval-episodes", "2"],
    "ultra_parallel_train_dqn.py": ["--num-workers", "1", "--num-envs-per-worker", "4", "--total-timesteps", "300",
                                    "--total-episodes", "none", "--buffer-size", "1000", "--learning-starts", "100",
                                    "--batch-size", "32"],
}


@pytest.mark.parametrize("script", sorted(RUNS))
def test_env_kwargs_reach_workers_and_main_process(script, tmp_path):
    out = tmp_path / "run"
    proc = run_script(script, "--env-id", "Catch-v0", "--env-kwargs", "rows=12", *RUNS[script], "--seed", "2",
                      "--device", "cpu", "--no-tensorboard", "--output-dir", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out / "metrics.csv", newline="") as f:
        lengths = [float(row["episodic_length"]) for row in csv.DictReader(f) if row["episodic_length"]]
    assert lengths and all(length == LENGTH for length in lengths), lengths  # default rows=10 would be 9
    logs = "".join(path.read_text() for path in (out / "logs").glob("*.log"))
    assert f"x {FRAME} uint8 observations" in logs


@pytest.mark.parametrize("script", sorted(RUNS))
def test_unknown_env_kwarg_is_one_line_and_exit_2(script, tmp_path):
    proc = run_script(script, "--env-id", "Catch-v0", "--env-kwargs", "no_such_kwarg=1", "--validate-only",
                      cwd=tmp_path, timeout=60)
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "no_such_kwarg" in errors[0] and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "runs").exists()
