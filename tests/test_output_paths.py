"""compare_results.py: an --output that cannot be created, a baseline that took no time. (An --output-dir that
cannot be created is a cell of the fault matrix, tests/test_faults.py, in every training script.)"""

from __future__ import annotations

from conftest import run_script


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
    report = (tmp_path / "out" / "comparison_report.txt").read_text()
    assert "no speedup to report: instant took no time" in report and "nan" not in report, report
