"""A population of independent PPO agents, one per process, over one shared market-data cache.

The coordinator loads the ``Market-v0`` price/volume cache once (building it on the first
run), copies it into shared memory and spawns ``num_workers`` processes. Each worker
attaches its environments to that memory (no copy), trains its own PPO agent on its own
device with its own hyperparameters (a list, or ranges sampled per worker), reports
progress every ``progress_every`` steps and checkpoints every ``checkpoint_every`` steps.
At the end every final agent is evaluated on the same held-out windows of the history,
``leaderboard.csv`` ranks them next to a random policy, and the best is copied to ``best.pt``.
Optionally (``--pbt-interval``), population-based training replaces the weakest agents by
perturbed copies of the strongest.

    python train_ppo_multiprocess.py                                   # 4 workers on the synthetic market
    python train_ppo_multiprocess.py --num-workers 8 --learning-rate 1e-4 1e-3 --sample-ranges learning_rate
    python train_ppo_multiprocess.py --data-source prices.csv --top-n-items 50 --duration 2
    python train_ppo_multiprocess.py --output-dir runs/pop --resume auto   # continue every worker
"""

from __future__ import annotations

import os

# Idle OpenMP threads must sleep, not spin: spinning threads collapse throughput as soon as
# the cores are shared with workers or anything else (see the README's "Threads").
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import logging
import math
import signal
import sys
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import torch

from common.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    load_checkpoint,
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
from common.envs import make_vec_env
from common.envs.market import (
    CACHE_ARRAYS,
    DEFAULT_CACHE_DIR,
    MarketData,
    MarketDataError,
    MarketParams,
    MarketVectorEnv,
    attach_market_data,
    load_market_data,
    share_market_data,
)
from common.networks import ActorCritic
from common.parallel import GracefulExit, TooManyRestarts, WorkerPool, describe_exit, init_worker_process
from common.ppo import PPOSettings, compute_gae, ppo_update
from common.runlog import MetricsWriter, default_run_dir, open_run_dir, read_metrics, setup_logging, write_summary
from common.shm import reclaim_stale_segments
from common.system import assign_devices, format_bytes, shm_space, threads_per_process

SCRIPT = "train_ppo_multiprocess"
EXIT_FAILED = 1
PER_WORKER = ("learning_rate", "gamma", "gae_lambda", "clip_coef", "ent_coef")  # may differ between workers


@dataclass
class EnvKwargs:
    env_id: str = "Market-v0"  # Market-v0, or any Gymnasium id with a Discrete action space (no cache then)
    data_source: str = "synthetic"  # synthetic, or the path of a CSV file timestamp,item,price,volume
    cache_dir: str = DEFAULT_CACHE_DIR  # where the market cache (.npy) is built once and loaded afterwards
    num_items: int = 200  # items in the synthetic market
    history_steps: int = 20_000  # timesteps in the synthetic market's history
    data_seed: int = 0  # seed of the synthetic market
    top_n_items: int = 10  # trade the N items with the largest traded volume
    window: int = 16  # past timesteps of price and volume in each observation
    episode_length: int = 256  # steps per episode (a random window of the history)
    initial_cash: float = 10_000.0  # cash at the start of each episode
    fee: float = 0.001  # fee per trade as a fraction of its value
    lot_fraction: float = 0.1  # one lot of an item is worth this fraction of the initial cash
    max_lots: int = 5  # most lots of one item that may be held
    holdout_fraction: float = 0.2  # last part of the history, used only for evaluation

    def validate(self) -> None:
        require_env_id(self.env_id)
        require_positive(self, "num_items", "history_steps", "top_n_items", "window", "episode_length",
                         "initial_cash", "lot_fraction", "max_lots")
        require(0 <= self.fee < 1, "fee", self.fee, "must be in [0, 1)")
        require(0 < self.holdout_fraction < 1, "holdout_fraction", self.holdout_fraction, "must be in (0, 1)")
        if self.data_source == "synthetic":
            require(self.top_n_items <= self.num_items, "top_n_items", self.top_n_items,
                    f"must be <= num_items ({self.num_items} items in the synthetic market)")
        else:
            require(Path(self.data_source).is_file(), "data_source", self.data_source,
                    "must be synthetic or an existing CSV file")

    @property
    def is_market(self) -> bool:
        return self.env_id == "Market-v0"

    def market_params(self, split: str) -> dict[str, Any]:
        names = [f for f in MarketParams.__dataclass_fields__ if f != "split"]
        return {**{name: getattr(self, name) for name in names}, "split": split}


@dataclass
class PPOKwargs:
    rollout_steps: int = 2048  # env steps per rollout of one worker (all its envs together)
    num_minibatches: int = 8  # minibatches per epoch; must divide rollout_steps
    update_epochs: int = 4  # passes over each rollout
    learning_rate: list[float] = field(default_factory=lambda: [3e-4])  # one value, one per worker, or a range
    gamma: list[float] = field(default_factory=lambda: [0.99])  # discount; one value, one per worker, or a range
    gae_lambda: list[float] = field(default_factory=lambda: [0.95])  # GAE lambda; same forms
    clip_coef: list[float] = field(default_factory=lambda: [0.2])  # PPO clipping range; same forms
    ent_coef: list[float] = field(default_factory=lambda: [0.01])  # entropy bonus; same forms
    sample_ranges: list[str] = field(default_factory=list)  # fields above whose 2 values are a [low, high] range
    anneal_lr: bool = True  # decay each worker's learning rate linearly to 0 over max_steps_per_worker
    vf_coef: float = 0.5  # value loss weight
    max_grad_norm: float = 0.5  # gradient-norm clipping
    norm_adv: bool = True  # normalize advantages per minibatch
    clip_vloss: bool = True  # clip the value loss as in the PPO paper's code
    target_kl: float | None = None  # stop an update's epochs early past this approximate KL
    hidden_sizes: list[int] = field(default_factory=lambda: [64, 64])  # actor and critic MLP widths

    def validate(self) -> None:
        require_positive(self, "rollout_steps", "num_minibatches", "update_epochs", "max_grad_norm")
        require(self.rollout_steps % self.num_minibatches == 0, "num_minibatches", self.num_minibatches,
                f"must divide rollout_steps ({self.rollout_steps})")
        for name in self.sample_ranges:
            require(name in PER_WORKER, "sample_ranges", name, f"must name fields among {', '.join(PER_WORKER)}")
        for name in PER_WORKER:
            values = getattr(self, name)
            require(len(values) > 0 and all(math.isfinite(v) and v >= 0 for v in values), name, values,
                    "values must be finite and >= 0")
        for name in ("gamma", "gae_lambda"):
            require(all(v <= 1 for v in getattr(self, name)), name, getattr(self, name), "must be in [0, 1]")
        require(all(h > 0 for h in self.hidden_sizes), "hidden_sizes", self.hidden_sizes, "widths must be > 0")


@dataclass
class TrainKwargs:
    seed: int = 1  # worker i seeds torch with seed + i and its envs with seed + i * num_envs_per_worker + j
    num_workers: int = 4  # independent agents, one process each
    num_envs_per_worker: int = 8  # environments each worker steps at once (numpy-vectorized)
    max_steps_per_worker: int = 1_000_000  # env steps each worker trains for
    checkpoint_every: int = 50_000  # steps between a worker's checkpoints worker_<i>_step_<S>.pt
    duration: float | None = None  # hours of wall time; then every worker saves, is evaluated, and the run ends
    output_dir: str | None = None  # run directory (default runs/train_ppo_multiprocess/<env>__<seed>__<time>)
    resume: str | None = None  # auto | run directory | checkpoint .pt (every worker starts from its weights)
    device: str = "auto"  # auto, cpu, cuda, cuda:N
    gpu_strategy: str = "round-robin"  # round-robin: workers spread over GPUs; single: all on one GPU
    num_gpus: int | None = None  # GPUs to spread workers over (default: all visible ones)
    threads_per_worker: int = 0  # torch threads per worker (0 = usable cores / num_workers)
    max_restarts: int = 3  # restarts per worker after a crash before it is given up
    progress_every: int = 1000  # steps between a worker's progress reports
    summary_every_s: float = 60.0  # seconds between summaries of all workers in the log
    stop_timeout_s: float = 30.0  # after Ctrl+C or the duration, how long workers get to save before termination
    tensorboard: bool = True  # also write TensorBoard events (tb/worker_<i>, tb/population)
    pbt_interval: int = 0  # population-based training every this many steps (0 = off)
    pbt_fraction: float = 0.25  # PBT: the weakest fraction copies one of the strongest fraction
    pbt_perturb: float = 0.2  # PBT: copied hyperparameters are multiplied by 1 -/+ this
    inject_crash_worker: int | None = None  # testing aid: this worker raises once at inject_crash_step
    inject_crash_step: int = 0  # testing aid: step at which inject_crash_worker raises (first life only)

    def validate(self) -> None:
        require_positive(self, "num_workers", "num_envs_per_worker", "max_steps_per_worker", "checkpoint_every",
                         "duration", "progress_every", "summary_every_s", "stop_timeout_s")
        require(self.threads_per_worker >= 0, "threads_per_worker", self.threads_per_worker, "must be >= 0")
        require(self.max_restarts >= 0, "max_restarts", self.max_restarts, "must be >= 0")
        require(self.pbt_interval >= 0, "pbt_interval", self.pbt_interval, "must be >= 0 (0 = off)")
        require(0 < self.pbt_fraction <= 0.5, "pbt_fraction", self.pbt_fraction, "must be in (0, 0.5]")
        require(0 <= self.pbt_perturb < 1, "pbt_perturb", self.pbt_perturb, "must be in [0, 1)")
        require(self.gpu_strategy in ("round-robin", "single"), "gpu_strategy", self.gpu_strategy,
                "must be round-robin or single")


@dataclass
class EvalKwargs:
    eval_episodes: int = 32  # held-out windows every final agent is evaluated on
    eval_num_envs: int = 8  # evaluation environments stepped at once
    eval_seed: int = 10_000  # picks the held-out windows (the same for every agent)
    eval_deterministic: bool = True  # act greedily (argmax) during evaluation
    eval_random_baseline: bool = True  # also evaluate a uniformly random policy for the leaderboard

    def validate(self) -> None:
        require_positive(self, "eval_episodes", "eval_num_envs")

    @staticmethod
    def validate_together(cfg: dict[str, Any]) -> None:
        ppo, train = cfg["PPO_KWARGS"], cfg["TRAIN_KWARGS"]
        require(ppo.rollout_steps % train.num_envs_per_worker == 0, "rollout_steps", ppo.rollout_steps,
                f"must be a multiple of num_envs_per_worker ({train.num_envs_per_worker})")
        for name in PER_WORKER:
            values = getattr(ppo, name)
            if name in ppo.sample_ranges:
                require(len(values) == 2 and values[0] <= values[1], name, values,
                        "is in sample_ranges, so it needs two values low high")
            else:
                require(len(values) in (1, train.num_workers), name, values,
                        f"needs 1 value or one per worker ({train.num_workers})")
        if train.inject_crash_worker is not None:
            require(0 <= train.inject_crash_worker < train.num_workers, "inject_crash_worker",
                    train.inject_crash_worker, f"must be a worker index below {train.num_workers}")


CONFIG_GROUPS = {"ENV_KWARGS": EnvKwargs, "PPO_KWARGS": PPOKwargs, "TRAIN_KWARGS": TrainKwargs,
                 "EVAL_KWARGS": EvalKwargs}


def worker_hyperparams(ppo: PPOKwargs, num_workers: int, seed: int) -> list[dict[str, float]]:
    """Each worker's own values of PER_WORKER: shared, listed per worker, or sampled from a range.

    Ranges are sampled log-uniformly when both ends are > 0 (learning rates span decades),
    uniformly otherwise, from a generator seeded with ``seed``: the same run, the same population.
    """
    rng = np.random.default_rng(seed)
    population: list[dict[str, float]] = [{} for _ in range(num_workers)]
    for name in PER_WORKER:
        values = getattr(ppo, name)
        for index, hyper in enumerate(population):
            if name in ppo.sample_ranges:
                low, high = values
                hyper[name] = float(math.exp(rng.uniform(math.log(low), math.log(high))) if low > 0
                                    else rng.uniform(low, high))
            else:
                hyper[name] = float(values[0] if len(values) == 1 else values[index])
    return population


# ------------------------------------------------------------------------------ worker side
# Everything below down to "coordinator side" runs inside a worker process.

@dataclass
class WorkerSetup:
    """What a worker needs, small and picklable: configs, shared-memory specs, its device and seeds."""

    index: int
    run_dir: str
    config: dict[str, dict]
    data_specs: dict | None
    item_indices: list[int] | None
    device: str
    threads: int
    hyper: dict[str, float]
    resume_path: str | None  # continue from this checkpoint of this worker
    init_path: str | None  # or start from these weights (--resume FILE.pt)
    life: int  # 0 on first start, +1 on each restart


def env_kwargs(env_cfg: EnvKwargs, data, item_indices, split: str) -> dict[str, Any]:
    if not env_cfg.is_market:
        return {}
    return {"data": data, "item_indices": item_indices, **env_cfg.market_params(split)}


def make_agent(envs, ppo: PPOKwargs, device: str) -> ActorCritic:
    return ActorCritic(envs.single_observation_space, envs.single_action_space, tuple(ppo.hidden_sizes)).to(device)


def load_agent(path: str | Path, device: str = "cpu") -> tuple[ActorCritic, dict[str, Any]]:
    """A fresh agent with a checkpoint's weights (to act, or to continue training); also returns the checkpoint."""
    state = load_checkpoint(path, map_location=device, required=("model", "observation_shape", "num_actions"))
    obs_space = gym.spaces.Box(-np.inf, np.inf, shape=tuple(state["observation_shape"]), dtype=np.float32)
    agent = ActorCritic(obs_space, gym.spaces.Discrete(int(state["num_actions"])), tuple(state["hidden_sizes"]))
    agent.load_state_dict(state["model"])
    return agent.to(device).eval(), state


class StopFlag:
    """Set by a ``stop`` command or by SIGTERM: finish the current rollout, save and leave."""

    def __init__(self):
        self.reason: str | None = None
        signal.signal(signal.SIGTERM, lambda *_: self.set("sigterm"))

    def set(self, reason: str) -> None:
        self.reason = self.reason or reason


def watch_parent() -> None:
    """Exit at once if the coordinator dies (even ``kill -9``): nobody would read or stop us."""
    parent = os.getppid()

    def loop() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=loop, name="parent-watch", daemon=True).start()


def worker_process(index: int, conn, setup: WorkerSetup) -> None:
    """Entry point of worker ``index`` (run by common.parallel.worker_main, which reports a crash)."""
    init_worker_process(setup.threads)
    watch_parent()
    stop = StopFlag()
    log = setup_logging(Path(setup.run_dir) / "logs" / f"worker_{index}.log", f"prl.worker{index}")
    data, handles = (attach_market_data(setup.data_specs) if setup.data_specs else (None, []))
    try:
        Worker(index, conn, setup, data, stop, log).train()
    except Exception:
        log.exception("worker %d failed", index)
        raise
    finally:
        for handle in handles:
            handle.close()
    # Everything is saved and reported; skip the interpreter's teardown of torch, which takes
    # seconds on a busy machine and would hold up the coordinator's exit.
    logging.shutdown()
    conn.close()
    os._exit(0)


class Worker:
    """One independent PPO agent: rollouts, updates, checkpoints, progress reports, evaluation."""

    def __init__(self, index: int, conn, setup: WorkerSetup, data, stop: StopFlag, log: logging.Logger):
        self.index, self.conn, self.setup, self.stop, self.log = index, conn, setup, stop, log
        self.env_cfg = EnvKwargs(**setup.config["ENV_KWARGS"])
        self.ppo = PPOKwargs(**setup.config["PPO_KWARGS"])
        self.train_cfg = TrainKwargs(**setup.config["TRAIN_KWARGS"])
        self.eval_cfg = EvalKwargs(**setup.config["EVAL_KWARGS"])
        self.data, self.items = data, setup.item_indices
        self.run_dir = Path(setup.run_dir)
        self.device = torch.device(setup.device)
        self.hyper = dict(setup.hyper)
        self.state = {"global_step": 0, "episodes": 0, "updates": 0, "wall_time": 0.0, "pbt_exploits": 0,
                      "recent_returns": []}
        seed = self.train_cfg.seed + index
        torch.manual_seed(seed)
        np.random.seed(seed)
        n = self.train_cfg.num_envs_per_worker
        self.envs = make_vec_env(self.env_cfg.env_id, n, self.train_cfg.seed, first_index=index * n,
                                 **env_kwargs(self.env_cfg, data, self.items, "train"))
        if not isinstance(self.envs.single_action_space, gym.spaces.Discrete):
            raise ValueError(f"{self.env_cfg.env_id}: this script needs a Discrete action space")
        self.agent = make_agent(self.envs, self.ppo, setup.device)
        self.optimizer = torch.optim.Adam(self.agent.parameters(), lr=self.hyper["learning_rate"], eps=1e-5)
        self._restore()
        self.recent = deque(self.state["recent_returns"], maxlen=50)

    # -- checkpoints
    def _restore(self) -> None:
        if self.setup.resume_path:
            state = load_checkpoint(self.setup.resume_path, map_location=self.device,
                                    required=("model", "optimizer", "global_step", "hyper"))
            self.agent.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.hyper = dict(state["hyper"])  # PBT may have changed them
            self.state.update({k: state[k] for k in self.state if k in state})
            set_rng_state(state["rng"])
            self.log.info("worker %d resumed from %s at step %d", self.index, self.setup.resume_path,
                          self.state["global_step"])
        elif self.setup.init_path:
            self.agent.load_state_dict(load_checkpoint(self.setup.init_path, map_location=self.device)["model"])
            self.log.info("worker %d starts from the weights of %s", self.index, self.setup.init_path)

    def save(self, name: str) -> Path:
        state = {"model": self.agent.state_dict(), "optimizer": self.optimizer.state_dict(), "rng": rng_state(),
                 "worker": self.index, "hyper": dict(self.hyper), **self.state,
                 "recent_returns": [float(r) for r in self.recent],
                 "observation_shape": list(self.envs.single_observation_space.shape),
                 "num_actions": int(self.envs.single_action_space.n), "hidden_sizes": list(self.ppo.hidden_sizes),
                 "env_id": self.env_cfg.env_id, "item_indices": self.items, "config": self.setup.config}
        path = save_checkpoint(state, self.run_dir / "checkpoints" / name)
        self.log.info("checkpoint %s (step %d)", path.name, self.state["global_step"])
        return path

    # -- messages to and from the coordinator
    def send(self, command: str, payload: Any) -> None:
        self.conn.send((command, payload))

    def poll_commands(self) -> None:
        while self.conn.poll(0):
            command, payload = self.conn.recv()
            if command in ("stop", "close"):
                self.stop.set(payload or command)
            else:
                raise ValueError(f"worker {self.index}: unknown command {command!r}")

    def progress(self, started: float, steps_done: int) -> dict[str, Any]:
        return {"step": self.state["global_step"], "episodes": self.state["episodes"],
                "recent_return": float(np.mean(self.recent)) if self.recent else math.nan,
                "sps": steps_done / max(1e-9, time.monotonic() - started), "pid": os.getpid()}

    # -- training
    def train(self) -> None:
        cfg, ppo, st = self.train_cfg, self.ppo, self.state
        n = cfg.num_envs_per_worker
        num_steps = ppo.rollout_steps // n
        obs_shape = self.envs.single_observation_space.shape
        obs = np.zeros((num_steps, n, *obs_shape), dtype=np.float32)
        actions = np.zeros((num_steps, n), dtype=np.int64)
        logprobs, values, rewards, final_values = (np.zeros((num_steps, n), dtype=np.float32) for _ in range(4))
        terminations, truncations = (np.zeros((num_steps, n), dtype=bool) for _ in range(2))
        metrics = MetricsWriter(self.run_dir, ["worker", "learning_rate", "policy_loss", "value_loss", "entropy",
                                               "approx_kl", "clipfrac", "explained_variance", "net_worth", "trades",
                                               "cpu_sps"],
                                tensorboard=cfg.tensorboard, filename=f"metrics_worker_{self.index}.csv",
                                tb_subdir=f"tb/worker_{self.index}")
        self.log.info("worker %d: pid %d, device %s, %d envs, hyperparameters %s", self.index, os.getpid(),
                      self.device, n, self.hyper)
        self.send("started", {"pid": os.getpid(), "step": st["global_step"], "hyper": self.hyper})
        started, steps_at_start = time.monotonic(), st["global_step"]
        self.cpu_start = time.process_time()
        wall_offset = st["wall_time"]
        next_report = (st["global_step"] // cfg.progress_every + 1) * cfg.progress_every
        generator = torch.Generator().manual_seed(cfg.seed + self.index * 7919 + st["updates"])
        # The envs' state is not in a checkpoint; a resumed worker re-seeds them by its step
        # so that it does not replay the windows it started with.
        self.envs.seed += st["global_step"]
        next_obs = self.envs.reset().astype(np.float32)
        finished_eps: list[dict] = []
        try:
            while st["global_step"] < cfg.max_steps_per_worker and self.stop.reason is None:
                if ppo.anneal_lr:
                    frac = max(0.0, 1.0 - st["global_step"] / cfg.max_steps_per_worker)
                    self.optimizer.param_groups[0]["lr"] = frac * self.hyper["learning_rate"]
                finished_eps.clear()
                for step in range(num_steps):
                    with torch.no_grad():
                        obs_t = torch.from_numpy(next_obs).to(self.device)
                        action, logprob, _, value = self.agent.get_action_and_value(obs_t)
                    obs[step] = next_obs
                    actions[step] = action.cpu().numpy()
                    logprobs[step], values[step] = logprob.cpu().numpy(), value.cpu().numpy()
                    result = self.envs.step(actions[step])
                    rewards[step], terminations[step], truncations[step] = (result.rewards, result.terminations,
                                                                             result.truncations)
                    final_values[step] = 0.0
                    if result.truncations.any():  # a time limit: bootstrap from the final observation
                        with torch.no_grad():
                            fv = self.agent.get_value(torch.from_numpy(result.final_obs).float().to(self.device))
                        final_values[step] = np.where(result.truncations, fv.cpu().numpy(), 0.0)
                    next_obs = result.obs.astype(np.float32, copy=False)
                    st["global_step"] += n
                    for episode in result.episodes:
                        st["episodes"] += 1
                        self.recent.append(episode["return"])
                        finished_eps.append(episode)
                    if st["global_step"] >= next_report:
                        next_report += cfg.progress_every
                        self.send("progress", self.progress(started, st["global_step"] - steps_at_start))
                    if (self.index == cfg.inject_crash_worker and self.setup.life == 0
                            and st["global_step"] >= cfg.inject_crash_step):
                        raise RuntimeError(f"injected crash of worker {self.index} at step {st['global_step']} "
                                           "(--inject-crash-worker)")
                stats = self.update(obs, actions, logprobs, values, rewards, terminations, truncations,
                                    final_values, next_obs, generator)
                st["updates"] += 1
                st["wall_time"] = wall_offset + time.monotonic() - started
                metrics.write(self.metrics_row(stats, finished_eps, started, steps_at_start))
                if st["global_step"] % cfg.checkpoint_every < n * num_steps:
                    self.save(f"worker_{self.index}_step_{st['global_step']}.pt")
                if (cfg.pbt_interval and st["global_step"] % cfg.pbt_interval < n * num_steps
                        and st["global_step"] < cfg.max_steps_per_worker):
                    self.pbt_step()
                self.poll_commands()
        finally:
            metrics.close()
        self.finish(started, steps_at_start)

    def update(self, obs, actions, logprobs, values, rewards, terminations, truncations, final_values,
               next_obs, generator) -> dict[str, float]:
        with torch.no_grad():
            next_values = self.agent.get_value(torch.from_numpy(next_obs).to(self.device)).cpu().numpy()
        advantages, returns = compute_gae(rewards, values, terminations, truncations, final_values, next_values,
                                          self.hyper["gamma"], self.hyper["gae_lambda"])
        flat = lambda a: torch.as_tensor(a.reshape(-1, *a.shape[2:])).to(self.device)  # noqa: E731
        batch = {"obs": flat(obs), "actions": flat(actions), "logprobs": flat(logprobs), "values": flat(values),
                 "advantages": flat(advantages), "returns": flat(returns)}
        settings = PPOSettings(self.ppo.update_epochs, self.ppo.rollout_steps // self.ppo.num_minibatches,
                               self.hyper["clip_coef"], self.ppo.clip_vloss, self.hyper["ent_coef"], self.ppo.vf_coef,
                               self.ppo.max_grad_norm, self.ppo.norm_adv, self.ppo.target_kl)
        stats = ppo_update(self.agent, self.optimizer, batch, settings, generator)
        if not (math.isfinite(stats["policy_loss"]) and math.isfinite(stats["value_loss"])):
            raise FloatingPointError(f"loss became non-finite at update {self.state['updates']}: {stats}")
        return stats

    def metrics_row(self, stats, episodes, started, steps_at_start) -> dict[str, Any]:
        def mean(key):
            return float(np.mean([e[key] for e in episodes])) if episodes and key in episodes[0] else math.nan

        st = self.state
        return {"wall_time": st["wall_time"], "global_step": st["global_step"], "episodes": st["episodes"],
                "episodic_return": mean("return"), "episodic_length": mean("length"),
                "sps": (st["global_step"] - steps_at_start) / max(1e-9, time.monotonic() - started),
                # per CPU-second of this process: what the rate would be with a core to itself
                "cpu_sps": (st["global_step"] - steps_at_start) / max(1e-9, time.process_time() - self.cpu_start),
                "worker": self.index, "learning_rate": self.optimizer.param_groups[0]["lr"], **stats,
                "net_worth": mean("net_worth"), "trades": mean("trades")}

    def pbt_step(self) -> None:
        """Report the score and a fresh checkpoint; the coordinator may answer: copy a stronger worker."""
        path = self.save(f"worker_{self.index}_step_{self.state['global_step']}.pt")
        score = float(np.mean(self.recent)) if self.recent else -math.inf
        self.send("pbt_ready", {"step": self.state["global_step"], "score": score, "path": str(path),
                                "hyper": dict(self.hyper)})
        deadline = time.monotonic() + 60.0
        while time.monotonic() < deadline:
            if not self.conn.poll(0.5):
                continue
            command, payload = self.conn.recv()
            if command in ("stop", "close"):
                self.stop.set(payload or command)
                return
            if command != "pbt":
                raise ValueError(f"worker {self.index}: unknown command {command!r} during PBT")
            if payload:
                donor = load_checkpoint(payload["path"], map_location=self.device, required=("model", "optimizer"))
                self.agent.load_state_dict(donor["model"])
                self.optimizer.load_state_dict(donor["optimizer"])
                self.hyper = dict(payload["hyper"])
                self.state["pbt_exploits"] += 1
                self.recent.clear()
                self.log.info("PBT: copied worker %d (score %.3f vs ours %.3f); hyperparameters now %s",
                              payload["donor"], payload["donor_score"], score, self.hyper)
            return
        self.log.warning("PBT: no answer from the coordinator within 60 s; continuing unchanged")

    def finish(self, started: float, steps_at_start: int) -> None:
        done = self.state["global_step"] >= self.train_cfg.max_steps_per_worker or self.stop.reason == "duration"
        result = {**self.progress(started, self.state["global_step"] - steps_at_start), "hyper": self.hyper,
                  "pbt_exploits": self.state["pbt_exploits"], "stop_reason": self.stop.reason, "finished": done}
        if done:
            result["checkpoint"] = str(self.save(f"worker_{self.index}_final.pt"))
            result["eval"] = self.evaluate()
            self.log.info("worker %d evaluation: %s", self.index, result["eval"])
        else:  # interrupted: save where we are; --resume auto continues from here
            result["checkpoint"] = str(self.save(f"worker_{self.index}_step_{self.state['global_step']}.pt"))
        self.envs.close()
        self.send("done", result)

    def evaluate(self) -> dict[str, float]:
        env_cfg, ev = self.env_cfg, self.eval_cfg
        envs = make_vec_env(env_cfg.env_id, ev.eval_num_envs, ev.eval_seed,
                            **env_kwargs(env_cfg, self.data, self.items, "eval"))
        agent, device, greedy = self.agent, self.device, ev.eval_deterministic

        def policy(obs: np.ndarray) -> np.ndarray:
            with torch.no_grad():
                dist = agent.distribution(torch.from_numpy(obs).to(device))
                return (dist.probs.argmax(-1) if greedy else dist.sample()).cpu().numpy()

        return run_episodes(envs, policy, ev.eval_episodes)


def run_episodes(envs, policy, episodes: int) -> dict[str, float]:
    """Play ``episodes`` episodes; the first ones to finish count (ties broken by env index)."""
    obs = envs.reset().astype(np.float32)
    done: list[dict] = []
    while len(done) < episodes:
        result = envs.step(policy(obs))
        done.extend(sorted(result.episodes, key=lambda e: e["env_index"]))
        obs = result.obs.astype(np.float32, copy=False)
    envs.close()
    done = done[:episodes]
    returns = np.array([e["return"] for e in done])
    out = {"mean_return": float(returns.mean()), "std_return": float(returns.std()), "episodes": len(done)}
    for key in ("net_worth", "trades", "fees"):
        if key in done[0]:
            out[f"mean_{key}"] = float(np.mean([e[key] for e in done]))
    return out


# ------------------------------------------------------------------------- coordinator side

@dataclass
class WorkerStatus:
    step: int = 0
    episodes: int = 0
    recent_return: float = math.nan
    sps: float = 0.0
    pid: int | None = None
    hyper: dict = field(default_factory=dict)
    result: dict | None = None  # the "done" report
    error: str | None = None  # traceback sent before dying
    failures: list[str] = field(default_factory=list)
    gave_up: bool = False
    pbt_score: float | None = None
    pbt_path: str | None = None

    @property
    def active(self) -> bool:
        return self.result is None and not self.gave_up


class Coordinator:
    """Starts the workers, logs their reports, restarts crashed ones, stops them on a signal or budget.

    Each worker reports through its own pipe rather than one shared queue: a worker killed
    with ``kill -9`` halfway through a write can then neither corrupt nor lock the channel
    the other workers report through.
    """

    def __init__(self, cfg: dict[str, Any], run_dir: Path, data_specs, item_indices, devices: list[str],
                 hypers: list[dict], init_path: str | None, log: logging.Logger):
        self.cfg, self.run_dir, self.log = cfg, run_dir, log
        self.train_cfg: TrainKwargs = cfg["TRAIN_KWARGS"]
        n = self.train_cfg.num_workers
        self.status = [WorkerStatus(hyper=hypers[i]) for i in range(n)]
        self.lives = [0] * n
        threads = self.train_cfg.threads_per_worker or threads_per_process(n)
        config_dict = to_dict(cfg)
        self.rng = np.random.default_rng(self.train_cfg.seed + 17)
        self.pbt_events: list[dict] = []
        self.metrics: MetricsWriter | None = None

        def args_for(index: int) -> tuple:
            # Called at start and on every restart: always continue from the newest checkpoint.
            latest = latest_checkpoint(run_dir / "checkpoints", rf"worker_{index}_(step_\d+|final)\.pt")
            setup = WorkerSetup(index, str(run_dir), config_dict, data_specs, item_indices, devices[index], threads,
                                hypers[index], str(latest) if latest else None,
                                init_path if latest is None else None, self.lives[index])
            return (setup,)

        self.pool = WorkerPool(worker_process, n, args_for, self.train_cfg.max_restarts, name="worker")

    def run(self, graceful: GracefulExit) -> str:
        """Drive the population until every worker is done or given up; returns why it ended."""
        tc = self.train_cfg
        started = time.monotonic()
        deadline = started + tc.duration * 3600 if tc.duration else math.inf
        next_summary = started + tc.summary_every_s
        stop_reason, stop_deadline = None, math.inf
        self.pool.start()
        self.log.info("started %d workers: pids %s", tc.num_workers, self.pool.pids())
        while any(s.active for s in self.status):
            self.poll(timeout=0.5, stopping=stop_reason is not None)
            now = time.monotonic()
            if stop_reason is None and (graceful.requested or now >= deadline):
                stop_reason = "signal" if graceful.requested else "duration"
                self.log.info("stopping (%s): every worker finishes its rollout and saves (up to %.0f s)",
                              "interrupted" if graceful.requested else f"duration of {tc.duration} h reached",
                              tc.stop_timeout_s)
                for index, status in enumerate(self.status):
                    if status.active:
                        self.send(index, "stop", stop_reason)
                stop_deadline = now + tc.stop_timeout_s
            if now >= stop_deadline:
                for index, status in enumerate(self.status):
                    if status.active:
                        self.log.error("worker %d did not stop within %.0f s; terminating it", index,
                                       tc.stop_timeout_s)
                        status.failures.append("did not stop in time; terminated")
                        status.gave_up = True
                        process = self.pool.workers[index].process
                        process.terminate()
                        process.join(2.0)
                        if process.is_alive():  # it does not even take SIGTERM (e.g. stopped): kill it
                            process.kill()
                            process.join(2.0)
                break
            if now >= next_summary:
                next_summary = now + tc.summary_every_s
                self.log_summary(now - started)
        return stop_reason or "done"

    def send(self, index: int, command: str, payload: Any = None) -> None:
        try:
            self.pool.workers[index].conn.send((command, payload))
        except (BrokenPipeError, OSError):
            pass  # it is dying; its sentinel tells us

    def poll(self, timeout: float, stopping: bool) -> None:
        waitables: dict[Any, int] = {}
        for index, status in enumerate(self.status):
            if status.active:
                handle = self.pool.workers[index]
                waitables[handle.conn] = index
                waitables[handle.process.sentinel] = index
        if not waitables:
            return
        ready = wait(list(waitables), timeout=timeout)
        for index in sorted({waitables[r] for r in ready}):
            handle = self.pool.workers[index]
            self.drain(index)
            if self.status[index].active and not handle.process.is_alive():
                self.died(index, stopping)

    def drain(self, index: int) -> None:
        conn = self.pool.workers[index].conn
        try:
            while conn.poll(0):
                command, payload = conn.recv()
                self.handle(index, command, payload)
        except (EOFError, OSError):
            pass

    def handle(self, index: int, command: str, payload: Any) -> None:
        status = self.status[index]
        if command == "started":
            status.pid, status.step, status.hyper = payload["pid"], payload["step"], payload["hyper"]
            self.log.info("worker %d running (pid %d) from step %d", index, payload["pid"], payload["step"])
        elif command == "progress":
            status.step, status.episodes = payload["step"], payload["episodes"]
            status.recent_return, status.sps = payload["recent_return"], payload["sps"]
            self.log.info("worker %d: step %d/%d  episodes %d  recent return %.3f  %.0f steps/s", index,
                          status.step, self.train_cfg.max_steps_per_worker, status.episodes, status.recent_return,
                          status.sps)
        elif command == "done":
            status.result = payload
            status.step, status.episodes = payload["step"], payload["episodes"]
            status.recent_return, status.sps = payload["recent_return"], payload["sps"]
            self.log.info("worker %d done at step %d (%s)", index, payload["step"],
                          "finished" if payload["finished"] else f"stopped: {payload['stop_reason']}")
        elif command == "pbt_ready":
            self.pbt(index, payload)
        elif command == "error":
            status.error = payload
        else:
            self.log.error("worker %d sent unknown message %r", index, command)

    def died(self, index: int, stopping: bool) -> None:
        status = self.status[index]
        handle = self.pool.workers[index]
        handle.process.join(1.0)
        reason = (f"raised an exception:\n{status.error}" if status.error
                  else describe_exit(handle.process.exitcode))
        status.failures.append(reason.splitlines()[-1] if status.error else reason)
        status.error = None
        self.log.error("worker %d (pid %s) died: %s", index, handle.process.pid, reason)
        if stopping:
            status.gave_up = True
            return
        try:
            self.lives[index] += 1
            self.pool.restart(index)
        except TooManyRestarts as err:
            self.log.error("%s", err)
            status.gave_up = True
            return
        latest = latest_checkpoint(self.run_dir / "checkpoints", rf"worker_{index}_(step_\d+|final)\.pt")
        self.log.warning("worker %d restarted from %s", index, latest.name if latest else "scratch (no checkpoint)")

    def pbt(self, index: int, report: dict) -> None:
        """Asynchronous PBT: compare with the latest scores of the others; the weak copy a strong one."""
        status = self.status[index]
        status.pbt_score, status.pbt_path, status.hyper = report["score"], report["path"], report["hyper"]
        scored = sorted((s.pbt_score, i) for i, s in enumerate(self.status) if s.pbt_score is not None)
        cut = max(1, int(len(self.status) * self.train_cfg.pbt_fraction))
        answer = None
        if len(scored) == len(self.status) and index in [i for _, i in scored[:cut]]:
            donor = int(self.rng.choice([i for _, i in scored[-cut:]]))
            if donor != index and self.status[donor].pbt_score > report["score"]:
                hyper = perturb(self.status[donor].hyper, self.train_cfg.pbt_perturb, self.rng)
                answer = {"donor": donor, "donor_score": self.status[donor].pbt_score,
                          "path": self.status[donor].pbt_path, "hyper": hyper}
                status.hyper = hyper
                event = {"step": report["step"], "worker": index, "copied": donor, "hyper": hyper}
                self.pbt_events.append(event)
                self.log.info("PBT: worker %d (score %.3f) copies worker %d (score %.3f), new hyperparameters %s",
                              index, report["score"], donor, answer["donor_score"], hyper)
        self.send(index, "pbt", answer)

    def log_summary(self, elapsed: float) -> None:
        total = sum(s.step for s in self.status)
        running = sum(s.active for s in self.status)
        returns = [s.recent_return for s in self.status if math.isfinite(s.recent_return)]
        self.log.info("summary after %.0f s: %d/%d workers running, %d steps in total (%.0f steps/s), "
                      "mean recent return %s, restarts %d", elapsed, running, len(self.status), total,
                      sum(s.sps for s in self.status if s.active),
                      f"{np.mean(returns):.3f}" if returns else "n/a", self.pool.total_restarts)
        for index, s in enumerate(self.status):
            self.log.info("  worker %d: step %d, episodes %d, recent return %.3f, %.0f steps/s%s", index, s.step,
                          s.episodes, s.recent_return, s.sps, " (given up)" if s.gave_up else "")
        self.write_metrics(elapsed, sum(s.sps for s in self.status if s.active))

    def write_metrics(self, elapsed: float, sps: float) -> None:
        """One row of the population's totals in metrics.csv (the core columns every mode shares)."""
        if self.metrics is None:
            self.metrics = MetricsWriter(self.run_dir, ["workers_running", "workers_finished", "restarts"],
                                         tensorboard=self.train_cfg.tensorboard, tb_subdir="tb/population")
        returns = [s.recent_return for s in self.status if math.isfinite(s.recent_return)]
        self.metrics.write({
            "wall_time": elapsed, "global_step": sum(s.step for s in self.status),
            "episodes": sum(s.episodes for s in self.status),
            "episodic_return": float(np.mean(returns)) if returns else math.nan, "episodic_length": math.nan,
            "sps": sps, "workers_running": sum(s.active for s in self.status),
            "workers_finished": sum(bool(s.result and s.result["finished"]) for s in self.status),
            "restarts": self.pool.total_restarts})


def perturb(hyper: dict[str, float], amount: float, rng: np.random.Generator) -> dict[str, float]:
    """PBT explore: scale each value by 1 - amount or 1 + amount (discounts on their 1 - x scale)."""
    out = {}
    for name, value in hyper.items():
        factor = 1.0 + amount * rng.choice([-1.0, 1.0])
        if name in ("gamma", "gae_lambda"):
            out[name] = round(min(0.9999, 1.0 - (1.0 - value) * factor), 6)
        else:
            out[name] = float(f"{value * factor:.6g}")
    return out


# ---------------------------------------------------------------------------------- setup

def worker_devices(train: TrainKwargs) -> list[str]:
    """One device per worker; asking for more GPUs than exist is a config error."""
    devices = assign_devices(train.num_workers, train.device, train.gpu_strategy)
    if train.num_gpus is not None:
        available = torch.cuda.device_count() if torch.cuda.is_available() else 0
        require(1 <= train.num_gpus <= available, "num_gpus", train.num_gpus,
                f"this machine has {available} CUDA GPU(s)")
        if devices[0].startswith("cuda") and train.gpu_strategy == "round-robin":
            devices = [f"cuda:{i % train.num_gpus}" for i in range(train.num_workers)]
    return devices


def resolve_run_dir(env_cfg: EnvKwargs, train: TrainKwargs) -> tuple[Path, str | None]:
    """The run directory, and a checkpoint every worker starts from (``--resume FILE.pt``)."""
    resume = train.resume
    if resume and resume not in ("auto",) and Path(resume).is_file():
        try:
            load_checkpoint(resume, required=("model", "observation_shape", "num_actions"))
        except CheckpointError as err:
            fail(f"--resume {resume}: {err}")
        run_dir = Path(train.output_dir) if train.output_dir else default_run_dir(SCRIPT, env_cfg.env_id, train.seed)
        return run_dir, resume
    if resume == "auto":
        if train.output_dir:
            run_dir = Path(train.output_dir)
        else:
            found = sorted(Path("runs", SCRIPT).glob(f"{env_cfg.env_id.replace('/', '_')}__{train.seed}__*"),
                           key=os.path.getmtime)
            run_dir = found[-1] if found else default_run_dir(SCRIPT, env_cfg.env_id, train.seed)
        return run_dir, None
    if resume:
        if not Path(resume).is_dir():
            fail(f"--resume {resume}: not auto, a run directory or a checkpoint file")
        return Path(resume), None
    run_dir = Path(train.output_dir) if train.output_dir else default_run_dir(SCRIPT, env_cfg.env_id, train.seed)
    if latest_checkpoint(run_dir / "checkpoints", r"worker_\d+_.*\.pt") is not None:
        fail(f"--output-dir {run_dir}: holds checkpoints of an earlier run; pass --resume auto to continue it "
             "or choose another directory")
    return run_dir, None


def load_market(env_cfg: EnvKwargs, log_line) -> tuple[Any, list[int] | None, dict]:
    """Load (or build) the cache, pick the items and check that the windows fit; one line on failure."""
    if not env_cfg.is_market:
        return None, None, {}
    try:
        data, info = load_market_data(env_cfg.data_source, env_cfg.cache_dir, env_cfg.num_items,
                                      env_cfg.history_steps, env_cfg.data_seed)
        items = data.top_items(env_cfg.top_n_items)
        for split in ("train", "eval"):  # fails early if the history is too short for a split
            MarketVectorEnv(1, data=data, item_indices=items, **env_cfg.market_params(split)).close()
    except MarketDataError as err:
        fail(str(err))
    log_line(f"market cache {info['path']}: {data.num_items} items x {data.num_steps} steps "
             f"({format_bytes(data.nbytes)}), {'built' if info['built'] else 'loaded'} in {info['seconds']:.2f} s")
    need, free = data.nbytes, shm_space()["free"]
    if need > free:
        fail(f"the market cache needs {format_bytes(need)} of shared memory, /dev/shm has {format_bytes(free)} free")
    return data, [int(i) for i in items], info


def main(argv: list[str] | None = None) -> int:
    cfg = parse_config(CONFIG_GROUPS, argv, description=__doc__.split("\n\n")[0])
    env_cfg, ppo, train, ev = (cfg[k] for k in CONFIG_GROUPS)
    try:
        devices = worker_devices(train)
    except ConfigError as err:
        fail(str(err))
    run_dir, init_path = resolve_run_dir(env_cfg, train)
    reclaim_stale_segments()
    startup_lines: list[str] = []
    data, item_indices, cache_info = load_market(env_cfg, startup_lines.append)
    hypers = worker_hyperparams(ppo, train.num_workers, train.seed)

    shared, lock, coordinator = None, None, None
    exit_code = 0
    try:
        data_specs = None
        if data is not None:
            shared, data_specs = share_market_data(data)  # the one copy every worker reads
            del data
        run_dir, lock = open_run_dir(run_dir, logger_name=f"prl.{SCRIPT}")
        log = logging.getLogger(f"prl.{SCRIPT}")
        save_config(cfg, run_dir / "config.yaml")
        for line in startup_lines:
            log.info("%s", line)
        log.info("%s: %d workers x %d envs of %s, devices %s, run dir %s", SCRIPT, train.num_workers,
                 train.num_envs_per_worker, env_cfg.env_id, sorted(set(devices)), run_dir)
        graceful = GracefulExit(log).install()
        coordinator = Coordinator(cfg, run_dir, data_specs, item_indices, devices, hypers, init_path, log)
        started = time.monotonic()
        reason = coordinator.run(graceful)
        coordinator.pool.stop(timeout=5.0)
        if reason == "signal":
            exit_code = graceful.exit_code
        elif any(s.gave_up for s in coordinator.status):
            exit_code = EXIT_FAILED
        data = shared_view(shared) if shared is not None else None
        finish(cfg, coordinator, data, item_indices, run_dir, reason, time.monotonic() - started,
               cache_info, exit_code, log)
    except Exception:
        logging.getLogger(f"prl.{SCRIPT}").exception("training failed")
        exit_code = EXIT_FAILED
    finally:
        if coordinator is not None:
            coordinator.pool.stop(timeout=5.0)
        if shared is not None:
            shared.unlink_all()
        if lock is not None:
            lock.release()
    return exit_code


# ------------------------------------------------------------------------------- results

LEADERBOARD_COLUMNS = ["rank", "worker", "eval_mean_return", "eval_std_return", "eval_mean_net_worth",
                       "eval_mean_trades", "eval_episodes", "steps", "train_recent_return", "restarts",
                       "pbt_exploits", *PER_WORKER, "checkpoint"]


def finish(cfg, coordinator: Coordinator, data, item_indices, run_dir: Path, reason: str, seconds: float,
           cache_info: dict, exit_code: int, log: logging.Logger) -> None:
    """Final statistics, leaderboard.csv (with a random baseline), best.pt, summary.json, metrics.csv."""
    status = coordinator.status
    rows = []
    for index, s in enumerate(status):
        result = s.result or {}
        evaluation = result.get("eval")
        rows.append({"worker": index, "steps": s.step, "train_recent_return": s.recent_return,
                     "restarts": coordinator.pool.workers[index].restarts,
                     "pbt_exploits": result.get("pbt_exploits", 0),
                     **{k: s.hyper.get(k) for k in PER_WORKER}, "checkpoint": result.get("checkpoint", ""),
                     **({f"eval_{k}": v for k, v in evaluation.items()} if evaluation else {})})
    ranked = sorted((r for r in rows if "eval_mean_return" in r), key=lambda r: -r["eval_mean_return"])
    for rank, row in enumerate(ranked, start=1):
        row["rank"] = rank
    baseline = None
    if ranked and cfg["EVAL_KWARGS"].eval_random_baseline:
        baseline = random_baseline(cfg, data, item_indices)
        ranked.append({"worker": "random", **{f"eval_{k}": v for k, v in baseline.items()}})
    if ranked:
        write_leaderboard(run_dir / "leaderboard.csv", ranked)
        best = ranked[0]
        copy_atomic(Path(best["checkpoint"]), run_dir / "best.pt")
        log.info("leaderboard: best is worker %d (eval mean return %.3f%s) -> best.pt", best["worker"],
                 best["eval_mean_return"], f", random policy {baseline['mean_return']:.3f}" if baseline else "")
    total_steps = sum(s.step for s in status)
    log.info("final statistics (%s): %d steps in %.1f s (%.0f steps/s), %d restart(s)", reason, total_steps, seconds,
             total_steps / max(seconds, 1e-9), coordinator.pool.total_restarts)
    for index, s in enumerate(status):
        state = "given up" if s.gave_up else ("finished" if s.result and s.result["finished"] else "stopped")
        log.info("  worker %d: %s at step %d, episodes %d, recent return %.3f, restarts %d%s", index, state, s.step,
                 s.episodes, s.recent_return, coordinator.pool.workers[index].restarts,
                 f", failures: {'; '.join(s.failures)}" if s.failures else "")
    plot_population(run_dir, len(status), run_dir / "plots" / "population.png")
    training_sps = sum(s.sps for s in status)  # each worker's steps over its own training time, summed
    coordinator.write_metrics(seconds, training_sps)
    coordinator.metrics.close()
    write_summary(run_dir, {
        "script": SCRIPT, "stop_reason": reason, "exit_code": exit_code, "wall_time_s": round(seconds, 3),
        "total_steps": total_steps, "sps": round(total_steps / max(seconds, 1e-9), 1),
        "training_sps": round(training_sps, 1),
        "restarts": coordinator.pool.total_restarts, "cache": cache_info, "item_indices": item_indices,
        "workers": [{**asdict(s), "restarts": coordinator.pool.workers[i].restarts} for i, s in enumerate(status)],
        "leaderboard": ranked, "random_baseline": baseline, "pbt_events": coordinator.pbt_events,
        "best_worker": ranked[0]["worker"] if ranked else None})


def random_baseline(cfg, data, item_indices) -> dict[str, float]:
    """A uniformly random policy on the same held-out windows as the agents."""
    env_cfg, ev = cfg["ENV_KWARGS"], cfg["EVAL_KWARGS"]
    envs = make_vec_env(env_cfg.env_id, ev.eval_num_envs, ev.eval_seed,
                        **env_kwargs(env_cfg, data, item_indices, "eval"))
    rng = np.random.default_rng(ev.eval_seed)
    n = int(envs.single_action_space.n)
    return run_episodes(envs, lambda obs: rng.integers(0, n, len(obs)), ev.eval_episodes)


def plot_population(run_dir: Path, num_workers: int, path: Path) -> None:
    """Every worker's training return against its steps, one line each, from metrics_worker_<i>.csv."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for index in range(num_workers):
        file = run_dir / f"metrics_worker_{index}.csv"
        if not file.is_file():
            continue
        rows = [r for r in read_metrics(file) if r.get("episodic_return")]
        ax.plot([int(r["global_step"]) for r in rows], [float(r["episodic_return"]) for r in rows],
                linewidth=1, label=f"worker {index}")
    ax.set_xlabel("env steps of the worker")
    ax.set_ylabel("mean episode return per update")
    ax.grid(alpha=0.3)
    if num_workers <= 16:
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def shared_view(shared) -> MarketData:
    """The coordinator's own mapping of the shared cache (re-attaching by name is not needed)."""
    prices, volumes = (shared[f"market_{name}"] for name in CACHE_ARRAYS)
    return MarketData(prices, volumes, [], source="shared memory")


def write_leaderboard(path: Path, rows: list[dict]) -> None:
    import csv

    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=LEADERBOARD_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in row.items()})
    os.replace(tmp, path)


def copy_atomic(source: Path, target: Path) -> None:
    tmp = target.with_name(f".{target.name}.tmp")
    tmp.write_bytes(source.read_bytes())
    os.replace(tmp, target)


if __name__ == "__main__":
    sys.exit(main())
