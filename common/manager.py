"""Rollout workers for a central learner: ParallelManager, WorkerCommunicator, ModelSynchronizer.

The learner's process owns the networks and the replay buffer. Each rollout worker is a
``spawn``-ed process with its own copy of the environment and a lightweight
:class:`InferencePolicy` (a Q-network, no optimizer, no buffer). Workers play whole
episodes and push them, a batch of ``games_per_worker`` episodes at a time, into their
own bounded queue; the learner drains those queues with :meth:`ParallelManager.collect_experiences`.
Weights go the other way with a version number, so every batch says which version
produced it. Every queue operation has a timeout.

One queue pair per worker (not one shared queue) keeps a killed worker from taking a
shared queue's lock with it: the dead worker's queues are thrown away with it, together
with whatever half-written message they may hold, and the restarted worker gets fresh
ones plus the current weights, epsilon and opponents.

Worker -> learner messages are ``(kind, worker_index, payload)`` with kind ``episodes``,
``eval``, ``paused``, ``reset_done``, ``status`` or ``error``. Learner -> worker
commands are ``(command, payload)``: ``sync``, ``opponents``, ``pause``, ``resume``,
``reset``, ``evaluate``, ``ping``, ``close``. Logging goes to the ``prl.manager`` logger.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import signal
import time
import traceback
import zlib
from collections import Counter
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

import numpy as np
import torch

from common.envs import play_episodes
from common.parallel import CONTEXT, POLL_S, ParentWatch, TooManyRestarts, describe_exit, init_worker_process

log = logging.getLogger("prl.manager")


def default_num_workers() -> int:
    """All cores but two (one for the learner, one for the system), at least one."""
    return max(1, (os.cpu_count() or 1) - 2)


@dataclass
class ManagerConfig:
    num_workers: int = field(default_factory=default_num_workers)  # rollout processes
    games_per_worker: int = 8  # episodes a worker plays per batch it sends
    max_game_length: int = 0  # cut an episode after this many steps (0 = the env's own limit)
    experience_batch_size: int = 8192  # most transitions per queue message; bigger batches are split by episode
    model_sync_interval: int = 1  # learner steps between weight broadcasts (see ModelSynchronizer.should_sync)
    worker_reset_interval: int = 0  # batches between worker resets (fresh envs and seeds); 0 = never
    timeout: float = 30.0  # seconds allowed for any queue operation and for one collect
    compression_enabled: bool = False  # zlib-compress the weights sent to workers
    max_restarts: int = 3  # restarts per worker before the manager gives up
    experience_queue_size: int = 2  # messages a worker may have waiting for the learner (bounded queue)
    control_queue_size: int = 16  # commands that may wait for a worker (bounded queue)
    envs_per_worker: int = 0  # environments a worker steps together; 0 = games_per_worker
    hang_timeout: float = 300.0  # a worker awaited this long without a message is killed and restarted (0 = never)


@dataclass
class WorkerSpec:
    """Everything a rollout worker needs to build its environment and policy (picklable)."""

    env_id: str
    seed: int
    hidden_sizes: tuple[int, ...] = (128, 128)
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    torch_threads: int = 1
    log_dir: str | None = None  # where worker_<i>.log goes (None = no worker log file)


@dataclass
class ExperienceBatch:
    """Whole episodes from one worker, played with one model version and epsilon."""

    worker: int
    model_version: int
    epsilon: float
    episodes: list[dict[str, Any]]
    steps: int
    collect_seconds: float
    last: bool = True  # the final message of the batch (a big batch travels in several messages)


# ------------------------------------------------------------------ model synchronization

class ModelSynchronizer:
    """Packs weights for workers with a version number, optionally zlib-compressed.

    ``should_sync(learner_step)`` is true once ``model_sync_interval`` learner steps have
    passed since the last sync. The payload is a flat float32 byte string plus the
    names and shapes needed to rebuild the state dict, so it pickles small and fast.
    """

    def __init__(self, model_sync_interval: int = 1, compression_enabled: bool = False):
        self.model_sync_interval = max(1, model_sync_interval)
        self.compression_enabled = compression_enabled
        self.version = 0
        self.last_sync_step: int | None = None
        self.bytes_sent = 0
        self.raw_bytes = 0

    def should_sync(self, learner_step: int) -> bool:
        return self.last_sync_step is None or learner_step - self.last_sync_step >= self.model_sync_interval

    def pack(self, state_dict: dict[str, torch.Tensor], learner_step: int | None = None,
             version: int | None = None) -> dict[str, Any]:
        """A new version of the weights, ready to send."""
        self.version = self.version + 1 if version is None else version
        if learner_step is not None:
            self.last_sync_step = learner_step
        payload = pack_state(state_dict, self.version, self.compression_enabled)
        self.bytes_sent += len(payload["data"])
        self.raw_bytes += payload["raw_bytes"]
        return payload

    @staticmethod
    def unpack(payload: dict[str, Any]) -> dict[str, torch.Tensor]:
        return unpack_state(payload)


def pack_state(state_dict: dict[str, torch.Tensor], version: int, compress: bool = False) -> dict[str, Any]:
    arrays = {k: v.detach().cpu().float().numpy().ravel() for k, v in state_dict.items()}
    flat = np.concatenate(list(arrays.values())) if arrays else np.zeros(0, np.float32)
    raw = flat.astype(np.float32).tobytes()
    data = zlib.compress(raw, 1) if compress else raw
    return {"version": version, "compressed": compress, "data": data, "raw_bytes": len(raw),
            "layout": [(k, tuple(v.shape)) for k, v in state_dict.items()]}


def unpack_state(payload: dict[str, Any]) -> dict[str, torch.Tensor]:
    raw = zlib.decompress(payload["data"]) if payload["compressed"] else payload["data"]
    flat = torch.from_numpy(np.frombuffer(raw, dtype=np.float32).copy())
    state, offset = {}, 0
    for name, shape in payload["layout"]:
        count = int(np.prod(shape)) if shape else 1
        state[name] = flat[offset:offset + count].view(shape)
        offset += count
    return state


# ------------------------------------------------------------------ worker side: policy and rollouts

class InferencePolicy:
    """A Q-network for acting only: epsilon-greedy over legal actions, no gradients."""

    def __init__(self, observation_space, action_space, hidden_sizes: tuple[int, ...]):
        from common.networks import QNetwork

        self.net = QNetwork(observation_space, action_space, tuple(hidden_sizes))
        self.net.eval()
        self.num_actions = int(action_space.n)
        self.version = -1

    def load(self, payload: dict[str, Any]) -> None:
        self.net.load_state_dict(unpack_state(payload))
        self.version = int(payload["version"])

    @torch.no_grad()
    def act(self, obs: np.ndarray, action_mask: np.ndarray | None, epsilon: float,
            rng: np.random.Generator) -> np.ndarray:
        q = self.net(torch.as_tensor(obs, dtype=torch.float32)).numpy()
        if action_mask is not None:
            q = np.where(action_mask, q, -np.inf)
        actions = q.argmax(axis=1)
        explore = rng.random(len(actions)) < epsilon
        if explore.any():
            if action_mask is None:
                actions[explore] = rng.integers(0, self.num_actions, explore.sum())
            else:
                weights = action_mask[explore].astype(np.float64)
                cumulative = np.cumsum(weights, axis=1)
                draws = rng.random(len(weights)) * cumulative[:, -1]
                actions[explore] = (cumulative > draws[:, None]).argmax(axis=1)
        return actions


class PolicyPlayer:
    """An opponent that plays a Q-network's (nearly) greedy moves from its own point of view."""

    def __init__(self, policy: InferencePolicy, epsilon: float, rng: np.random.Generator):
        self.policy, self.epsilon, self.rng = policy, epsilon, rng

    def act(self, obs: np.ndarray, action_mask: np.ndarray, env_ids: np.ndarray) -> np.ndarray:
        return self.policy.act(obs, action_mask, self.epsilon, self.rng)


class MixturePlayer:
    """Draws one player per game from ``players`` with ``probs``, and plays it for that game."""

    def __init__(self, players: list, probs: list[float], num_envs: int, rng: np.random.Generator):
        self.players = players
        self.probs = np.asarray(probs, dtype=np.float64) / np.sum(probs)
        self.rng = rng
        self.assigned = self.rng.choice(len(players), size=num_envs, p=self.probs)

    def start_games(self, env_ids: np.ndarray) -> None:
        self.assigned[env_ids] = self.rng.choice(len(self.players), size=len(env_ids), p=self.probs)

    def act(self, obs: np.ndarray, action_mask: np.ndarray, env_ids: np.ndarray) -> np.ndarray:
        actions = np.zeros(len(env_ids), dtype=np.int64)
        owners = self.assigned[env_ids]
        for k in np.unique(owners):
            rows = np.flatnonzero(owners == k)
            actions[rows] = self.players[k].act(obs[rows], action_mask[rows], env_ids[rows])
        return actions


def split_by_transitions(episodes: list[dict[str, Any]], limit: int) -> list[list[dict[str, Any]]]:
    """Group whole episodes into chunks of at most ``limit`` transitions (an episode is never split)."""
    chunks, current, size = [], [], 0
    for episode in episodes:
        if current and size + episode["length"] > limit:
            chunks.append(current)
            current, size = [], 0
        current.append(episode)
        size += episode["length"]
    if current or not chunks:
        chunks.append(current)
    return chunks


class RolloutWorker:
    """The loop inside a worker process: apply commands, play a batch, send it, repeat."""

    def __init__(self, index: int, spec: WorkerSpec, config: ManagerConfig, control_q, experience_q,
                 initial: dict[str, Any]):
        self.index, self.spec, self.config = index, spec, config
        self.control_q, self.experience_q = control_q, experience_q
        self.watch = ParentWatch()
        self.rng = np.random.default_rng(initial["seed"])
        self.seed = initial["seed"]
        self.epsilon = 1.0
        self.paused, self.paused_acked, self.closing = False, False, False
        self.reset_requested = False
        self.eval_requests: list[dict[str, Any]] = []
        self.episodes_done = 0
        self.vec = self._make_env(self.config.games_per_worker)
        self.policy = InferencePolicy(self.vec.single_observation_space, self.vec.single_action_space,
                                      spec.hidden_sizes)
        self.opponent_payload: dict[str, Any] | None = None
        self._apply("sync", initial.get("sync"))
        if initial.get("opponents") is not None:
            self._apply("opponents", initial["opponents"])
        self.paused = bool(initial.get("paused", False))

    def _make_env(self, games: int, **overrides):
        from common.envs import make_vec_env

        width = self.config.envs_per_worker or games
        kwargs = {**self.spec.env_kwargs, **overrides}
        return make_vec_env(self.spec.env_id, max(1, min(width, games)), self.seed, **kwargs)

    # -- commands
    def poll(self, block: bool) -> None:
        """Apply every waiting command; with ``block`` wait up to POLL_S for the first one."""
        if not self.watch.parent_alive():
            os._exit(0)
        try:
            message = self.control_q.get(timeout=POLL_S) if block else self.control_q.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(*message)
            try:
                message = self.control_q.get_nowait()
            except queue.Empty:
                return

    def _apply(self, command: str, payload: Any) -> None:
        if command == "sync":
            if payload is None:
                return
            if payload.get("model") is not None:
                self.policy.load(payload["model"])
            if payload.get("epsilon") is not None:
                self.epsilon = float(payload["epsilon"])
        elif command == "opponents":
            self.opponent_payload = payload
            self._install_opponents(self.vec, payload)
        elif command == "pause":
            self.paused, self.paused_acked = True, False
        elif command == "resume":
            self.paused = False
        elif command == "reset":
            self.reset_requested = True
        elif command == "evaluate":
            self.eval_requests.append(payload)
        elif command == "ping":
            self.send("status", {"request": payload})
        elif command == "close":
            self.closing = True
        elif command == "crash":  # fault injection for tests and drills
            raise RuntimeError(f"crash requested: {payload}")
        else:
            raise ValueError(f"unknown command {command!r}")

    def _install_opponents(self, vec, payload: dict[str, Any] | None) -> None:
        """Give a two-player env a per-game mixture of the latest policy, snapshots and fixed players."""
        if payload is None or not hasattr(vec.env, "set_opponent"):
            return
        from common.envs.connect_four import make_player

        players, probs = [], []
        snapshots = payload.get("snapshots", [])
        for name, prob in payload.get("probs", {}).items():
            if prob <= 0:
                continue
            if name == "latest":
                players.append(PolicyPlayer(self.policy, payload.get("epsilon", 0.0), self.rng))
                probs.append(prob)
            elif name == "snapshot":
                for snap in snapshots:
                    policy = InferencePolicy(vec.single_observation_space, vec.single_action_space,
                                             self.spec.hidden_sizes)
                    policy.load(snap)
                    players.append(PolicyPlayer(policy, payload.get("epsilon", 0.0), self.rng))
                    probs.append(prob / len(snapshots))
            else:
                players.append(make_player(name, int(self.rng.integers(2**31 - 1))))
                probs.append(prob)
        if players:
            vec.env.set_opponent(MixturePlayer(players, probs, vec.num_envs, self.rng))

    # -- messages
    def send(self, kind: str, payload: dict[str, Any]) -> bool:
        """Put a message, waiting while the queue is full but still obeying commands; False if closing."""
        payload.update(version=self.policy.version, episodes_done=self.episodes_done, pid=os.getpid())
        message = (kind, self.index, payload)
        deadline = time.monotonic() + self.config.timeout
        while not self.closing:
            try:
                self.experience_q.put(message, timeout=POLL_S)
                return True
            except queue.Full:
                self.poll(block=False)
                if time.monotonic() > deadline:
                    log.warning("worker %d: learner took no message for %.0fs; still waiting",
                                self.index, self.config.timeout)
                    deadline = time.monotonic() + self.config.timeout
        return False

    # -- main loop
    def run(self) -> None:
        while not self.closing:
            self.poll(block=self.paused)
            if self.closing:
                break
            if self.reset_requested:
                self._reset()
                continue
            if self.eval_requests:
                self._evaluate(self.eval_requests.pop(0))
                continue
            if self.paused:
                if not self.paused_acked:
                    self.paused_acked = self.send("paused", {})
                continue
            self._collect()

    def _actor(self, epsilon: float):
        return lambda obs, masks: self.policy.act(obs, masks, epsilon, self.rng)

    def _collect(self) -> None:
        started = time.perf_counter()
        version, epsilon = self.policy.version, self.epsilon
        episodes, steps = play_episodes(self.vec, self._actor(epsilon), self.config.games_per_worker,
                                        self.config.max_game_length, record=True,
                                        seed=int(self.rng.integers(2**31 - 1)))
        seconds = time.perf_counter() - started
        self.episodes_done += len(episodes)
        chunks = split_by_transitions(episodes, self.config.experience_batch_size)
        for k, chunk in enumerate(chunks):
            batch = ExperienceBatch(self.index, version, epsilon, chunk, steps if k == 0 else 0, seconds,
                                    last=k == len(chunks) - 1)
            if not self.send("episodes", {"batch": batch}):
                return

    def _evaluate(self, request: dict[str, Any]) -> None:
        overrides = {}
        if request.get("learner_first") is not None:
            overrides["learner_first"] = request["learner_first"]
        vec = self._make_env(request["episodes"], **overrides)
        try:
            if request.get("opponent") is not None and hasattr(vec.env, "set_opponent"):
                from common.envs.connect_four import make_player

                vec.env.set_opponent(make_player(request["opponent"], int(self.rng.integers(2**31 - 1))))
            episodes, steps = play_episodes(vec, self._actor(request.get("epsilon", 0.0)), request["episodes"],
                                            self.config.max_game_length, seed=int(self.rng.integers(2**31 - 1)))
        finally:
            vec.close()
        self.send("eval", {"request": request["request"], "episodes": episodes, "steps": steps})

    def _reset(self) -> None:
        self.reset_requested = False
        self.vec.close()
        self.seed = int(self.rng.integers(2**31 - 1))
        self.vec = self._make_env(self.config.games_per_worker)
        self._install_opponents(self.vec, self.opponent_payload)
        self.send("reset_done", {})


def rollout_worker(index: int, spec: WorkerSpec, config: ManagerConfig, control_q, experience_q,
                   initial: dict[str, Any]) -> None:
    """Entry point of a rollout worker process; a crash is reported with its traceback."""
    init_worker_process(spec.torch_threads)
    # A SIGTERM sent to the whole process group (systemd, a batch scheduler) is for the
    # learner to act on: it stops the workers itself after saving. Workers still exit on
    # their own when the learner is gone (ParentWatch).
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if spec.log_dir is not None:
        from common.runlog import setup_logging

        setup_logging(Path(spec.log_dir) / f"worker_{index}.log", "prl.manager")
    try:
        RolloutWorker(index, spec, config, control_q, experience_q, initial).run()
    except Exception:
        message = traceback.format_exc()
        log.error("worker %d failed:\n%s", index, message)
        try:
            experience_q.put(("error", index, {"traceback": message}), timeout=5.0)
        except (queue.Full, OSError, ValueError):
            pass
        experience_q.close()
        experience_q.join_thread()  # make sure the traceback left before exiting
        os._exit(1)
    experience_q.cancel_join_thread()  # on close, never hang on a full queue nobody reads


# ------------------------------------------------------------------ learner side

class WorkerCommunicator:
    """One bounded command queue and one bounded experience queue per worker.

    Every operation takes a timeout; ``renew(i)`` replaces worker ``i``'s queues (after a
    crash, its old queues may hold a half-written message and are discarded).
    """

    def __init__(self, num_workers: int, experience_queue_size: int = 2, control_queue_size: int = 16,
                 timeout: float = 30.0):
        self.experience_queue_size = experience_queue_size
        self.control_queue_size = control_queue_size
        self.timeout = timeout
        self.control: dict[int, Any] = {}
        self.experience: dict[int, Any] = {}
        for index in range(num_workers):
            self.renew(index)

    def renew(self, index: int) -> None:
        for queues in (self.control, self.experience):
            if index in queues:
                _discard(queues[index])
        self.control[index] = CONTEXT.Queue(self.control_queue_size)
        self.experience[index] = CONTEXT.Queue(self.experience_queue_size)

    def send(self, index: int, command: str, payload: Any = None, timeout: float | None = None) -> bool:
        """Queue a command for worker ``index``; False (and a warning) if its queue stayed full."""
        try:
            self.control[index].put((command, payload), timeout=self.timeout if timeout is None else timeout)
            return True
        except queue.Full:
            log.warning("worker %d: command queue full for %.1fs; '%s' not sent", index,
                        self.timeout if timeout is None else timeout, command)
            return False

    def receive(self, index: int) -> tuple | None:
        """The next message from worker ``index``, or None if none is waiting."""
        try:
            return self.experience[index].get_nowait()
        except queue.Empty:
            return None

    def readable(self, indices: list[int], timeout: float) -> list[int]:
        """Indices of workers with a message waiting, after waiting up to ``timeout`` seconds."""
        # Queue._reader is the receiving end of the queue's pipe: waiting on it wakes us
        # when any worker has sent something, instead of polling every queue in turn.
        readers = {self.experience[i]._reader: i for i in indices}
        return [readers[r] for r in wait(list(readers), timeout=max(0.0, timeout))]

    def get_queue_info(self) -> dict[str, Any]:
        """Messages waiting in each worker's queues, with their bounds."""
        def size(q) -> int:
            try:
                return q.qsize()
            except (NotImplementedError, OSError, ValueError):
                return -1

        return {"experience": {i: size(q) for i, q in self.experience.items()},
                "control": {i: size(q) for i, q in self.control.items()},
                "experience_max": self.experience_queue_size, "control_max": self.control_queue_size}

    def close(self) -> None:
        for queues in (self.control, self.experience):
            for q in queues.values():
                _discard(q)
            queues.clear()


def _discard(q) -> None:
    q.cancel_join_thread()  # never block exit on data no one will read
    q.close()


@dataclass
class WorkerState:
    index: int
    process: Any = None
    paused: bool = False
    paused_acked: bool = False
    reset_acked: bool = True
    restarts: int = 0
    model_version: int = -1
    episodes: int = 0  # episodes received from this worker (all its incarnations)
    batches: int = 0
    last_seen: float = 0.0
    heard_since_spawn: bool = False  # startup (spawn, imports) can be slow: no hang check before the first message
    error: str | None = None
    pending_evals: list[dict[str, Any]] = field(default_factory=list)


class ParallelManager:
    """Runs rollout workers for a training loop (see the module docstring).

    Typical use::

        manager = ParallelManager(spec, config, model.state_dict())
        manager.start_workers()
        try:
            while training:
                for batch in manager.collect_experiences(timeout=30):
                    ...  # add batch.episodes to the replay buffer, learn
                manager.sync_model_to_workers(model.state_dict(), epsilon=eps)
        finally:
            manager.stop_workers()
    """

    def __init__(self, spec: WorkerSpec, config: ManagerConfig, model_state: dict[str, torch.Tensor] | None = None,
                 epsilon: float = 1.0):
        self.spec, self.config = spec, config
        self.communicator = WorkerCommunicator(config.num_workers, config.experience_queue_size,
                                               config.control_queue_size, config.timeout)
        self.synchronizer = ModelSynchronizer(config.model_sync_interval, config.compression_enabled)
        self.workers = {i: WorkerState(i) for i in range(config.num_workers)}
        self._model = self.synchronizer.pack(model_state) if model_state is not None else None
        self._epsilon = epsilon
        self._opponents: dict[str, Any] | None = None
        self._batches: list[ExperienceBatch] = []  # received, not yet handed out
        self._evals: dict[int, dict[str, Any]] = {}
        self._request_ids = itertools.count()
        self._generation = itertools.count()
        self.total_restarts = 0
        self._started = self._stopped = False

    # -- lifecycle
    def start_workers(self) -> None:
        """Spawn every worker with the current weights, epsilon and opponents."""
        if self._model is None:
            raise RuntimeError("start_workers() needs model weights: pass model_state or call sync_model_to_workers()")
        for index in self.workers:
            self._spawn(index)
        self._started = True
        log.info("started %d rollout worker(s): %s", len(self.workers),
                 ", ".join(str(w.process.pid) for w in self.workers.values()))

    def _spawn(self, index: int) -> None:
        state = self.workers[index]
        initial = {"seed": self.spec.seed + 7919 * index + 104729 * next(self._generation),
                   "sync": {"model": self._model, "epsilon": self._epsilon},
                   "opponents": self._opponents, "paused": state.paused}
        state.process = CONTEXT.Process(
            target=rollout_worker, name=f"rollout-{index}", daemon=True,
            args=(index, self.spec, self.config, self.communicator.control[index],
                  self.communicator.experience[index], initial))
        state.process.start()
        state.paused_acked = False
        state.reset_acked = True
        state.error = None
        state.last_seen = time.monotonic()
        state.heard_since_spawn = False

    def stop_workers(self, timeout: float = 10.0) -> None:
        """Ask every worker to close, then terminate and kill stragglers. Safe to call twice."""
        if self._stopped:
            return
        self._stopped = True
        for index, state in self.workers.items():
            if state.process is not None and state.process.is_alive():
                self.communicator.send(index, "close", timeout=0.5)
        deadline = time.monotonic() + timeout
        for state in self.workers.values():
            if state.process is not None:
                state.process.join(max(0.0, deadline - time.monotonic()))
        for state in self.workers.values():
            if state.process is not None:
                _reap(state.process)
        self.communicator.close()
        log.info("rollout workers stopped")

    # -- weights and settings
    def sync_model_to_workers(self, model_state: dict[str, torch.Tensor] | None = None, epsilon: float | None = None,
                              learner_step: int | None = None) -> int:
        """Send new weights (a new version) and/or epsilon to every worker; returns the current version."""
        if model_state is not None:
            self._model = self.synchronizer.pack(model_state, learner_step)
        if epsilon is not None:
            self._epsilon = epsilon
        payload = {"model": self._model if model_state is not None else None, "epsilon": epsilon}
        for index in self._live():
            # Weights are latest-wins: a worker whose command queue is full is behind anyway and
            # gets the next version, so the learner never waits long on it.
            self.communicator.send(index, "sync", payload, timeout=1.0)
        return self.model_version

    @property
    def model_version(self) -> int:
        return int(self._model["version"]) if self._model is not None else -1

    def set_opponents(self, snapshots: list[dict[str, torch.Tensor]], probs: dict[str, float],
                      epsilon: float = 0.0) -> None:
        """Opponent mixture for two-player envs: ``probs`` over latest / snapshot / random / heuristic."""
        packed = [pack_state(s, -(k + 1), self.config.compression_enabled) for k, s in enumerate(snapshots)]
        self._opponents = {"snapshots": packed, "probs": dict(probs), "epsilon": epsilon}
        for index in self._live():
            self.communicator.send(index, "opponents", self._opponents)

    # -- experience
    def collect_experiences(self, timeout: float | None = None,
                            min_batches: int | None = None) -> list[ExperienceBatch]:
        """Batches that arrived, waiting until ``min_batches`` complete batches (default: one from
        each active worker) are in or ``timeout`` seconds pass, whichever comes first; never longer.

        A worker whose batch is in is not read again while the others are awaited, so a fast
        worker is held back by its bounded queue instead of flooding the learner.
        """
        timeout = self.config.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while True:
            done = Counter(b.worker for b in self._batches if b.last)
            active = self._active()
            if min_batches is None:
                waiting_for = [i for i in active if done[i] == 0]
            else:
                waiting_for = active if sum(done.values()) < min_batches else []
            remaining = deadline - time.monotonic()
            if not waiting_for or remaining <= 0:
                break
            self._pump(min(remaining, 1.0), waiting_for)
            self._kill_hung(waiting_for)
        self._pump(0.0, self._active())
        batches, self._batches = self._batches, []
        return batches

    def _pump(self, timeout: float, ids: list[int] | None = None) -> None:
        """Receive what workers ``ids`` have sent (waiting up to ``timeout`` s), then handle dead workers.

        At most one queue's worth of messages is taken from each worker per call, so
        reading keeps pace with what the bounded queues let through.
        """
        live = set(self._live())
        ids = [i for i in (self._live() if ids is None else ids) if i in live]
        for index in self.communicator.readable(ids, timeout) if ids else []:
            for _ in range(self.config.experience_queue_size + 1):
                message = self.communicator.receive(index)
                if message is None:
                    break
                self._handle(*message)
        if not ids:
            time.sleep(min(timeout, 0.05))
        self._check_deaths()

    def _kill_hung(self, indices: list[int]) -> None:
        """SIGKILL awaited workers silent for ``hang_timeout`` s since their last message; the
        next check restarts them. A worker still starting up is never taken for hung."""
        if self.config.hang_timeout <= 0:
            return
        now = time.monotonic()
        for index in indices:
            state = self.workers[index]
            silent = now - state.last_seen
            if state.heard_since_spawn and silent > self.config.hang_timeout and state.process.is_alive():
                log.error("rollout worker %d (pid %d) sent nothing for %.0fs: presumed hung, killing it",
                          index, state.process.pid, silent)
                state.process.kill()
                state.process.join(5.0)

    def _handle(self, kind: str, index: int, payload: dict[str, Any]) -> None:
        state = self.workers[index]
        state.last_seen = time.monotonic()
        state.heard_since_spawn = True
        state.model_version = payload.get("version", state.model_version)
        if kind == "episodes":
            batch: ExperienceBatch = payload["batch"]
            self._batches.append(batch)
            state.episodes += len(batch.episodes)
            state.batches += int(batch.last)
            log.debug("worker %d: %d episodes, version %d", index, len(batch.episodes), batch.model_version)
        elif kind == "paused":
            state.paused_acked = True
        elif kind == "reset_done":
            state.reset_acked = True
        elif kind == "eval":
            self._evals[payload["request"]] = payload
            state.pending_evals = [r for r in state.pending_evals if r["request"] != payload["request"]]
        elif kind == "status":
            pass
        elif kind == "error":
            state.error = payload["traceback"]
        else:
            log.warning("worker %d sent an unknown message %r", index, kind)

    def _check_deaths(self) -> None:
        for index in self._live(include_dead=True):
            process = self.workers[index].process
            if process is not None and not process.is_alive():
                self._restart(index)

    def _restart(self, index: int) -> None:
        state = self.workers[index]
        process = state.process
        process.join(1.0)
        if state.error is None and process.exitcode == 1:  # it reported a traceback before exiting
            try:
                while (message := self.communicator.receive(index)) is not None:
                    if message[0] == "error":
                        state.error = message[2]["traceback"]
            except Exception:  # anything unreadable: the exit status below still says what happened
                pass
        reason = f"raised an exception:\n{state.error}" if state.error else describe_exit(process.exitcode)
        log.error("rollout worker %d (pid %d) died: %s", index, process.pid, reason)
        if state.restarts >= self.config.max_restarts:
            raise TooManyRestarts(f"rollout worker {index} died {state.restarts + 1} times "
                                  f"(limit {self.config.max_restarts} restarts); last: {reason.splitlines()[0]}")
        _reap(process)
        self.communicator.renew(index)  # drops whatever the dead worker left half-sent
        state.restarts += 1
        self.total_restarts += 1
        self._spawn(index)
        for request in state.pending_evals:
            self.communicator.send(index, "evaluate", request)
        log.warning("restarted rollout worker %d with model version %d (restart %d of at most %d)",
                    index, self.model_version, state.restarts, self.config.max_restarts)

    # -- control
    def pause_workers(self, ids: list[int], timeout: float | None = None) -> None:
        """Pause workers; on return they send nothing more until resumed (batches they sent
        before pausing are kept for the next collect)."""
        for index in ids:
            self.workers[index].paused = True
            self.workers[index].paused_acked = False
            self.communicator.send(index, "pause")
        self._wait(lambda: all(self.workers[i].paused_acked for i in ids), timeout, "pause", ids)

    def resume_workers(self, ids: list[int]) -> None:
        for index in ids:
            self.workers[index].paused = False
            self.communicator.send(index, "resume")

    def reset_workers(self, ids: list[int] | None = None, timeout: float | None = None) -> None:
        """Give workers fresh environments and seeds (their weights and settings stay)."""
        ids = list(self.workers) if ids is None else ids
        for index in ids:
            self.workers[index].reset_acked = False
            self.communicator.send(index, "reset")
        self._wait(lambda: all(self.workers[i].reset_acked for i in ids), timeout, "reset", ids)

    def evaluate(self, episodes: int, opponent: str | None = None, learner_first: bool | None = None,
                 epsilon: float = 0.0, timeout: float | None = None) -> list[dict[str, Any]]:
        """Play ``episodes`` greedy (``epsilon``) episodes spread over the active workers; their stats."""
        ids = self._active() or list(self.workers)
        shares = [episodes // len(ids) + (k < episodes % len(ids)) for k in range(len(ids))]
        requests = []
        for index, share in zip(ids, shares):
            if share == 0:
                continue
            request = {"request": next(self._request_ids), "episodes": share, "opponent": opponent,
                       "learner_first": learner_first, "epsilon": epsilon}
            self.workers[index].pending_evals.append(request)
            self.communicator.send(index, "evaluate", request)
            requests.append(request["request"])
        self._wait(lambda: all(r in self._evals for r in requests), timeout, "evaluate",
                   [i for i in ids if self.workers[i].pending_evals])
        return [ep for r in requests for ep in self._evals.pop(r)["episodes"]]

    def _wait(self, done, timeout: float | None, what: str, ids: list[int]) -> None:
        """Read from workers ``ids`` until ``done()``; only theirs, so the others keep their backpressure."""
        timeout = self.config.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while not done():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"workers {ids} did not finish '{what}' within {timeout:.0f}s")
            self._pump(min(remaining, 0.5), [i for i in ids if self._needs_reading(i, what)])

    def _needs_reading(self, index: int, what: str) -> bool:
        state = self.workers[index]
        if what == "pause":
            return not state.paused_acked
        if what == "reset":
            return not state.reset_acked
        return bool(state.pending_evals)

    # -- status
    def _live(self, include_dead: bool = False) -> list[int]:
        return [i for i, s in self.workers.items() if s.process is not None and (include_dead or s.process.is_alive())]

    def _active(self) -> list[int]:
        return [i for i in self._live() if not self.workers[i].paused]

    def get_status(self) -> dict[str, Any]:
        """Active, paused and restarted workers, each worker's model version and episodes, queue sizes."""
        now = time.monotonic()
        return {
            "active_workers": self._active(),
            "paused_workers": [i for i, s in self.workers.items() if s.paused],
            "restarted_workers": {i: s.restarts for i, s in self.workers.items() if s.restarts},
            "total_restarts": self.total_restarts,
            "model_version": self.model_version,
            "workers": {i: {"pid": s.process.pid if s.process else None,
                            "alive": bool(s.process and s.process.is_alive()), "paused": s.paused,
                            "model_version": s.model_version, "episodes": s.episodes, "batches": s.batches,
                            "restarts": s.restarts, "seconds_since_message": round(now - s.last_seen, 2)}
                        for i, s in self.workers.items()},
            "queue_info": self.communicator.get_queue_info(),
            "batches_waiting": len(self._batches),
        }

    def pids(self) -> list[int]:
        return [s.process.pid for s in self.workers.values() if s.process is not None]


def _reap(process, timeout: float = 5.0) -> None:
    """Kill a worker that did not exit when asked (workers ignore SIGTERM, so SIGKILL it is)."""
    if process.is_alive():
        process.kill()
        process.join(timeout)
