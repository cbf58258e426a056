"""train_parallel_timed.py under torchrun (2 ranks on CPU, gloo): decentralized distributed PPO."""

from __future__ import annotations

import csv
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import ROOT, script_env

TINY = ["--env-id", "CartPole-v1", "--num-workers", "1", "--num-envs-per-worker", "4", "--n-steps", "32",
        "--batch-size", "64", "--no-tensorboard", "--target-return", "none"]


def torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            str(ROOT / "train_parallel_timed.py"), *map(str, args)]


def rows(run_dir: Path) -> list[dict]:
    with open(run_dir / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("form", ["--no-async-training", "--async-training"])
def test_two_ranks_stay_identical_and_only_rank_0_writes(tmp_path, form):
    run_dir = tmp_path / "dd"
    result = subprocess.run(torchrun(*TINY, form, "--total-timesteps", 2560, "--output-dir", run_dir),
                            env=script_env(), capture_output=True, text=True, timeout=170)
    assert result.returncode == 0, result.stdout + result.stderr
    metrics = rows(run_dir)
    per_update = 2 * 32 * 4  # both ranks' env steps count
    assert [int(r["global_step"]) for r in metrics] == [per_update * (i + 1) for i in range(len(metrics))]
    assert all(r["world_size"] == "2" for r in metrics)
    # Each rank hashed its own parameters after every update; rank 0 recorded both hashes.
    hashes = [r["params_hash"].split(":") for r in metrics]
    assert all(len(pair) == 2 and pair[0] == pair[1] for pair in hashes), hashes
    assert len({pair[0] for pair in hashes}) == len(metrics)  # the parameters really changed every update
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["latest.pt"]
    assert sorted(p.name for p in (run_dir / "logs").iterdir()) == ["main.log"]
    log = (run_dir / "logs" / "main.log").read_text()
    assert "world size 2" in log and "[rank 1]" not in log
    stops = re.findall(r"(\[rank 1\] )?stopping after update (\d+)", result.stderr)
    assert len(stops) == 2 and stops[0][1] == stops[1][1]


@pytest.mark.timeout(180)
def test_duration_stops_both_ranks_after_the_same_update(tmp_path):
    run_dir = tmp_path / "timed"
    result = subprocess.run(torchrun(*TINY, "--total-timesteps", 10**9, "--duration", 4 / 3600,
                                     "--output-dir", run_dir), env=script_env(), capture_output=True, text=True,
                            timeout=170)
    assert result.returncode == 0, result.stdout + result.stderr
    stops = re.findall(r"(\[rank 1\] )?stopping after update (\d+): duration", result.stderr)
    assert len(stops) == 2 and stops[0][1] == stops[1][1], result.stderr
    assert int(stops[0][1]) == len(rows(run_dir))


@pytest.mark.timeout(180)
def test_a_killed_rank_ends_the_job_with_an_error(tmp_path):
    run_dir = tmp_path / "killed"
    env = script_env()
    env["PRL_COLLECTIVE_TIMEOUT_S"] = "30"
    proc = subprocess.Popen(torchrun(*TINY, "--total-timesteps", 10**9, "--output-dir", run_dir), env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and not ((run_dir / "metrics.csv").exists() and len(rows(run_dir)) >= 3):
            time.sleep(0.2)
        assert len(rows(run_dir)) >= 3
        ranks = [c for c in psutil.Process(proc.pid).children() if "train_parallel_timed" in " ".join(c.cmdline())]
        rank_1 = next(c for c in ranks if c.environ().get("RANK") == "1")
        rank_1.kill()
        killed = time.monotonic()
        status = proc.wait(60)
        assert status != 0
        assert time.monotonic() - killed < 45
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        proc.stdout.close()


@pytest.mark.timeout(240)
def test_max_restarts_resumes_from_the_newest_checkpoint(tmp_path):
    """torchrun --max-restarts 1: a rank killed mid-run, every rank restarted, the run continues its checkpoint."""
    run_dir = tmp_path / "elastic"
    command = torchrun(*TINY, "--total-timesteps", 12_800, "--checkpoint-interval-s", 0.5, "--output-dir", run_dir)
    command[command.index("--standalone"):command.index("--standalone") + 1] = ["--standalone", "--max-restarts", "1",
                                                                                "--monitor-interval", "0.5"]
    proc = subprocess.Popen(command, env=script_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and not ((run_dir / "checkpoints" / "latest.pt").exists()
                                                   and len(rows(run_dir)) >= 4):
            time.sleep(0.2)
        killed_at = len(rows(run_dir))
        ranks = [c for c in psutil.Process(proc.pid).children() if "train_parallel_timed" in " ".join(c.cmdline())]
        next(c for c in ranks if c.environ().get("RANK") == "1").kill()
        output, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    assert proc.returncode == 0, output[-3000:]
    log = (run_dir / "logs" / "main.log").read_text()
    assert "resumed from" in log and str(run_dir / "checkpoints" / "latest.pt") in log
    resumed_at = int(re.findall(r"resumed from .* at step (\d+)", log)[0])
    assert resumed_at > 0
    steps = [int(r["global_step"]) for r in rows(run_dir)]
    assert steps[-1] >= 12_800 and len(steps) > killed_at
    # The rows after the restart continue the checkpoint's step count (a fresh start would begin at 256 again).
    per_update = 2 * 32 * 4
    assert resumed_at + per_update in steps[killed_at - 1:], (resumed_at, steps)
