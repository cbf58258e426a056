"""The shared-memory replay buffer: consistent samples under concurrent writers, wraparound,
half-written slots of a killed writer, prioritized proportions, and the message-fed fallback."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from common import system
from common.replay_shm import ReplayLayout, ReplayTooLarge, SharedMemoryUnavailable, SumTree, make_replay, open_writer
from common.supervisor import CONTEXT

OBS = (64,)  # wide rows, so a torn copy would show


def transitions(writer: int, start: int, count: int) -> dict[str, np.ndarray]:
    """Transitions whose every field is derived from one id, so any mix-up is detectable."""
    ids = writer * 1_000_000 + np.arange(start, start + count)
    return {
        "obs": np.repeat(ids[:, None].astype(np.float32), OBS[0], axis=1),
        "next_obs": np.repeat((ids + 1)[:, None].astype(np.float32), OBS[0], axis=1),
        "actions": ids % 5,
        "rewards": ids.astype(np.float32),
        "dones": (ids % 2).astype(np.float32),
        "discounts": np.full(count, 0.99, np.float32),
        "priorities": np.ones(count, np.float32),
    }


def assert_consistent(sample) -> np.ndarray:
    ids = sample.rewards.astype(np.int64)
    np.testing.assert_array_equal(sample.obs, np.repeat(ids[:, None], OBS[0], axis=1))
    np.testing.assert_array_equal(sample.next_obs, np.repeat((ids + 1)[:, None], OBS[0], axis=1))
    np.testing.assert_array_equal(sample.actions, ids % 5)
    np.testing.assert_array_equal(sample.dones, ids % 2)
    return ids


def writer_process(spec, writer: int, batches: int, batch_size: int, die_mid_write: bool = False) -> None:
    replay = open_writer(spec, writer)
    start = int(replay.arrays["cursors"][writer])
    for b in range(batches):
        replay.add(transitions(writer, start + b * batch_size, batch_size))
    if die_mid_write:  # phase 1 of a write (slots marked odd, half the fields written), then a hard death
        arrays, part = replay.arrays, replay.layout.part_capacity
        cursor = int(arrays["cursors"][writer])
        serial = cursor + np.arange(batch_size)
        slots = writer * part + serial % part
        arrays["seq"][slots] = 2 * serial + 1
        arrays["obs"][slots] = -1.0
        os._exit(9)
    replay.close()


def run_writers(spec, jobs) -> list:
    procs = [CONTEXT.Process(target=writer_process, args=(spec, *job)) for job in jobs]
    for p in procs:
        p.start()
    return procs


@pytest.mark.timeout(60)
def test_concurrent_writers_never_tear():
    layout = ReplayLayout(capacity=3 * 2048, num_writers=3, obs_shape=OBS)
    replay = make_replay(layout, backend="shm")
    try:
        assert replay.backend == "shm"
        procs = run_writers(replay.writer_spec, [(w, 400, 32) for w in range(3)])
        samples = rejected = 0
        deadline = time.monotonic() + 40
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
            replay.sync()
            if len(replay):
                sample = replay.sample(256)
                assert len(sample.rewards) > 0
                assert_consistent(sample)
                samples += 1
                rejected += sample.rejected
        for p in procs:
            p.join(10)
            assert p.exitcode == 0
        replay.sync()
        assert samples > 0
        assert replay.inserted() == 3 * 400 * 32
        assert len(replay) == 3 * 2048  # wrapped: every slot holds a committed transition
        ids = assert_consistent(replay.sample(4096))
        # Only each writer's newest part_capacity transitions survive the wraparound.
        serial = ids % 1_000_000
        assert (serial >= 400 * 32 - 2048).all()
    finally:
        replay.close()


def test_wraparound_in_process():
    layout = ReplayLayout(capacity=10, num_writers=2, obs_shape=OBS)
    replay = make_replay(layout, backend="shm")
    try:
        writer = open_writer(replay.writer_spec, 1)
        for start in range(0, 12, 3):
            writer.add(transitions(1, start, 3))
        writer.close()
        replay.sync()
        assert len(replay) == 5 and replay.inserted() == 12
        assert list(replay.filled()) == [0, 5]
        ids = set(assert_consistent(replay.sample(500)) % 1_000_000)
        assert ids == {7, 8, 9, 10, 11}
        with pytest.raises(ValueError):
            open_writer(replay.writer_spec, 0).add(transitions(0, 0, 6))  # larger than a partition
    finally:
        replay.close()


@pytest.mark.timeout(60)
def test_half_written_slots_of_a_killed_writer_are_never_sampled():
    layout = ReplayLayout(capacity=2 * 64, num_writers=2, obs_shape=OBS)
    replay = make_replay(layout, backend="shm")
    try:
        # Writer 0 fills its partition past one lap, then dies in the middle of a write.
        (proc,) = run_writers(replay.writer_spec, [(0, 5, 16, True)])
        proc.join(20)
        assert proc.exitcode == 9
        replay.sync()
        seq = replay.arrays["seq"][:64]
        assert (seq % 2 == 1).sum() == 16, "the interrupted slots are marked as being written"
        # A replay checkpoint taken now saves the half-written slots as empty, the committed ones as they are.
        state = replay.state()
        torn = seq % 2 == 1
        assert (state["seq"][:64][torn] == 0).all() and (state["seq"][:64][~torn] == seq[~torn]).all()
        for _ in range(50):
            ids = assert_consistent(replay.sample(64))  # -1 rows from the torn write would fail here
            assert (ids >= 0).all()
        # The restarted writer resumes at the saved cursor and overwrites the torn slots.
        (proc,) = run_writers(replay.writer_spec, [(0, 1, 16)])
        proc.join(20)
        assert proc.exitcode == 0
        replay.sync()
        assert not (replay.arrays["seq"][:64] % 2 == 1).any()
        assert replay.inserted() == 6 * 16
    finally:
        replay.close()


def test_sum_tree_sums_and_finds():
    tree = SumTree(5)
    tree.update(np.arange(5), np.array([1.0, 0.0, 3.0, 2.0, 4.0]))
    assert tree.total() == pytest.approx(10.0)
    np.testing.assert_array_equal(tree.find(np.array([0.0, 0.99, 1.0, 3.99, 4.0, 5.99, 6.0, 9.99])),
                                  [0, 0, 2, 2, 3, 3, 4, 4])
    tree.update(np.array([2]), np.array([0.5]))
    assert tree.total() == pytest.approx(7.5)


def test_prioritized_sampling_proportions():
    layout = ReplayLayout(capacity=8, num_writers=1, obs_shape=OBS, prioritized=True)
    replay = make_replay(layout, backend="shm", alpha=1.0)
    replay.priority_eps = 0.0
    replay.seed(0)
    try:
        batch = transitions(0, 0, 4)
        batch["priorities"] = np.array([1.0, 2.0, 3.0, 4.0], np.float32)
        writer = open_writer(replay.writer_spec, 0)
        writer.add(batch)
        writer.close()
        replay.sync()
        counts = np.zeros(4)
        weights_of = {}
        for _ in range(200):
            sample = replay.sample(50, beta=1.0)
            ids = assert_consistent(sample)
            np.add.at(counts, ids, 1)
            weights_of.update(zip(ids.tolist(), sample.weights.tolist()))
        np.testing.assert_allclose(counts / counts.sum(), [0.1, 0.2, 0.3, 0.4], atol=0.01)
        # IS weights (N * P)^-beta normalised by the max: lowest priority gets weight 1.
        assert weights_of[0] == pytest.approx(1.0) and weights_of[3] == pytest.approx(0.25)
        # New priorities from the learner change the proportions.
        sample = replay.sample(4)
        replay.update_priorities(sample, np.where(sample.rewards == 0, 6.0, 0.0))
        ids = replay.sample(1000).rewards
        assert (ids == 0).mean() > 0.5
    finally:
        replay.close()


class Link:
    """Stands in for an actor's WorkerLink: what it sends arrives at the learner as a message."""

    def __init__(self, replay, writer: int):
        self.replay, self.writer = replay, writer

    def send(self, kind: str, payload) -> None:
        assert kind == "transitions"
        self.replay.receive(self.writer, payload)


def test_message_fed_fallback_when_shared_memory_is_too_small(caplog):
    layout = ReplayLayout(capacity=2 * 256, num_writers=2, obs_shape=OBS)
    with system.assumed_machine({"shm_free": 1024}):
        with pytest.raises(SharedMemoryUnavailable):
            make_replay(layout, backend="shm")
        replay = make_replay(layout, backend="auto")
    try:
        assert replay.backend == "queue" and "falling back" in caplog.text
        for writer in (0, 1):
            actor_side = open_writer(replay.writer_spec, writer, Link(replay, writer))
            for start in range(0, 320, 32):
                actor_side.add(transitions(writer, start, 32))
        replay.sync()
        assert replay.inserted() == 640 and len(replay) == 512
        assert_consistent(replay.sample(300))
    finally:
        replay.close()


def test_refuses_a_buffer_larger_than_ram():
    with system.assumed_machine({"ram_available": 1 << 20}), pytest.raises(ReplayTooLarge, match="lower --buffer-size"):
        make_replay(ReplayLayout(capacity=100_000, num_writers=1, obs_shape=OBS), backend="auto")
