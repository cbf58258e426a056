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
from common.manager import (
    InferencePolicy,
    ManagerConfig,
    ModelSynchronizer,
    ParallelManager,
    WorkerSpec,
    split_by_transitions,
)
from common.networks import QNetwork
from common.parallel import ParallelManager as ReExported
from common.parallel import TooManyRestarts

HIDDEN = (16,)


def cartpole_net(seed: int = 0) -> QNetwork:
    torch.manual_seed(seed)
    env = gym.make("CartPole-v1")
    return QNetwork(env.observation_space, env.action_space, HIDDEN)


def manager(num_workers: int = 2, **overrides) -> ParallelManager:
    config = ManagerConfig(num_workers=num_workers, games_per_worker=2, timeout=20.0, **overrides)
    return ParallelManager(WorkerSpec("CartPole-v1", seed=1, hidden_sizes=HIDDEN), config,
                           cartpole_net().state_dict(), epsilon=1.0)


def test_reexported_from_parallel():
    assert ReExported is ParallelManager


def test_synchronizer_versions_and_compression():
    net = cartpole_net()
    sync = ModelSynchronizer(model_sync_interval=10, compression_enabled=True)
    assert sync.should_sync(0)
    first = sync.pack(net.state_dict(), learner_step=0)
    assert first["version"] == 1 and first["compressed"]
    assert not sync.should_sync(9) and sync.should_sync(10)
    restored = ModelSynchronizer.unpack(first)
    for key, value in net.state_dict().items():
        assert torch.equal(restored[key], value)
    assert sync.pack(net.state_dict(), learner_step=10)["version"] == 2


def test_split_keeps_episodes_whole():
    episodes = [{"length": n} for n in (5, 5, 12, 1, 3)]
    chunks = split_by_transitions(episodes, 10)
    assert [[e["length"] for e in c] for c in chunks] == [[5, 5], [12], [1, 3]]


def test_play_episodes_whole_with_masks():
    env = gym.make("ConnectFour-v0")
    policy = InferencePolicy(env.observation_space, env.action_space, HIDDEN)
    policy.load(ModelSynchronizer().pack(QNetwork(env.observation_space, env.action_space, HIDDEN).state_dict()))
    vec = make_vec_env("ConnectFour-v0", 3, seed=0, opponent="random")
    rng = np.random.default_rng(0)
    episodes, steps = play_episodes(vec, lambda obs, masks: policy.act(obs, masks, 0.3, rng), 7, record=True, seed=5)
    assert len(episodes) == 7 and steps >= sum(e["length"] for e in episodes) // 3
    for ep in episodes:
        n = ep["length"]
        assert ep["obs"].shape == (n + 1, 2, 6, 7) and ep["masks"].shape == (n + 1, 7)
        assert ep["terminated"] and ep["return"] == ep["result"] == ep["rewards"].sum()
        assert ep["masks"][np.arange(n), ep["actions"]].all()  # never an illegal move
        # a whole game: it starts from an empty (or one-disc) board
        assert ep["obs"][0].sum() <= 1


@pytest.mark.timeout(90)
def test_manager_interface_with_real_workers():
    m = manager()
    try:
        m.start_workers()
        batches = m.collect_experiences(timeout=30)
        assert {b.worker for b in batches} == {0, 1}
        assert all(b.model_version == 1 and b.epsilon == 1.0 for b in batches)
        assert all(len(b.episodes) == 2 and b.episodes[0]["obs"].shape[1] == 4 for b in batches if b.last)

        # timeout: returns what arrived instead of blocking
        started = time.monotonic()
        m.collect_experiences(timeout=0.2, min_batches=10_000)
        assert time.monotonic() - started < 3.0

        # sync: the new version and epsilon reach every worker
        version = m.sync_model_to_workers(cartpole_net(seed=1).state_dict(), epsilon=0.25)
        assert version == 2
        seen = set()
        for _ in range(20):
            seen |= {b.worker for b in m.collect_experiences(timeout=5) if b.model_version == 2 and b.epsilon == 0.25}
            if seen == {0, 1}:
                break
        assert seen == {0, 1}
        status = m.get_status()
        assert all(w["model_version"] == 2 for w in status["workers"].values())

        # pause: nothing from worker 0 until resumed
        m.pause_workers([0])
        assert m.get_status()["paused_workers"] == [0] and m.get_status()["active_workers"] == [1]
        m.collect_experiences(timeout=0.5)  # drops what it sent before pausing
        late = m.collect_experiences(timeout=1.0, min_batches=50)
        assert late and all(b.worker == 1 for b in late)
        m.resume_workers([0])
        assert any(b.worker == 0 for b in m.collect_experiences(timeout=10))

        # reset and evaluation
        m.reset_workers()
        results = m.evaluate(5)
        assert len(results) == 5 and all(r["length"] >= 1 for r in results)
        info = m.communicator.get_queue_info()
        assert info["experience_max"] == 2 and set(info["experience"]) == {0, 1}
        assert status["workers"][0]["episodes"] > 0
    finally:
        m.stop_workers()
    m.stop_workers()  # twice is fine


@pytest.mark.timeout(90)
def test_crash_and_kill_are_restarted_with_current_weights(caplog):
    m = manager(max_restarts=2)
    try:
        m.start_workers()
        m.collect_experiences(timeout=30)
        m.sync_model_to_workers(cartpole_net(seed=2).state_dict(), epsilon=0.5)
        old_pid = m.workers[1].process.pid
        os.kill(old_pid, signal.SIGKILL)
        started = time.monotonic()
        while m.get_status()["restarted_workers"].get(1) != 1:
            m.collect_experiences(timeout=0.5)
            assert time.monotonic() - started < 5.0, "kill -9 not detected within 5 s"
        assert m.workers[1].process.pid != old_pid
        fresh = []
        for _ in range(30):
            fresh += [b for b in m.collect_experiences(timeout=5) if b.worker == 1]
            if fresh:
                break
        assert fresh and fresh[0].model_version == 2 and fresh[0].epsilon == 0.5

        # an exception inside the worker: its traceback is logged and it is restarted
        m.communicator.send(0, "crash", "test")
        while m.get_status()["restarted_workers"].get(0) != 1:
            m.collect_experiences(timeout=0.5)
            assert time.monotonic() - started < 30
        assert "RuntimeError: crash requested: test" in caplog.text  # the worker's traceback, logged
        assert "killed by signal SIGKILL" in caplog.text

        # past the restart limit: TooManyRestarts
        with pytest.raises(TooManyRestarts):
            for _ in range(3):
                os.kill(m.workers[1].process.pid, signal.SIGKILL)
                deadline = time.monotonic() + 10
                pid = m.workers[1].process.pid
                while m.workers[1].process.pid == pid and time.monotonic() < deadline:
                    m.collect_experiences(timeout=0.5)
    finally:
        m.stop_workers()


@pytest.mark.timeout(90)
def test_hung_worker_is_replaced_and_stop_kills_one_that_ignores_stop(caplog):
    m = manager(num_workers=1, hang_timeout=2.0)
    m.start_workers()
    try:
        m.collect_experiences(timeout=30)
        hung = m.workers[0].process
        os.kill(hung.pid, signal.SIGSTOP)  # alive but silent
        deadline = time.monotonic() + 30
        while m.workers[0].restarts == 0 and time.monotonic() < deadline:
            m.collect_experiences(timeout=1.0)
        assert m.workers[0].restarts == 1 and not hung.is_alive()
        assert "presumed hung" in caplog.text
        assert any(b.worker == 0 for b in m.collect_experiences(timeout=30))
        process = m.workers[0].process
        os.kill(process.pid, signal.SIGSTOP)  # it can no longer read its stop message
    finally:
        m.stop_workers(timeout=1.0)
    assert not process.is_alive()
