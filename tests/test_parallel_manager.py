"""ParallelManager against real rollout worker processes, and its parts."""

from __future__ import annotations

import os
import signal
import time

import gymnasium as gym
import numpy as np
import pytest
import torch

from common.envs import make_vec_env, play_episodes
from common.envs.selfplay import MixturePlayer, opponent_mixture
from common.manager_config import ManagerConfig, WorkerSpec
from common.networks import QNetwork
from common.parallel_manager import ParallelManager
from common.rollout_worker import InferencePolicy, split_by_transitions
from common.supervisor import WorkerFailed

HIDDEN = (16,)


def cartpole_net(seed: int = 0) -> QNetwork:
    torch.manual_seed(seed)
    env = gym.make("CartPole-v1")
    return QNetwork(env.observation_space, env.action_space, HIDDEN)


def manager(num_workers: int = 2, **overrides) -> ParallelManager:
    config = ManagerConfig(num_workers=num_workers, games_per_worker=2, timeout=20.0, **overrides)
    return ParallelManager(WorkerSpec("CartPole-v1", seed=1), parallel_config=config, model=cartpole_net(), epsilon=1.0)


def test_split_keeps_episodes_whole():
    episodes = [{"length": n} for n in (5, 5, 12, 1, 3)]
    chunks = split_by_transitions(episodes, 10)
    assert [[e["length"] for e in c] for c in chunks] == [[5, 5], [12], [1, 3]]


@pytest.mark.timeout(90)
def test_seed_004_usage_with_plain_dicts():
    """The README of seed 004, step by step: dicts in, workers started, experience out, weights synced."""
    m = ParallelManager({"env_id": "ConnectFour-v0", "seed": 3, "opponent": "heuristic"},
                        {"hidden_dim": 32, "num_layers": 2, "input_dim": 84, "action_dim": 7},
                        {"num_workers": 1, "games_per_worker": 10, "max_game_length": 200, "experience_batch_size": 64,
                         "model_sync_interval": 100, "timeout": 60.0, "compression_enabled": False})
    assert m.spec.env_kwargs == {"opponent": "heuristic"} and m.model.spec["hidden_sizes"] == [32, 32]
    m.start_workers()
    try:
        experiences = m.collect_experiences()
        assert experiences and sum(len(b.episodes) for b in experiences) >= 10
        with torch.no_grad():  # "train" the manager's model, then sync it with no argument
            for param in m.model.parameters():
                param.add_(1.0)
        assert m.sync_model_to_workers() == 2
        deadline = time.monotonic() + 30
        while not any(b.model_version == 2 for b in m.collect_experiences(timeout=5)):
            assert time.monotonic() < deadline, "the synced weights never reached the worker"
        m.reset_workers()
        status = m.get_status()
        assert status["active_workers"] == [0] and set(status["queue_info"]["experience"]) == {0}
    finally:
        m.stop_workers()


def test_seed_004_dicts_that_do_not_fit_are_refused_in_one_line():
    with pytest.raises(ValueError, match="action_dim 9 does not match ConnectFour-v0"):
        ParallelManager({"env_id": "ConnectFour-v0"}, {"action_dim": 9}, {"num_workers": 1})
    with pytest.raises(ValueError, match="unknown key.*queue_size"):
        ParallelManager({"env_id": "CartPole-v1"}, {}, {"queue_size": 3})
    with pytest.raises(ValueError, match="needs an env_id"):
        ParallelManager({"board_size": 9}, {}, {})


def test_play_episodes_whole_with_masks():
    env = gym.make("ConnectFour-v0")
    policy = InferencePolicy(QNetwork(env.observation_space, env.action_space, HIDDEN))
    vec = make_vec_env("ConnectFour-v0", 3, seed=0, opponent="random")
    rng = np.random.default_rng(0)
    episodes, steps = play_episodes(vec, lambda obs, masks: policy.act(obs, masks, 0.3, rng), 7, record=True, seed=5)
    assert len(episodes) == 7 and steps >= sum(e["length"] for e in episodes) // 3
    for ep in episodes:
        n = ep["length"]
        assert ep["obs"].shape == (n + 1, 2, 6, 7) and ep["masks"].shape == (n + 1, 7)
        assert ep["terminated"] and ep["return"] == ep["result"] == ep["rewards"].sum()
        assert ep["masks"][np.arange(n), ep["actions"]].all()  # never an illegal move
        assert ep["obs"][0].sum() <= 1  # a whole game: it starts from an empty (or one-disc) board


def test_opponent_mixture_plays_each_game_with_one_player():
    env = gym.make("ConnectFour-v0")
    latest = InferencePolicy(QNetwork(env.observation_space, env.action_space, HIDDEN))
    payload = {"probs": {"latest": 0.5, "snapshot": 0.0, "random": 0.5, "heuristic": 0.0}, "epsilon": 0.1}
    player = opponent_mixture(payload, latest, [], 64, np.random.default_rng(0))
    assert isinstance(player, MixturePlayer) and len(player.players) == 2
    assert 0.3 < player.assigned.mean() < 0.7  # about half the games each
    vec = make_vec_env("ConnectFour-v0", 64, seed=0)
    vec.env.set_opponent(player)
    episodes, _ = play_episodes(vec, lambda obs, masks: latest.act(obs, masks, 1.0, np.random.default_rng(1)), 100)
    assert len(episodes) == 100 and {e["result"] for e in episodes} <= {-1.0, 0.0, 1.0}


@pytest.mark.timeout(120)
def test_manager_interface_with_real_workers():
    m = manager()
    try:
        m.start_workers()
        batches = m.collect_experiences(timeout=60)
        assert {b.worker for b in batches} == {0, 1}
        assert all(b.model_version == 1 and b.epsilon == 1.0 for b in batches)
        assert all(len(b.episodes) == 2 and b.episodes[0]["obs"].shape[1] == 4 for b in batches if b.last)

        started = time.monotonic()  # timeout: returns what arrived instead of blocking
        m.collect_experiences(timeout=0.2, min_batches=10_000)
        assert time.monotonic() - started < 3.0

        # sync: the new version (through shared memory) and epsilon reach every worker
        assert m.sync_model_to_workers(cartpole_net(seed=1), epsilon=0.25) == 2
        seen = set()
        for _ in range(20):
            seen |= {b.worker for b in m.collect_experiences(timeout=5) if b.model_version == 2 and b.epsilon == 0.25}
            if seen == {0, 1}:
                break
        assert seen == {0, 1}
        status = m.get_status()
        assert all(w["model_version"] == 2 for w in status["workers"].values()) and status["model_version"] == 2

        # pause: nothing from worker 0 until resumed
        m.pause_workers([0])
        assert m.get_status()["paused_workers"] == [0] and m.get_status()["active_workers"] == [1]
        m.collect_experiences(timeout=0.5)  # drops what it sent before pausing
        late = m.collect_experiences(timeout=1.0, min_batches=50)
        assert late and all(b.worker == 1 for b in late)
        m.resume_workers([0])
        assert any(b.worker == 0 for b in m.collect_experiences(timeout=10))

        m.reset_workers()
        results = m.evaluate(5)
        assert len(results) == 5 and all(r["length"] >= 1 for r in results)
        info = m.communicator.get_queue_info()
        assert info["experience_max"] == 2 and set(info["experience"]) == {0, 1}
        assert status["workers"][0]["episodes"] > 0
    finally:
        m.stop_workers()
    m.stop_workers()  # twice is fine


@pytest.mark.timeout(120)
def test_deaths_are_restarted_with_current_weights_until_the_limit(monkeypatch, caplog):
    monkeypatch.setenv("PRL_INJECT_FAULT", "raise:0:3")  # worker 0 raises at its third message, in its first life
    m = manager(max_restarts=2)
    try:
        m.start_workers()
        m.sync_model_to_workers(cartpole_net(seed=2), epsilon=0.5)
        deadline = time.monotonic() + 60
        while m.get_status()["restarted_workers"].get(0) != 1:
            m.collect_experiences(timeout=0.5)
            assert time.monotonic() < deadline, "the raising worker was not restarted"
        assert "RuntimeError: fault injected into worker 0" in caplog.text  # its traceback, logged

        os.kill(m.supervisor.workers[1].process.pid, signal.SIGKILL)
        started = time.monotonic()
        while m.get_status()["restarted_workers"].get(1) != 1:
            m.collect_experiences(timeout=0.5)
            assert time.monotonic() - started < 5.0, "kill -9 not detected within 5 s"
        fresh = []
        for _ in range(30):
            fresh += [b for b in m.collect_experiences(timeout=5) if b.worker == 1]
            if fresh:
                break
        assert fresh and fresh[0].model_version == 2 and fresh[0].epsilon == 0.5
        assert "killed by signal SIGKILL" in caplog.text

        with pytest.raises(WorkerFailed, match="worker 1 died 3 times"):
            for _ in range(3):
                pid = m.supervisor.workers[1].process.pid
                os.kill(pid, signal.SIGKILL)
                deadline = time.monotonic() + 10
                while m.supervisor.workers[1].process.pid == pid and time.monotonic() < deadline:
                    m.collect_experiences(timeout=0.5)
    finally:
        m.stop_workers()


@pytest.mark.timeout(60)
def test_an_env_the_learner_cannot_make_is_refused_before_any_worker_starts():
    # The worker-side case (an env that fails only in a worker) is in tests/test_env_factory.py.
    with pytest.raises(ValueError, match="cannot create CartPole-v1"):
        ParallelManager(WorkerSpec("CartPole-v1", env_kwargs={"no_such_option": 1}),
                        parallel_config=ManagerConfig(num_workers=1, timeout=30.0), model=cartpole_net())
