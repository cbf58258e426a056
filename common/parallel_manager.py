"""Rollout workers for a central learner (seed 004's library API): ParallelManager, its
WorkerCommunicator and ModelSynchronizer.

The learner's process owns the networks and the replay buffer. Each rollout worker is a
process started and watched by :class:`common.supervisor.Supervisor`, with one duplex pipe:
a worker that dies is reported with its id and its traceback (or signal) and restarted with
the current weights, epsilon and opponents; one that cannot run with its configuration
(:class:`~common.supervisor.WorkerConfigError`) is not restarted and ends the run. A worker
plays whole episodes (:mod:`common.rollout_worker`) with an
:class:`~common.rollout_worker.InferencePolicy` (the learner's model, no optimizer) and
sends them on its pipe, a batch of ``games_per_worker`` episodes at a time, at most
``experience_queue_size`` batches ahead of the learner: every batch
:meth:`ParallelManager.collect_experiences` hands out gives its worker one credit back.

Weights go the other way through shared memory (:class:`common.networks.SharedParams`,
versioned under a seqlock): slot 0 holds the learner's current weights, further slots the
past snapshots that self-play opponents play with, so pipes carry small messages only.
Every batch says which weights version played it.

**The model.** Any ``nn.Module`` whose class a worker can import: the module is pickled once
(:mod:`common.model_packing`), by reference to its class (and to the classes of its
submodules), with every parameter left out; the pickle goes to the workers through shared
memory and each rebuilds the module from it, then loads the parameters from the weights slot.
So the learner's model needs no constructor arguments or ``spec``, and
``sync_model_to_workers()`` publishes ``manager.model`` with no arguments. Buffers (BatchNorm
statistics ...) travel in that pickle, as they were when the manager was built; only parameters
are synced. A worker turns the model's output into actions by a convention, or by the user's
own ``act_fn`` (see :class:`~common.rollout_worker.InferencePolicy`).

Commands (learner -> worker): ``settings``, ``opponents``, ``credit``, ``pause``, ``resume``,
``reset``, ``evaluate``, ``stop`` (an unknown one is an error); messages (worker -> learner):
``episodes``, ``eval``, ``paused``, ``reset_done``. Two-player built-ins get their opponents
from :mod:`common.envs.selfplay`; nothing here knows a particular env.

**The env.** A Gymnasium id (``env_config["env_id"]``), or the user's own env as it takes the
model: ``env_factory=``, an env class or a module-level function that returns an env, which
``env_config``'s keys reach as keyword arguments (seed 004's ``{"board_size": 9, "max_moves":
200}``). Workers import the factory by name (:func:`common.envs.env_factory_id`). The learner's
process makes one env first and reads its spaces and whether it marks legal actions
(``observation_space``, ``action_space``, ``action_mask``); a model that does not fit them is
refused in one line (:func:`~common.manager_config.check_model_fits`).

Seed 004's call works with plain dicts: ``env_config`` names the env and its keyword
arguments, ``model_config`` the Q-network (or ``model=`` any module), ``parallel_config`` the
fields of :class:`~common.manager_config.ManagerConfig`::

    manager = ParallelManager({"env_id": "ConnectFour-v0"}, {"hidden_dim": 256, "num_layers": 2},
                              {"num_workers": 4, "games_per_worker": 10, "timeout": 30.0})
    manager.start_workers()
    try:
        experiences = manager.collect_experiences()  # ... train manager.model on them ...
        manager.sync_model_to_workers()
    finally:
        manager.stop_workers()

Everything the constructor is given is checked before any process or shared memory exists
(one-line ``ValueError``); the constructor, ``start_workers`` and ``stop_workers`` release all
they made on any failure, and a manager never stopped is stopped when the interpreter exits.
"""

from __future__ import annotations

import copy
import itertools
import logging
import time
import weakref
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from common.manager_config import (
    ManagerConfig,
    WorkerSpec,
    build_model,
    check_model_fits,
    check_value,
    probe_env_spaces,
)
from common.model_packing import pack_model, parameter_shapes
from common.networks import SharedParams, flat_size
from common.rollout_worker import ExperienceBatch, rollout_worker
from common.shm import SharedArrays
from common.supervisor import Message, Supervisor

log = logging.getLogger("prl.manager")
_manager_numbers = itertools.count()  # distinct shared-memory names for several managers in one process


class ModelSynchronizer:
    """Publishes the learner's weights to the workers as numbered versions (shared memory, slot 0).

    ``should_sync(learner_step)`` is true once ``model_sync_interval`` learner steps have passed
    since the last publication, or when there was none. A publication made without a
    ``learner_step`` counts as one at the last step this synchronizer knows (the latest given to
    ``should_sync`` or ``publish``); before any step is known it counts as none.
    """

    def __init__(self, params: SharedParams, model_sync_interval: int = 1):
        self.params = params
        self.model_sync_interval = max(1, model_sync_interval)
        self.last_sync_step: int | None = None
        self.known_step: int | None = None  # the latest learner step seen

    @property
    def version(self) -> int:
        return self.params.version(0)

    def _see(self, learner_step: int) -> None:
        self.known_step = learner_step if self.known_step is None else max(self.known_step, learner_step)

    def should_sync(self, learner_step: int) -> bool:
        self._see(learner_step)
        return self.last_sync_step is None or learner_step - self.last_sync_step >= self.model_sync_interval

    def publish(self, model: nn.Module, learner_step: int | None = None) -> int:
        """Write ``model``'s weights as a new version; returns it."""
        if learner_step is not None:
            self._see(learner_step)
            self.last_sync_step = learner_step
        elif self.known_step is not None:
            self.last_sync_step = self.known_step
        return self.params.publish(model, 0)



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
    env_resets: int = 0  # fresh envs the worker made in its current life (as its newest batch says)


def _release(supervisor: Supervisor, arrays: SharedArrays) -> None:
    """Stop the workers and unlink the segments of a manager that was never stopped (at exit)."""
    try:
        supervisor.stop(5.0)
    finally:
        arrays.unlink_all()


class ParallelManager:
    """Runs rollout workers for a training loop (see the module docstring).

    ``env_config``: a :class:`WorkerSpec` or seed 004's dict; ``env_factory``: the user's env
    class or env-making function, which the dict's keys (all but ``seed``) are passed to, in place
    of an ``env_id``; ``model_config``: the Q-network (ignored when ``model`` is given);
    ``parallel_config``: a :class:`ManagerConfig` or a dict of its fields; ``model``: any
    ``nn.Module`` whose classes a worker can import (the network is then ``manager.model``);
    ``act_fn``: how workers act with it (see :class:`InferencePolicy`; None = the convention).
    Every argument is checked before any process or shared memory exists, the model against the
    env's spaces too: a one-line ValueError names the first that cannot work. Also a context
    manager (stops on exit).
    """

    def __init__(self, env_config: WorkerSpec | dict, model_config: dict | None = None,
                 parallel_config: ManagerConfig | dict | None = None, *, model: nn.Module | None = None,
                 epsilon: float = 1.0, logger: logging.Logger | None = None, act_fn: Callable | None = None,
                 env_factory: Callable | None = None):
        self.log = logger or log
        self._stopped, self._started = True, False  # nothing to stop until the shared memory exists
        if isinstance(env_config, WorkerSpec) and env_factory is not None:
            raise ValueError(f"env_config: the WorkerSpec names env_id {env_config.env_id!r} and env_factory names "
                             f"the env too; give one")
        self.spec = (env_config if isinstance(env_config, WorkerSpec)
                     else WorkerSpec.from_dict(env_config, env_factory))
        self.spec.validate()
        self.config = (parallel_config if isinstance(parallel_config, ManagerConfig)
                       else ManagerConfig.from_dict({} if parallel_config is None else parallel_config))
        self.config.validate()
        if model is not None and not isinstance(model, nn.Module):
            raise ValueError(f"model: must be a torch.nn.Module, not {type(model).__name__}")
        if act_fn is not None and not callable(act_fn):
            raise ValueError(f"act_fn: must be a module-level function, not {type(act_fn).__name__}")
        check_value("ParallelManager", "epsilon", epsilon, "float", 0)
        if epsilon > 1:
            raise ValueError(f"ParallelManager: epsilon {epsilon!r}: must be in [0, 1]")
        spaces = probe_env_spaces(self.spec)
        self.observation_space, self.action_space = spaces.observation_space, spaces.action_space
        self.action_mask = spaces.action_mask  # the env marks legal actions: episodes carry "masks"
        self.model = model if model is not None else build_model(self.spec, model_config, spaces)
        if flat_size(self.model) == 0:
            raise ValueError(f"model: {type(self.model).__name__} has no parameters to send to the workers")
        self._shapes = parameter_shapes(self.model)
        model_bytes = pack_model(self.model, act_fn)  # the workers' copy; refuses what they could not rebuild
        if act_fn is None:  # an act_fn reads the output its own way: the workers' first act checks it
            check_model_fits(self.model, spaces)
        self.act_fn = act_fn
        self._arrays = SharedArrays()
        try:
            self._allocate(model_bytes)
            self.workers = {i: WorkerState(i) for i in range(self.config.num_workers)}
            self.supervisor = Supervisor(rollout_worker, self.config.num_workers, self._args_for, name="worker",
                                         max_restarts=self.config.max_restarts,
                                         start_timeout_s=self.config.start_timeout,
                                         hang_timeout_s=self.config.hang_timeout or None, logger=self.log)
        except BaseException:
            self._arrays.unlink_all()
            raise
        self._stopped = False
        # A manager nobody stopped (an exception before the caller's try) is stopped at interpreter exit.
        self._finalizer = weakref.finalize(self, _release, self.supervisor, self._arrays)
        self.communicator = WorkerCommunicator(self.supervisor, self.config.experience_queue_size)
        self._epsilon = float(epsilon)
        self._opponents: dict[str, Any] | None = None
        self._batches: list[ExperienceBatch] = []  # received, not yet handed out
        self._evals: dict[int, dict[str, Any]] = {}
        self._request_ids = itertools.count()

    def _allocate(self, model_bytes: bytes) -> None:
        """The shared weights slots, their versions and the model's pickle (the only segments this makes)."""
        tag, slots = next(_manager_numbers), 1 + self.config.opponent_slots
        names = {"params": f"manager{tag}_params", "versions": f"manager{tag}_versions",
                 "model": f"manager{tag}_model"}
        self._arrays.create(names["params"], (slots, flat_size(self.model)), np.float32)
        self._arrays.create(names["versions"], (slots, 2), np.int64)
        self._arrays.create(names["model"], (len(model_bytes),), np.uint8, fill=None)[:] = np.frombuffer(
            model_bytes, dtype=np.uint8)
        self._param_specs = {key: self._arrays.specs()[name] for key, name in names.items()}
        self.params = SharedParams({key: self._arrays[names[key]] for key in ("params", "versions")})
        self.synchronizer = ModelSynchronizer(self.params, self.config.model_sync_interval)

    def _args_for(self, index: int) -> tuple:
        """What worker ``index`` starts with; called again at every restart, so it gets the current state."""
        state = self.workers[index]
        state.lives += 1
        start = {"seed": self.spec.seed + 7919 * index + 104729 * state.lives, "epsilon": self._epsilon,
                 "opponents": self._opponents, "paused": state.paused,
                 "credits": max(0, self.config.experience_queue_size - self.communicator.waiting[index])}
        return self.spec, self.config, self._param_specs, start

    # -- lifecycle
    def start_workers(self, wait: bool = False, stop: Callable[[], bool] | None = None) -> None:
        """Start every worker; they play with the weights published last (``manager.model``'s, if none).

        ``wait``: return only once every worker is set up (its env made, its model rebuilt and
        answering with legal actions) or ``stop()`` is true, so that a worker that cannot run
        raises here (:class:`WorkerConfigError`). Whatever fails in here stops the workers and
        releases the shared memory before the error propagates."""
        if self._stopped or self._started:
            raise RuntimeError(f"start_workers: this manager was already {'stopped' if self._stopped else 'started'}"
                               f"; make a new ParallelManager")
        self._started = True
        try:
            if self.model_version == 0:
                self.synchronizer.publish(self.model)
            self.supervisor.start()
            if wait:
                self.wait_ready(stop or (lambda: False))
        except BaseException:
            self.stop_workers()
            raise

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
        self._finalizer.detach()
        try:
            self.supervisor.stop(timeout)
        finally:
            # Reading an unmapped segment would crash the process: model_version, get_status() and
            # a late sync go to private copies from now on (np.empty_like commits no memory until written).
            self.params = SharedParams({"params": np.empty_like(self.params.params),
                                        "versions": self.params.versions.copy()})
            self.synchronizer.params = self.params
            self._arrays.unlink_all()

    def __enter__(self) -> ParallelManager:
        return self

    def __exit__(self, *exc) -> None:
        self.stop_workers()

    # -- weights and settings
    def sync_model_to_workers(self, model: nn.Module | dict[str, torch.Tensor] | None = None,
                              epsilon: float | None = None, learner_step: int | None = None) -> int:
        """Publish ``manager.model``'s weights as a new version, the workers' from their next batch on.

        ``model`` (optional): a network of the same parameter shapes, which becomes
        ``manager.model``, or a state dict loaded into it; ``epsilon``: a new exploration rate;
        ``learner_step``: the step this sync counts at for ``synchronizer.should_sync``.
        Returns the version."""
        if isinstance(model, dict):
            self.model.load_state_dict(model)
        elif model is not None:
            self._check_shapes(model, "sync_model_to_workers")
            self.model = model
        version = self.synchronizer.publish(self.model, learner_step)
        if epsilon is not None:
            self.set_epsilon(epsilon)
        return version

    def _check_shapes(self, model: nn.Module, what: str) -> None:
        if not isinstance(model, nn.Module) or parameter_shapes(model) != self._shapes:
            raise ValueError(f"{what}: {type(model).__name__} does not have the parameter shapes of the workers' "
                             f"{type(self.model).__name__}; a new architecture needs a new ParallelManager")

    def set_epsilon(self, epsilon: float) -> None:
        """The exploration rate workers play with from their next batch on."""
        if epsilon != self._epsilon:
            self._epsilon = epsilon
            self.communicator.broadcast("settings", {"epsilon": epsilon})

    @property
    def model_version(self) -> int:
        return self.synchronizer.version

    def set_opponents(self, snapshots: list[nn.Module | dict[str, torch.Tensor]], probs: dict[str, float],
                      epsilon: float = 0.0, snapshot_weights: list[float] | None = None,
                      snapshot_ids: list[int] | None = None) -> None:
        """Opponent mixture for two-player envs: ``probs`` over latest / snapshot / random / heuristic
        (see :mod:`common.envs.selfplay`); ``snapshots`` are past weights of the learner, drawn in
        proportion to ``snapshot_weights`` (evenly without) and named in episodes by ``snapshot_ids``."""
        if len(snapshots) > self.config.opponent_slots:
            raise ValueError(f"{len(snapshots)} snapshots, but opponent_slots is {self.config.opponent_slots}")
        scratch = copy.deepcopy(self.model) if any(isinstance(s, dict) for s in snapshots) else None
        for slot, snapshot in enumerate(snapshots, start=1):
            if isinstance(snapshot, dict):
                scratch.load_state_dict(snapshot)
            else:
                self._check_shapes(snapshot, "set_opponents")
            self.params.publish(scratch if isinstance(snapshot, dict) else snapshot, slot)
        self._opponents = {"slots": list(range(1, len(snapshots) + 1)), "probs": dict(probs), "epsilon": epsilon,
                           "snapshot_weights": snapshot_weights, "snapshot_ids": snapshot_ids}
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
            state.model_version, state.env_resets = payload.model_version, payload.env_resets
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
                            "batches": s.batches, "restarts": procs[i].restarts, "env_resets": s.env_resets,
                            "seconds_since_message": round(now - s.last_seen, 2)}
                        for i, s in self.workers.items()},
            "queue_info": self.communicator.get_queue_info(),
            "batches_waiting": len(self._batches),
        }

    def pids(self) -> list[int]:
        return self.supervisor.pids()
