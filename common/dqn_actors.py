"""The actors of the asynchronous actor-learner DQN (ultra_parallel_train_dqn.py, Ape-X style).

Each actor process steps ``num_envs_per_worker`` environments with one batched forward pass
per step, explores at its own rate (:func:`actor_epsilon`), turns the steps into n-step
transitions and writes them into its partition of the replay (:mod:`common.replay_shm`),
with initial priorities under prioritized replay. No transition is pickled.

Everything an actor shares with its learner lives in shared memory (:func:`control_arrays`):
the weights (``common.networks.SharedParams``), per-actor step counters and weight versions,
and three control words: ``GO`` (every actor is up: the clock starts), ``STEPS_BEFORE`` (the
run's env steps before this invocation) and ``ALLOWED`` (the env steps of all actors together
that the rate limiter lets them reach). Its pipe carries finished episodes only (and, with
the message backend, the transitions). The config an actor reads is the script's ``Config``.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from common.dqn import epsilon_greedy, initial_priorities, linear_schedule
from common.envs import make_vec_env
from common.networks import QNetwork, SharedParams
from common.replay import NStepAccumulator, storage_dtype
from common.replay_shm import open_writer
from common.shm import SharedArrays, attach_all
from common.supervisor import Supervisor, WorkerConfigError, set_torch_threads

GO, STEPS_BEFORE, ALLOWED = range(3)  # control: start flag, env steps before this invocation, steps actors may reach


def control_arrays(arrays: SharedArrays, num_workers: int) -> None:
    """The counters and control words of a rank's ``num_workers`` actors, created in ``arrays``."""
    arrays.create("actor_steps", (num_workers,), np.int64)  # env steps (transitions) each actor took
    arrays.create("actor_vsteps", (num_workers,), np.int64)  # vector steps each actor took
    arrays.create("actor_version", (num_workers,), np.int64)  # weights version each actor acts with
    arrays.create("collect_until", (num_workers,), np.int64)  # sync mode: vector steps an actor may reach
    arrays.create("control", (3,), np.int64)


def actor_epsilon(cfg, actor: int, num_actors: int, global_step: int) -> float:
    """Ape-X spread: eps_i = eps ** (1 + alpha * i / (n - 1)) over the n actors of every rank, with eps
    decaying over the run."""
    base = linear_schedule(cfg.epsilon_start, cfg.epsilon_end, cfg.epsilon_decay_steps, global_step)
    if num_actors == 1:
        return base
    return base ** (1 + cfg.epsilon_alpha * actor / (num_actors - 1))


class Actor:
    """One actor process: epsilon-greedy steps of its envs, n-step transitions into its replay partition.

    ``index`` is its place among this rank's actors (the shared counters), ``actor`` among the
    ``num_actors`` of every rank (its exploration rate)."""

    def __init__(self, link, cfg, shared: dict, replay, envs, seed: int, actor: int, num_actors: int):
        self.link, self.cfg, self.shared, self.replay, self.envs = link, cfg, shared, replay, envs
        self.index, self.actor, self.num_actors = link.index, actor, num_actors
        self.params = SharedParams(shared)
        self.q_net = QNetwork(envs.single_observation_space, envs.single_action_space, tuple(cfg.hidden_sizes))
        self.version = self.params.wait_fetch(self.q_net, 0, link.parent_alive)
        shared["actor_version"][self.index] = self.version
        self.rng = np.random.default_rng(seed)
        space = envs.single_observation_space
        self.nstep = NStepAccumulator(cfg.n_step, cfg.gamma, cfg.num_envs_per_worker, space.shape,
                                      storage_dtype(space))
        self.obs = envs.reset()
        self.episodes: list[dict] = []

    def must_wait(self) -> bool:
        shared, i = self.shared, self.index
        if not shared["control"][GO]:
            return True  # the clock starts when every actor is ready
        if not self.cfg.async_training and shared["actor_vsteps"][i] >= shared["collect_until"][i]:
            return True  # sync mode: the learner opens the next collect phase
        return shared["actor_steps"].sum() >= shared["control"][ALLOWED]  # rate limiter: the learner is behind

    def run(self) -> None:
        link, last_report = self.link, 0.0  # the first finished episodes go out at once (a short run has no other)
        while not link.stop_requested:
            for command, _ in link.commands():
                if command != "stop":
                    raise ValueError(f"actor {self.index}: unknown command {command!r}")
            if link.stop_requested:
                break
            if self.must_wait():
                link.receive(0.0005)  # returns at once for a stop; heartbeats meanwhile
                continue
            self.step()
            if self.episodes and time.monotonic() - last_report > 0.1:
                link.send("episodes", self.episodes)  # a few small dicts: the only thing a pipe carries
                self.episodes, last_report = [], time.monotonic()

    def step(self) -> None:
        cfg, shared, i = self.cfg, self.shared, self.index
        if shared["actor_vsteps"][i] % cfg.weight_poll_steps == 0 and self.params.version(0) != self.version:
            self.version = self.params.fetch(self.q_net) or self.version
            shared["actor_version"][i] = self.version
        # The run's step count estimated from this actor's own progress: reading the other actors'
        # counters would make exploration depend on scheduling, and sync runs unrepeatable (and
        # the actors of other ranks are on other machines).
        global_step = int(shared["control"][STEPS_BEFORE] + shared["actor_steps"][i] * self.num_actors)
        epsilon = actor_epsilon(cfg, self.actor, self.num_actors, global_step)
        with torch.inference_mode():
            q_values = self.q_net(torch.as_tensor(self.obs)).numpy()
        actions = epsilon_greedy(q_values, epsilon, self.rng)
        result = self.envs.step(actions)
        batch = self.nstep.push(self.obs, actions, result.rewards, result.final_obs, result.terminations,
                                result.truncations)
        if batch is not None:
            if cfg.prioritized:
                batch["priorities"] = initial_priorities(self.q_net, batch)
            self.replay.add(batch)
        shared["actor_steps"][i] += cfg.num_envs_per_worker
        shared["actor_vsteps"][i] += 1
        self.obs = result.obs
        self.episodes += [{**episode, "epsilon": epsilon} for episode in result.episodes]


def actor_main(link, cfg, env_kwargs: dict, shared_specs: dict, replay_spec: dict, seed: int, actor: int,
               num_actors: int) -> None:
    """Actor process (run by the supervisor, which reports a crash and restarts it)."""
    set_torch_threads(1)
    shared, handles = attach_all(shared_specs)
    replay = open_writer(replay_spec, link.index, link)
    envs = None
    try:
        try:
            envs = make_vec_env(cfg.env_id, cfg.num_envs_per_worker, seed, **env_kwargs)
        except Exception as err:  # a bad env id or keyword: no restart can fix it
            raise WorkerConfigError(f"cannot create {cfg.env_id} with {env_kwargs}: {err}") from err
        acting = Actor(link, cfg, shared, replay, envs, seed, actor, num_actors)
        link.ready()
        acting.run()
    finally:
        if envs is not None:
            envs.close()
        replay.close()
        shared.clear()
        for handle in handles:
            handle.close()


def start_actors(run, shared_specs: dict, replay_spec: dict, rank: int) -> Supervisor:
    """This rank's ``num_workers`` actors; rank r's actor i is actor ``r * num_workers + i`` of the run."""
    cfg, supervisor = run.cfg, None

    def args_for(index: int) -> tuple:
        lives = supervisor.workers[index].restarts if supervisor is not None else 0
        actor = rank * cfg.num_workers + index
        # Fresh seeds for a restarted actor, so it does not replay the episodes it died in.
        seed = cfg.seed + actor * cfg.num_envs_per_worker + 1_000_003 * lives
        return cfg, run.env_kwargs, shared_specs, replay_spec, seed, actor, cfg.num_actors

    supervisor = run.supervise(Supervisor(
        actor_main, cfg.num_workers, args_for, name="worker", max_restarts=cfg.max_worker_restarts,
        start_timeout_s=max(cfg.worker_timeout_s, 120.0), hang_timeout_s=cfg.worker_timeout_s, logger=run.log))
    supervisor.start()
    return supervisor
