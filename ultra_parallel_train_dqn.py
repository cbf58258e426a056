"""Asynchronous actor-learner DQN over a replay buffer in shared memory (Ape-X style).

``--n-workers`` actor processes each step ``--envs-per-worker`` environments with one
batched forward pass per step, each with its own exploration rate, and write n-step
transitions straight into a replay buffer in shared memory (no transition is pickled).
The learner (this process; GPU when present) samples large batches, runs Double DQN with
a target network, gradient accumulation, mixed precision where it is safe and optionally
prioritized replay, and publishes its weights through shared memory with a version
counter that the actors poll. ``--no-async-training`` alternates collecting and learning
instead, for comparison.

    python ultra_parallel_train_dqn.py                                   # GridCoverage-v0
    python ultra_parallel_train_dqn.py --config configs/ultra_cartpole.yaml
    python ultra_parallel_train_dqn.py --n-workers 8 --prioritized --duration 0.5 --resume auto
"""

from __future__ import annotations

import os

# Idle OpenMP threads must sleep, not spin: spinning threads collapse throughput as soon as
# the cores are shared with actors or anything else (see the README's "Threads").
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import logging
import math
import re
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import gymnasium as gym
import numpy as np
import torch

from common.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    resolve_resume,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from common.config import fail, parse_config, require, require_env_id, require_positive, save_config, to_dict
from common.dqn import double_dqn_loss, linear_schedule, soft_update
from common.envs import make_vec_env
from common.envs.grid_coverage import VIEWS as GRID_VIEWS
from common.networks import QNetwork, flat_size, read_flat_params, write_flat_params
from common.parallel import GracefulExit, ParentWatch, TooManyRestarts, WorkerPool, describe_exit, init_worker_process
from common.replay_shm import (
    ReplayBuffer,
    ReplayLayout,
    ReplayTooLarge,
    SharedMemoryUnavailable,
    check_fits,
    make_replay,
    open_writer,
)
from common.runlog import MetricsWriter, Progress, default_run_dir, open_run_dir, read_metrics, write_summary
from common.shm import SharedArrays, attach_all, reclaim_stale_segments
from common.system import ProcessTreeSampler, resolve_device, usable_cores

SCRIPT = "ultra_parallel_train_dqn"
EXIT_FAILED = 1
CHECKPOINT_PATTERN = r"ultra_model_ep\d+\.pth"


@dataclass
class UltraTrainingConfig:
    env_id: str = "GridCoverage-v0"  # any Gymnasium id with a Discrete action space and a Box observation
    seed: int = 1  # environment i of the run is seeded seed + i
    grid_size: int | None = None  # GridCoverage-v0 only: side of the grid (None = the env's default, 6)
    grid_view: str = "egocentric"  # GridCoverage-v0 only: egocentric (maps centred on the agent) or global
    n_episodes: int = 100_000  # stop after this many finished training episodes (all actors together)
    total_timesteps: int | None = None  # also stop after this many env steps (None = no step limit)
    duration: float | None = None  # hours of wall time for this invocation (None = no time limit)
    target_return: float | None = None  # stop once the mean of the last 100 episode returns reaches this
    target_coverage: float | None = None  # stop once the mean coverage of the last 100 episodes reaches this
    n_workers: int = 2  # actor processes
    envs_per_worker: int = 16  # environments each actor steps together (one batched forward pass)
    async_training: bool = True  # learn while actors collect; false alternates collect and learn phases
    sync_steps: int = 16  # sync mode: vector steps each actor takes per collect phase
    batch_size: int = 256  # transitions per micro-batch
    grad_accum_steps: int = 1  # micro-batches per optimizer step (effective batch = batch_size * this)
    buffer_size: int = 200_000  # replay capacity in transitions (split evenly among actors)
    learning_starts: int = 2_000  # transitions in the buffer before learning starts
    replay_ratio: float = 8.0  # sampled / inserted transitions the learner keeps to (it waits beyond it)
    rate_limit: bool = True  # async: actors also wait when the learner falls behind replay_ratio (false = Ape-X)
    rate_limit_slack: int = 5_000  # async: env steps actors may run ahead of the learner's replay_ratio
    learning_rate: float = 2.5e-4  # Adam step size
    gamma: float = 0.99  # discount factor
    n_step: int = 3  # n-step returns (1 = plain one-step TD targets)
    target_update_interval: int = 250  # optimizer steps between target-network updates
    tau: float = 1.0  # target update rate (1 = hard copy)
    max_grad_norm: float = 10.0  # gradient-norm clipping
    hidden_sizes: list[int] = field(default_factory=lambda: [256, 256])  # Q-network MLP widths
    eps_start: float = 1.0  # exploration rate at the start (before the per-actor spread)
    eps_end: float = 0.4  # base exploration rate after the decay; actor i uses eps ** (1 + eps_alpha*i/(n-1))
    eps_decay_steps: int = 50_000  # env steps (all actors) over which eps decays from start to end
    eps_alpha: float = 7.0  # Ape-X spread of exploration rates across actors (0 = all equal)
    prioritized: bool = False  # proportional prioritized replay (priorities computed by actors on insertion)
    per_alpha: float = 0.6  # how strongly priorities skew sampling
    per_beta: float = 0.4  # importance-sampling correction at the start, annealed to 1 over the run
    mixed_precision: str = "auto"  # auto (fp16 + GradScaler on CUDA, off on CPU), bf16, fp16 (CUDA), off
    weight_poll_steps: int = 1  # actors check for new weights every this many vector steps
    replay_backend: str = "auto"  # auto (shared memory, else queue), shm, queue
    save_replay: bool = False  # also save the replay buffer with each checkpoint (large)
    device: str = "auto"  # learner device: auto, cpu, cuda, cuda:N
    output_dir: str | None = None  # run directory (default runs/ultra_parallel_train_dqn/<env>__<seed>__<time>)
    resume: str | None = None  # checkpoint path, or auto = newest checkpoint of this run directory
    save_every_episodes: int = 5_000  # write checkpoints/ultra_model_ep<N>.pth every this many episodes
    checkpoint_interval_s: float = 300.0  # also checkpoint after this many seconds without one
    keep_checkpoints: int = 5  # periodic checkpoints kept (older ones are deleted)
    log_interval_s: float = 10.0  # seconds between progress lines when not on a terminal
    metrics_interval_s: float = 1.0  # seconds between metrics.csv rows
    tensorboard: bool = True  # also write TensorBoard events to tb/
    max_actor_restarts: int = 3  # restarts per actor before the run gives up (exit 1)

    def validate(self) -> None:
        require_env_id(self.env_id)
        require_positive(self, "n_episodes", "total_timesteps", "duration", "n_workers", "envs_per_worker",
                         "sync_steps", "batch_size", "grad_accum_steps", "buffer_size", "replay_ratio",
                         "learning_rate", "n_step", "target_update_interval", "tau", "max_grad_norm",
                         "weight_poll_steps", "save_every_episodes", "checkpoint_interval_s",
                         "keep_checkpoints", "log_interval_s", "metrics_interval_s", "eps_decay_steps")
        require(self.grid_size is None or self.grid_size >= 2, "grid_size", self.grid_size, "must be >= 2")
        require(self.grid_size is None or self.env_id == "GridCoverage-v0", "grid_size", self.grid_size,
                "applies to GridCoverage-v0 only")
        require(self.grid_view in GRID_VIEWS, "grid_view", self.grid_view, f"must be one of {GRID_VIEWS}")
        require(self.learning_starts >= 0, "learning_starts", self.learning_starts, "must be >= 0")
        slots = self.buffer_size // self.n_workers * self.n_workers
        require(self.learning_starts <= slots, "learning_starts", self.learning_starts,
                f"must not exceed the replay capacity ({slots} slots)")
        ahead = self.n_step * self.envs_per_worker * self.n_workers + \
            math.ceil(self.batch_size * self.grad_accum_steps / self.replay_ratio)
        require(self.rate_limit_slack >= ahead, "rate_limit_slack", self.rate_limit_slack,
                f"must be >= {ahead} (n_step * envs in total + effective batch / replay_ratio) or the rate "
                "limiter could stall learner and actors")
        require(0 <= self.gamma <= 1, "gamma", self.gamma, "must be in [0, 1]")
        require(self.tau <= 1, "tau", self.tau, "must be in (0, 1]")
        for name in ("eps_start", "eps_end", "per_beta"):
            require(0 <= getattr(self, name) <= 1, name, getattr(self, name), "must be in [0, 1]")
        require(self.eps_alpha >= 0, "eps_alpha", self.eps_alpha, "must be >= 0")
        require(self.per_alpha >= 0, "per_alpha", self.per_alpha, "must be >= 0")
        require(self.max_actor_restarts >= 0, "max_actor_restarts", self.max_actor_restarts, "must be >= 0")
        require(all(h > 0 for h in self.hidden_sizes), "hidden_sizes", self.hidden_sizes, "widths must be > 0")
        require(self.replay_backend in ("auto", "shm", "queue"), "replay_backend", self.replay_backend,
                "must be auto, shm or queue")
        require(self.mixed_precision in ("auto", "bf16", "fp16", "off"), "mixed_precision", self.mixed_precision,
                "must be auto, bf16, fp16 or off")
        part = self.buffer_size // self.n_workers
        burst = self.n_step * self.envs_per_worker  # most transitions one vector step can emit
        require(part >= burst, "buffer_size", self.buffer_size,
                f"must hold n_step * envs_per_worker = {burst} transitions per actor ({self.n_workers} actors)")
        device = resolve_device(self.device)
        require(self.mixed_precision != "fp16" or device.startswith("cuda"), "mixed_precision", "fp16",
                "needs a CUDA device (use bf16 on CPU)")

    def env_kwargs(self) -> dict:
        if self.env_id != "GridCoverage-v0":
            return {}
        return {"view": self.grid_view, **({"size": self.grid_size} if self.grid_size is not None else {})}


# --------------------------------------------------------------------------- actors
# Everything an actor shares with the learner lives in shared memory: the weights with
# a version seqlock, per-actor step counters and weight versions, and a stop flag.

def control_arrays(arrays: SharedArrays, n_workers: int, num_params: int) -> None:
    arrays.create("params", (num_params,), np.float32)
    arrays.create("version", (2,), np.int64)  # [begun, finished] writes of params: a seqlock
    arrays.create("actor_steps", (n_workers,), np.int64)  # env steps (transitions) each actor took
    arrays.create("actor_vsteps", (n_workers,), np.int64)  # vector steps each actor took
    arrays.create("actor_version", (n_workers,), np.int64)  # weights version each actor acts with
    arrays.create("collect_until", (n_workers,), np.int64)  # sync mode: vector steps an actor may reach
    # [stop flag, env steps before this invocation, go flag, env steps (this invocation) actors may reach]
    arrays.create("control", (4,), np.int64)


def publish_weights(q_net: torch.nn.Module, shared: dict[str, np.ndarray]) -> int:
    """Write the weights under the seqlock; returns the new version."""
    shared["version"][0] += 1
    write_flat_params(q_net, shared["params"])
    shared["version"][1] = shared["version"][0]
    return int(shared["version"][1])


def fetch_weights(q_net: torch.nn.Module, shared: dict[str, np.ndarray], scratch: np.ndarray) -> int | None:
    """Copy the weights if no write was in progress meanwhile; returns their version or None."""
    finished = int(shared["version"][1])
    np.copyto(scratch, shared["params"])
    if int(shared["version"][0]) != finished:
        return None  # the learner was writing: try again at the next poll
    read_flat_params(q_net, scratch)
    return finished


def actor_epsilon(cfg: UltraTrainingConfig, index: int, global_step: int) -> float:
    """Ape-X spread: eps_i = eps ** (1 + alpha * i / (n - 1)), with eps decaying over the run."""
    base = linear_schedule(cfg.eps_start, cfg.eps_end, cfg.eps_decay_steps, global_step)
    if cfg.n_workers == 1:
        return base
    return base ** (1 + cfg.eps_alpha * index / (cfg.n_workers - 1))


class NStepAccumulator:
    """Turns per-step transitions of ``num_envs`` environments into n-step transitions.

    A transition leaves once it has ``n`` rewards, or when its episode ends (then with
    fewer rewards and the final observation); ``discounts`` holds gamma ** rewards used.
    """

    def __init__(self, n: int, gamma: float, num_envs: int, obs_shape: tuple[int, ...]):
        self.n, self.gamma = n, gamma
        self.obs = np.zeros((n, num_envs, *obs_shape), dtype=np.float32)
        self.actions = np.zeros((n, num_envs), dtype=np.int64)
        self.rewards = np.zeros((n, num_envs), dtype=np.float32)
        self.count = np.zeros(num_envs, dtype=np.int64)  # steps stored since the episode began
        self.pos = 0
        self.powers = gamma ** np.arange(n + 1, dtype=np.float64)

    def push(self, obs, actions, rewards, final_obs, terminations, truncations) -> dict[str, np.ndarray] | None:
        n, pos = self.n, self.pos
        self.obs[pos], self.actions[pos], self.rewards[pos] = obs, actions, rewards
        self.pos = (pos + 1) % n
        self.count += 1
        order = (pos + 1 + np.arange(n)) % n  # oldest first
        done = terminations | truncations
        out: list[dict[str, np.ndarray]] = []
        full = np.flatnonzero((self.count >= n) & ~done)
        if len(full):
            returns = (self.rewards[order][:, full] * self.powers[:n, None]).sum(axis=0)
            out.append({"obs": self.obs[order[0], full], "actions": self.actions[order[0], full],
                        "rewards": returns, "next_obs": final_obs[full],
                        "dones": np.zeros(len(full), np.float32), "discounts": np.full(len(full), self.powers[n])})
        for env in np.flatnonzero(done):  # flush every pending transition of a finished episode
            k = min(int(self.count[env]), n)
            steps = order[n - k:]
            rewards = self.rewards[steps, env]
            tails = np.array([(rewards[j:] * self.powers[:k - j]).sum() for j in range(k)])
            out.append({"obs": self.obs[steps, env], "actions": self.actions[steps, env], "rewards": tails,
                        "next_obs": np.repeat(final_obs[env][None], k, axis=0),
                        "dones": np.full(k, float(terminations[env]), np.float32),
                        "discounts": self.powers[k - np.arange(k)]})
            self.count[env] = 0
        if not out:
            return None
        batch = {key: np.concatenate([part[key] for part in out]) for key in out[0]}
        batch["rewards"] = batch["rewards"].astype(np.float32)
        batch["discounts"] = batch["discounts"].astype(np.float32)
        return batch


@torch.inference_mode()
def initial_priorities(q_net: torch.nn.Module, batch: dict[str, np.ndarray]) -> np.ndarray:
    """|TD error| under the actor's own network, as Ape-X actors compute it on insertion."""
    q = q_net(torch.from_numpy(batch["obs"])).gather(1, torch.from_numpy(batch["actions"])[:, None]).squeeze(1)
    next_q = q_net(torch.from_numpy(batch["next_obs"])).max(dim=1).values
    target = torch.from_numpy(batch["rewards"]) + torch.from_numpy(batch["discounts"]) * next_q * \
        (1 - torch.from_numpy(batch["dones"]))
    return (target - q).abs().numpy()


def actor_main(index: int, conn, cfg_dict: dict, control_specs: dict, replay_spec: dict, seed: int) -> None:
    """Actor process: steps its environments with epsilon-greedy actions and fills its replay partition."""
    init_worker_process(1)
    cfg = UltraTrainingConfig(**cfg_dict)
    watch = ParentWatch()
    shared, handles = attach_all(control_specs)
    replay = open_writer(replay_spec, index, alive=watch.parent_alive)
    envs = make_vec_env(cfg.env_id, cfg.envs_per_worker, seed, **cfg.env_kwargs())
    try:
        q_net = QNetwork(envs.single_observation_space, envs.single_action_space, tuple(cfg.hidden_sizes))
        scratch = np.empty_like(shared["params"])
        version = None
        while version is None:
            version = fetch_weights(q_net, shared, scratch)
        shared["actor_version"][index] = version
        rng = np.random.default_rng(seed)
        nstep = NStepAccumulator(cfg.n_step, cfg.gamma, cfg.envs_per_worker, envs.single_observation_space.shape)
        obs = envs.reset().astype(np.float32)
        conn.send(("ready", os.getpid()))
        episodes, last_report, vstep = [], time.monotonic(), 0
        while not shared["control"][2] and not shared["control"][0] and watch.parent_alive():
            time.sleep(0.001)  # the clock starts when every actor is ready
        while not shared["control"][0] and watch.parent_alive():
            if conn.poll(0) and conn.recv()[0] == "close":
                break
            if not cfg.async_training and shared["actor_vsteps"][index] >= shared["collect_until"][index]:
                time.sleep(0.001)  # sync mode: wait for the learner to open the next collect phase
                continue
            if shared["actor_steps"].sum() >= shared["control"][3]:
                time.sleep(0.0002)  # rate limiter: the learner is behind the replay ratio
                continue
            if vstep % cfg.weight_poll_steps == 0 and shared["version"][1] != version:
                version = fetch_weights(q_net, shared, scratch) or version
                shared["actor_version"][index] = version
            # The run's step count estimated from this actor's own progress: reading the other actors'
            # counters would make exploration depend on scheduling, and sync runs unrepeatable.
            global_step = int(shared["control"][1] + shared["actor_steps"][index] * cfg.n_workers)
            epsilon = actor_epsilon(cfg, index, global_step)
            with torch.inference_mode():
                actions = q_net(torch.from_numpy(obs)).argmax(dim=1).numpy()
            explore = rng.random(cfg.envs_per_worker) < epsilon
            actions = np.where(explore, rng.integers(0, envs.single_action_space.n, cfg.envs_per_worker), actions)
            result = envs.step(actions)
            batch = nstep.push(obs, actions, result.rewards, result.final_obs.astype(np.float32),
                               result.terminations, result.truncations)
            if batch is not None:
                if cfg.prioritized:
                    batch["priorities"] = initial_priorities(q_net, batch)
                replay.add(batch)
            vstep += 1
            shared["actor_steps"][index] += cfg.envs_per_worker
            shared["actor_vsteps"][index] += 1
            obs = result.obs.astype(np.float32)
            for episode in result.episodes:
                episode["epsilon"] = epsilon
            episodes.extend(result.episodes)
            if episodes and time.monotonic() - last_report > 0.1:
                conn.send(("episodes", episodes))  # a few small dicts: the only thing a pipe carries
                episodes, last_report = [], time.monotonic()
    except (BrokenPipeError, ConnectionError):
        pass  # the learner is gone; exit quietly
    finally:
        envs.close()
        replay.close(flush=False)  # the run is ending: do not wait for the learner to read queued batches
        shared.clear()
        for handle in handles:
            handle.close()


class Actors:
    """The actor processes: start, collect their episode reports, restart the dead, stop."""

    def __init__(self, cfg: UltraTrainingConfig, arrays: SharedArrays, replay: ReplayBuffer, log):
        self.cfg, self.log = cfg, log
        self.shared = {name: arrays[name] for name in arrays.specs()}
        cfg_dict, specs, replay_spec = to_dict(cfg), arrays.specs(), replay.writer_spec

        def args_for(index: int) -> tuple:
            restarts = self.pool.workers[index].restarts + 1 if index in self.pool.workers else 0
            # Fresh seeds for a restarted actor, so it does not replay the episodes it died in.
            seed = cfg.seed + index * cfg.envs_per_worker + 1_000_003 * restarts
            return cfg_dict, specs, replay_spec, seed

        self.pool = WorkerPool(actor_main, cfg.n_workers, args_for, cfg.max_actor_restarts, name="actor")
        self.pool.start()
        self._await_ready(list(range(cfg.n_workers)))
        log.info("started %d actors (pids %s)", cfg.n_workers, self.pool.pids())

    def go(self) -> None:
        self.shared["control"][2] = 1

    @property
    def restarts(self) -> int:
        return self.pool.total_restarts

    def _await_ready(self, indices: list[int], timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        pending = set(indices)
        while pending:
            self.check_alive()
            for index in list(pending):
                conn = self.pool.workers[index].conn
                while conn.poll(0):
                    if conn.recv()[0] == "ready":
                        pending.discard(index)
            if time.monotonic() > deadline:
                raise TimeoutError(f"actors {sorted(pending)} did not start within {timeout:.0f} s")
            time.sleep(0.01)

    def _death_reason(self, index: int) -> str:
        handle = self.pool.workers[index]
        handle.process.join(1.0)
        try:
            while handle.conn.poll(0):
                command, payload = handle.conn.recv()
                if command == "error":
                    return f"raised an exception:\n{payload}"
        except (EOFError, OSError):
            pass
        return describe_exit(handle.process.exitcode)

    def check_alive(self) -> None:
        """Restart every dead actor with the current weights (TooManyRestarts past the limit)."""
        for index, handle in list(self.pool.workers.items()):
            if handle.process.is_alive():
                continue
            self.log.error("actor %d (pid %s) died: %s", index, handle.process.pid, self._death_reason(index))
            self.pool.restart(index)
            self._await_ready([index])

    def episodes(self) -> list[dict]:
        """Episode reports the actors sent since the last call."""
        found = []
        for handle in self.pool.workers.values():
            try:
                while handle.conn.poll(0):
                    command, payload = handle.conn.recv()
                    if command == "episodes":
                        found.extend(payload)
            except (EOFError, OSError):
                continue  # a dead actor; check_alive reports and replaces it
        return found

    def stop(self) -> None:
        self.shared["control"][0] = 1
        self.pool.stop(timeout=10.0)


# --------------------------------------------------------------------------- learner

class Learner:
    """Double DQN on replay samples: micro-batches, gradient accumulation, mixed precision."""

    def __init__(self, cfg: UltraTrainingConfig, obs_space, act_space, device: torch.device):
        self.cfg, self.device = cfg, device
        self.q_net = QNetwork(obs_space, act_space, tuple(cfg.hidden_sizes)).to(device)
        self.target_net = QNetwork(obs_space, act_space, tuple(cfg.hidden_sizes)).to(device)
        self.target_net.load_state_dict(self.q_net.state_dict())
        self.optimizer = torch.optim.Adam(self.q_net.parameters(), lr=cfg.learning_rate)
        precision = cfg.mixed_precision
        if precision == "auto":
            precision = "fp16" if device.type == "cuda" else "off"
        self.precision = precision
        self.amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
        # fp16 gradients underflow without loss scaling; bf16 has fp32's range and needs none.
        self.scaler = torch.amp.GradScaler("cuda", enabled=precision == "fp16")
        self.updates = 0

    def to_tensors(self, sample) -> dict[str, torch.Tensor]:
        names = ("obs", "actions", "rewards", "next_obs", "dones", "discounts")
        batch = {name: torch.as_tensor(getattr(sample, name)).to(self.device, non_blocking=True) for name in names}
        batch["weights"] = None if sample.weights is None else torch.as_tensor(sample.weights).to(self.device)
        return batch

    def update(self, replay: ReplayBuffer, beta: float) -> dict[str, float]:
        """One optimizer step over ``grad_accum_steps`` micro-batches; returns loss statistics."""
        cfg = self.cfg
        self.optimizer.zero_grad(set_to_none=True)
        losses, rejected = [], 0
        for _ in range(cfg.grad_accum_steps):
            sample = replay.sample(cfg.batch_size, beta)
            rejected += sample.rejected
            b = self.to_tensors(sample)
            with torch.autocast(self.device.type, dtype=self.amp_dtype or torch.float32,
                                enabled=self.amp_dtype is not None):
                loss, td_abs = double_dqn_loss(self.q_net, self.target_net, b["obs"], b["actions"], b["rewards"],
                                               b["next_obs"], b["dones"], b["discounts"], weights=b["weights"])
            loss = loss.float()
            if not torch.isfinite(loss):
                return {"loss": float(loss), "rejected": rejected}
            self.scaler.scale(loss / cfg.grad_accum_steps).backward()
            replay.update_priorities(sample, td_abs.float().cpu().numpy())
            losses.append(loss.item())
        self.scaler.unscale_(self.optimizer)
        torch.nn.utils.clip_grad_norm_(self.q_net.parameters(), cfg.max_grad_norm)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.updates += 1
        if self.updates % cfg.target_update_interval == 0:
            soft_update(self.target_net, self.q_net, cfg.tau)
        return {"loss": float(np.mean(losses)), "rejected": rejected}

    def state(self) -> dict:
        return {"model": self.q_net.state_dict(), "target": self.target_net.state_dict(),
                "optimizer": self.optimizer.state_dict(), "scaler": self.scaler.state_dict(),
                "updates": self.updates}

    def load(self, state: dict) -> None:
        self.q_net.load_state_dict(state["model"])
        self.target_net.load_state_dict(state["target"])
        self.optimizer.load_state_dict(state["optimizer"])
        if state.get("scaler") and self.scaler.is_enabled():  # empty when saved without fp16
            self.scaler.load_state_dict(state["scaler"])
        self.updates = int(state["updates"])


# --------------------------------------------------------------------------- setup

def probe_spaces(cfg: UltraTrainingConfig):
    """Build one env to learn the spaces; reject what DQN cannot handle before writing anything."""
    try:
        env = gym.make(cfg.env_id, **cfg.env_kwargs())
    except Exception as err:  # missing extras (Box2D, ALE), bad env kwargs and broken ids all land here
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        fail(f"--env-id {cfg.env_id}: cannot create it ({reason})")
    obs_space, act_space = env.observation_space, env.action_space
    env.close()
    if not isinstance(act_space, gym.spaces.Discrete):
        fail(f"--env-id {cfg.env_id}: DQN needs a Discrete action space, not {act_space}")
    if not isinstance(obs_space, gym.spaces.Box):
        fail(f"--env-id {cfg.env_id}: observation space {obs_space} is not a Box")
    return obs_space, act_space


def find_resume(cfg: UltraTrainingConfig) -> tuple[Path | None, dict | None]:
    """Load the checkpoint to resume from before anything is written (a bad file exits 2)."""
    try:
        return resolve_resume(cfg.resume, cfg.output_dir, SCRIPT, cfg.env_id, cfg.seed,
                              required=("model", "target", "optimizer", "global_step", "config"),
                              pattern=CHECKPOINT_PATTERN, hidden_sizes=cfg.hidden_sizes)
    except CheckpointError as err:
        fail(f"--resume {cfg.resume}: {err}")


def main(argv: list[str] | None = None) -> int:
    cfg = parse_config(UltraTrainingConfig, argv, description=__doc__.split("\n\n")[0])
    obs_space, act_space = probe_spaces(cfg)
    layout = ReplayLayout(cfg.buffer_size, cfg.n_workers, obs_space.shape, "float32", cfg.prioritized)
    try:
        check_fits(layout.nbytes(), shared=False)
    except ReplayTooLarge as err:
        fail(f"--buffer-size {cfg.buffer_size}: {err}")
    resume_path, state = find_resume(cfg)
    if resume_path is not None and cfg.output_dir is None:
        cfg.output_dir = str(resume_path.parent.parent)
    run_dir = Path(cfg.output_dir) if cfg.output_dir else default_run_dir(SCRIPT, cfg.env_id, cfg.seed)

    reclaim_stale_segments()
    run_dir, lock = open_run_dir(run_dir, logger_name=f"prl.{SCRIPT}")
    save_config(cfg, run_dir / "config.yaml")
    log = logging.getLogger(f"prl.{SCRIPT}")
    torch.manual_seed(cfg.seed)
    np.random.seed(cfg.seed)
    device = torch.device(resolve_device(cfg.device))
    # The learner takes the cores the actors leave. Also in sync mode: torch's worker threads spin-wait,
    # and next to polling actors a second thread made updates several times slower, not faster.
    torch.set_num_threads(max(1, usable_cores() - cfg.n_workers))

    learner = Learner(cfg, obs_space, act_space, device)
    gs = {"global_step": 0, "episodes": 0, "wall_time": 0.0, "recent_returns": [], "recent_coverage": [],
          "best_mean100": -math.inf, "samples_trained": 0}
    if state is not None:
        learner.load(state)
        gs.update({k: state[k] for k in gs if k in state})
        set_rng_state(state["rng"])
        log.info("resumed from %s at step %d, episode %d (update %d)", resume_path, gs["global_step"],
                 gs["episodes"], learner.updates)

    arrays = SharedArrays()
    replay = actors = None
    graceful = GracefulExit(log).install()
    exit_code = 0
    try:
        control_arrays(arrays, cfg.n_workers, flat_size(learner.q_net))
        shared = {name: arrays[name] for name in arrays.specs()}
        shared["control"][1] = gs["global_step"]
        replay = make_replay(layout, cfg.replay_backend, alpha=cfg.per_alpha)
        replay.seed(cfg.seed)
        replay_file = run_dir / "checkpoints" / "replay.npz"
        if state is not None and cfg.save_replay and replay_file.exists():
            with np.load(replay_file) as saved:
                replay.load_state(dict(saved))
            log.info("replay buffer restored: %d transitions", len(replay))
        publish_weights(learner.q_net, shared)
        log.info("%s: %s, %d actor(s) x %d envs, %s, replay %d slots (%s, %.1f MiB, %s), learner on %s, "
                 "precision %s, run dir %s", SCRIPT, cfg.env_id, cfg.n_workers, cfg.envs_per_worker,
                 "async" if cfg.async_training else "sync", layout.slots, replay.backend, layout.nbytes() / 2**20,
                 "prioritized" if cfg.prioritized else "uniform", device, learner.precision, run_dir)
        actors = Actors(cfg, arrays, replay, log)
        exit_code = train(cfg, learner, replay, actors, shared, gs, run_dir, graceful, log)
    except (TooManyRestarts, SharedMemoryUnavailable, TimeoutError) as err:
        log.error("training failed: %s", err)
        if actors is not None:
            save_training_checkpoint(cfg, learner, replay, gs, run_dir, log)
        exit_code = EXIT_FAILED
    except Exception:
        log.exception("training failed")
        exit_code = EXIT_FAILED
    finally:
        if actors is not None:
            actors.stop()
        if replay is not None:
            replay.close()
        arrays.unlink_all()
        lock.release()
    if graceful.requested and exit_code == 0:
        exit_code = graceful.exit_code
    log.info("exit status %d", exit_code)
    return exit_code


# --------------------------------------------------------------------------- training

EXTRA_COLUMNS = ["return_mean100", "coverage", "coverage_mean100", "loss", "epsilon_max", "epsilon_min",
                 "buffer_size", "buffer_fill", "updates", "updates_per_s", "samples_per_s", "episodes_per_s",
                 "policy_lag", "weights_version", "torn_samples_skipped", "actor_restarts", "cpu_percent",
                 "rss_mb", "pss_mb"]


def save_training_checkpoint(cfg: UltraTrainingConfig, learner: Learner, replay: ReplayBuffer | None, gs: dict,
                             run_dir: Path, log, final: bool = False) -> Path:
    """checkpoints/ultra_model_ep<N>.pth (and ultra_final_model.pth at the end); older periodic ones pruned."""
    state = {**learner.state(), "config": to_dict(cfg), "rng": rng_state(), **gs}
    path = save_checkpoint(state, run_dir / "checkpoints" / f"ultra_model_ep{gs['episodes']}.pth")
    if final:
        save_checkpoint(state, run_dir / "ultra_final_model.pth")
    if cfg.save_replay and replay is not None:
        tmp = run_dir / "checkpoints" / ".replay.tmp.npz"
        np.savez(tmp, **replay.state())
        os.replace(tmp, run_dir / "checkpoints" / "replay.npz")
    periodic = sorted((p for p in path.parent.iterdir() if re.fullmatch(CHECKPOINT_PATTERN, p.name)),
                      key=lambda p: int(re.findall(r"\d+", p.name)[-1]))
    for old in periodic[:-cfg.keep_checkpoints]:
        if old != path:
            old.unlink(missing_ok=True)
    log.info("checkpoint saved: %s (step %d, episode %d)", path, gs["global_step"], gs["episodes"])
    return path


def mean_or_nan(values) -> float:
    return float(np.mean(values)) if len(values) else math.nan


def train(cfg: UltraTrainingConfig, learner: Learner, replay: ReplayBuffer, actors: Actors, shared: dict,
          gs: dict, run_dir: Path, graceful, log) -> int:
    metrics = MetricsWriter(run_dir, EXTRA_COLUMNS, tensorboard=cfg.tensorboard)
    progress = Progress(cfg.n_episodes, "episodes", log, cfg.log_interval_s, initial=gs["episodes"])
    sampler = ProcessTreeSampler()
    recent_returns = deque(gs["recent_returns"], maxlen=100)
    recent_coverage = deque(gs["recent_coverage"], maxlen=100)
    start = time.monotonic()
    wall_offset, step_offset = gs["wall_time"], gs["global_step"]
    deadline = start + cfg.duration * 3600 if cfg.duration else math.inf
    last_checkpoint, last_saved_episodes = start, gs["episodes"]
    # The replay ratio and the rate limiter count this invocation's transitions and samples only.
    inserted_base, samples_at_start, samples_base = replay.inserted(), gs["samples_trained"], 0
    effective_batch = cfg.batch_size * cfg.grad_accum_steps
    version = int(shared["version"][1])
    window = {"time": start, "episodes": [], "losses": [], "updates": 0, "samples": 0, "rejected": 0,
              "steps": gs["global_step"]}
    last_health = 0.0
    last_good = latest_checkpoint(run_dir / "checkpoints", CHECKPOINT_PATTERN)
    reason, exit_code = "episode budget reached", 0

    def allow_inserts() -> None:
        if cfg.async_training and cfg.rate_limit:
            shared["control"][3] = cfg.learning_starts + cfg.rate_limit_slack + int(samples_base / cfg.replay_ratio)
        else:
            shared["control"][3] = np.iinfo(np.int64).max

    allow_inserts()
    actors.go()

    def may_learn() -> bool:
        inserted = replay.inserted() - inserted_base
        return len(replay) >= cfg.learning_starts and samples_base + effective_batch <= cfg.replay_ratio * inserted

    def poll(now: float) -> None:
        nonlocal last_health
        if now - last_health >= 0.1 and not graceful.requested:  # no restarts while shutting down
            actors.check_alive()
            last_health = now
        for episode in actors.episodes():
            gs["episodes"] += 1
            window["episodes"].append(episode)
            recent_returns.append(episode["return"])
            if "coverage" in episode:
                recent_coverage.append(episode["coverage"])
        replay.sync()

    def learn_once(beta: float) -> float:
        """One optimizer step, counted in the metrics window; returns its loss."""
        nonlocal samples_base
        stats = learner.update(replay, beta)
        samples_base += effective_batch
        window["losses"].append(stats["loss"])
        window["updates"] += 1
        window["samples"] += effective_batch
        window["rejected"] += stats["rejected"]
        return stats["loss"]

    while True:
        now = time.monotonic()
        poll(now)
        if graceful.requested:
            reason = "interrupted"
            break
        # A checkpoint that is due is written before the next update, so it holds weights no update has
        # touched since the episodes it counts -- the last good state if that update diverges.
        if gs["episodes"] - last_saved_episodes >= cfg.save_every_episodes or \
                now - last_checkpoint >= cfg.checkpoint_interval_s:
            gs["global_step"] = step_offset + int(shared["actor_steps"].sum())
            gs["recent_returns"], gs["recent_coverage"] = list(recent_returns), list(recent_coverage)
            gs["samples_trained"] = samples_at_start + samples_base
            last_good = save_training_checkpoint(cfg, learner, replay, gs, run_dir, log)
            last_checkpoint, last_saved_episodes = now, gs["episodes"]
        progress_frac = min(1.0, max(gs["episodes"] / cfg.n_episodes,
                                     gs["global_step"] / cfg.total_timesteps if cfg.total_timesteps else 0.0,
                                     (now - start) / (deadline - start) if cfg.duration else 0.0))
        beta = cfg.per_beta + (1.0 - cfg.per_beta) * progress_frac
        if cfg.async_training:
            if may_learn():
                loss = learn_once(beta)
                if not math.isfinite(loss):
                    reason, exit_code = f"loss became {loss} at update {learner.updates}", EXIT_FAILED
                    break
                version = publish_weights(learner.q_net, shared)
                allow_inserts()
            else:
                time.sleep(0.0005)  # actors are behind the replay ratio (or the buffer is filling)
        else:
            # Collect phase: every actor takes sync_steps vector steps with the same weights ...
            shared["collect_until"][:] = shared["actor_vsteps"] + cfg.sync_steps
            while (shared["actor_vsteps"] < shared["collect_until"]).any() and not graceful.requested:
                time.sleep(0.0002)
                poll(time.monotonic())
            replay.sync()
            # ... then the learn phase catches up with the replay ratio while they wait.
            loss = 0.0
            while may_learn() and not graceful.requested and math.isfinite(loss):
                loss = learn_once(beta)
            if not math.isfinite(loss):
                reason, exit_code = f"loss became {loss} at update {learner.updates}", EXIT_FAILED
                break
            version = publish_weights(learner.q_net, shared)

        gs["global_step"] = step_offset + int(shared["actor_steps"].sum())
        now = time.monotonic()
        gs["wall_time"] = wall_offset + now - start
        mean100 = mean_or_nan(recent_returns) if len(recent_returns) == 100 else math.nan
        coverage100 = mean_or_nan(recent_coverage) if len(recent_coverage) == 100 else math.nan
        if math.isfinite(mean100):
            gs["best_mean100"] = max(gs["best_mean100"], mean100)

        if now - window["time"] >= cfg.metrics_interval_s:
            write_row(cfg, metrics, progress, sampler, window, gs, replay, actors, shared, version, learner.updates,
                      mean100, coverage100, recent_coverage, now)
            window.update({"time": now, "episodes": [], "losses": [], "updates": 0, "samples": 0, "rejected": 0,
                           "steps": gs["global_step"]})

        stop = None
        if gs["episodes"] >= cfg.n_episodes:
            stop = f"episode budget of {cfg.n_episodes} reached"
        elif cfg.total_timesteps and gs["global_step"] >= cfg.total_timesteps:
            stop = f"step budget of {cfg.total_timesteps} reached"
        elif cfg.target_return is not None and mean100 >= cfg.target_return:
            stop = f"target return {cfg.target_return} reached (mean of last 100 = {mean100:.1f})"
        elif cfg.target_coverage is not None and coverage100 >= cfg.target_coverage:
            stop = f"target coverage {cfg.target_coverage} reached (mean of last 100 = {coverage100:.3f})"
        elif now >= deadline:
            stop = f"duration of {cfg.duration} h reached"
        if stop:
            reason = stop
            break

    if window["episodes"] or window["updates"]:  # the last partial interval, so the CSV ends where the run did
        write_row(cfg, metrics, progress, sampler, window, gs, replay, actors, shared, version, learner.updates,
                  mean100, coverage100, recent_coverage, time.monotonic())
    progress.close()
    gs["recent_returns"], gs["recent_coverage"] = list(recent_returns), list(recent_coverage)
    gs["samples_trained"] = samples_at_start + samples_base
    if exit_code == EXIT_FAILED:
        log.error("training failed: %s; stopping without saving. Last good checkpoint: %s", reason,
                  last_good or "none (no checkpoint was written yet)")
    else:
        log.info("stopping: %s", reason)
        save_training_checkpoint(cfg, learner, replay, gs, run_dir, log, final=reason != "interrupted")
    metrics.close()
    finish_run(cfg, run_dir, gs, learner, replay, actors, sampler, reason, log)
    return exit_code


def write_row(cfg, metrics, progress, sampler, window, gs, replay, actors, shared, version, learner_updates,
              mean100, coverage100, recent_coverage, now) -> None:
    seconds = max(1e-9, now - window["time"])
    episodes = window["episodes"]
    epsilons = [actor_epsilon(cfg, i, gs["global_step"]) for i in range(cfg.n_workers)]
    resources = sampler.sample()
    row = {"wall_time": gs["wall_time"], "global_step": gs["global_step"], "episodes": gs["episodes"],
           "episodic_return": mean_or_nan([e["return"] for e in episodes]),
           "episodic_length": mean_or_nan([e["length"] for e in episodes]),
           "sps": (gs["global_step"] - window["steps"]) / seconds,
           "return_mean100": mean100,
           "coverage": mean_or_nan([e["coverage"] for e in episodes if "coverage" in e]),
           "coverage_mean100": coverage100,
           "loss": mean_or_nan(window["losses"]), "epsilon_max": max(epsilons), "epsilon_min": min(epsilons),
           "buffer_size": len(replay), "buffer_fill": len(replay) / replay.layout.slots,
           "updates": learner_updates, "updates_per_s": window["updates"] / seconds,
           "samples_per_s": window["samples"] / seconds, "episodes_per_s": len(episodes) / seconds,
           "policy_lag": float(version - shared["actor_version"].mean()), "weights_version": version,
           "torn_samples_skipped": window["rejected"], "actor_restarts": actors.restarts,
           "cpu_percent": resources.cpu_percent, "rss_mb": resources.rss_bytes / 2**20,
           "pss_mb": resources.pss_bytes / 2**20}
    metrics.write(row)
    fields = {"ret100": mean100, "buf": len(replay), "loss": row["loss"], "eps/s": round(row["episodes_per_s"], 1),
              "upd/s": round(row["updates_per_s"]), "sps": round(row["sps"]), "lag": round(row["policy_lag"], 1)}
    if recent_coverage:
        fields = {"cov": f"{100 * np.mean(recent_coverage):.1f}%", **fields}
    progress.update(gs["episodes"], fields)


def finish_run(cfg, run_dir: Path, gs: dict, learner: Learner, replay: ReplayBuffer, actors: Actors,
               sampler: ProcessTreeSampler, reason: str, log) -> None:
    rows = read_metrics(run_dir / "metrics.csv")
    last = {key: next((float(r[key]) for r in reversed(rows) if r.get(key)), None)
            for key in ("return_mean100", "coverage_mean100")}
    wall = max(1e-9, gs["wall_time"])
    summary = {"script": SCRIPT, "env_id": cfg.env_id, "seed": cfg.seed, "n_workers": cfg.n_workers,
               "envs_per_worker": cfg.envs_per_worker, "async_training": cfg.async_training,
               "prioritized": cfg.prioritized, "precision": learner.precision, "replay_backend": replay.backend,
               "global_step": gs["global_step"], "episodes": gs["episodes"], "updates": learner.updates,
               "wall_time_s": round(gs["wall_time"], 3), "sps": round(gs["global_step"] / wall, 1),
               "final_mean_return": last["return_mean100"], "final_mean_coverage": last["coverage_mean100"],
               "best_mean_return": gs["best_mean100"] if math.isfinite(gs["best_mean100"]) else None,
               "peak_rss_mb": round(sampler.peak_rss / 2**20, 1), "peak_pss_mb": round(sampler.peak_pss / 2**20, 1),
               "actor_restarts": actors.restarts, "stop_reason": reason}
    write_summary(run_dir, summary)
    plot_results(rows, run_dir / "plots" / "ultra_training_results.png",
                 f"{SCRIPT}: {cfg.env_id}, {cfg.n_workers} actor(s) x {cfg.envs_per_worker} envs, "
                 f"{'async' if cfg.async_training else 'sync'}")
    log.info("summary: %d steps, %d episodes, %d updates in %.1f s (%.0f steps/s), final mean return %s -> %s",
             gs["global_step"], gs["episodes"], learner.updates, gs["wall_time"], summary["sps"],
             last["return_mean100"], run_dir)


def plot_results(rows: list[dict], path: Path, title: str) -> None:
    """ultra_training_results.png: reward, coverage (or episode length), loss and throughput over time."""
    if not rows:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def col(key: str) -> np.ndarray:
        return np.array([float(r[key]) if r.get(key) not in (None, "") else np.nan for r in rows])

    t = col("wall_time")
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    ax = axes[0, 0]
    ax.plot(t, col("episodic_return"), ".", markersize=3, alpha=0.5, label="episodes in interval")
    ax.plot(t, col("return_mean100"), "-", label="mean of last 100")
    ax.set_ylabel("episode return")
    ax.legend(fontsize=8)
    ax = axes[0, 1]
    if np.isfinite(col("coverage")).any():
        ax.plot(t, 100 * col("coverage"), ".", markersize=3, alpha=0.5, label="episodes in interval")
        ax.plot(t, 100 * col("coverage_mean100"), "-", label="mean of last 100")
        ax.set_ylabel("coverage (%)")
        ax.legend(fontsize=8)
    else:
        ax.plot(t, col("episodic_length"), ".", markersize=3)
        ax.set_ylabel("episode length")
    axes[1, 0].plot(t, col("loss"))
    axes[1, 0].set_ylabel("TD loss")
    axes[1, 0].set_yscale("log")
    ax = axes[1, 1]
    ax.plot(t, col("sps"), label="env steps/s")
    ax.plot(t, col("samples_per_s"), label="learner samples/s")
    ax.set_ylabel("throughput")
    ax.legend(fontsize=8)
    for ax in axes.flat:
        ax.set_xlabel("wall time (s)")
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
