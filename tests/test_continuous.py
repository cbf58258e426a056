"""Continuous control: normalization statistics shared by every worker, and Pendulum-v1 really learns."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import ROOT, run_script

from common.checkpoint import load_checkpoint
from common.normalize import Normalizer, RunningMeanStd

SCRIPT = "train_parallel_timed.py"
PENDULUM = ["--config", str(ROOT / "configs" / "pendulum.yaml"), "--no-tensorboard", "--seed", "1"]


def test_running_statistics_equal_those_of_all_the_data_at_once():
    rng = np.random.default_rng(0)
    batches = [rng.normal(3.0, 2.0, size=(n, 3)) for n in (1, 7, 100, 1000)]
    stats = RunningMeanStd((3,))
    for batch in batches:
        stats.update(batch)
    everything = np.concatenate(batches)
    assert np.allclose(stats.mean, everything.mean(0), atol=1e-4)
    assert np.allclose(stats.var, everything.var(0), rtol=1e-3)
    # Moments summed over two "ranks" give the statistics of both halves together.
    halves = RunningMeanStd((3,)), RunningMeanStd((3,))
    other = [b * 2 for b in batches]
    for mine, theirs in zip(batches, other):
        total = _moments(theirs)
        halves[0].update(mine, lambda m, t=total: m + t)
    assert np.allclose(halves[0].mean, np.concatenate(batches + other).mean(0), atol=1e-3)


def _moments(batch):
    return np.concatenate([[len(batch)], batch.sum(0), (batch ** 2).sum(0)])


def test_published_statistics_read_back_identically_and_normalize_raw_observations():
    learner = Normalizer((3,), norm_obs=True, norm_reward=True, gamma=0.9)
    learner.update(np.random.default_rng(1).normal(5.0, 4.0, size=(64, 3)), np.arange(64.0))
    published = np.zeros(learner.size())
    learner.publish(published)
    worker = Normalizer((3,), norm_obs=True, norm_reward=True, gamma=0.9)
    worker.read(published)
    assert worker.digest() == learner.digest()
    assert np.array_equal(worker.obs.mean, learner.obs.mean) and worker.ret.var == learner.ret.var
    obs = np.full((2, 3), 5.0, dtype=np.float32)
    assert np.allclose(worker.observations(obs), (5.0 - learner.obs.mean) / np.sqrt(learner.obs.var), atol=1e-5)
    off = Normalizer((3,), norm_obs=False, norm_reward=False)
    assert off.observations(obs) is obs and not off.state_dict()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("workers", [0, 2])
def test_pendulum_learns_with_and_without_workers(tmp_path, workers):
    run_dir = tmp_path / "pendulum"
    # With workers, every collected rollout is checked to have been acted on with the published statistics.
    result = run_script(SCRIPT, *PENDULUM, "--num-workers", workers, "--num-envs-per-worker", 16 // max(1, workers),
                        "--total-timesteps", 200_000, "--target-return", -300, "--output-dir", run_dir, timeout=230)
    assert result.returncode == 0, result.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["best_mean_return"] >= -300, summary  # a random policy scores about -1200


def test_normalization_statistics_survive_a_resume(tmp_path):
    run_dir = tmp_path / "resume"
    small = [*PENDULUM, "--num-workers", 2, "--num-envs-per-worker", 4, "--n-steps", 64, "--batch-size", 128,
             "--target-return", "none", "--output-dir", run_dir]
    assert run_script(SCRIPT, *small, "--total-timesteps", 1024).returncode == 0
    first = load_checkpoint(run_dir / "checkpoints" / "latest.pt")
    assert first["obs_norm"]["count"] == pytest.approx(1024, abs=0.01)  # every observation taken in once
    result = run_script(SCRIPT, *small, "--total-timesteps", 2048, "--resume", "auto")
    assert result.returncode == 0, result.stderr
    second = load_checkpoint(run_dir / "checkpoints" / "latest.pt")
    assert second["obs_norm"]["count"] == pytest.approx(2048, abs=0.01)  # continued, not restarted
    assert second["reward_norm"]["count"] == pytest.approx(2048, abs=0.01)
    assert not np.allclose(second["obs_norm"]["mean"], first["obs_norm"]["mean"])
