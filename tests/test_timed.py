"""End-to-end tests of train_parallel_timed.py and compare_results.py, run as a user runs them."""

from __future__ import annotations

import csv
import json
import os
import re
import signal
import time
from pathlib import Path

import psutil
import pytest
import yaml
from conftest import ROOT, kill_tree, run_script, start_script

from common.checkpoint import load_checkpoint
from common.shm import segments_of

SCRIPT = "train_parallel_timed.py"
FAST = ["--config", str(ROOT / "configs" / "cartpole_fast.yaml")]
TINY = ["--env-id", "CartPole-v1", "--num-envs-per-worker", "4", "--n-steps", "32", "--batch-size", "64",
        "--no-tensorboard", "--target-return", "none"]


def metrics_rows(run_dir: Path) -> list[dict]:
    with open(run_dir / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def worker_pids(pid: int) -> list[int]:
    try:
        children = psutil.Process(pid).children()
    except psutil.NoSuchProcess:
        return []
    return [c.pid for c in children if "resource_tracker" not in " ".join(c.cmdline())]


def wait_for_metrics(run_dir: Path, rows: int, proc, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if (run_dir / "metrics.csv").exists() and len(metrics_rows(run_dir)) >= rows:
            return
        time.sleep(0.1)
    raise AssertionError(f"no {rows} metric rows in time; output:\n{proc.stdout.read() if proc.poll() else ''}")


@pytest.mark.parametrize("workers, env_id", [(0, "CartPole-v1"), (2, "CartPole-v1"), (1, "Pendulum-v1")])
def test_tiny_run_writes_the_whole_run_directory(tmp_path, workers, env_id):
    run_dir = tmp_path / f"w{workers}"
    result = run_script(SCRIPT, *TINY, "--num-workers", workers, "--total-timesteps", 2000,
                        "--output-dir", run_dir, "--tensorboard", "--env-id", env_id)
    assert result.returncode == 0, result.stderr
    for path in ("config.yaml", "logs/main.log", "metrics.csv", "checkpoints/latest.pt", "summary.json",
                 "plots/training_curve.png"):
        assert (run_dir / path).is_file(), path
    assert list((run_dir / "tb").iterdir()), "no TensorBoard events"
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["num_workers"] == workers and config["env_id"] == env_id
    rows = metrics_rows(run_dir)
    assert list(rows[0])[:6] == ["wall_time", "global_step", "episodes", "episodic_return", "episodic_length", "sps"]
    steps_per_update = 32 * 4 * max(1, workers)
    assert [int(r["global_step"]) for r in rows] == [steps_per_update * (i + 1) for i in range(len(rows))]
    assert float(rows[-1]["cpu_percent"]) >= 0 and float(rows[-1]["pss_mb"]) > 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["global_step"] >= 2000 and summary["sps"] > 0 and summary["peak_rss_mb"] > 0
    assert summary["stop_reason"] == "total_timesteps 2000 reached"
    assert "exit status 0" in (run_dir / "logs" / "main.log").read_text()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("workers", [0, 2])
def test_cartpole_learns_within_a_fixed_step_budget(tmp_path, workers):
    run_dir = tmp_path / "learn"
    result = run_script(SCRIPT, *FAST, "--num-workers", workers, "--seed", 1, "--target-return", 195,
                        "--total-timesteps", 150_000, "--no-tensorboard", "--output-dir", run_dir, timeout=220)
    assert result.returncode == 0, result.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["best_mean_return"] >= 195, summary
    assert summary["stop_reason"].startswith("target return")


@pytest.mark.parametrize("argv, message", [
    (["--env-id", "NoSuchEnv-v9"], "--env-id 'NoSuchEnv-v9': not a registered Gymnasium id"),
    (["--num-workers", "-1"], "--num-workers -1: must be >= 0"),
    (["--batch-size", "100", "--n-steps", "32", "--num-envs-per-worker", "4"], "--batch-size 100: must divide"),
    (["--duration", "0"], "--duration 0.0: must be > 0"),
])
def test_bad_input_exits_2_with_one_line_and_no_run_directory(tmp_path, argv, message):
    run_dir = tmp_path / "never"
    result = run_script(SCRIPT, *argv, "--output-dir", run_dir, timeout=60)
    assert result.returncode == 2
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not run_dir.exists()


def test_bad_yaml_key_and_bad_resume_file_exit_2(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("env_id: CartPole-v1\nlearnig_rate: 0.1\n")
    result = run_script(SCRIPT, "--config", config, "--output-dir", tmp_path / "a", timeout=60)
    assert result.returncode == 2 and "unknown key 'learnig_rate'" in result.stderr
    bogus = tmp_path / "bogus.pt"
    bogus.write_text("hello")
    result = run_script(SCRIPT, *TINY, "--resume", bogus, "--output-dir", tmp_path / "b", timeout=60)
    assert result.returncode == 2 and "not a readable checkpoint" in result.stderr, result.stderr
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_second_run_in_the_same_directory_exits_3(tmp_path):
    run_dir = tmp_path / "locked"
    proc = start_script(SCRIPT, *TINY, "--num-workers", 0, "--total-timesteps", 10**9, "--output-dir", run_dir)
    try:
        wait_for_metrics(run_dir, 1, proc)
        result = run_script(SCRIPT, *TINY, "--num-workers", 0, "--output-dir", run_dir, timeout=60)
        assert result.returncode == 3 and "another run holds the lock" in result.stderr
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 143


@pytest.mark.parametrize("signum, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_saves_checkpoint_and_summary_and_cleans_up(tmp_path, signum, status):
    run_dir = tmp_path / "sig"
    proc = start_script(SCRIPT, *TINY, "--num-workers", 2, "--total-timesteps", 10**9, "--output-dir", run_dir)
    try:
        wait_for_metrics(run_dir, 3, proc)
        children = worker_pids(proc.pid)
        assert len(children) == 2
        if signum == signal.SIGINT:
            os.killpg(proc.pid, signum)  # Ctrl+C in a terminal reaches the whole process group
        else:
            proc.send_signal(signum)
        assert proc.wait(30) == status
    finally:
        kill_tree(proc)
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in children)
    assert segments_of(proc.pid) == []
    state = load_checkpoint(run_dir / "checkpoints" / "latest.pt")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stop_reason"] == "interrupted" and state["counters"]["global_step"] == summary["global_step"] > 0


def test_killed_worker_is_reported_restarted_and_the_run_goes_on(tmp_path):
    run_dir = tmp_path / "kill"
    proc = start_script(SCRIPT, *TINY, "--num-workers", 2, "--total-timesteps", 10**9, "--output-dir", run_dir)
    try:
        wait_for_metrics(run_dir, 3, proc)
        victim = worker_pids(proc.pid)[1]
        os.kill(victim, signal.SIGKILL)
        killed_at = time.monotonic()
        log = run_dir / "logs" / "main.log"
        while "restarted worker" not in log.read_text() and time.monotonic() - killed_at < 20:
            time.sleep(0.1)
        assert time.monotonic() - killed_at < 5, "the death was not noticed within 5 s"
        text = log.read_text()
        assert re.search(r"worker \d died: killed by signal SIGKILL", text), text
        rows_before = len(metrics_rows(run_dir))
        wait_for_metrics(run_dir, rows_before + 3, proc)  # training goes on
        assert victim not in worker_pids(proc.pid) and len(worker_pids(proc.pid)) == 2
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 143
    finally:
        kill_tree(proc)
    assert int(metrics_rows(run_dir)[-1]["worker_restarts"]) == 1


def test_repeated_worker_deaths_save_and_exit_1(tmp_path):
    run_dir = tmp_path / "deaths"
    proc = start_script(SCRIPT, *TINY, "--num-workers", 2, "--total-timesteps", 10**9, "--max-worker-restarts", 0,
                        "--output-dir", run_dir)
    try:
        wait_for_metrics(run_dir, 2, proc)
        os.kill(worker_pids(proc.pid)[0], signal.SIGKILL)
        assert proc.wait(30) == 1
    finally:
        kill_tree(proc)
    text = (run_dir / "logs" / "main.log").read_text()
    assert "died 1 times; giving up" in text and "Traceback" not in text
    assert (run_dir / "checkpoints" / "latest.pt").is_file()


def test_main_process_killed_workers_exit_and_next_run_reclaims_memory(tmp_path):
    run_dir = tmp_path / "orphans"
    proc = start_script(SCRIPT, *TINY, "--num-workers", 2, "--total-timesteps", 10**9, "--output-dir", run_dir)
    try:
        wait_for_metrics(run_dir, 2, proc)
        workers = worker_pids(proc.pid)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(psutil.pid_exists(p) for p in workers):
            time.sleep(0.1)
        alive = [p for p in workers if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        assert not alive, "workers outlived their parent by more than 10 s"
    finally:
        kill_tree(proc)
    # Whatever the dead run left in /dev/shm is gone after the next run starts.
    result = run_script(SCRIPT, *TINY, "--num-workers", 0, "--total-timesteps", 200, "--output-dir", tmp_path / "next")
    assert result.returncode == 0
    assert segments_of(proc.pid) == []


def test_resume_continues_from_the_saved_step(tmp_path):
    run_dir = tmp_path / "resume"
    first = run_script(SCRIPT, *TINY, "--num-workers", 0, "--total-timesteps", 1024, "--output-dir", run_dir)
    assert first.returncode == 0, first.stderr
    saved = load_checkpoint(run_dir / "checkpoints" / "latest.pt")
    rows_before = metrics_rows(run_dir)
    second = run_script(SCRIPT, *TINY, "--num-workers", 0, "--total-timesteps", 2048, "--output-dir", run_dir,
                        "--resume", "auto")
    assert second.returncode == 0, second.stderr
    rows = metrics_rows(run_dir)
    steps = [int(r["global_step"]) for r in rows]
    assert steps == sorted(steps) and steps[len(rows_before)] == saved["counters"]["global_step"] + 128
    walls = [float(r["wall_time"]) for r in rows]
    assert walls == sorted(walls), "wall time restarted instead of continuing"
    assert f"resumed from {run_dir / 'checkpoints' / 'latest.pt'} at step {saved['counters']['global_step']}" in \
        (run_dir / "logs" / "main.log").read_text()
    assert json.loads((run_dir / "summary.json").read_text())["global_step"] == 2048


def test_compare_results_on_two_real_runs(tmp_path):
    runs = []
    for workers in (0, 2):
        run_dir = tmp_path / f"cmp{workers}"
        result = run_script(SCRIPT, *TINY, "--num-workers", workers, "--total-timesteps", 3000, "--output-dir", run_dir)
        assert result.returncode == 0, result.stderr
        runs.append(run_dir)
    out = tmp_path / "out"
    result = run_script("compare_results.py", "--sequential", runs[0], "--parallel", runs[1], "--threshold", "20",
                        "--output", out)
    assert result.returncode == 0, result.stderr
    assert "speedup" in result.stdout and "cmp0" in result.stdout and "cmp2" in result.stdout
    assert (out / "comparison.png").stat().st_size > 10_000
    report = (out / "comparison_report.txt").read_text()
    assert "cmp2" in report and "throughput of cmp0" in report
    bad = run_script("compare_results.py", tmp_path, "--output", out)
    assert bad.returncode == 2 and "not a run directory" in bad.stderr
