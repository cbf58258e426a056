"""Central Double-DQN learner fed by rollout processes, with self-play on ConnectFour-v0.

The main process owns the Q-network, its target network, the replay buffer and the
optimizer. ``--num-workers`` rollout processes play whole episodes with a copy of the
Q-network (epsilon-greedy over legal actions) and send them back a batch of
``--episodes-per-batch`` episodes at a time. Per iteration the learner adds the batches
to the replay buffer, performs ``--learning-steps-per-batch`` Double-DQN updates,
decays epsilon once and sends the new weights (with a version number) to the workers.

On a two-player built-in (``ConnectFour-v0``, the default) the opponent of each game is
drawn from the latest policy, a pool of past snapshots of the learner and a random
player, and evaluation plays the greedy policy against a random and a heuristic player
from both seats. Any single-agent Gymnasium id with a Discrete action space works too.

    python parallel_train_dqn.py                                   # ConnectFour-v0 self-play
    python parallel_train_dqn.py --config configs/parallel_dqn_cartpole.yaml
    python parallel_train_dqn.py --duration 0.25 --resume auto --output-dir runs/c4
"""

from __future__ import annotations

import os

# Idle OpenMP threads must sleep, not spin: spinning threads collapse throughput as soon as
# the cores are shared with workers or anything else (see the README's "Threads").
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import copy
import logging
import math
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
    resolve_resume,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from common.config import (
    ConfigError,
    fail,
    parse_config,
    require,
    require_env_id,
    require_positive,
    save_config,
    to_dict,
)
from common.dqn import double_dqn_loss, linear_schedule, soft_update
from common.manager import ManagerConfig, ParallelManager, WorkerSpec, default_num_workers
from common.networks import QNetwork
from common.parallel import GracefulExit, TooManyRestarts
from common.plots import plot_training_curve
from common.replay import ReplayBuffer, ReplayMemoryError, check_replay_memory
from common.runlog import MetricsWriter, Progress, default_run_dir, open_run_dir, read_metrics, write_summary
from common.system import ProcessTreeSampler, resolve_device, usable_cores

SCRIPT = "parallel_train_dqn"
EXIT_FAILED = 1


@dataclass
class Config:
    env_id: str = "ConnectFour-v0"  # any Gymnasium id with a Discrete action space; two-player built-ins use self-play
    seed: int = 1  # seeds the networks, the replay sampling and every worker's environments
    num_workers: int = field(default_factory=default_num_workers)  # rollout processes (default: cores - 2, >= 1)
    episodes_per_batch: int = 16  # whole episodes each worker plays per batch it sends
    learning_steps_per_batch: int = 0  # gradient updates per iteration; 0 = num_workers * episodes_per_batch
    replay_ratio: float = 0.0  # if > 0: gradient updates per new transition instead of learning_steps_per_batch
    total_episodes: int = 200_000  # stop after this many training episodes (0 = no limit)
    total_timesteps: int = 0  # stop after this many environment steps (0 = no limit)
    duration: float | None = 0.25  # hours of wall time for this invocation (None = no limit)
    target_return: float | None = None  # stop once the mean of the last 100 training returns reaches this
    target_win_rate: list[float] | None = None  # two-player: stop once eval win rates vs random, heuristic reach these
    batch_size: int = 128  # transitions per gradient update
    buffer_size: int = 100_000  # replay capacity in transitions (checked against free RAM)
    learning_starts: int = 1_000  # transitions in the buffer before the first update
    learning_rate: float = 5e-4  # Adam step size
    gamma: float = 0.99  # discount factor
    n_step: int = 1  # n-step returns (rewards of n steps, then the bootstrap value discounted by gamma**n)
    target_update_interval: int = 250  # learner steps between target-network updates
    tau: float = 1.0  # target update rate: 1 = hard copy, < 1 = Polyak averaging at every interval
    max_grad_norm: float = 10.0  # gradient-norm clipping
    hidden_sizes: list[int] = field(default_factory=lambda: [256, 256])  # Q-network MLP widths
    epsilon_start: float = 1.0  # exploration rate of the first batch
    epsilon_end: float = 0.05  # exploration rate after the decay
    epsilon_decay_batches: int = 300  # iterations over which epsilon decays linearly (once per iteration)
    device: str = "cpu"  # learner device: auto, cpu, cuda, cuda:N (workers always act on CPU)
    eval_interval: int = 50  # iterations between parallel greedy evaluations (0 = only at the end)
    eval_episodes: int = 100  # evaluation episodes (per opponent and seat in two-player games)
    snapshot_interval: int = 20  # iterations between snapshots of the learner added to the opponent pool
    pool_size: int = 10  # most snapshots kept in the opponent pool (oldest dropped)
    opponent_latest: float = 0.5  # share of self-play games against the latest policy
    opponent_snapshot: float = 0.3  # share against a past snapshot (uniform over the pool)
    opponent_random: float = 0.2  # share against the random player
    opponent_heuristic: float = 0.0  # share against the heuristic player (0 = pure self-play + random)
    opponent_epsilon: float = 0.05  # exploration of policy opponents, so games do not repeat
    mirror_augment: bool = True  # ConnectFour-v0: also store every move mirrored left-right (the game is symmetric)
    games_per_worker: int = 0  # alias kept for the manager's vocabulary; 0 = episodes_per_batch
    max_game_length: int = 0  # cut episodes after this many steps (0 = the environment's own limit)
    experience_batch_size: int = 8192  # most transitions per queue message (batches are split by episode)
    model_sync_interval: int = 1  # learner steps between weight broadcasts (checked once per iteration)
    worker_reset_interval: int = 0  # iterations between worker resets (fresh envs and seeds); 0 = never
    timeout: float = 30.0  # seconds for any queue operation and for one collect
    compression_enabled: bool = False  # zlib-compress weights sent to workers
    max_worker_restarts: int = 3  # restarts per worker before the run gives up (exit 1)
    experience_queue_size: int = 2  # batches a worker may have waiting (bounded queue)
    output_dir: str | None = None  # run directory (default runs/parallel_train_dqn/<env>__<seed>__<time>)
    resume: str | None = None  # checkpoint path, or auto = newest checkpoint of this run directory
    checkpoint_interval_s: float = 60.0  # seconds between checkpoints (plus one at the end)
    log_interval_s: float = 10.0  # seconds between progress lines when not on a terminal
    tensorboard: bool = True  # also write TensorBoard events to tb/

    def validate(self) -> None:
        require_env_id(self.env_id)
        require(self.num_workers >= 1, "num_workers", self.num_workers, "must be >= 1")
        require_positive(self, "n_step", "episodes_per_batch", "batch_size", "buffer_size", "learning_rate",
                         "target_update_interval", "max_grad_norm", "epsilon_decay_batches", "eval_episodes",
                         "snapshot_interval", "pool_size", "timeout", "duration", "checkpoint_interval_s",
                         "log_interval_s", "experience_batch_size", "model_sync_interval", "experience_queue_size")
        for name in ("learning_steps_per_batch", "total_episodes", "total_timesteps", "learning_starts",
                     "eval_interval", "games_per_worker", "max_game_length", "worker_reset_interval",
                     "max_worker_restarts"):
            require(getattr(self, name) >= 0, name, getattr(self, name), "must be >= 0")
        require(self.replay_ratio >= 0, "replay_ratio", self.replay_ratio, "must be >= 0 (0 = off)")
        for name in ("epsilon_start", "epsilon_end", "opponent_epsilon"):
            require(0 <= getattr(self, name) <= 1, name, getattr(self, name), "must be in [0, 1]")
        require(0 <= self.gamma <= 1, "gamma", self.gamma, "must be in [0, 1]")
        require(0 < self.tau <= 1, "tau", self.tau, "must be in (0, 1]")
        shares = [self.opponent_latest, self.opponent_snapshot, self.opponent_random, self.opponent_heuristic]
        require(min(shares) >= 0 and sum(shares) > 0, "opponent_latest", shares,
                "opponent shares must be >= 0 and not all 0")
        require(all(h > 0 for h in self.hidden_sizes), "hidden_sizes", self.hidden_sizes, "widths must be > 0")
        if self.target_win_rate is not None:
            require(len(self.target_win_rate) == 2 and all(0 <= r <= 1 for r in self.target_win_rate),
                    "target_win_rate", self.target_win_rate, "must be two rates in [0, 1] (vs random, vs heuristic)")
        resolve_device(self.device)

    @property
    def updates_per_batch(self) -> int:
        return self.learning_steps_per_batch or self.num_workers * self.episodes_per_batch

    def manager_config(self) -> ManagerConfig:
        return ManagerConfig(num_workers=self.num_workers, games_per_worker=self.games_per_worker or
                             self.episodes_per_batch, max_game_length=self.max_game_length,
                             experience_batch_size=self.experience_batch_size,
                             model_sync_interval=self.model_sync_interval,
                             worker_reset_interval=self.worker_reset_interval, timeout=self.timeout,
                             compression_enabled=self.compression_enabled, max_restarts=self.max_worker_restarts,
                             experience_queue_size=self.experience_queue_size)


# --------------------------------------------------------------------------- setup

def probe_spaces(cfg: Config) -> tuple[gym.Space, gym.Space, bool, bool]:
    """Build one env to learn its spaces; reject what DQN cannot use before anything is written.

    Returns (observation space, action space, has action masks, is a two-player env).
    """
    try:
        env = gym.make(cfg.env_id)
        _, info = env.reset(seed=cfg.seed)
    except Exception as err:  # missing extras (Box2D, ALE) and broken ids both land here
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        fail(f"--env-id {cfg.env_id}: cannot create it ({reason})")
    obs_space, act_space = env.observation_space, env.action_space
    two_player = hasattr(env.unwrapped, "set_opponent")
    env.close()
    if not isinstance(act_space, gym.spaces.Discrete):
        fail(f"--env-id {cfg.env_id}: action space {act_space} is not Discrete (DQN needs discrete actions)")
    if not isinstance(obs_space, gym.spaces.Box):
        fail(f"--env-id {cfg.env_id}: observation space {obs_space} is not a Box")
    return obs_space, act_space, "action_mask" in info, two_player


def find_resume(cfg: Config) -> tuple[Path | None, dict | None]:
    """Load the checkpoint to resume from before anything is written (a bad file exits 2)."""
    try:
        return resolve_resume(cfg.resume, cfg.output_dir, SCRIPT, cfg.env_id, cfg.seed,
                              required=("model", "target", "optimizer", "counters", "config"),
                              hidden_sizes=cfg.hidden_sizes)
    except CheckpointError as err:
        fail(f"--resume {cfg.resume}: {err}")


class OpponentPool:
    """Past snapshots of the learner for self-play: one every ``snapshot_interval`` iterations,
    at most ``pool_size``, sent to the workers as weight dictionaries."""

    def __init__(self, pool_size: int, snapshots: list[dict] | None = None):
        self.snapshots: deque[dict[str, torch.Tensor]] = deque(snapshots or [], maxlen=pool_size)

    def add(self, model: torch.nn.Module) -> None:
        self.snapshots.append({k: v.detach().cpu().clone() for k, v in model.state_dict().items()})

    def send(self, manager: ParallelManager, cfg: Config) -> None:
        probs = {"latest": cfg.opponent_latest, "snapshot": cfg.opponent_snapshot if self.snapshots else 0.0,
                 "random": cfg.opponent_random, "heuristic": cfg.opponent_heuristic}
        if sum(probs.values()) == 0:  # only snapshots were asked for and there are none yet
            probs["random"] = 1.0
        manager.set_opponents(list(self.snapshots), probs, cfg.opponent_epsilon)


def main(argv: list[str] | None = None) -> int:
    cfg = parse_config(Config, argv, description=__doc__.split("\n\n")[0])
    obs_space, act_space, masked, two_player = probe_spaces(cfg)
    try:
        check_replay_memory(cfg.buffer_size, obs_space.shape, np.float32, act_space.n if masked else None)
    except ReplayMemoryError as err:
        fail(str(ConfigError("buffer_size", cfg.buffer_size, str(err))))
    resume_path, state = find_resume(cfg)
    if resume_path is not None and cfg.output_dir is None:
        cfg.output_dir = str(resume_path.parent.parent)
    run_dir = Path(cfg.output_dir) if cfg.output_dir else default_run_dir(SCRIPT, cfg.env_id, cfg.seed)
    run_dir, lock = open_run_dir(run_dir, logger_name=f"prl.{SCRIPT}")
    save_config(cfg, run_dir / "config.yaml")
    log = logging.getLogger(f"prl.{SCRIPT}")
    torch.manual_seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.set_num_threads(max(1, usable_cores() - cfg.num_workers))
    device = torch.device(resolve_device(cfg.device))

    q_net = QNetwork(obs_space, act_space, tuple(cfg.hidden_sizes)).to(device)
    target_net = copy.deepcopy(q_net)
    optimizer = torch.optim.Adam(q_net.parameters(), lr=cfg.learning_rate)
    counters = {"iteration": 0, "global_step": 0, "episodes": 0, "learner_steps": 0, "wall_time": 0.0,
                "model_version": 0, "best_mean100": -math.inf, "solved_at_s": None, "recent_returns": []}
    pool = OpponentPool(cfg.pool_size)
    if state is not None:
        q_net.load_state_dict(state["model"])
        target_net.load_state_dict(state["target"])
        optimizer.load_state_dict(state["optimizer"])
        counters.update(state["counters"])
        pool = OpponentPool(cfg.pool_size, state.get("snapshots", []))
        set_rng_state(state["rng"])
        log.info("resumed from %s at iteration %d, step %d", resume_path, counters["iteration"],
                 counters["global_step"])
    buffer = ReplayBuffer(cfg.buffer_size, obs_space.shape, np.float32, act_space.n if masked else None, cfg.seed)

    spec = WorkerSpec(cfg.env_id, cfg.seed + 1000 * counters["iteration"], tuple(cfg.hidden_sizes),
                      log_dir=str(run_dir / "logs"))
    manager = ParallelManager(spec, cfg.manager_config(), None, epsilon_at(cfg, counters["iteration"]))
    manager.synchronizer.version = counters["model_version"]
    manager.sync_model_to_workers(cpu_state(q_net), learner_step=counters["learner_steps"])
    if two_player:
        pool.send(manager, cfg)
    graceful = GracefulExit(log).install()
    log.info("%s: %s, %d rollout worker(s) x %d episodes per batch, %d updates per batch, buffer %d, run dir %s",
             SCRIPT, cfg.env_id, cfg.num_workers, cfg.episodes_per_batch, cfg.updates_per_batch, cfg.buffer_size,
             run_dir)
    exit_code, reason = 0, "finished"
    try:
        manager.start_workers()
        exit_code, reason = train(cfg, manager, q_net, target_net, optimizer, buffer, pool, counters, two_player,
                                  run_dir, graceful, log, device)
    except TooManyRestarts as err:
        log.error("training failed: %s", err)
        exit_code, reason = EXIT_FAILED, f"failed: {err}"
    except TimeoutError as err:
        log.error("training failed: %s", err)
        exit_code, reason = EXIT_FAILED, f"failed: {err}"
    finally:
        manager.stop_workers()
        save_training_checkpoint(cfg, q_net, target_net, optimizer, pool, counters, run_dir, log)
        finish_run(cfg, run_dir, counters, manager, reason, log)
        lock.release()
    if graceful.requested and exit_code == 0:
        exit_code = graceful.exit_code
    log.info("exit status %d", exit_code)
    return exit_code


def epsilon_at(cfg: Config, iteration: int) -> float:
    return linear_schedule(cfg.epsilon_start, cfg.epsilon_end, cfg.epsilon_decay_batches, iteration)


def cpu_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


# --------------------------------------------------------------------------- training

def train(cfg: Config, manager: ParallelManager, q_net, target_net, optimizer, buffer: ReplayBuffer,
          pool: OpponentPool, counters: dict, two_player: bool, run_dir: Path, graceful, log, device):
    """The learning loop; returns (exit status, reason)."""
    eval_columns = eval_names(two_player)
    metrics = MetricsWriter(run_dir, ["return_mean100", "epsilon", "loss", "q_mean", "learner_steps",
                                      "updates_per_s", "episodes_per_s", "model_version", "staleness",
                                      "buffer_size", "train_win_rate", *eval_columns, "cpu_percent", "rss_mb"],
                            tensorboard=cfg.tensorboard)
    progress = Progress(cfg.total_episodes or None, "episodes", log, cfg.log_interval_s, counters["episodes"])
    sampler = ProcessTreeSampler()
    recent = deque(counters["recent_returns"], maxlen=100)
    started = time.monotonic()
    wall_offset = counters["wall_time"]
    last_checkpoint = time.monotonic()
    latest_eval: dict[str, float] = {}  # the newest evaluation, for the win-rate stop
    reason = "finished"
    try:
        while True:
            stop = stop_reason(cfg, counters, recent, latest_eval, started)
            if stop is not None:
                reason = stop
                break
            if graceful.requested:
                reason = "interrupted"
                break
            iteration_start = time.perf_counter()
            batches = manager.collect_experiences(timeout=cfg.timeout)
            if not batches:
                log.warning("no experience from any worker within %.0fs; status: %s", cfg.timeout,
                            manager.get_status()["workers"])
                continue
            batch_stats = add_to_buffer(buffer, batches, counters, recent, manager.model_version, cfg.gamma,
                                        cfg.n_step, mirror=cfg.mirror_augment and cfg.env_id == "ConnectFour-v0")
            learn_start = time.perf_counter()
            updates = round(cfg.replay_ratio * batch_stats["steps"]) if cfg.replay_ratio > 0 else cfg.updates_per_batch
            losses, q_means = learn(cfg, q_net, target_net, optimizer, buffer, counters, device, updates)
            learn_seconds = time.perf_counter() - learn_start
            counters["iteration"] += 1
            epsilon = epsilon_at(cfg, counters["iteration"])
            if manager.synchronizer.should_sync(counters["learner_steps"]):
                manager.sync_model_to_workers(cpu_state(q_net), epsilon, counters["learner_steps"])
            else:
                manager.sync_model_to_workers(None, epsilon)
            counters["model_version"] = manager.model_version
            if two_player and counters["iteration"] % cfg.snapshot_interval == 0:
                pool.add(q_net)
                pool.send(manager, cfg)
            if cfg.worker_reset_interval and counters["iteration"] % cfg.worker_reset_interval == 0:
                manager.reset_workers()
            eval_row = {}
            if cfg.eval_interval and counters["iteration"] % cfg.eval_interval == 0:
                eval_row = latest_eval = evaluate(cfg, manager, two_player, log)
            mean100 = float(np.mean(recent)) if recent else math.nan
            if recent and len(recent) == recent.maxlen and mean100 > counters["best_mean100"]:
                counters["best_mean100"] = mean100
            wall = wall_offset + time.monotonic() - started
            if cfg.target_return is not None and counters["solved_at_s"] is None and len(recent) == recent.maxlen \
                    and mean100 >= cfg.target_return:
                counters["solved_at_s"] = wall
            iteration_seconds = time.perf_counter() - iteration_start
            resources = sampler.sample()
            row = {"wall_time": wall, "global_step": counters["global_step"], "episodes": counters["episodes"],
                   "episodic_return": batch_stats["return"], "episodic_length": batch_stats["length"],
                   "sps": batch_stats["steps"] / max(iteration_seconds, 1e-9), "return_mean100": mean100,
                   "epsilon": epsilon, "loss": float(np.mean(losses)) if losses else math.nan,
                   "q_mean": float(np.mean(q_means)) if q_means else math.nan,
                   "learner_steps": counters["learner_steps"],
                   "updates_per_s": len(losses) / learn_seconds if losses and learn_seconds > 0 else math.nan,
                   "episodes_per_s": batch_stats["episodes"] / max(iteration_seconds, 1e-9),
                   "model_version": counters["model_version"], "staleness": batch_stats["staleness"],
                   "buffer_size": len(buffer), "train_win_rate": batch_stats["win_rate"],
                   "cpu_percent": resources.cpu_percent, "rss_mb": resources.rss_bytes / 2**20, **eval_row}
            metrics.write(row)
            progress.update(counters["episodes"], {"step": counters["global_step"], "ret100": mean100,
                                                   "eps": epsilon, "ver": counters["model_version"],
                                                   "buf": len(buffer)})
            counters["wall_time"] = wall
            counters["recent_returns"] = list(recent)
            if time.monotonic() - last_checkpoint >= cfg.checkpoint_interval_s:
                save_training_checkpoint(cfg, q_net, target_net, optimizer, pool, counters, run_dir, log)
                last_checkpoint = time.monotonic()
        if reason != "interrupted" and not graceful.requested:
            counters["final_eval"] = evaluate(cfg, manager, two_player, log)
    finally:
        progress.close()
        metrics.close()
        counters["wall_time"] = wall_offset + time.monotonic() - started
        counters["recent_returns"] = list(recent)
        counters["peak_rss_mb"] = sampler.peak_rss / 2**20
    if graceful.requested:
        return graceful.exit_code, "interrupted"
    return 0, reason


def stop_reason(cfg: Config, counters: dict, recent: deque, last_eval: dict, started: float) -> str | None:
    if cfg.total_episodes and counters["episodes"] >= cfg.total_episodes:
        return f"total_episodes {cfg.total_episodes} reached"
    if cfg.total_timesteps and counters["global_step"] >= cfg.total_timesteps:
        return f"total_timesteps {cfg.total_timesteps} reached"
    if cfg.duration is not None and time.monotonic() - started >= cfg.duration * 3600:
        return f"duration {cfg.duration} h reached"
    if cfg.target_return is not None and len(recent) == recent.maxlen and np.mean(recent) >= cfg.target_return:
        return f"target return {cfg.target_return} reached (mean of the last 100 episodes)"
    if cfg.target_win_rate is not None and "eval_win_random" in last_eval:
        random_rate, heuristic_rate = cfg.target_win_rate
        if last_eval["eval_win_random"] >= random_rate and last_eval["eval_win_heuristic"] >= heuristic_rate:
            return f"target win rates {cfg.target_win_rate} reached"
    return None


def add_to_buffer(buffer: ReplayBuffer, batches, counters: dict, recent: deque, version: int, gamma: float,
                  n_step: int, mirror: bool = False) -> dict[str, float]:
    """Add every episode of the batches to the replay buffer in one go; returns batch statistics.

    With ``mirror`` (board games whose last observation axis is the action's column) each
    episode is stored a second time reflected left-right: same outcome, twice the data.
    """
    returns, lengths, results, staleness, steps = [], [], [], [], 0
    for batch in batches:
        steps += batch.steps
        staleness.append(version - batch.model_version)
        for episode in batch.episodes:
            buffer.add_episode(episode["obs"], episode["actions"], episode["rewards"], episode["terminated"],
                               episode.get("masks"), gamma, n_step)
            if mirror:
                masks = episode.get("masks")
                buffer.add_episode(episode["obs"][..., ::-1], episode["obs"].shape[-1] - 1 - episode["actions"],
                                   episode["rewards"], episode["terminated"],
                                   masks[:, ::-1] if masks is not None else None, gamma, n_step)
            returns.append(episode["return"])
            lengths.append(episode["length"])
            if "result" in episode:
                results.append(episode["result"])
    recent.extend(returns)
    counters["episodes"] += len(returns)
    counters["global_step"] += int(sum(lengths))
    return {"return": float(np.mean(returns)) if returns else math.nan,
            "length": float(np.mean(lengths)) if lengths else math.nan,
            "episodes": len(returns), "steps": int(sum(lengths)),
            "staleness": float(np.mean(staleness)) if staleness else math.nan,
            "win_rate": float(np.mean(np.array(results) == 1.0)) if results else math.nan}


def learn(cfg: Config, q_net, target_net, optimizer, buffer: ReplayBuffer, counters: dict, device, updates: int):
    """``updates`` Double-DQN updates (Huber loss, masked next actions, clipped gradients)."""
    losses, q_means = [], []
    if updates <= 0 or len(buffer) < max(cfg.learning_starts, cfg.batch_size):
        return losses, q_means
    for _ in range(updates):
        sample = buffer.sample(cfg.batch_size)
        obs = torch.as_tensor(sample.obs, device=device)
        next_obs = torch.as_tensor(sample.next_obs, device=device)
        next_mask = torch.as_tensor(sample.next_masks, device=device) if sample.next_masks is not None else None
        loss, td_abs = double_dqn_loss(q_net, target_net, obs, torch.as_tensor(sample.actions, device=device),
                                       torch.as_tensor(sample.rewards, device=device), next_obs,
                                       torch.as_tensor(sample.dones, device=device),
                                       torch.as_tensor(sample.discounts, device=device), next_mask)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(q_net.parameters(), cfg.max_grad_norm)
        optimizer.step()
        counters["learner_steps"] += 1
        if counters["learner_steps"] % cfg.target_update_interval == 0:
            soft_update(target_net, q_net, cfg.tau)
        losses.append(loss.item())
    with torch.no_grad():
        q_means.append(float(q_net(obs).max(dim=1).values.mean()))
    return losses, q_means


def eval_names(two_player: bool) -> list[str]:
    if not two_player:
        return ["eval_return"]
    return ["eval_win_random", "eval_win_heuristic", "eval_win_random_first", "eval_win_random_second",
            "eval_win_heuristic_first", "eval_win_heuristic_second", "eval_draw_heuristic", "eval_loss_heuristic"]


def evaluate(cfg: Config, manager: ParallelManager, two_player: bool, log) -> dict[str, float]:
    """Greedy episodes played by the workers in parallel; win/draw/loss rates for two-player games."""
    if not two_player:
        episodes = manager.evaluate(cfg.eval_episodes)
        result = {"eval_return": float(np.mean([e["return"] for e in episodes]))}
        log.info("eval: mean return %.2f over %d greedy episodes", result["eval_return"], len(episodes))
        return result
    out: dict[str, float] = {}
    for opponent in ("random", "heuristic"):
        outcomes = []
        for seat, first in (("first", True), ("second", False)):
            games = np.array([e["result"] for e in manager.evaluate(cfg.eval_episodes, opponent, first)])
            out[f"eval_win_{opponent}_{seat}"] = float(np.mean(games == 1.0))
            outcomes.append(games)
        games = np.concatenate(outcomes)
        out[f"eval_win_{opponent}"] = float(np.mean(games == 1.0))
        out[f"eval_draw_{opponent}"] = float(np.mean(games == 0.0))
        out[f"eval_loss_{opponent}"] = float(np.mean(games == -1.0))
    log.info("eval: win rate vs random %.1f%% (first %.1f%%, second %.1f%%), vs heuristic %.1f%% "
             "(first %.1f%%, second %.1f%%, draws %.1f%%)", 100 * out["eval_win_random"],
             100 * out["eval_win_random_first"], 100 * out["eval_win_random_second"],
             100 * out["eval_win_heuristic"], 100 * out["eval_win_heuristic_first"],
             100 * out["eval_win_heuristic_second"], 100 * out["eval_draw_heuristic"])
    return out


# --------------------------------------------------------------------------- outputs

def save_training_checkpoint(cfg: Config, q_net, target_net, optimizer, pool: OpponentPool, counters: dict,
                             run_dir: Path, log, name: str = "latest.pt") -> None:
    state = {"model": q_net.state_dict(), "target": target_net.state_dict(), "optimizer": optimizer.state_dict(),
             "counters": {k: v for k, v in counters.items() if k != "final_eval"}, "config": to_dict(cfg),
             "snapshots": list(pool.snapshots), "rng": rng_state()}
    path = save_checkpoint(state, run_dir / "checkpoints" / name)
    log.info("checkpoint saved: %s (iteration %d, step %d)", path, counters["iteration"], counters["global_step"])


def finish_run(cfg: Config, run_dir: Path, counters: dict, manager: ParallelManager, reason: str, log) -> None:
    rows = read_metrics(run_dir / "metrics.csv") if (run_dir / "metrics.csv").exists() else []
    plot = plot_training_curve(rows, run_dir / "plots" / "training.png", f"{SCRIPT}: {cfg.env_id}")
    recent = counters.get("recent_returns", [])
    wall = counters["wall_time"]
    status = manager.get_status()
    summary = {
        "script": SCRIPT, "env_id": cfg.env_id, "seed": cfg.seed, "reason": reason,
        "iterations": counters["iteration"], "global_step": counters["global_step"],
        "episodes": counters["episodes"], "learner_steps": counters["learner_steps"],
        "wall_time_s": wall, "sps": counters["global_step"] / wall if wall > 0 else None,
        "episodes_per_s": counters["episodes"] / wall if wall > 0 else None,
        "updates_per_s_overall": counters["learner_steps"] / wall if wall > 0 else None,
        "return_mean100": float(np.mean(recent)) if recent else None,
        "best_mean100": counters["best_mean100"] if math.isfinite(counters["best_mean100"]) else None,
        "solved_at_s": counters["solved_at_s"], "final_eval": counters.get("final_eval"),
        "model_version": counters["model_version"], "worker_restarts": status["total_restarts"],
        "num_workers": cfg.num_workers, "peak_rss_mb": counters.get("peak_rss_mb"),
        "plot": str(plot) if plot else None,
    }
    write_summary(run_dir, summary)
    log.info("summary: %s", {k: summary[k] for k in ("reason", "episodes", "global_step", "return_mean100",
                                                       "solved_at_s", "final_eval")})


if __name__ == "__main__":
    sys.exit(main())
