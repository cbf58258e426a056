"""End-to-end tests of train_parallel_timed.py and compare_results.py, run as a user runs them."""

from __future__ import annotations

import csv
import json
import os
import signal
import time
from pathlib import Path

import psutil
import pytest
import yaml
from conftest import HELPERS, ROOT, kill_tree, run_script, start_script, tensorboard_tags

from common.checkpoint import load_checkpoint

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
    return [c.pid for c in children if not any(helper in " ".join(c.cmdline()) for helper in HELPERS)]


def wait_for_metrics(run_dir: Path, rows: int, proc, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if (run_dir / "metrics.csv").exists() and len(metrics_rows(run_dir)) >= rows:
            return
        time.sleep(0.1)
    raise AssertionError(f"no {rows} metric rows in time; output:\n{proc.stdout.read() if proc.poll() else ''}")


# Pendulum-v1 normalizes observations and rewards (Box actions): overlapped, every rollout is checked against
# the statistics published for it and learned with them, while the learner's own have moved on.
@pytest.mark.parametrize("workers, env_id, form", [(0, "CartPole-v1", "--no-async-training"),
                                                   (2, "CartPole-v1", "--no-async-training"),
                                                   (1, "Pendulum-v1", "--no-async-training"),
                                                   (2, "Pendulum-v1", "--async-training")])
def test_tiny_run_writes_the_whole_run_directory(tmp_path, workers, env_id, form):
    run_dir = tmp_path / f"w{workers}"
    result = run_script(SCRIPT, *TINY, "--num-workers", workers, "--total-timesteps", 2000,
                        "--output-dir", run_dir, "--tensorboard", "--env-id", env_id, form)
    assert result.returncode == 0, result.stderr
    for path in ("config.yaml", "logs/main.log", "metrics.csv", "checkpoints/latest.pt", "summary.json",
                 "plots/training_curve.png"):
        assert (run_dir / path).is_file(), path
    tags = tensorboard_tags(run_dir / "tb")
    assert {"charts/episodic_return", "charts/episodic_length", "charts/SPS", "charts/learning_rate",
            "losses/value_loss", "losses/policy_loss", "losses/entropy", "losses/approx_kl", "losses/clipfrac",
            "losses/explained_variance", "prl/collect_sps"} <= tags, sorted(tags)
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["num_workers"] == workers and config["env_id"] == env_id
    assert config["async_training"] == (form == "--async-training")
    rows = metrics_rows(run_dir)
    assert list(rows[0])[:6] == ["wall_time", "global_step", "episodes", "episodic_return", "episodic_length", "sps"]
    steps_per_update = 32 * 4 * max(1, workers)
    assert [int(r["global_step"]) for r in rows] == [steps_per_update * (i + 1) for i in range(len(rows))]
    assert float(rows[-1]["cpu_percent"]) >= 0 and float(rows[-1]["pss_mb"]) > 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["global_step"] >= 2000 and summary["sps"] > 0 and summary["peak_rss_mb"] > 0
    assert summary["stop_reason"] == "total_timesteps 2000 reached"
    assert summary["async_training"] == config["async_training"]
    assert all(float(r["wait_ms"]) >= 0 and float(r["update_ms"]) > 0 for r in rows)
    lags = [float(r["policy_lag"]) for r in rows]
    if config["async_training"]:  # a rollout starts one update behind and takes up each epoch's parameters
        assert lags[0] == 0 and all(0 <= lag <= 1 for lag in lags) and max(lags) > 0, lags
    else:
        assert not any(lags), lags
    log = (run_dir / "logs" / "main.log").read_text()
    assert "exit status 0" in log
    assert ("collecting while learning" in log) == config["async_training"]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("workers, form, learner", [(0, "--no-async-training", "numpy"),
                                                    (0, "--no-async-training", "torch"),
                                                    (2, "--no-async-training", "numpy"),
                                                    (1, "--async-training", "numpy")])
def test_cartpole_learns_within_a_fixed_step_budget(tmp_path, workers, form, learner):
    run_dir = tmp_path / "learn"
    result = run_script(SCRIPT, *FAST, "--num-workers", workers, form, "--seed", 1, "--target-return", 195,
                        "--total-timesteps", 150_000, "--no-tensorboard", "--output-dir", run_dir,
                        "--learner", learner, timeout=220)
    assert result.returncode == 0, result.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["best_mean_return"] >= 195, summary
    assert summary["stop_reason"].startswith("target return")


def test_a_batch_that_does_not_divide_the_rollout_is_refused(tmp_path):
    # Every other bad input of every script is a cell of tests/test_faults.py.
    result = run_script(SCRIPT, "--batch-size", "100", "--n-steps", "32", "--num-envs-per-worker", "4",
                        "--output-dir", tmp_path / "never", timeout=60)
    assert result.returncode == 2 and "--batch-size 100: must divide" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / "never").exists()


def test_the_numpy_learner_where_it_cannot_learn_is_refused(tmp_path):
    """Catch-v0's observations are pictures (a CNN, so torch): one line, exit 2, nothing written."""
    result = run_script(SCRIPT, "--env-id", "Catch-v0", "--num-workers", 0, "--learner", "numpy",
                        "--output-dir", tmp_path / "never", timeout=60)
    assert result.returncode == 2 and "--learner 'numpy': numpy learns an MLP policy" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / "never").exists()


def test_collecting_while_learning_needs_workers(tmp_path):
    result = run_script(SCRIPT, "--async-training", "--num-workers", "0", "--output-dir", tmp_path / "never",
                        timeout=60)
    assert result.returncode == 2 and "--async-training True: needs num_workers >= 1" in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / "never").exists()


def test_a_rollout_from_another_snapshot_is_refused():
    """Overlapped, the learner's statistics move on while a rollout is collected: each rollout is checked
    against the snapshot published for it, not against the learner's current statistics. Its parameters
    may be newer than those published with it (the learner publishes after every epoch), never older."""
    from common.supervisor import Message
    from train_parallel_timed import Snapshot, WorkerCollector

    collector = object.__new__(WorkerCollector)
    collector.slot, collector.snapshot = 1, Snapshot(7, None, "abc")
    for fine in (7, 9):
        collector.check(Message(0, "collected", {"slot": 1, "version": fine, "norm_digest": "abc"}))
    for stale in ({"slot": 1, "version": 6, "norm_digest": "abc"}, {"slot": 1, "version": 7, "norm_digest": "abd"},
                  {"slot": 0, "version": 7, "norm_digest": "abc"}):
        with pytest.raises(RuntimeError, match="the learner published parameters 7"):
            collector.check(Message(0, "collected", stale))


@pytest.mark.parametrize("form", ["--no-async-training", "--async-training"])
def test_repeated_worker_deaths_save_and_exit_1(tmp_path, form):
    run_dir = tmp_path / "deaths"
    proc = start_script(SCRIPT, *TINY, "--num-workers", 2, "--total-timesteps", 10**9, "--max-worker-restarts", 0,
                        "--output-dir", run_dir, form)
    try:
        wait_for_metrics(run_dir, 2, proc)
        os.kill(worker_pids(proc.pid)[0], signal.SIGKILL)
        assert proc.wait(30) == 1
    finally:
        kill_tree(proc)
    text = (run_dir / "logs" / "main.log").read_text()
    assert "died 1 times; giving up" in text and "Traceback" not in text
    assert (run_dir / "checkpoints" / "latest.pt").is_file()


def loaded_libraries(pid: int) -> str:
    return Path(f"/proc/{pid}/maps").read_text()


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads the loaded libraries from /proc")
@pytest.mark.parametrize("learner", ["auto", "torch"])
def test_an_mlp_policy_runs_without_torch_but_for_the_torch_learner(tmp_path, learner):
    """Workers act in numpy from the published parameters, so their start-up skips torch's import (most of
    it). The numpy learner (auto for an MLP on the CPU) spares the main process the import as well, and
    writes a checkpoint torch loads and TensorBoard events; --learner torch learns with torch, in the main
    process only."""
    run_dir = tmp_path / learner
    proc = start_script(SCRIPT, *TINY, "--num-workers", 2, "--total-timesteps", 10**9, "--learner", learner,
                        "--output-dir", run_dir, "--tensorboard")  # (TensorBoard's writer needs no torch either)
    try:
        wait_for_metrics(run_dir, 2, proc)
        workers = worker_pids(proc.pid)
        assert len(workers) == 2
        # Synchronous, workers and learner take turns: the workers keep the learner's priority.
        assert {psutil.Process(pid).nice() for pid in workers} == {psutil.Process(proc.pid).nice()}
        assert ("libtorch" in loaded_libraries(proc.pid)) == (learner == "torch")
        assert not any("libtorch" in loaded_libraries(pid) for pid in workers)
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(30) == 130
    finally:
        kill_tree(proc)
    chosen = "torch" if learner == "torch" else "numpy"
    assert f"{chosen} learner on cpu" in (run_dir / "logs" / "main.log").read_text()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["learner"] == chosen and summary["device"] == "cpu"
    saved = load_checkpoint(run_dir / "checkpoints" / "latest.pt")
    assert saved["counters"]["global_step"] == summary["global_step"]
    assert saved["model"]["actor.4.weight"].shape == (2, 64) and ("torch" in saved["rng"]) == (learner == "torch")
    assert {"charts/episodic_return", "losses/policy_loss", "prl/collect_sps"} <= tensorboard_tags(run_dir / "tb")


@pytest.mark.parametrize("first_learner, second_learner", [("numpy", "numpy"), ("numpy", "torch"),
                                                           ("torch", "numpy")])
def test_resume_continues_from_the_saved_step(tmp_path, first_learner, second_learner):
    """Also across learners: the two save the same checkpoint (parameters and Adam's state)."""
    run_dir = tmp_path / "resume"
    first = run_script(SCRIPT, *TINY, "--num-workers", 0, "--total-timesteps", 1024, "--output-dir", run_dir,
                       "--learner", first_learner, "--n-epochs", 4, "--learning-rate", 5e-4)
    assert first.returncode == 0, first.stderr
    saved = load_checkpoint(run_dir / "checkpoints" / "latest.pt")
    assert saved["optimizer"]["state"][0]["step"] == 8 * 4 * 2  # 8 updates of 4 epochs of 2 minibatches
    rows_before = metrics_rows(run_dir)
    # The resumed run learns at the rate it is given, not at the (annealed) one the checkpoint ended with.
    second = run_script(SCRIPT, *TINY, "--num-workers", 0, "--total-timesteps", 2048, "--output-dir", run_dir,
                        "--resume", "auto", "--learner", second_learner, "--no-anneal-lr", "--learning-rate", 0.002,
                        "--n-epochs", 4)
    assert second.returncode == 0, second.stderr
    assert {float(r["learning_rate"]) for r in metrics_rows(run_dir)[len(rows_before):]} == {0.002}
    assert float(rows_before[-1]["learning_rate"]) < 5e-4
    resumed = load_checkpoint(run_dir / "checkpoints" / "latest.pt")
    assert resumed["optimizer"]["state"][0]["step"] == 2 * saved["optimizer"]["state"][0]["step"]
    rows = metrics_rows(run_dir)
    steps = [int(r["global_step"]) for r in rows]
    assert steps == sorted(steps) and steps[len(rows_before)] == saved["counters"]["global_step"] + 128
    walls = [float(r["wall_time"]) for r in rows]
    assert walls == sorted(walls), "wall time restarted instead of continuing"
    assert f"resumed from {run_dir / 'checkpoints' / 'latest.pt'} at step {saved['counters']['global_step']}" in \
        (run_dir / "logs" / "main.log").read_text()
    assert json.loads((run_dir / "summary.json").read_text())["global_step"] == 2048


def test_collecting_while_learning_stops_on_ctrl_c_with_a_checkpoint_and_resumes(tmp_path):
    """Ctrl+C lands while a rollout is in flight: the run saves what it learned and exits 130; the resumed run
    continues the step count (the rollout in flight was not learned, so it is not counted)."""
    run_dir = tmp_path / "overlap"
    args = [*TINY, "--num-workers", 1, "--async-training", "--output-dir", run_dir]
    proc = start_script(SCRIPT, *args, "--total-timesteps", 10**9)
    try:
        wait_for_metrics(run_dir, 3, proc)
        workers = worker_pids(proc.pid)
        # Overlapped, the workers yield the cores to the learner's update (the next rollout's parameters wait on it)
        learner_niceness = psutil.Process(proc.pid).nice()
        assert [psutil.Process(pid).nice() for pid in workers] == [min(19, learner_niceness + 10)]
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(30) == 130
    finally:
        kill_tree(proc)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(psutil.pid_exists(pid) for pid in workers):
        time.sleep(0.1)
    assert not any(psutil.pid_exists(pid) for pid in workers), "workers outlived the run"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stop_reason"] == "interrupted" and summary["async_training"] is True
    saved = load_checkpoint(run_dir / "checkpoints" / "latest.pt")["counters"]["global_step"]
    assert saved == summary["global_step"] == int(metrics_rows(run_dir)[-1]["global_step"])
    rows_before = len(metrics_rows(run_dir))
    resumed = run_script(SCRIPT, *args, "--total-timesteps", saved + 512, "--resume", "auto")
    assert resumed.returncode == 0, resumed.stderr
    steps = [int(r["global_step"]) for r in metrics_rows(run_dir)]
    assert steps[rows_before:] == [saved + 128 * (i + 1) for i in range(4)]


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
