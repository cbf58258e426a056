"""An output directory that cannot be created is one line and exit 2 in every script, with nothing written."""

from __future__ import annotations

import pytest
from conftest import run_script

SCRIPTS = {
    "train_parallel_timed.py": ["--env-id", "CartPole-v1"],
    "ultra_parallel_train_dqn.py": ["--env-id", "CartPole-v1"],
    "parallel_train_dqn.py": ["--env-id", "CartPole-v1"],
    "train_ppo_multiprocess.py": ["--env-id", "CartPole-v1"],
}


@pytest.mark.parametrize("script", list(SCRIPTS))
def test_output_dir_under_a_file_is_one_line_and_exit_2(script, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory\n")
    for target, why in ((blocker / "run", "is a file, not a directory"), (blocker, "is a file, not a directory")):
        result = run_script(script, *SCRIPTS[script], "--output-dir", target, timeout=60)
        lines = (result.stdout + result.stderr).strip().splitlines()
        assert result.returncode == 2, result.stdout + result.stderr
        assert len(lines) == 1 and lines[0].startswith("error: --output-dir") and why in lines[0], lines
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]


def test_compare_results_output_that_is_a_file(tmp_path):
    blocker = tmp_path / "report"
    blocker.write_text("x\n")
    for target in (blocker, blocker / "sub"):
        result = run_script("compare_results.py", tmp_path, "--output", target, timeout=60)
        lines = (result.stdout + result.stderr).strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1 and "is a file, not a directory" in lines[0], lines


def test_compare_results_with_a_baseline_that_took_no_time(tmp_path):
    """A run stopped before its first step (wall time 0) compares as 'no speed', not a ZeroDivisionError."""
    runs = []
    for name, wall, steps in (("instant", 0.0, 0), ("real", 10.0, 5000)):
        run = tmp_path / name
        run.mkdir()
        (run / "metrics.csv").write_text("wall_time,global_step,episodes,episodic_return,episodic_length,sps\n"
                                         f"{wall},{steps},0,,,0\n")
        (run / "summary.json").write_text(f'{{"env_id": "CartPole-v1", "global_step": {steps}, '
                                          f'"wall_time_s": {wall}, "num_workers": 1}}')
        runs.append(run)
    result = run_script("compare_results.py", *runs, "--output", tmp_path / "out", timeout=60)
    assert result.returncode == 0, result.stderr
    real = next(line for line in result.stdout.splitlines() if line.startswith("real"))
    assert real.split()[5:7] == ["500.0", "-"]  # its own speed, and no speedup over a baseline of no speed
