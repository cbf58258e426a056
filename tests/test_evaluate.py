"""python -m common.evaluate and common.policy.load_policy on real runs, as a user runs them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import ROOT, run_script, script_env

TIMED_CARTPOLE = ["--config", str(ROOT / "configs" / "cartpole_fast.yaml"), "--seed", "1", "--no-tensorboard"]


def evaluate(*args, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "common.evaluate", *map(str, args)], cwd=cwd or ROOT,
                          env=script_env(), capture_output=True, text=True, timeout=180)


@pytest.fixture(scope="module")
def solved_cartpole(tmp_path_factory):
    """A CartPole-v1 policy trained by train_parallel_timed.py until the training mean reached 475."""
    run_dir = tmp_path_factory.mktemp("timed") / "cartpole"
    result = run_script("train_parallel_timed.py", *TIMED_CARTPOLE, "--output-dir", run_dir, timeout=240)
    assert result.returncode == 0, result.stderr
    return run_dir


@pytest.mark.timeout(300)
def test_a_solved_cartpole_policy_scores_475_under_evaluation(solved_cartpole):
    result = evaluate(solved_cartpole, "--episodes", "20", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["episodes"] == 20 and report["env_id"] == "CartPole-v1"
    assert report["mean_return"] >= 475, report


def test_video_and_onnx_export_agree_with_the_policy(solved_cartpole, tmp_path):
    result = evaluate(solved_cartpole, "--episodes", "2", "--video", tmp_path / "videos",
                      "--export", tmp_path / "policy.onnx", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    videos = sorted((tmp_path / "videos").glob("*.mp4"))
    assert len(videos) == 2 and all(v.stat().st_size > 1000 for v in videos), videos
    assert report["export"]["max_abs_error"] <= 1e-5 and report["export"]["checked_observations"] >= 32
    assert (tmp_path / "policy.onnx").stat().st_size > 1000


def test_load_policy_needs_no_training_script(solved_cartpole, tmp_path):
    code = f"""
import sys, gymnasium as gym, numpy as np
from common.policy import load_policy
policy = load_policy({str(solved_cartpole / "checkpoints" / "latest.pt")!r})
assert not any(name.startswith(("train_", "parallel_train", "ultra_")) for name in sys.modules)
env = gym.make("CartPole-v1")
obs, _ = env.reset(seed=123)
total, done = 0.0, False
while not done:
    obs, reward, terminated, truncated, _ = env.step(int(policy.act(obs[None])[0]))
    total += reward
    done = terminated or truncated
print(total)
"""
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=script_env(), capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert float(result.stdout) >= 400


def test_a_path_without_a_checkpoint_is_one_line_and_exit_2(tmp_path):
    result = evaluate(tmp_path)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "not a run directory with a checkpoint" in result.stderr
