"""Does compressing ParallelManager's experience batches in transit pay? Bytes and seconds, measured.

A rollout worker sends each batch of whole episodes (``ExperienceBatch``) to the learner through its
pipe. This plays real batches (ConnectFour-v0 against the random player; CartPole-v1 with a random
policy and with a balancing one, whose episodes are long), then measures, per batch:

- bytes on the pipe: pickled as the pipe pickles it, and zlib-compressed (levels 1 and 6);
- the worker's CPU time to put a batch on the pipe (pickle [+ compress] + send) and the learner's to take it
  off (receive [+ decompress] + unpickle), each in its own process (``spawn``, as the manager's workers),
  medians of ``--repeats`` batches. CPU time of the thread, not wall time: on a machine whose cores are
  all busy (as a training run's are) that is what a batch costs, and it is what other load disturbs least.

    python benchmarks/bench_manager_compression.py [--repeats 50] [--games 16]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import pickle
import statistics
import sys
import time
import zlib
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def make_batches(games: int) -> dict[str, object]:
    from common.envs import make_vec_env, play_episodes
    from common.rollout_worker import ExperienceBatch

    rng = np.random.default_rng(0)

    def random_policy(obs, masks):
        if masks is None:
            return rng.integers(0, 2, len(obs))
        return np.array([rng.choice(np.flatnonzero(m)) for m in masks])

    def balance(obs, masks):  # pushes towards the pole's fall: CartPole episodes of hundreds of steps
        return ((obs[:, 2] + 0.5 * obs[:, 3]) > 0).astype(np.int64)

    out = {}
    for name, env_id, policy, kwargs in (("ConnectFour-v0 vs random", "ConnectFour-v0", random_policy,
                                          {"opponent": "random"}),
                                         ("CartPole-v1 random policy", "CartPole-v1", random_policy, {}),
                                         ("CartPole-v1 balancing policy", "CartPole-v1", balance, {})):
        vec = make_vec_env(env_id, games, 0, **kwargs)
        episodes, steps = play_episodes(vec, policy, games, record=True, seed=1)
        vec.close()
        out[name] = ExperienceBatch(0, 1, 0.1, episodes, steps, 0.01)
    return out


def _learner(conn) -> None:
    """The learner's end: takes each batch off the pipe once it is there (first byte: the zlib level, 0 = none),
    timing it in CPU seconds of this thread; answers every batch with its time."""
    import zlib as _zlib

    while True:
        conn.poll(None)
        started = time.thread_time()
        data = conn.recv_bytes()
        if not data:
            return
        pickle.loads(_zlib.decompress(data[1:]) if data[0] else data[1:])
        conn.send(time.thread_time() - started)


def transit(conn, batch, level: int, repeats: int) -> tuple[float, float]:
    """(worker CPU seconds to put a batch on the pipe, learner CPU seconds to take it off), medians of ``repeats``.

    ``level`` 0: pickled, as the pipe sends any object; 1-9: pickled, then zlib at that level."""
    send_times, recv_times = [], []
    for _ in range(repeats):
        started = time.thread_time()
        data = pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL)
        conn.send_bytes(bytes([level]) + (zlib.compress(data, level) if level else data))
        send_times.append(time.thread_time() - started)
        recv_times.append(conn.recv())  # the far end took it: the next send starts on an empty pipe
    return statistics.median(send_times), statistics.median(recv_times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--games", type=int, default=16, help="episodes per batch (games_per_worker)")
    args = parser.parse_args()
    batches = make_batches(args.games)
    context = mp.get_context("spawn")
    conn, child = context.Pipe()
    learner = context.Process(target=_learner, args=(child,))
    learner.start()
    child.close()
    print(f"{'batch':30s} {'steps':>6s} {'mode':>7s} {'bytes':>9s} {'ratio':>6s} {'send ms':>8s} {'recv ms':>8s}")
    try:
        for name, batch in batches.items():
            steps = sum(e["length"] for e in batch.episodes)
            plain = len(pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL))
            for level in (0, 1, 6):
                size = len(zlib.compress(pickle.dumps(batch, protocol=5), level)) if level else plain
                send, recv = transit(conn, batch, level, args.repeats)
                mode = f"zlib-{level}" if level else "plain"
                print(f"{name:30s} {steps:6d} {mode:>7s} {size:9d} {plain / size:6.1f} {1e3 * send:8.2f} "
                      f"{1e3 * recv:8.2f}")
    finally:
        conn.send_bytes(b"")
        learner.join()


if __name__ == "__main__":
    main()
