"""launch_parallel_training.py: the report, the recommendation, dry runs, launches and signal passing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
from conftest import ROOT, run_script, script_env

import launch_parallel_training as launcher

LAUNCHER = "launch_parallel_training.py"


def machine(cores: int, gpus: int = 0, shm_gib: float = 16.0, ram_gib: float = 64.0) -> dict:
    return {"usable_cores": cores, "physical_cores": cores, "logical_cores": cores,
            "gpus": [{"index": i, "name": "GPU", "memory_gib": 80.0, "capability": "9.0"} for i in range(gpus)],
            "shm_free_gib": shm_gib, "shm_total_gib": shm_gib, "ram_available_gib": ram_gib, "ram_total_gib": ram_gib,
            "open_files_limit": 65536, "hostname": "sim"}


def test_check_only_json_describes_this_machine():
    result = run_script(LAUNCHER, "--check-only", "--json", timeout=60)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert set(report) >= {"dependencies", "system", "recommendation"}
    facts = report["system"]
    assert facts["logical_cores"] == os.cpu_count()
    assert facts["physical_cores"] == psutil.cpu_count(logical=False)
    assert abs(facts["ram_total_gib"] - psutil.virtual_memory().total / 2**30) < 0.1
    import torch

    assert len(facts["gpus"]) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    packages = {p["package"]: p for p in report["dependencies"]["packages"]}
    assert packages["torch"]["ok"] and packages["torch"]["installed"].startswith("2.13.0")
    assert report["recommendation"]["mode"] in launcher.MODES and report["recommendation"]["reason"]


def test_check_only_text_has_every_section():
    result = run_script(LAUNCHER, "--check-only", timeout=60)
    assert result.returncode == 0
    for heading in ("Dependencies", "System", "Recommendation", "/dev/shm", "open-files limit", "torch build",
                    "start method", "why:"):
        assert heading in result.stdout


@pytest.mark.parametrize("facts, mode, expect", [
    (machine(2), "timed", {"num_workers": 2, "device": "cpu"}),
    (machine(16, gpus=1), "ultra", {"n_workers": 14, "device": "cuda:0"}),
    (machine(128), "timed", {"num_workers": 128}),
    (machine(64, gpus=4), "ppo-multiprocess", {"device": "round-robin over GPUs"}),
    (machine(16, gpus=1, shm_gib=0.01), "dqn", {}),
    (machine(4, gpus=1), "dqn", {"device": "cuda:0"}),
])
def test_recommendation_for_simulated_machines(facts, mode, expect):
    rec = launcher.recommend(facts)
    assert rec.mode == mode, rec.reason
    assert rec.reason
    for key, value in expect.items():
        assert rec.settings[key] == value
    if facts["usable_cores"] < launcher.ULTRA_MIN_CORES:
        assert "ultra" in rec.refused
    if facts["shm_free_gib"] < 0.05:
        assert any("/dev/shm" in w for w in rec.warnings)
    if not facts["gpus"]:
        assert any("no CUDA GPU" in w for w in rec.warnings)


@pytest.mark.parametrize("mode, extra, expected", [
    ("timed", ["--episodes", "300", "--seed", "4"], ["train_parallel_timed.py", "--total-episodes 300", "--seed 4"]),
    ("dqn", ["--duration", "0.5", "--batch-size", "32"], ["parallel_train_dqn.py", "--duration 0.5",
                                                         "--batch-size 32"]),
    ("ultra", ["--force", "--episodes", "50"], ["ultra_parallel_train_dqn.py", "--n-episodes 50"]),
    ("ppo-multiprocess", ["--episodes", "40", "--num-workers", "2"],
     ["train_ppo_multiprocess.py", "--max-steps-per-worker 5120", "--num-workers 2"]),
])
def test_dry_run_prints_the_translated_command(mode, extra, expected):
    result = run_script(LAUNCHER, "--mode", mode, "--dry-run", *extra, timeout=60)
    assert result.returncode == 0, result.stderr
    command = result.stdout.strip().splitlines()[-1]
    for part in expected:
        assert part in command, command


@pytest.mark.parametrize("argv, status, message", [
    (["--mode", "warp"], 2, "--mode 'warp': must be one of"),
    (["--episodes", "0"], 2, "--episodes 0: must be > 0"),
    (["--mode", "ultra"], 2, "not recommended on this machine"),
    (["--mode", "timed", "--no-such-flag", "3"], 2, "unrecognized arguments: --no-such-flag"),
])
def test_bad_input_exits_with_one_clear_line(argv, status, message, tmp_path):
    if argv[:2] == ["--mode", "ultra"] and os.cpu_count() >= launcher.ULTRA_MIN_CORES:
        pytest.skip("this machine has enough cores for the ultra mode")
    result = run_script(LAUNCHER, *argv, cwd=tmp_path, timeout=60)
    assert result.returncode == status
    assert message in result.stderr, result.stderr
    assert not (tmp_path / "runs").exists()


def test_missing_package_exits_1_with_how_to_install(monkeypatch, capsys):
    real = launcher.importlib.metadata.version

    def version(name):
        if name == "tqdm":
            raise launcher.importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(launcher.importlib.metadata, "version", version)
    assert launcher.main(["--check-only"]) == 1
    assert "missing or wrong version: tqdm -> pip install -r requirements.txt" in capsys.readouterr().out
    assert launcher.main(["--mode", "timed"]) == 1
    assert "missing required packages: tqdm" in capsys.readouterr().err


TINY = {
    "timed": ["--env-id", "CartPole-v1", "--num-workers", "1", "--num-envs-per-worker", "4", "--n-steps", "32",
              "--batch-size", "64", "--total-timesteps", "512", "--target-return", "none", "--no-tensorboard"],
    "dqn": ["--env-id", "CartPole-v1", "--num-workers", "1", "--episodes-per-batch", "4", "--total-episodes", "8",
            "--eval-interval", "0", "--eval-episodes", "2", "--learning-starts", "50", "--no-tensorboard"],
    "ultra": ["--force", "--env-id", "CartPole-v1", "--n-workers", "1", "--envs-per-worker", "4", "--n-episodes",
              "10", "--learning-starts", "100", "--no-tensorboard"],
    "ppo-multiprocess": ["--num-items", "20", "--history-steps", "2000", "--num-workers", "1",
                         "--num-envs-per-worker", "4", "--rollout-steps", "256", "--num-minibatches", "4",
                         "--episode-length", "64", "--max-steps-per-worker", "512", "--eval-episodes", "4",
                         "--no-tensorboard"],
}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", list(TINY))
def test_tiny_launch_of_each_mode(mode, tmp_path):
    extra = ["--cache-dir", str(tmp_path / "cache")] if mode == "ppo-multiprocess" else []
    result = run_script(LAUNCHER, "--mode", mode, *TINY[mode], *extra, cwd=tmp_path, timeout=220)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "results in runs/" in result.stdout
    run_dirs = list((tmp_path / "runs").glob("*/*"))
    assert len(run_dirs) == 1 and (run_dirs[0] / "metrics.csv").is_file() and (run_dirs[0] / "config.yaml").is_file()


@pytest.mark.timeout(120)
def test_sigint_reaches_the_script_through_execv(tmp_path):
    proc = subprocess.Popen([sys.executable, str(ROOT / LAUNCHER), "--mode", "timed",
                             "--env-id", "CartPole-v1", "--num-workers", "1", "--n-steps", "32", "--batch-size", "64",
                             "--total-timesteps", "1000000000", "--target-return", "none", "--no-tensorboard"],
                            cwd=tmp_path, env=script_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        deadline = time.monotonic() + 60
        metrics = []
        while time.monotonic() < deadline and not metrics:
            metrics = list((tmp_path / "runs").glob("*/*/metrics.csv"))
            time.sleep(0.2)
        assert metrics, "the launched script never started training"
        time.sleep(1.0)
        assert "train_parallel_timed.py" in " ".join(psutil.Process(proc.pid).cmdline())  # same pid, new program
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        proc.stdout.close()
    assert (metrics[0].parent / "checkpoints" / "latest.pt").is_file()


@pytest.mark.timeout(200)
def test_tune_measures_and_caches_the_fastest_setting(tmp_path):
    cache = tmp_path / "tune.json"
    env = script_env()
    env["PRL_TUNE_CACHE"] = str(cache)
    result = subprocess.run([sys.executable, str(ROOT / LAUNCHER), "--mode", "timed", "--tune", "--trial-seconds",
                             "1", "--env-id", "CartPole-v1", "--n-steps", "32", "--batch-size", "64",
                             "--target-return", "none"], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=190)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "steps/s" in result.stdout and "fastest:" in result.stdout
    stored = json.loads(cache.read_text())
    (entry,) = stored.values()
    assert entry["sps"] > 0 and len(entry["table"]) >= 2
    dry = subprocess.run([sys.executable, str(ROOT / LAUNCHER), "--mode", "timed", "--dry-run", "--env-id",
                          "CartPole-v1"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert "using the tuned setting" in dry.stdout
    assert " ".join(entry["args"]) in dry.stdout.strip().splitlines()[-1]
