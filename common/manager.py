"""Rollout workers for a central learner: ParallelManager, WorkerCommunicator, ModelSynchronizer.

The learner's process owns the networks and the replay buffer. Each rollout worker is a
process started and watched by :class:`common.supervisor.Supervisor`, with one duplex pipe:
a worker that dies is reported with its id and its traceback (or signal) and restarted with
the current weights, epsilon and opponents; one that cannot run with its configuration
(:class:`~common.supervisor.WorkerConfigError`) is not restarted and ends the run. A worker
plays whole episodes with an :class:`InferencePolicy` (a Q-network, no optimizer) and sends
them on its pipe, a batch of ``games_per_worker`` episodes at a time, at most
``experience_queue_size`` batches ahead of the learner: every batch
:meth:`ParallelManager.collect_experiences` hands out gives its worker one credit back.

Weights go the other way through shared memory (:class:`common.networks.SharedParams`,
versioned under a seqlock): slot 0 holds the learner's current weights, further slots the
past snapshots that self-play opponents play with, so pipes carry small messages only.
Every batch says which weights version played it.

Commands (learner -> worker): ``settings``, ``opponents``, ``credit``, ``pause``, ``resume``,
``reset``, ``evaluate``, ``stop`` (an unknown one is an error); messages (worker -> learner):
``episodes``, ``eval``, ``paused``, ``reset_done``. Two-player built-ins get their opponents
from :mod:`common.envs.selfplay`; nothing here knows a particular env.

Seed 004's call works with plain dicts: ``env_config`` names the env and its keyword
arguments, ``model_config`` the Q-network, ``parallel_config`` the fields of
:class:`ManagerConfig`::

    manager = ParallelManager({"env_id": "ConnectFour-v0"}, {"hidden_dim": 256, "num_layers": 2},
                              {"num_workers": 4, "games_per_worker": 10, "timeout": 30.0})
    manager.start_workers()
    try:
        experiences = manager.collect_experiences()  # ... train manager.model on them ...
        manager.sync_model_to_workers()
    finally:
        manager.stop_workers()
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import Counter
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from torch import nn

from common.dqn import epsilon_greedy
from common.envs import make_vec_env, play_episodes
from common.networks import QNetwork, SharedParams, build_network, flat_size
from common.shm import SharedArrays, attach_all
from common.supervisor import Message, Supervisor, WorkerConfigError, set_torch_threads
from common.system import usable_cores

log = logging.getLogger("prl.manager")
_manager_numbers = itertools.count()  # distinct shared-memory names for several managers in one process


def default_num_workers() -> int:
    """All cores but two (one for the learner, one for the system), at least one."""
    return max(1, usable_cores() - 2)


def _from_dict(cls: type, values: dict, what: str):
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"{what}: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    return cls(**values)


@dataclass
class ManagerConfig:
    num_workers: int = field(default_factory=default_num_workers)  # rollout processes
    games_per_worker: int = 8  # episodes a worker plays per batch it sends
    max_game_length: int = 0  # cut an episode after this many steps (0 = the env's own limit)
    experience_batch_size: int = 8192  # most transitions per message; bigger batches are split by episode
    model_sync_interval: int = 1  # learner steps between weight publications (see ModelSynchronizer.should_sync)
    worker_reset_interval: int = 0  # batches between worker resets, for the training loop (0 = never)
    timeout: float = 30.0  # seconds collect_experiences, pause, reset and evaluate wait at most
    compression_enabled: bool = False  # seed 004's setting; weights go through shared memory, never compressed
    max_restarts: int = 3  # restarts per worker before the manager gives up (WorkerFailed)
    experience_queue_size: int = 2  # batches a worker may play ahead of the learner
    envs_per_worker: int = 0  # environments a worker steps together; 0 = games_per_worker
    hang_timeout: float = 300.0  # a worker silent this long is killed and restarted (0 = never)
    start_timeout: float = 120.0  # a worker not ready this long after its start is killed and restarted
    opponent_slots: int = 10  # past snapshots set_opponents can hand the workers for self-play

    @classmethod
    def from_dict(cls, values: dict) -> ManagerConfig:
        return _from_dict(cls, values, "parallel_config")


@dataclass
class WorkerSpec:
    """The env a rollout worker plays (picklable): seed 004's ``env_config``."""

    env_id: str
    seed: int = 0
    hidden_sizes: tuple[int, ...] = (128, 128)  # used when no model_config or model says otherwise
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    torch_threads: int = 1
    log_dir: str | None = None  # where worker_<i>.log goes (None = no worker log file)

    @classmethod
    def from_dict(cls, env_config: dict) -> WorkerSpec:
        """``{"env_id": ..., "seed": ...}``; every other key is a keyword argument of the env."""
        config = dict(env_config)
        if "env_id" not in config:
            raise ValueError("env_config: needs an env_id (a Gymnasium id, e.g. ConnectFour-v0); the other keys "
                             "are the env's keyword arguments")
        own = {f.name for f in fields(cls)} - {"env_kwargs"}
        return cls(**{k: config.pop(k) for k in list(config) if k in own}, env_kwargs=config)


def build_model(spec: WorkerSpec, model_config: dict | None = None) -> QNetwork:
    """The Q-network ``model_config`` describes for ``spec``'s env: ``hidden_sizes``, or seed 004's
    ``hidden_dim`` and ``num_layers``; ``input_dim`` and ``action_dim``, if given, must match the env."""
    from common import envs  # noqa: F401  (registers the built-in envs)

    config = dict(model_config or {})
    try:
        env = gym.make(spec.env_id, **spec.env_kwargs)
    except Exception as err:
        raise ValueError(f"env_config: cannot create {spec.env_id} with {spec.env_kwargs}: {err}") from None
    obs_space, action_space = env.observation_space, env.action_space
    env.close()
    hidden = config.pop("hidden_sizes", None)
    width, layers = config.pop("hidden_dim", None), config.pop("num_layers", 2)
    hidden = list(hidden) if hidden is not None else [width] * layers if width else list(spec.hidden_sizes)
    actual = {"input_dim": int(np.prod(obs_space.shape)), "action_dim": int(getattr(action_space, "n", -1))}
    for key, value in actual.items():
        if key in config and int(config.pop(key)) != value:
            raise ValueError(f"model_config: {key} {model_config[key]} does not match {spec.env_id} ({value})")
    if config:
        raise ValueError(f"model_config: unknown key(s) {', '.join(sorted(config))}")
    return QNetwork(obs_space, action_space, tuple(hidden))


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
    """Publishes the learner's weights to the workers as numbered versions (shared memory, slot 0).

    ``should_sync(learner_step)`` is true once ``model_sync_interval`` learner steps have
    passed since the last publication.
    """

    def __init__(self, params: SharedParams, model_sync_interval: int = 1):
        self.params = params
        self.model_sync_interval = max(1, model_sync_interval)
        self.last_sync_step: int | None = None

    @property
    def version(self) -> int:
        return self.params.version(0)

    def should_sync(self, learner_step: int) -> bool:
        return self.last_sync_step is None or learner_step - self.last_sync_step >= self.model_sync_interval

    def publish(self, model: nn.Module, learner_step: int | None = None) -> int:
        """Write ``model``'s weights as a new version; returns it."""
        if learner_step is not None:
            self.last_sync_step = learner_step
        return self.params.publish(model, 0)


# ------------------------------------------------------------------ worker side

class InferencePolicy:
    """A Q-network for acting only: epsilon-greedy over legal actions, no gradients."""

    def __init__(self, net: nn.Module):
        self.net = net.eval()
        self.version = 0

    def fetch(self, params: SharedParams, slot: int, alive=lambda: True) -> None:
        self.version = params.wait_fetch(self.net, slot, alive)

    def act(self, obs: np.ndarray, action_mask: np.ndarray | None, epsilon: float,
            rng: np.random.Generator) -> np.ndarray:
        with torch.no_grad():
            q = self.net(torch.as_tensor(obs, dtype=torch.float32)).numpy()
        return epsilon_greedy(q, epsilon, rng, action_mask)


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
    """The loop inside a worker process: apply commands; play a batch while it has credit; repeat."""

    def __init__(self, link, spec: WorkerSpec, config: ManagerConfig, net_spec: dict, param_specs: dict,
                 state: dict[str, Any]):
        self.link, self.spec, self.config, self.net_spec = link, spec, config, net_spec
        arrays, self._handles = attach_all(param_specs)
        self.params = SharedParams(arrays)
        self.seed = state["seed"]
        self.rng = np.random.default_rng(self.seed)
        self.epsilon, self.credits, self.opponents = state["epsilon"], state["credits"], state["opponents"]
        self.paused, self.paused_acked, self.reset_requested = state["paused"], False, False
        self.evals: list[dict[str, Any]] = []
        self.policy = InferencePolicy(build_network(net_spec))
        self.policy.fetch(self.params, 0, link.parent_alive)
        self.vec = self._make_env(config.games_per_worker)
        self._install_opponents()

    def _make_env(self, games: int, **overrides):
        width = self.config.envs_per_worker or games
        kwargs = {**self.spec.env_kwargs, **overrides}
        try:
            return make_vec_env(self.spec.env_id, max(1, min(width, games)), self.seed, **kwargs)
        except Exception as err:  # a bad env id or keyword: no restart can fix it
            raise WorkerConfigError(f"cannot create {self.spec.env_id} with {kwargs}: {err}") from err

    def _install_opponents(self) -> None:
        """Two-player envs: the per-game opponent mixture of the latest policy, snapshots and fixed players."""
        if self.opponents is None or not hasattr(self.vec.env, "set_opponent"):
            return
        from common.envs.selfplay import opponent_mixture

        snapshots = []
        for slot in self.opponents["slots"]:
            snapshots.append(InferencePolicy(build_network(self.net_spec)))
            snapshots[-1].fetch(self.params, slot, self.link.parent_alive)
        player = opponent_mixture(self.opponents, self.policy, snapshots, self.vec.num_envs, self.rng)
        if player is not None:
            self.vec.env.set_opponent(player)

    def apply(self, command: str, payload: Any) -> None:
        if command == "settings":
            self.epsilon = float(payload["epsilon"])
        elif command == "opponents":
            self.opponents = payload
            self._install_opponents()
        elif command == "credit":
            self.credits += int(payload)
        elif command in ("pause", "resume"):
            self.paused, self.paused_acked = command == "pause", False
        elif command == "reset":
            self.reset_requested = True
        elif command == "evaluate":
            self.evals.append(payload)
        elif command != "stop":
            raise ValueError(f"worker {self.link.index}: unknown command {command!r}")

    def run(self) -> None:
        link = self.link
        while not link.stop_requested:
            for command, payload in link.commands():
                self.apply(command, payload)
            if link.stop_requested:
                return
            if self.reset_requested:
                self.reset()
            elif self.evals:
                self.evaluate(self.evals.pop(0))
            elif self.paused or self.credits <= 0:
                if self.paused and not self.paused_acked:
                    link.send("paused")
                    self.paused_acked = True
                message = link.receive()  # idle until the learner says something (heartbeats meanwhile)
                if message is not None:
                    self.apply(*message)
            else:
                self.collect()

    def _act(self, epsilon: float):
        return lambda obs, masks: self.policy.act(obs, masks, epsilon, self.rng)

    def collect(self) -> None:
        if self.params.version(0) != self.policy.version:
            self.policy.fetch(self.params, 0, self.link.parent_alive)
        started = time.perf_counter()
        version, epsilon = self.policy.version, self.epsilon
        episodes, steps = play_episodes(self.vec, self._act(epsilon), self.config.games_per_worker,
                                        self.config.max_game_length, record=True,
                                        seed=int(self.rng.integers(2**31 - 1)))
        seconds = time.perf_counter() - started
        chunks = split_by_transitions(episodes, self.config.experience_batch_size)
        for k, chunk in enumerate(chunks):
            self.link.send("episodes", ExperienceBatch(self.link.index, version, epsilon, chunk,
                                                       steps if k == 0 else 0, seconds, last=k == len(chunks) - 1))
        self.credits -= 1

    def evaluate(self, request: dict[str, Any]) -> None:
        vec = self._make_env(request["episodes"], **request["env_kwargs"])
        try:
            if request["opponent"] is not None:
                vec.env.set_opponent(request["opponent"])
            episodes, steps = play_episodes(vec, self._act(request["epsilon"]), request["episodes"],
                                            self.config.max_game_length, seed=int(self.rng.integers(2**31 - 1)))
        finally:
            vec.close()
        self.link.send("eval", {"request": request["request"], "episodes": episodes, "steps": steps})

    def reset(self) -> None:
        self.reset_requested = False
        self.vec.close()
        self.seed = int(self.rng.integers(2**31 - 1))
        self.vec = self._make_env(self.config.games_per_worker)
        self._install_opponents()
        self.link.send("reset_done")

    def close(self) -> None:
        self.vec.close()
        self.params = None
        for handle in self._handles:
            handle.close()


def rollout_worker(link, spec: WorkerSpec, config: ManagerConfig, net_spec: dict, param_specs: dict,
                   state: dict[str, Any]) -> None:
    """Entry point of a rollout worker process (run by the supervisor, which reports a crash)."""
    set_torch_threads(spec.torch_threads)
    if spec.log_dir is not None:
        from common.runlog import setup_logging

        setup_logging(Path(spec.log_dir) / f"worker_{link.index}.log", "prl.manager")
    worker = RolloutWorker(link, spec, config, net_spec, param_specs, state)
    try:
        link.ready()
        worker.run()
    finally:
        worker.close()


# ------------------------------------------------------------------ learner side

class WorkerCommunicator:
    """The learner's end of the workers' pipes, over the supervisor: commands out, messages in,
    and how many complete batches of each worker wait to be collected."""

    def __init__(self, supervisor: Supervisor, experience_queue_size: int):
        self.supervisor = supervisor
        self.experience_queue_size = experience_queue_size
        self.waiting: Counter[int] = Counter()  # complete batches received per worker, not yet collected

    def send(self, index: int, command: str, payload: Any = None) -> bool:
        """False if the worker is gone (the supervisor restarts it with the current state)."""
        return self.supervisor.send(index, command, payload)

    def broadcast(self, command: str, payload: Any = None) -> None:
        self.supervisor.broadcast(command, payload)

    def receive(self, timeout: float) -> list[Message]:
        """What the workers sent within ``timeout`` s (deaths and restarts handled and reported too)."""
        return self.supervisor.poll(timeout)

    def get_queue_info(self) -> dict[str, Any]:
        """Complete batches waiting per worker, and how many a worker may play ahead."""
        return {"experience": {i: self.waiting[i] for i in self.supervisor.workers},
                "experience_max": self.experience_queue_size}


@dataclass
class WorkerState:
    index: int
    paused: bool = False
    paused_acked: bool = False
    reset_acked: bool = True
    lives: int = 0
    model_version: int = 0  # the weights version of the worker's newest batch
    episodes: int = 0  # episodes received from this worker (all its lives)
    batches: int = 0
    last_seen: float = field(default_factory=time.monotonic)
    pending_evals: list[dict[str, Any]] = field(default_factory=list)


class ParallelManager:
    """Runs rollout workers for a training loop (see the module docstring).

    ``env_config``: a :class:`WorkerSpec` or seed 004's dict; ``model_config``: the network
    (ignored when ``model`` is given; the network is then ``manager.model``);
    ``parallel_config``: a :class:`ManagerConfig` or a dict of its fields.
    """

    def __init__(self, env_config: WorkerSpec | dict, model_config: dict | None = None,
                 parallel_config: ManagerConfig | dict | None = None, *, model: nn.Module | None = None,
                 epsilon: float = 1.0, logger: logging.Logger | None = None):
        self.spec = env_config if isinstance(env_config, WorkerSpec) else WorkerSpec.from_dict(env_config)
        self.config = (parallel_config if isinstance(parallel_config, ManagerConfig)
                       else ManagerConfig.from_dict(parallel_config or {}))
        self.model = model if model is not None else build_model(self.spec, model_config)
        self.log = logger or log
        self._arrays = SharedArrays()
        tag, slots = next(_manager_numbers), 1 + self.config.opponent_slots
        names = {"params": f"manager{tag}_params", "versions": f"manager{tag}_versions"}
        self._arrays.create(names["params"], (slots, flat_size(self.model)), np.float32)
        self._arrays.create(names["versions"], (slots, 2), np.int64)
        self._param_specs = {key: self._arrays.specs()[name] for key, name in names.items()}
        self.params = SharedParams({key: self._arrays[name] for key, name in names.items()})
        self.synchronizer = ModelSynchronizer(self.params, self.config.model_sync_interval)
        self.workers = {i: WorkerState(i) for i in range(self.config.num_workers)}
        self.supervisor = Supervisor(rollout_worker, self.config.num_workers, self._args_for, name="worker",
                                     max_restarts=self.config.max_restarts, start_timeout_s=self.config.start_timeout,
                                     hang_timeout_s=self.config.hang_timeout or None, logger=self.log)
        self.communicator = WorkerCommunicator(self.supervisor, self.config.experience_queue_size)
        self._epsilon = epsilon
        self._opponents: dict[str, Any] | None = None
        self._batches: list[ExperienceBatch] = []  # received, not yet handed out
        self._evals: dict[int, dict[str, Any]] = {}
        self._request_ids = itertools.count()
        self._stopped = False

    def _args_for(self, index: int) -> tuple:
        """What worker ``index`` starts with; called again at every restart, so it gets the current state."""
        state = self.workers[index]
        state.lives += 1
        start = {"seed": self.spec.seed + 7919 * index + 104729 * state.lives, "epsilon": self._epsilon,
                 "opponents": self._opponents, "paused": state.paused,
                 "credits": max(0, self.config.experience_queue_size - self.communicator.waiting[index])}
        return self.spec, self.config, self.model.spec, self._param_specs, start

    # -- lifecycle
    def start_workers(self) -> None:
        """Start every worker; they play with the weights published last (``manager.model``'s, if none)."""
        if self.model_version == 0:
            self.synchronizer.publish(self.model)
        self.supervisor.start()

    def wait_ready(self, stop=lambda: False) -> None:
        """Wait until every worker is set up (or ``stop()`` is true)."""
        for message in self.supervisor.wait_ready(stop):
            self._handle(message)

    def stop_workers(self, timeout: float = 10.0) -> None:
        """Stop every worker (killing those that do not stop within ``timeout`` s) and release the
        shared memory. Safe to call twice."""
        if self._stopped:
            return
        self._stopped = True
        self.supervisor.stop(timeout)
        self._arrays.unlink_all()

    # -- weights and settings
    def sync_model_to_workers(self, model: nn.Module | dict[str, torch.Tensor] | None = None,
                              epsilon: float | None = None, learner_step: int | None = None) -> int:
        """Publish new weights as a new version: ``model`` (a network, or a state dict loaded into
        ``manager.model``), or ``manager.model`` when none is given; and a new epsilon, if given.
        Returns the version."""
        if isinstance(model, dict):
            self.model.load_state_dict(model)
        elif model is not None:
            self.model = model
        version = self.synchronizer.publish(self.model, learner_step)
        if epsilon is not None:
            self.set_epsilon(epsilon)
        return version

    def set_epsilon(self, epsilon: float) -> None:
        """The exploration rate workers play with from their next batch on."""
        if epsilon != self._epsilon:
            self._epsilon = epsilon
            self.communicator.broadcast("settings", {"epsilon": epsilon})

    @property
    def model_version(self) -> int:
        return self.synchronizer.version

    def set_opponents(self, snapshots: list[nn.Module | dict[str, torch.Tensor]], probs: dict[str, float],
                      epsilon: float = 0.0) -> None:
        """Opponent mixture for two-player envs: ``probs`` over latest / snapshot / random / heuristic
        (see :mod:`common.envs.selfplay`); ``snapshots`` are past weights of the learner."""
        if len(snapshots) > self.config.opponent_slots:
            raise ValueError(f"{len(snapshots)} snapshots, but opponent_slots is {self.config.opponent_slots}")
        scratch = build_network(self.model.spec)
        for slot, snapshot in enumerate(snapshots, start=1):
            if isinstance(snapshot, dict):
                scratch.load_state_dict(snapshot)
            self.params.publish(scratch if isinstance(snapshot, dict) else snapshot, slot)
        self._opponents = {"slots": list(range(1, len(snapshots) + 1)), "probs": dict(probs), "epsilon": epsilon}
        self.communicator.broadcast("opponents", self._opponents)

    # -- experience
    def collect_experiences(self, timeout: float | None = None, min_batches: int | None = None,
                            stop=None) -> list[ExperienceBatch]:
        """Batches that arrived, waiting until ``min_batches`` complete batches (default: one from
        each active worker) are in, ``timeout`` seconds pass or ``stop()`` is true; never longer."""
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
            if not waiting_for or remaining <= 0 or (stop is not None and stop()):
                break
            self._pump(min(remaining, 0.25))
        self._pump(0.0)
        batches, self._batches = self._batches, []
        for index, count in Counter(b.worker for b in batches if b.last).items():
            self.communicator.waiting[index] -= count
            self.communicator.send(index, "credit", count)  # it may play as many batches more
        return batches

    def _pump(self, timeout: float) -> None:
        for message in self.communicator.receive(timeout):
            self._handle(message)

    def _handle(self, message: Message) -> None:
        state, payload = self.workers[message.index], message.payload
        state.last_seen = time.monotonic()
        if message.kind == "episodes":
            self._batches.append(payload)
            state.episodes += len(payload.episodes)
            state.model_version = payload.model_version
            if payload.last:
                state.batches += 1
                self.communicator.waiting[message.index] += 1
        elif message.kind == "paused":
            state.paused_acked = True
        elif message.kind == "reset_done":
            state.reset_acked = True
        elif message.kind == "eval":
            self._evals[payload["request"]] = payload
            state.pending_evals = [r for r in state.pending_evals if r["request"] != payload["request"]]
        elif message.kind == "restarted":  # what the dead worker was asked to do and did not, it does now
            state.paused_acked, state.reset_acked = False, True
            for request in state.pending_evals:
                self.communicator.send(message.index, "evaluate", request)
        elif message.kind != "ready":
            self.log.warning("worker %d sent an unknown message %r", message.index, message.kind)

    # -- control
    def pause_workers(self, ids: list[int], timeout: float | None = None) -> None:
        """Pause workers; on return they send nothing more until resumed (batches they sent
        before pausing are kept for the next collect)."""
        for index in ids:
            self.workers[index].paused, self.workers[index].paused_acked = True, False
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
                 epsilon: float = 0.0, timeout: float | None = None,
                 env_kwargs: dict | None = None) -> list[dict[str, Any]]:
        """Play ``episodes`` episodes at ``epsilon`` (greedy by default) spread over the active workers.

        ``opponent`` (a player name) and ``learner_first`` (the seat) are for two-player envs;
        ``env_kwargs`` go to the evaluation envs. Returns each episode's statistics.
        """
        ids = self._active() or self.supervisor.live()
        kwargs = {**(env_kwargs or {}), **({} if learner_first is None else {"learner_first": learner_first})}
        requests = []
        for k, index in enumerate(ids):
            share = episodes // len(ids) + (k < episodes % len(ids))
            if share:
                request = {"request": next(self._request_ids), "episodes": share, "opponent": opponent,
                           "env_kwargs": kwargs, "epsilon": epsilon}
                self.workers[index].pending_evals.append(request)
                self.communicator.send(index, "evaluate", request)
                requests.append(request["request"])
        self._wait(lambda: all(r in self._evals for r in requests), timeout, "evaluate", ids)
        return [episode for r in requests for episode in self._evals.pop(r)["episodes"]]

    def _wait(self, done, timeout: float | None, what: str, ids: list[int]) -> None:
        timeout = self.config.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while not done():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"workers {ids} did not finish '{what}' within {timeout:.0f} s")
            self._pump(min(remaining, 0.25))

    # -- status
    def _active(self) -> list[int]:
        return [i for i in self.supervisor.live() if not self.workers[i].paused]

    def get_status(self) -> dict[str, Any]:
        """Active, paused and restarted workers, each worker's model version and episodes, queue sizes."""
        now, procs = time.monotonic(), self.supervisor.workers
        return {
            "active_workers": self._active(),
            "paused_workers": [i for i, s in self.workers.items() if s.paused],
            "restarted_workers": {i: w.restarts for i, w in procs.items() if w.restarts},
            "total_restarts": self.supervisor.total_restarts,
            "model_version": self.model_version,
            "workers": {i: {"pid": procs[i].process.pid if procs[i].process else None, "alive": procs[i].alive,
                            "paused": s.paused, "model_version": s.model_version, "episodes": s.episodes,
                            "batches": s.batches, "restarts": procs[i].restarts,
                            "seconds_since_message": round(now - s.last_seen, 2)}
                        for i, s in self.workers.items()},
            "queue_info": self.communicator.get_queue_info(),
            "batches_waiting": len(self._batches),
        }

    def pids(self) -> list[int]:
        return self.supervisor.pids()
