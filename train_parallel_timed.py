"""Synchronous parallel PPO on a wall-clock budget.

``--num-workers`` rollout processes each step ``--num-envs-per-worker`` environments with
the current policy for ``--n-steps`` steps, writing the rollout straight into shared
memory. The main process then computes GAE, runs the PPO update and publishes the new
parameters through shared memory, and the next rollout starts. ``--num-workers 0`` runs
the very same rollout code in the main process: the sequential baseline.

Started by ``torchrun``, every rank does the above with its own workers and the
gradients are averaged across ranks before every optimizer step (DD-PPO).

    python train_parallel_timed.py                       # LunarLander-v3 until solved
    python train_parallel_timed.py --env-id CartPole-v1 --config configs/cartpole_fast.yaml
    python train_parallel_timed.py --duration 1.0 --num-workers 4 --resume auto
"""

from __future__ import annotations

import os

# Idle OpenMP threads must sleep, not spin: spinning threads collapse throughput (we measured
# 100x slower inference) as soon as the cores are shared with workers or anything else.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import copy
import math
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import gymnasium as gym
import numpy as np
import torch

from common import distributed
from common.checkpoint import CheckpointError, resolve_resume, rng_state, save_checkpoint, set_rng_state
from common.config import fail, parse_config, require, require_env_id, require_positive, save_config, to_dict
from common.envs import make_vec_env
from common.networks import ActorCritic, flat_size, read_flat_params, write_flat_params
from common.parallel import (
    GracefulExit,
    ParentWatch,
    TooManyRestarts,
    WorkerDied,
    WorkerPool,
    init_worker_process,
    receive,
)
from common.plots import plot_training_curve
from common.ppo import PPOSettings, compute_gae, ppo_update
from common.runlog import MetricsWriter, Progress, default_run_dir, open_run_dir, read_metrics, write_summary
from common.shm import SharedArrays, attach_all, reclaim_stale_segments
from common.system import ProcessTreeSampler, resolve_device, threads_per_process

SCRIPT = "train_parallel_timed"
EXIT_FAILED = 1


@dataclass
class Config:
    env_id: str = "LunarLander-v3"  # any Gymnasium id with a Discrete or Box action space
    seed: int = 1  # environment i of the run is seeded seed + i
    num_workers: int = 2  # rollout processes; 0 runs the same loop in the main process (sequential baseline)
    num_envs_per_worker: int = 8  # environments each worker steps (the main process, with 0 workers)
    n_steps: int = 256  # steps per environment per rollout
    total_timesteps: int = 5_000_000  # stop after this many env steps (all workers together)
    total_episodes: int | None = None  # also stop after this many finished episodes
    duration: float | None = 0.17  # hours of wall time for this invocation; stops after the update in flight
    target_return: float | None = 200.0  # stop once the mean of the last 100 episode returns reaches this
    learning_rate: float = 5e-4  # Adam step size (annealed linearly to 0 over total_timesteps when anneal_lr)
    anneal_lr: bool = True  # linearly decay the learning rate
    gamma: float = 0.999  # discount factor
    gae_lambda: float = 0.98  # GAE lambda
    batch_size: int = 256  # minibatch size; must divide the rollout (n_steps * envs in total)
    n_epochs: int = 4  # passes over each rollout
    clip_coef: float = 0.2  # PPO surrogate (and value) clipping range
    clip_vloss: bool = False  # clip the value loss as in the PPO paper's code (slows learning of large returns)
    ent_coef: float = 0.01  # entropy bonus
    vf_coef: float = 0.5  # value loss weight
    max_grad_norm: float = 0.5  # gradient-norm clipping
    norm_adv: bool = True  # normalize advantages per minibatch
    target_kl: float | None = None  # stop the epochs of an update early past this approximate KL
    hidden_sizes: list[int] = field(default_factory=lambda: [64, 64])  # actor and critic MLP widths
    torch_threads: int = 1  # learner's torch threads (0 = every core); 64-wide MLPs update fastest on one
    device: str = "cpu"  # learner device: auto, cpu, cuda, cuda:N (small MLPs are fastest on CPU)
    output_dir: str | None = None  # run directory (default runs/train_parallel_timed/<env>__<seed>__<time>)
    resume: str | None = None  # checkpoint path, or auto = newest checkpoint of this run directory
    checkpoint_interval_s: float = 60.0  # seconds between checkpoints (plus one at the end)
    log_interval_s: float = 10.0  # seconds between progress lines when not on a terminal
    tensorboard: bool = True  # also write TensorBoard events to tb/
    max_worker_restarts: int = 3  # restarts per worker before the run gives up (exit 1)
    worker_timeout_s: float = 120.0  # a rollout taking longer than this counts as a hung worker

    def validate(self) -> None:
        require_env_id(self.env_id)
        require(self.num_workers >= 0, "num_workers", self.num_workers, "must be >= 0 (0 = sequential)")
        require_positive(self, "num_envs_per_worker", "n_steps", "total_timesteps", "total_episodes", "duration",
                         "learning_rate", "batch_size", "n_epochs", "checkpoint_interval_s", "log_interval_s",
                         "worker_timeout_s")
        rollout = self.n_steps * self.total_envs
        require(rollout % self.batch_size == 0, "batch_size", self.batch_size,
                f"must divide the rollout of n_steps * envs = {self.n_steps} * {self.total_envs} = {rollout}")
        require(0 <= self.gamma <= 1, "gamma", self.gamma, "must be in [0, 1]")
        require(0 <= self.gae_lambda <= 1, "gae_lambda", self.gae_lambda, "must be in [0, 1]")
        require(self.torch_threads >= 0, "torch_threads", self.torch_threads, "must be >= 0 (0 = all cores)")
        require(self.max_worker_restarts >= 0, "max_worker_restarts", self.max_worker_restarts, "must be >= 0")
        require(all(h > 0 for h in self.hidden_sizes), "hidden_sizes", self.hidden_sizes, "widths must be > 0")
        resolve_device(self.device)

    @property
    def total_envs(self) -> int:
        return max(1, self.num_workers) * self.num_envs_per_worker


# --------------------------------------------------------------------------- rollout
# The same function fills the rollout in a worker process and, with 0 workers, in the
# main process, so the sequential baseline measures exactly the same code.

ROLLOUT_KEYS = ("obs", "actions", "logprobs", "values", "rewards", "terminations", "truncations", "final_values")


def rollout_arrays(arrays, num_steps: int, obs_shape, action_shape, action_dtype, total_envs: int, num_params: int):
    """Allocate the shared rollout: ``[n_steps, envs, ...]``, each worker owning a column slice."""
    t, n = num_steps, total_envs
    arrays.create("obs", (t, n, *obs_shape), np.float32)
    arrays.create("actions", (t, n, *action_shape), action_dtype)
    for key in ("logprobs", "values", "rewards", "final_values"):
        arrays.create(key, (t, n), np.float32)
    arrays.create("terminations", (t, n), np.float32)
    arrays.create("truncations", (t, n), np.float32)
    arrays.create("next_values", (n,), np.float32)
    arrays.create("params", (num_params,), np.float32)


@torch.inference_mode()
def collect_rollout(agent: ActorCritic, envs, buf: dict[str, np.ndarray], cols: slice, n_steps: int,
                    next_obs: np.ndarray, action_low=None, action_high=None):
    """Step ``envs`` for ``n_steps`` with ``agent``, writing into columns ``cols`` of ``buf``.

    Returns the observation to continue from and the episodes that finished.
    """
    episodes = []
    for step in range(n_steps):
        obs_tensor = torch.from_numpy(next_obs)
        action, logprob, value = agent.act(obs_tensor)
        action_np = action.numpy()
        buf["obs"][step, cols] = next_obs
        buf["actions"][step, cols] = action_np
        buf["logprobs"][step, cols] = logprob.numpy()
        buf["values"][step, cols] = value.numpy()
        env_action = action_np if action_low is None else np.clip(action_np, action_low, action_high)
        result = envs.step(env_action)
        buf["rewards"][step, cols] = result.rewards
        buf["terminations"][step, cols] = result.terminations
        buf["truncations"][step, cols] = result.truncations
        if result.truncations.any():
            # A time limit is not the end of the task: bootstrap from the final observation.
            final_values = agent.get_value(torch.from_numpy(result.final_obs.astype(np.float32))).numpy()
            buf["final_values"][step, cols] = np.where(result.truncations, final_values, 0.0)
        next_obs = result.obs.astype(np.float32, copy=False)
        episodes.extend(result.episodes)
    buf["next_values"][cols] = agent.get_value(torch.from_numpy(next_obs)).numpy()
    return next_obs, episodes


def make_agent(cfg: Config, envs) -> ActorCritic:
    return ActorCritic(envs.single_observation_space, envs.single_action_space, tuple(cfg.hidden_sizes))


def action_bounds(space: gym.Space):
    if isinstance(space, gym.spaces.Box):
        return space.low, space.high
    return None, None


def rollout_worker(index: int, conn, cfg_dict: dict, specs: dict, first_env: int, seed: int, threads: int) -> None:
    """Worker process: owns ``num_envs_per_worker`` environments and a copy of the policy."""
    init_worker_process(threads)
    cfg = Config(**cfg_dict)
    watch = ParentWatch()
    buf, handles = attach_all(specs)
    envs = make_vec_env(cfg.env_id, cfg.num_envs_per_worker, seed, first_index=first_env)
    try:
        agent = make_agent(cfg, envs)
        low, high = action_bounds(envs.single_action_space)
        cols = slice(first_env, first_env + cfg.num_envs_per_worker)
        next_obs = envs.reset().astype(np.float32)
        conn.send(("ready", os.getpid()))
        while True:
            command, payload = receive(conn, watch)
            if command == "collect":
                read_flat_params(agent, buf["params"])
                started = time.perf_counter()
                next_obs, episodes = collect_rollout(agent, envs, buf, cols, cfg.n_steps, next_obs, low, high)
                conn.send(("collected", {"episodes": episodes,
                                         "seconds": time.perf_counter() - started}))
            elif command == "close":
                break
            else:
                raise ValueError(f"worker {index}: unknown command {command!r}")
    finally:
        envs.close()
        buf.clear()
        for handle in handles:
            handle.close()


class InProcessCollector:
    """Sequential baseline: the rollout runs in this process.

    It acts with the learner's own network on the CPU, or with a CPU copy refreshed from
    the published parameters when the learner lives on a GPU (rollouts step one small
    batch at a time, where a GPU only adds transfer latency).
    """

    def __init__(self, cfg: Config, agent: ActorCritic, buf, seed: int):
        self.cfg, self.buf = cfg, buf
        self.learner_on_cpu = next(agent.parameters()).device.type == "cpu"
        self.agent = agent if self.learner_on_cpu else copy.deepcopy(agent).cpu()
        self.envs = make_vec_env(cfg.env_id, cfg.num_envs_per_worker, seed)
        self.low, self.high = action_bounds(self.envs.single_action_space)
        self.next_obs = self.envs.reset().astype(np.float32)
        self.restarts = 0

    def collect(self) -> tuple[list[dict], int]:
        if not self.learner_on_cpu:
            read_flat_params(self.agent, self.buf["params"])
        cols = slice(0, self.cfg.num_envs_per_worker)
        self.next_obs, episodes = collect_rollout(self.agent, self.envs, self.buf, cols, self.cfg.n_steps,
                                                  self.next_obs, self.low, self.high)
        return episodes, self.cfg.n_steps * self.cfg.num_envs_per_worker

    def close(self) -> None:
        self.envs.close()


class WorkerCollector:
    """``num_workers`` processes, each filling its own columns of the shared rollout.

    A worker that dies is reported (traceback or signal) and restarted with the current
    parameters, and its share of the rollout is collected again.
    """

    def __init__(self, cfg: Config, arrays: SharedArrays, seed: int, logger):
        self.cfg, self.log = cfg, logger
        # A rollout step runs the policy on a handful of observations, where extra torch threads
        # only add wake-up latency (measured: one LunarLander worker collected 12.0k steps/s with
        # two threads, 14.3k in the main process with one), so each worker uses one.
        threads = 1
        specs, cfg_dict = arrays.specs(), to_dict(cfg)

        def args_for(index: int) -> tuple:
            restarts = self.pool.workers[index].restarts + 1 if index in self.pool.workers else 0
            # A restarted worker gets fresh seeds so it does not replay the episodes it died in.
            worker_seed = seed + 1_000_003 * restarts
            return cfg_dict, specs, index * cfg.num_envs_per_worker, worker_seed, threads

        self.pool = WorkerPool(rollout_worker, cfg.num_workers, args_for, cfg.max_worker_restarts, name="worker")
        self.pool.start()
        self._await_ready(list(range(cfg.num_workers)))
        logger.info("started %d workers (pids %s), %d torch thread(s) each", cfg.num_workers,
                    self.pool.pids(), threads)

    @property
    def restarts(self) -> int:
        return self.pool.total_restarts

    def _await_ready(self, indices: list[int]) -> None:
        while True:
            try:
                self.pool.gather(indices, "ready", timeout=self.cfg.worker_timeout_s)
                return
            except WorkerDied as err:
                self._handle_death(err)

    def _handle_death(self, err: WorkerDied) -> None:
        self.log.error("worker %d died: %s", err.index, err.reason)
        self.pool.restart(err.index)  # raises TooManyRestarts past the limit
        self._await_ready([err.index])

    def collect(self) -> tuple[list[dict], int]:
        pending = list(range(self.cfg.num_workers))
        for index in pending:
            self._send_collect(index)
        episodes, steps = [], 0
        while pending:
            try:
                replies = self.pool.gather(pending, "collected", timeout=self.cfg.worker_timeout_s)
            except WorkerDied as err:
                self._handle_death(err)
                self._send_collect(err.index)  # redo its share with the current parameters
                continue
            except TimeoutError as err:
                raise WorkerDied(-1, str(err)) from None
            for index, reply in replies.items():
                episodes.extend(reply["episodes"])
                steps += self.cfg.n_steps * self.cfg.num_envs_per_worker
                pending.remove(index)
        return episodes, steps

    def _send_collect(self, index: int) -> None:
        """Ask one worker for its share of the rollout; a worker found dead is replaced first."""
        while True:
            try:
                self.pool.send(index, "collect")
                return
            except WorkerDied as err:  # it died between two rollouts
                self._handle_death(err)

    def close(self) -> None:
        self.pool.stop()


# --------------------------------------------------------------------------- setup

def find_resume(cfg: Config) -> tuple[Path | None, dict | None]:
    """Load the checkpoint to resume from before anything is written (a bad file exits 2)."""
    try:
        return resolve_resume(cfg.resume, cfg.output_dir, SCRIPT, cfg.env_id, cfg.seed,
                              required=("model", "optimizer", "global_step", "config"))
    except CheckpointError as err:
        fail(f"--resume {cfg.resume}: {err}")


def probe_spaces(cfg: Config):
    """Build one env to learn the spaces; reject unsupported action spaces before writing anything."""
    try:
        env = gym.make(cfg.env_id)
    except Exception as err:  # missing extras (Box2D, ALE) and broken ids both land here
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        fail(f"--env-id {cfg.env_id}: cannot create it ({reason})")
    obs_space, act_space = env.observation_space, env.action_space
    env.close()
    if not isinstance(act_space, (gym.spaces.Discrete, gym.spaces.Box)):
        fail(f"--env-id {cfg.env_id}: action space {act_space} is not Discrete or Box")
    if not isinstance(obs_space, gym.spaces.Box):
        fail(f"--env-id {cfg.env_id}: observation space {obs_space} is not a Box")
    return obs_space, act_space


def main(argv: list[str] | None = None) -> int:
    cfg = parse_config(Config, argv, description=__doc__.split("\n\n")[0])
    dist = distributed.from_environment(cfg.device)
    seed = cfg.seed + dist.rank * cfg.total_envs  # ranks never share an environment seed
    obs_space, act_space = probe_spaces(cfg)
    resume_path, state = find_resume(cfg) if dist.is_main else (None, None)
    resume_path, state = dist.broadcast_object((resume_path, state))  # every rank continues rank 0's checkpoint
    if resume_path is not None and cfg.output_dir is None:
        cfg.output_dir = str(resume_path.parent.parent)
    run_dir = Path(cfg.output_dir) if cfg.output_dir else default_run_dir(SCRIPT, cfg.env_id, cfg.seed)
    run_dir = dist.agree_on_path(run_dir)

    reclaim_stale_segments()
    lock = None
    if dist.is_main:
        run_dir, lock = open_run_dir(run_dir, logger_name=f"prl.{SCRIPT}")
        save_config(cfg, run_dir / "config.yaml")
    log = distributed.rank_logger(SCRIPT, dist, run_dir)
    torch.manual_seed(cfg.seed)
    np.random.seed(cfg.seed)
    # Workers sit idle while the learner updates, so the update may use every core.
    torch.set_num_threads(cfg.torch_threads or threads_per_process(1))
    device = torch.device(resolve_device(cfg.device))

    agent = ActorCritic(obs_space, act_space, tuple(cfg.hidden_sizes)).to(device)
    # fused: one kernel for all parameters (measured ~10% less CPU per PPO update on CartPole)
    optimizer = torch.optim.Adam(agent.parameters(), lr=cfg.learning_rate, eps=1e-5, fused=True)
    progress_state = {"global_step": 0, "update": 0, "episodes": 0, "wall_time": 0.0,
                      "recent_returns": [], "best_mean100": -math.inf}
    if state is not None:
        agent.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        progress_state.update({k: state[k] for k in progress_state if k in state})
        set_rng_state(state["rng"])
        log.info("resumed from %s at step %d (update %d)", resume_path, progress_state["global_step"],
                 progress_state["update"])
    dist.broadcast_model(agent)

    arrays = SharedArrays()
    collector = None
    graceful = GracefulExit(log).install()
    exit_code = 0
    try:
        action_shape = act_space.shape if isinstance(act_space, gym.spaces.Box) else ()
        action_dtype = np.float32 if isinstance(act_space, gym.spaces.Box) else np.int64
        rollout_arrays(arrays, cfg.n_steps, obs_space.shape, action_shape, action_dtype, cfg.total_envs,
                       flat_size(agent))
        buf = {key: arrays[key] for key in arrays.specs()}
        if cfg.num_workers == 0:
            collector = InProcessCollector(cfg, agent, buf, seed)
        else:
            collector = WorkerCollector(cfg, arrays, seed, log)
        log.info("%s: %s, %d worker(s) x %d envs, rollout %d steps, world size %d, run dir %s",
                 SCRIPT, cfg.env_id, cfg.num_workers, cfg.num_envs_per_worker, cfg.n_steps * cfg.total_envs,
                 dist.world_size, run_dir)
        exit_code = train(cfg, dist, agent, optimizer, collector, buf, progress_state, run_dir, graceful, log, device)
    except (WorkerDied, TooManyRestarts) as err:
        log.error("training failed: %s", err)
        save_training_checkpoint(cfg, dist, agent, optimizer, progress_state, run_dir, log)
        exit_code = EXIT_FAILED
    except distributed.PeerFailure as err:
        log.error("training failed: %s", err)
        exit_code = EXIT_FAILED
    except Exception:
        log.exception("training failed")
        exit_code = EXIT_FAILED
    finally:
        if collector is not None:
            collector.close()
        arrays.unlink_all()
        if lock is not None:
            lock.release()
        dist.close(abort=exit_code == EXIT_FAILED)
    if graceful.requested and exit_code == 0:
        exit_code = graceful.exit_code
    log.info("exit status %d", exit_code)
    return exit_code


# --------------------------------------------------------------------------- training

def save_training_checkpoint(cfg, dist, agent, optimizer, progress_state, run_dir: Path, log,
                             name: str = "latest.pt") -> None:
    if not dist.is_main:
        return
    state = {"model": agent.state_dict(), "optimizer": optimizer.state_dict(), "config": to_dict(cfg),
             "rng": rng_state(), **progress_state,
             "recent_returns": list(progress_state["recent_returns"])}
    path = save_checkpoint(state, run_dir / "checkpoints" / name)
    log.info("checkpoint saved: %s (step %d)", path, progress_state["global_step"])


def train(cfg: Config, dist, agent, optimizer, collector, buf, progress_state, run_dir: Path, graceful,
          log, device) -> int:
    settings = PPOSettings(cfg.n_epochs, cfg.batch_size, cfg.clip_coef, cfg.clip_vloss, cfg.ent_coef, cfg.vf_coef,
                           cfg.max_grad_norm, cfg.norm_adv, cfg.target_kl)
    recent = deque(progress_state["recent_returns"], maxlen=100)
    metrics = MetricsWriter(run_dir, ["return_mean100", "collect_sps", "learning_rate", "policy_loss", "value_loss",
                                      "entropy", "approx_kl", "clipfrac", "explained_variance", "cpu_percent",
                                      "rss_mb", "pss_mb", "worker_restarts", "world_size", "update_ms",
                                      "allreduce_ms", "allreduce_kib", "params_hash"],
                            tensorboard=cfg.tensorboard) if dist.is_main else None
    sampler = ProcessTreeSampler()
    progress = Progress(cfg.total_timesteps, "steps", log, cfg.log_interval_s,
                        initial=progress_state["global_step"]) if dist.is_main else None
    start = time.monotonic()
    wall_offset = progress_state["wall_time"]
    deadline = start + cfg.duration * 3600 if cfg.duration else math.inf
    last_checkpoint = start
    last_sample, resources = 0.0, None
    reason = "step budget reached"
    generator = torch.Generator().manual_seed(cfg.seed + progress_state["update"])
    grad_hook = dist.gradient_hook(agent)
    gs = progress_state

    while gs["global_step"] < cfg.total_timesteps:
        if cfg.anneal_lr:
            frac = max(0.0, 1.0 - gs["global_step"] / cfg.total_timesteps)
            optimizer.param_groups[0]["lr"] = frac * cfg.learning_rate
        write_flat_params(agent, buf["params"])
        collect_start = time.perf_counter()
        episodes, steps = collector.collect()
        collect_seconds = time.perf_counter() - collect_start
        if dist.any_rank(graceful.requested):
            reason = "interrupted"
            break  # the rollout in flight is finished; skip its update and save

        batch = make_batch(cfg, buf, device)
        update_start = time.perf_counter()
        stats = ppo_update(agent, optimizer, batch, settings, generator, grad_hook)
        update_seconds = time.perf_counter() - update_start
        allreduce_seconds, allreduce_bytes = dist.allreduce_seconds, dist.allreduce_bytes
        dist.allreduce_seconds, dist.allreduce_bytes = 0.0, 0
        params_hash = distributed.params_digest(agent) if dist.world_size > 1 else ""
        total_steps, all_episodes, rank_hashes = dist.gather_progress(steps, episodes, params_hash)
        if len(set(rank_hashes)) > 1:
            log.error("ranks hold different parameters after update %d", gs["update"] + 1)
            return EXIT_FAILED
        gs["global_step"] += total_steps
        gs["update"] += 1
        gs["episodes"] += len(all_episodes)
        recent.extend(e["return"] for e in all_episodes)
        mean100 = float(np.mean(recent)) if len(recent) == 100 else math.nan
        if not math.isnan(mean100):
            gs["best_mean100"] = max(gs["best_mean100"], mean100)
        now = time.monotonic()
        gs["wall_time"] = wall_offset + now - start
        gs["recent_returns"] = list(recent)
        if now - last_sample >= 1.0 or resources is None:
            resources, last_sample = sampler.sample(), now
        if dist.is_main:
            row = {"wall_time": gs["wall_time"], "global_step": gs["global_step"], "episodes": gs["episodes"],
                   "episodic_return": float(np.mean([e["return"] for e in all_episodes])) if all_episodes else math.nan,
                   "episodic_length": float(np.mean([e["length"] for e in all_episodes])) if all_episodes else math.nan,
                   "sps": gs["global_step"] / max(1e-9, gs["wall_time"]),
                   "return_mean100": mean100, "collect_sps": total_steps / max(1e-9, collect_seconds),
                   "learning_rate": optimizer.param_groups[0]["lr"], **stats,
                   "cpu_percent": resources.cpu_percent, "rss_mb": resources.rss_bytes / 2**20,
                   "pss_mb": resources.pss_bytes / 2**20, "worker_restarts": collector.restarts,
                   "world_size": dist.world_size, "update_ms": 1000 * update_seconds,
                   "allreduce_ms": 1000 * allreduce_seconds, "allreduce_kib": allreduce_bytes / 1024,
                   "params_hash": ":".join(rank_hashes)}
            metrics.write(row)
            progress.update(gs["global_step"], {"return100": mean100, "sps": round(row["sps"]),
                                                "restarts": collector.restarts})
        if not math.isfinite(stats["policy_loss"]) or not math.isfinite(stats["value_loss"]):
            log.error("loss became %s at update %d; stopping with the last good checkpoint",
                      stats["policy_loss"], gs["update"])
            return EXIT_FAILED
        stop = None
        if cfg.target_return is not None and mean100 >= cfg.target_return:
            stop = f"target return {cfg.target_return} reached (mean of last 100 = {mean100:.1f})"
        elif now >= deadline:
            stop = f"duration of {cfg.duration} h reached"
        elif cfg.total_episodes is not None and gs["episodes"] >= cfg.total_episodes:
            stop = f"episode budget of {cfg.total_episodes} reached"
        stop = dist.agree_on_stop(stop)
        if stop:
            reason = stop
            break
        if now - last_checkpoint >= cfg.checkpoint_interval_s:
            save_training_checkpoint(cfg, dist, agent, optimizer, gs, run_dir, log)
            last_checkpoint = now

    if progress is not None:
        progress.close()
    log.info("stopping after update %d: %s", gs["update"], reason)
    save_training_checkpoint(cfg, dist, agent, optimizer, gs, run_dir, log)
    if dist.is_main:
        metrics.close()
        finish_run(cfg, run_dir, gs, sampler, reason, log, collector.restarts, dist.world_size)
    return 0


def make_batch(cfg: Config, buf: dict[str, np.ndarray], device) -> dict[str, torch.Tensor]:
    """GAE over the shared rollout, then flatten ``[T, N]`` into one batch of samples."""
    advantages, returns = compute_gae(buf["rewards"], buf["values"], buf["terminations"], buf["truncations"],
                                      buf["final_values"], buf["next_values"], cfg.gamma, cfg.gae_lambda)
    samples = cfg.n_steps * cfg.total_envs

    def flat(array: np.ndarray) -> torch.Tensor:
        return torch.as_tensor(array.reshape(samples, *array.shape[2:])).to(device)

    return {"obs": flat(buf["obs"]), "actions": flat(buf["actions"]), "logprobs": flat(buf["logprobs"]),
            "values": flat(buf["values"]), "advantages": flat(advantages), "returns": flat(returns)}


def finish_run(cfg: Config, run_dir: Path, gs: dict, sampler: ProcessTreeSampler, reason: str, log,
               restarts: int, world_size: int) -> None:
    rows = read_metrics(run_dir / "metrics.csv")
    last_mean = next((float(r["return_mean100"]) for r in reversed(rows) if r.get("return_mean100")), None)
    summary = {"script": SCRIPT, "env_id": cfg.env_id, "seed": cfg.seed, "num_workers": cfg.num_workers,
               "num_envs_per_worker": cfg.num_envs_per_worker, "world_size": world_size,
               "global_step": gs["global_step"], "updates": gs["update"], "episodes": gs["episodes"],
               "wall_time_s": round(gs["wall_time"], 3),
               "sps": round(gs["global_step"] / max(1e-9, gs["wall_time"]), 1),
               "final_mean_return": last_mean,
               "best_mean_return": gs["best_mean100"] if math.isfinite(gs["best_mean100"]) else None,
               "peak_rss_mb": round(sampler.peak_rss / 2**20, 1), "peak_pss_mb": round(sampler.peak_pss / 2**20, 1),
               "worker_restarts": restarts, "stop_reason": reason}
    write_summary(run_dir, summary)
    plot_training_curve(rows, run_dir / "plots" / "training_curve.png",
                        f"{SCRIPT}: {cfg.env_id}, {cfg.num_workers} worker(s) x {cfg.num_envs_per_worker} envs")
    log.info("summary: %d steps in %.1f s (%.0f steps/s), final mean return %s, best %s -> %s",
             summary["global_step"], summary["wall_time_s"], summary["sps"], last_mean,
             summary["best_mean_return"], run_dir)


if __name__ == "__main__":
    sys.exit(main())
