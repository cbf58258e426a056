"""The CUDA paths of every training script, on a machine with an NVIDIA GPU.

Skipped where torch sees no GPU (CI has none). Each test runs a script as a user would, with the
learner (or the workers) on ``cuda``, and checks that the run really used the GPU and really learned.
(Catch from pixels on the GPU is a case of tests/test_catch.py.)
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, run_script, script_env

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def summary_of(run_dir):
    return json.loads((run_dir / "summary.json").read_text())


def main_log(run_dir) -> str:
    return (run_dir / "logs" / "main.log").read_text()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("precision", ["fp16", "bf16", "off"])
def test_ultra_learns_cartpole_with_its_learner_on_the_gpu(tmp_path, precision):
    run = tmp_path / "run"
    result = run_script("ultra_parallel_train_dqn.py", "--config", ROOT / "configs" / "ultra_cartpole.yaml",
                        "--no-async-training", "--seed", "1", "--device", "cuda", "--mixed-precision", precision,
                        "--total-timesteps", "60000", "--target-return", "75", "--no-tensorboard",
                        "--output-dir", run, timeout=170)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = summary_of(run)
    assert summary["stop_reason"].startswith("target return"), summary
    assert summary["precision"] == precision
    assert f"learner on cuda (precision {precision})" in main_log(run)


@pytest.mark.timeout(150)
def test_parallel_dqn_learns_cartpole_with_its_learner_on_the_gpu(tmp_path):
    run = tmp_path / "run"
    result = run_script("parallel_train_dqn.py", "--env-id", "CartPole-v1", "--hidden-sizes", "64", "64",
                        "--episodes-per-batch", "8", "--replay-ratio", "0.25", "--batch-size", "64",
                        "--learning-rate", "1e-3", "--no-anneal-lr", "--target-update-interval", "100",
                        "--epsilon-decay-steps", "4000", "--epsilon-end", "0.04", "--eval-interval", "0",
                        "--eval-episodes", "20", "--num-workers", "1", "--no-tensorboard", "--seed", "1",
                        "--total-timesteps", "12000", "--device", "cuda", "--output-dir", run, timeout=140)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = summary_of(run)
    assert summary["final_mean_return"] >= 60, summary  # a random policy averages about 22
    assert summary["precision"] == "off"  # auto: fp32, measured faster than autocast for networks this small
    assert "learner on cuda (precision off)" in main_log(run)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("form", ["--no-async-training", "--async-training"])
def test_timed_ppo_learns_cartpole_with_its_learner_on_the_gpu(tmp_path, form):
    run = tmp_path / "run"
    result = run_script("train_parallel_timed.py", "--config", ROOT / "configs" / "cartpole_fast.yaml",
                        "--num-workers", "2", form, "--seed", "1", "--device", "cuda", "--target-return", "195",
                        "--total-timesteps", "150000", "--no-tensorboard", "--output-dir", run, timeout=170)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = summary_of(run)
    assert summary["best_mean_return"] >= 195 and summary["stop_reason"].startswith("target return"), summary
    assert summary["learner"] == "torch" and summary["device"].startswith("cuda")


@pytest.mark.timeout(180)
def test_population_workers_learn_on_the_gpu(tmp_path):
    """Three workers, every one on cuda:0 (one GPU, round robin), each learning CartPole. (auto would keep
    CartPole's MLP policies on the CPU, where they train faster.)"""
    run = tmp_path / "run"
    result = run_script("train_ppo_multiprocess.py", "--env-id", "CartPole-v1", "--num-workers", "3",
                        "--num-envs-per-worker", "4", "--n-steps", "128", "--batch-size", "128",
                        "--learning-rate", "1e-3", "--max-steps-per-worker", "40960", "--target-return", "none",
                        "--eval-episodes", "8", "--device", "cuda", "--seed", "1", "--no-tensorboard",
                        "--output-dir", run, timeout=170)
    assert result.returncode == 0, result.stderr[-3000:]
    for i in range(3):
        assert "device cuda:0" in (run / "logs" / f"worker_{i}.log").read_text()
    summary = summary_of(run)
    assert summary["exit_code"] == 0 and summary["global_step"] == 3 * 40960
    # On the CPU, seed 1's workers end at 287, 298 and 208 (a random policy averages about 22).
    assert min(w["recent_return"] for w in summary["workers"]) >= 100, summary["workers"]


@pytest.mark.timeout(240)
def test_dd_ppo_on_the_gpu_under_torchrun(tmp_path):
    """Two DD-PPO ranks with their learners on the GPU. NCCL needs a GPU per rank (it refuses two ranks
    on one device): with fewer GPUs than ranks the gradients are averaged over gloo instead."""
    run = tmp_path / "run"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(ROOT / "train_parallel_timed.py"), "--config", str(ROOT / "configs" / "cartpole_fast.yaml"),
               "--num-workers", "1", "--device", "cuda", "--seed", "1", "--target-return", "195",
               "--total-timesteps", "200000", "--no-tensorboard", "--output-dir", str(run)]
    result = subprocess.run(command, cwd=ROOT, env=script_env(), capture_output=True, text=True, timeout=220)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    summary = summary_of(run)
    assert summary["best_mean_return"] >= 195, summary
    assert summary["device"].startswith("cuda") and summary["world_size"] == 2
    backend = "nccl" if torch.cuda.device_count() >= 2 else "gloo"
    assert f"world size 2 (backend {backend})" in main_log(run), main_log(run)[-2000:]


@pytest.mark.timeout(180)
def test_ultra_on_atari_frames_with_an_fp16_learner_on_the_gpu(tmp_path):
    """Pong's uint8 frames through the shared replay to a Nature CNN learning in fp16: the run
    finishes its steps with updates made and a finite loss."""
    pytest.importorskip("ale_py")
    run = tmp_path / "run"
    result = run_script("ultra_parallel_train_dqn.py", "--config", ROOT / "configs" / "atari_pong_ultra_dqn.yaml",
                        "--num-workers", "2", "--num-envs-per-worker", "4", "--buffer-size", "20000",
                        "--learning-starts", "2000", "--total-timesteps", "12000", "--device", "cuda",
                        "--mixed-precision", "fp16", "--no-tensorboard", "--output-dir", run, timeout=170)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = summary_of(run)
    assert summary["precision"] == "fp16" and summary["global_step"] >= 12000, summary
    assert summary["updates"] > 0, summary
