"""A population of independent PPO agents, one per process, over one shared market-data cache.

The coordinator loads the ``Market-v0`` price/volume cache once (building it on the first
run), copies it into shared memory and starts ``num_workers`` processes. Each worker
attaches its environments to that memory (no copy) and trains its own PPO agent on its own
device with its own hyperparameters (a list, or ranges sampled per worker), saving
``worker_<i>_step_<S>.pt`` every ``checkpoint_every`` steps, until ``max_steps_per_worker``
or until the mean of its own last 100 returns reaches ``target_return``. A worker that dies
is restarted from its newest checkpoint; one given up does not stop the others (the run then
exits 1 at the end). Every update of every worker is a row of ``metrics.csv`` (column
``worker``); ``checkpoints/population.pt`` holds the population's own counters, so that
``--resume`` continues them while each worker continues from its newest checkpoint. At the
end every final agent is evaluated on the same held-out windows of the history,
``leaderboard.csv`` ranks them next to a random policy, and the best is copied to
``best.pt``. Optionally (``--pbt-interval``), population-based training replaces the weakest
agents by perturbed copies of the strongest. Any Gymnasium id with a Discrete or Box action
space trains the same way, without a cache.

Under torchrun every rank runs ``num_workers`` members of one population, numbered globally
(rank r's worker i is member ``r * num_workers + i``), each node over its own shared copy of the
cache. Rank 0 coordinates all of them as above and alone writes the run directory: the other ranks
(``PopulationNode``) forward their workers' reports and checkpoints to it (common.population_relay)
and hand their workers its answers, so PBT, the leaderboard and ``best.pt`` span every node.

    python train_ppo_multiprocess.py                                   # 4 workers on the synthetic market
    python train_ppo_multiprocess.py --num-workers 8 --learning-rate 1e-4 1e-3 --sample-ranges learning_rate
    python train_ppo_multiprocess.py --data-source prices.csv --top-n-items 50 --duration 2
    python train_ppo_multiprocess.py --output-dir runs/pop --resume auto   # continue every worker
    torchrun --nnodes 2 --nproc-per-node 1 ... train_ppo_multiprocess.py --num-workers 8   # 16 members on 2 nodes
"""

from __future__ import annotations

import os

# Idle OpenMP threads must sleep, not spin: spinning threads collapse throughput as soon as
# the cores are shared with workers or anything else (see "Threads" in docs/conventions.md).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import copy
import csv
import hashlib
import math
import re
import shutil
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

from common.config import ConfigError, require, require_env_id, require_positive
from common.distributed import launched_by_torchrun
from common.hub import code_digest, stop_message
from common.lazy import lazy_import
from common.normalize import NormalizationSettings
from common.population_relay import POLL_S, MemberForwarder, Place, RemoteMembers
from common.run import (
    RECENT,
    EnvInfo,
    FlatConfig,
    Mode,
    RunConfig,
    TrainingDiverged,
    checkpoint_run_dir,
    config_dict,
    env_kwargs_of,
    probe_env,
    run_training,
    train_in_process,
)
from common.runlog import setup_logging
from common.supervisor import Supervisor, WorkerConfigError, WorkerFailed, set_torch_threads
from common.system import assign_devices, format_bytes, shm_shortfall, threads_per_process

# Loaded on first use, so that --help and --validate-only answer at once (see common/lazy.py).
torch, checkpoints, envs_lib, market, networks, numpy_ppo, optim, ppo, rollout = map(lazy_import, (
    "torch", "common.checkpoint", "common.envs", "common.envs.market", "common.networks", "common.numpy_ppo",
    "common.optim", "common.ppo", "common.rollout"))

PER_WORKER = ("learning_rate", "gamma", "gae_lambda", "clip_coef", "ent_coef")  # may differ between workers


def population_size(num_workers: int) -> int:
    """Members in all: ``num_workers`` on every rank of a torchrun job, else ``num_workers``."""
    return num_workers * (int(os.environ["WORLD_SIZE"]) if launched_by_torchrun() else 1)


@dataclass
class EnvKwargs:
    env_id: str = "Market-v0"  # Market-v0, or any Gymnasium id with a Discrete or Box action space (no cache then)
    data_source: str = "synthetic"  # synthetic, or the path of a CSV file timestamp,item,price,volume
    cache_dir: str = "runs/cache/market"  # where the market cache (.npy) is built once and loaded afterwards
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


def market_kwargs(cfg) -> dict[str, Any]:
    """Market-v0's gymnasium.make kwargs from ENV_KWARGS, plain values: checkpoints keep them, so that
    common.evaluate rebuilds the env from the same cache. Other envs take only ``--env-kwargs``."""
    return {f.name: getattr(cfg, f.name) for f in fields(EnvKwargs) if f.name != "env_id"} if cfg.is_market else {}


def split_kwargs(env_kwargs: dict[str, Any], split: str, data, item_indices) -> dict[str, Any]:
    """A process's env kwargs: Market-v0 attaches to the shared cache, on the train or the held-out windows."""
    return {**env_kwargs, "split": split, "data": data, "item_indices": item_indices} if data is not None \
        else env_kwargs


@dataclass
class PPOKwargs(NormalizationSettings):
    n_steps: int = 256  # steps per environment per rollout; a worker's rollout is n_steps * num_envs_per_worker
    rollout_steps: int | None = None  # a worker's whole rollout (all its envs) instead; when given, sets n_steps
    batch_size: int = 256  # minibatch size; must divide the rollout
    n_epochs: int = 4  # passes over each rollout
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
    activation: str = "tanh"  # of the hidden layers: tanh or relu
    log_std_init: float = 0.0  # Box actions: the first policy's log standard deviation (then learned)

    def validate(self) -> None:
        require_positive(self, "n_steps", "rollout_steps", "batch_size", "n_epochs", "max_grad_norm")
        for name in self.sample_ranges:
            require(name in PER_WORKER, "sample_ranges", name, f"must name fields among {', '.join(PER_WORKER)}")
        for name in PER_WORKER:
            values = getattr(self, name)
            require(len(values) > 0 and all(math.isfinite(v) and v >= 0 for v in values), name, values,
                    "values must be finite and >= 0")
        for name in ("gamma", "gae_lambda"):
            require(all(v <= 1 for v in getattr(self, name)), name, getattr(self, name), "must be in [0, 1]")
        require(len(self.hidden_sizes) > 0 and all(h > 0 for h in self.hidden_sizes), "hidden_sizes",
                self.hidden_sizes, "widths must be > 0")
        require(self.activation in ("tanh", "relu"), "activation", self.activation, "must be tanh or relu")

    @staticmethod
    def validate_together(cfg: dict[str, Any]) -> None:
        ppo_cfg, train = cfg["PPO_KWARGS"], cfg["TRAIN_KWARGS"]
        envs = train.num_envs_per_worker
        if ppo_cfg.rollout_steps is not None:  # the name seed users know: steps of all a worker's envs together
            require(ppo_cfg.rollout_steps % envs == 0, "rollout_steps", ppo_cfg.rollout_steps,
                    f"must be a multiple of num_envs_per_worker ({envs})")
            ppo_cfg.n_steps, ppo_cfg.rollout_steps = ppo_cfg.rollout_steps // envs, None
        rollout = ppo_cfg.n_steps * envs
        require(rollout % ppo_cfg.batch_size == 0, "batch_size", ppo_cfg.batch_size,
                f"must divide the rollout of n_steps * num_envs_per_worker = {ppo_cfg.n_steps} * {envs} = {rollout}")
        members = population_size(train.num_workers)
        each = (f"one per worker ({members})" if members == train.num_workers else
                f"one per member ({members}: {members // train.num_workers} ranks x {train.num_workers} workers)")
        for name in PER_WORKER:
            values = getattr(ppo_cfg, name)
            if name in ppo_cfg.sample_ranges:
                require(len(values) == 2 and values[0] <= values[1], name, values,
                        "is in sample_ranges, so it needs two values low high")
            else:
                require(len(values) in (1, members), name, values, f"needs 1 value or {each}")


@dataclass
class TrainKwargs(RunConfig):
    seed: int = 1  # worker i seeds torch with seed + i and its envs with seed + i * num_envs_per_worker + j
    num_workers: int = 4  # independent agents, one process each (under torchrun: on each rank)
    num_envs_per_worker: int = 8  # environments each worker steps at once (numpy-vectorized)
    max_steps_per_worker: int | None = 1_000_000  # env steps each worker trains for (none: until duration or Ctrl+C)
    duration: float | None = None  # hours of training (from when the workers are up); then each saves, is evaluated
    target_return: str | None = "auto"  # a worker is done once the mean of its last 100 returns reaches this
    checkpoint_every: int = 50_000  # steps between a worker's checkpoints worker_<i>_step_<S>.pt
    device: str = "auto"  # auto (GPUs for image observations, else the CPU), cpu, cuda, cuda:N
    gpu_strategy: str = "round-robin"  # round-robin: workers spread over GPUs; single: all on one GPU
    num_gpus: int | None = None  # GPUs to spread workers over (default: all visible ones)
    threads_per_worker: int = 0  # torch threads per worker (0 = usable cores / num_workers)
    learner: str = "auto"  # auto (numpy for an MLP policy on the CPU, else torch), numpy or torch
    stop_timeout_s: float = 30.0  # on Ctrl+C or the duration's end, how long workers get to save (and evaluate)
    pbt_interval: int = 0  # population-based training every this many steps (0 = off)
    pbt_fraction: float = 0.25  # PBT: the weakest fraction copies one of the strongest fraction
    pbt_perturb: float = 0.2  # PBT: copied hyperparameters are multiplied by 1 -/+ this

    def validate(self) -> None:
        super().validate()
        require_positive(self, "max_steps_per_worker", "checkpoint_every", "stop_timeout_s")
        require(self.threads_per_worker >= 0, "threads_per_worker", self.threads_per_worker, "must be >= 0")
        require(self.pbt_interval >= 0, "pbt_interval", self.pbt_interval, "must be >= 0 (0 = off)")
        require(0 < self.pbt_fraction <= 0.5, "pbt_fraction", self.pbt_fraction, "must be in (0, 0.5]")
        require(0 <= self.pbt_perturb < 1, "pbt_perturb", self.pbt_perturb, "must be in [0, 1)")
        assign_devices(self.num_workers, self.device, self.gpu_strategy, self.num_gpus)  # GPUs that are not there
        require(self.learner in ("auto", "numpy", "torch"), "learner", self.learner, "must be auto, numpy or torch")


@dataclass
class EvalKwargs:
    eval_episodes: int = 32  # held-out windows every final agent is evaluated on
    eval_num_envs: int = 8  # evaluation environments stepped at once
    eval_seed: int = 10_000  # picks the held-out windows (the same for every agent)
    eval_deterministic: bool = True  # act greedily (argmax, or the mean of a Box action) during evaluation
    eval_random_baseline: bool = True  # also evaluate a uniformly random policy for the leaderboard

    def validate(self) -> None:
        require_positive(self, "eval_episodes", "eval_num_envs")


CONFIG_GROUPS = {"ENV_KWARGS": EnvKwargs, "PPO_KWARGS": PPOKwargs, "TRAIN_KWARGS": TrainKwargs,
                 "EVAL_KWARGS": EvalKwargs}


class Config(FlatConfig):
    """The four groups from one flat set of fields, for Python: ``Config(num_workers=8, learning_rate=3e-4)``
    (each field goes to the group that owns it; the others keep their defaults)."""

    def __init__(self, **settings: Any):
        owner = {f.name: name for name, cls in CONFIG_GROUPS.items() for f in fields(cls)}
        unknown = sorted(set(settings) - set(owner))
        if unknown:
            raise TypeError(f"unknown field(s) {', '.join(unknown)}; the fields are those of "
                            f"{', '.join(cls.__name__ for cls in CONFIG_GROUPS.values())}")
        super().__init__({name: cls(**{k: v for k, v in settings.items() if owner[k] == name})
                          for name, cls in CONFIG_GROUPS.items()})


def config_from_dict(values: dict[str, Any]) -> FlatConfig:
    """The grouped config again from its flat dict (what workers receive and checkpoints hold)."""
    return FlatConfig({name: cls(**{f.name: values[f.name] for f in fields(cls)})
                       for name, cls in CONFIG_GROUPS.items()})


def worker_hyperparams(cfg, num_workers: int, seed: int) -> list[dict[str, float]]:
    """Each worker's own values of PER_WORKER: shared, listed per worker, or sampled from a range.

    Ranges are sampled log-uniformly when both ends are > 0 (learning rates span decades),
    uniformly otherwise, from a generator seeded with ``seed``: the same run, the same population.
    """
    rng = np.random.default_rng(seed)
    population: list[dict[str, float]] = [{} for _ in range(num_workers)]
    for name in PER_WORKER:
        values = getattr(cfg, name)
        for index, hyper in enumerate(population):
            if name in cfg.sample_ranges:
                low, high = values
                hyper[name] = float(math.exp(rng.uniform(math.log(low), math.log(high))) if low > 0
                                    else rng.uniform(low, high))
            else:
                hyper[name] = float(values[0] if len(values) == 1 else values[index])
    return population


# ------------------------------------------------------------------------------ the agent
# Everything down to "the coordinator" runs inside a worker process.

@dataclass
class WorkerSetup:
    """What a worker gets, small and picklable: the config, shared-memory specs, its device and seeds."""

    member: int  # the worker's number in the whole population (its local index plus its rank's first)
    config: dict[str, Any]  # flat
    env_kwargs: dict[str, Any]  # gymnasium.make kwargs, plain values
    run_dir: str  # where it writes checkpoints/ and logs/ (a rank > 0: its node's scratch directory)
    data_specs: dict | None  # the shared market cache (None for other envs)
    item_indices: list[int] | None
    device: str
    threads: int
    hyper: dict[str, float]
    target: float | None  # the worker is done once the mean of its last 100 returns reaches this
    checkpoint: str | None  # continue from this checkpoint of this worker (its newest)


def population_worker(link, setup: WorkerSetup) -> None:
    """Worker process: one agent, from its newest checkpoint until its budget, its target or a stop."""
    set_torch_threads(setup.threads)
    log = setup_logging(Path(setup.run_dir) / "logs" / f"worker_{setup.member}.log", f"prl.worker{setup.member}")
    data, handles = market.attach_market_data(setup.data_specs) if setup.data_specs else (None, [])
    try:
        agent = Agent(link, setup, data, log)
        link.ready(step=agent.counters["global_step"], hyper=agent.hyper)
        if agent.train():
            agent.finish()
    except Exception:
        log.exception("worker %d failed", setup.member)
        raise
    finally:
        for handle in handles:
            handle.close()


class Agent:
    """One independent PPO agent: rollouts, updates, checkpoints, reports, PBT, evaluation."""

    def __init__(self, link, setup: WorkerSetup, data, log):
        self.link, self.setup, self.data, self.log = link, setup, data, log
        self.cfg = cfg = config_from_dict(setup.config)
        self.index, self.hyper = setup.member, dict(setup.hyper)
        torch.manual_seed(cfg.seed + self.index)
        np.random.seed(cfg.seed + self.index)
        n = cfg.num_envs_per_worker
        self.envs = envs_lib.make_vec_env(cfg.env_id, n, cfg.seed, first_index=self.index * n,
                                          **split_kwargs(setup.env_kwargs, "train", data, setup.item_indices))
        obs_space, action_space = self.envs.single_observation_space, self.envs.single_action_space
        self.device = torch.device(setup.device)
        seed = cfg.seed + 7919 * self.index
        # An MLP policy on the CPU learns in numpy (common/numpy_ppo.py, as train_parallel_timed.py's does):
        # the same network, loss and Adam without torch's per-operation overhead, about twice as fast an
        # update on the market's 333 inputs. Its checkpoints are the ones the torch learner writes.
        self.numpy = cfg.learner == "numpy" or (cfg.learner == "auto"
                                                and rollout.numpy_learner_fits(setup.device, obs_space))
        if self.numpy:
            spec = rollout.actor_critic_spec(obs_space, action_space, cfg.hidden_sizes, cfg.activation,
                                             cfg.log_std_init)
            self.learner = numpy_ppo.MLPActorCritic(spec, obs_space, action_space, seed=cfg.seed + self.index)
            self.optimizer = numpy_ppo.Adam(self.learner.params, self.learner.grads, self.learner.shapes,
                                            lr=self.hyper["learning_rate"], eps=1e-5)
            self.actor = None  # the rollouts act in numpy from self.learner.params
            acting = rollout.NumpyActing(obs_space, action_space, cfg.hidden_sizes, cfg.activation,
                                         lambda: self.learner.params, seed)
        else:
            self.learner = networks.ActorCritic(obs_space, action_space, tuple(cfg.hidden_sizes), cfg.activation,
                                                cfg.log_std_init).to(self.device)
            # Rollouts step a few observations at a time, where a GPU only adds latency: act with a CPU copy.
            self.actor = self.learner if self.device.type == "cpu" else copy.deepcopy(self.learner).cpu()
            self.optimizer = optim.FusedAdam(self.learner.parameters(), lr=self.hyper["learning_rate"], eps=1e-5)
            acting = ppo.acting_for(self.actor, seed)
        self.counters = {"global_step": 0, "episodes": 0, "updates": 0, "wall_time": 0.0, "pbt_exploits": 0,
                         "recent_returns": []}
        self.normalizer = rollout.make_normalizer(cfg, obs_space, action_space, self.hyper["gamma"])
        if setup.checkpoint:
            self.restore(setup.checkpoint)
        self.recent = deque(self.counters["recent_returns"], maxlen=RECENT)
        layout = rollout.rollout_layout(cfg.n_steps, n, obs_space, action_space)
        self.buf = {key: np.zeros(shape, dtype) for key, (shape, dtype) in layout.items()}
        # Each agent is its own learner: its normalization statistics are its own too.
        self.collector = rollout.RolloutCollector(acting, self.envs, self.buf, slice(None), self.normalizer)
        self.generator = torch.Generator().manual_seed(seed + self.counters["updates"])
        self.rng = np.random.default_rng(seed + self.counters["updates"])  # the numpy learner's minibatches
        self.stop_payload: dict = {}
        self.clock = (time.monotonic(), time.process_time(), self.counters["global_step"], self.counters["wall_time"])
        log.info("worker %d: pid %d, device %s (%s learner), %d envs of %s, hyperparameters %s", self.index,
                 os.getpid(), self.device, "numpy" if self.numpy else "torch", n, cfg.env_id, self.hyper)
        log.info("worker %d %s", self.index, rollout.describe_rollout(self.buf, obs_space))

    # -- checkpoints
    def restore(self, path: str) -> None:
        """Continue from one of this worker's checkpoints; one that cannot fit is a configuration error."""
        try:
            state = checkpoints.load_checkpoint(path, map_location=self.device,
                                                required=("model", "optimizer", "counters", "hyper", "rng"))
            self.learner.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        except (checkpoints.CheckpointError, RuntimeError, ValueError) as err:
            reason = str(err).strip().splitlines()[0][:200]
            raise WorkerConfigError(f"worker {self.index} cannot continue from {path}: {reason}") from None
        self.sync_actor()
        self.normalizer.load_state_dict(state)
        self.hyper = dict(state["hyper"])  # PBT may have changed them
        self.normalizer.gamma = self.hyper["gamma"]
        self.counters.update(state["counters"])
        checkpoints.set_rng_state(state["rng"])
        self.log.info("worker %d resumed from %s at step %d", self.index, path, self.counters["global_step"])

    def save(self, name: str) -> Path:
        """The same keys as the lifecycle's checkpoints, so ``build_network(ckpt["policy"])`` rebuilds the agent."""
        c = self.counters
        c["recent_returns"], c["wall_time"] = list(self.recent), self.wall_time()
        state = {"script": MODE.script, "config": self.setup.config, "counters": dict(c),
                 "env": {"id": self.cfg.env_id, "kwargs": self.setup.env_kwargs},
                 "rng": checkpoints.rng_state(), "model": self.learner.state_dict(), "policy": self.learner.spec,
                 "optimizer": self.optimizer.state_dict(), **self.normalizer.state_dict(),
                 "worker": self.index, "hyper": dict(self.hyper),
                 "item_indices": self.setup.item_indices}
        path = checkpoints.save_checkpoint(state, Path(self.setup.run_dir) / "checkpoints" / name)
        self.log.info("checkpoint %s (step %d)", path.name, c["global_step"])
        return path

    # -- training
    def train(self) -> bool:
        """Rollouts and updates until done; False if the loss diverged (nothing is saved then)."""
        cfg, c = self.cfg, self.counters
        rollout = cfg.n_steps * cfg.num_envs_per_worker
        # The envs' state is not in a checkpoint: a resumed worker re-seeds them by its step,
        # so that it does not replay the windows it started with.
        self.envs.seed += c["global_step"]
        self.collector.next_obs = self.envs.reset()
        while not self.done():
            self.set_learning_rate()
            started = time.time()
            episodes = self.collector.collect(cfg.n_steps)
            c["global_step"] += rollout
            stats = self.update()
            if stats is None:
                return False
            c["episodes"] += len(episodes)
            self.recent.extend(e["return"] for e in episodes)
            saved = self.save(f"worker_{self.index}_step_{c['global_step']}.pt") if self.crossed(
                cfg.checkpoint_every, rollout) else None
            self.report(episodes, stats, rollout, started, saved)
            if cfg.pbt_interval and self.crossed(cfg.pbt_interval, rollout) and not self.done():
                self.pbt_step(saved)
            for command, payload in self.link.commands():
                if command == "stop":
                    self.stop_payload = self.stop_payload or payload or {"evaluate": False}
                elif command != "pbt":  # a PBT answer that came after pbt_step stopped waiting: out of date
                    raise ValueError(f"worker {self.index}: unknown command {command!r}")
        return True

    def update(self) -> dict[str, float] | None:
        cfg, h = self.cfg, self.hyper
        started = time.perf_counter()
        settings = rollout.PPOSettings(cfg.n_epochs, cfg.batch_size, h["clip_coef"], cfg.clip_vloss, h["ent_coef"],
                                       cfg.vf_coef, cfg.max_grad_norm, cfg.norm_adv, cfg.target_kl)
        batch = rollout.flat_batch(self.buf, h["gamma"], h["gae_lambda"], self.normalizer)
        self.normalizer.update(self.buf["obs"], self.buf["disc_returns"])  # after the batch used the old statistics
        if self.numpy:
            stats = numpy_ppo.ppo_update(self.learner, self.optimizer, batch, settings, self.rng)
            finite = bool(np.isfinite(self.learner.params).all())
        else:
            stats = ppo.ppo_update(self.learner, self.optimizer, ppo.as_tensors(batch, self.device), settings,
                                   self.generator)
            finite = all(torch.isfinite(p).all() for p in self.learner.parameters())
        self.counters["updates"] += 1
        if not (finite and math.isfinite(stats["policy_loss"]) and math.isfinite(stats["value_loss"])):
            reason = f"loss became {stats['policy_loss']} at update {self.counters['updates']}"
            self.log.error("worker %d: %s; stopping without saving", self.index, reason)
            self.link.send("diverged", {"reason": reason})
            return None
        self.sync_actor()
        return {**stats, "update_ms": 1000 * (time.perf_counter() - started)}

    def sync_actor(self) -> None:
        """A CPU copy that acts for a GPU learner takes the learner's weights (numpy acting reads them itself)."""
        if self.actor is not None and self.actor is not self.learner:
            self.actor.load_state_dict(self.learner.state_dict())

    def set_learning_rate(self) -> None:
        """This worker's own rate (PBT may have changed it), annealed over its step budget when anneal_lr is on.
        Set before every update: a checkpoint or a PBT donor's optimizer state carries another rate."""
        budget = self.cfg.max_steps_per_worker
        frac = max(0.0, 1.0 - self.counters["global_step"] / budget) if self.cfg.anneal_lr and budget else 1.0
        self.optimizer.param_groups[0]["lr"] = frac * self.hyper["learning_rate"]

    def crossed(self, every: int, rollout: int) -> bool:
        """Did the last rollout pass a multiple of ``every`` steps?"""
        step = self.counters["global_step"]
        return step // every > (step - rollout) // every

    def done(self) -> bool:
        budget = self.cfg.max_steps_per_worker
        return (self.link.stop_requested or (budget is not None and self.counters["global_step"] >= budget)
                or self.reached_target())

    def reached_target(self) -> bool:
        return (self.setup.target is not None and len(self.recent) == RECENT
                and float(np.mean(self.recent)) >= self.setup.target)

    def wall_time(self) -> float:
        started, _, _, offset = self.clock
        return offset + time.monotonic() - started

    def rates(self) -> dict[str, float]:
        """Steps per second of training in this life, and per second of this process's CPU time."""
        started, cpu, steps_then, _ = self.clock
        steps = self.counters["global_step"] - steps_then
        return {"sps": steps / max(1e-9, time.monotonic() - started),
                "cpu_sps": steps / max(1e-9, time.process_time() - cpu)}

    def recent_return(self) -> float:
        return float(np.mean(self.recent)) if self.recent else math.nan

    # -- talking to the coordinator
    def report(self, episodes: list[dict], stats: dict, steps: int, started: float, saved: Path | None) -> None:
        c = self.counters
        self.link.send("update", {"step": c["global_step"], "steps": steps, "episodes": episodes, "stats": stats,
                                  "learning_rate": self.optimizer.param_groups[0]["lr"], "started": started,
                                  "recent_return": self.recent_return(), "checkpoint": str(saved or ""),
                                  **self.rates()})
        self.log.info("update %d: step %d, episodes %d, recent return %.3f, policy loss %.4f, value loss %.4f, "
                      "entropy %.3f, %.0f ms", c["updates"], c["global_step"], c["episodes"], self.recent_return(),
                      stats["policy_loss"], stats["value_loss"], stats["entropy"], stats["update_ms"])

    def pbt_step(self, saved: Path | None) -> None:
        """Report the score and a fresh checkpoint; the coordinator may answer: copy a stronger worker.
        A copy made is reported (``pbt_copied``): the coordinator counts only copies that happened."""
        step = self.counters["global_step"]
        path = saved or self.save(f"worker_{self.index}_step_{step}.pt")
        score = float(np.mean(self.recent)) if self.recent else -math.inf
        self.link.send("pbt_ready", {"step": step, "score": score, "path": str(path), "hyper": dict(self.hyper)})
        answer = self.pbt_answer(step)
        if answer is None:
            return
        donor = checkpoints.load_checkpoint(answer["path"], map_location=self.device, required=("model", "optimizer"))
        self.learner.load_state_dict(donor["model"])
        self.optimizer.load_state_dict(donor["optimizer"])
        self.sync_actor()
        self.normalizer.load_state_dict(donor)  # the copied weights expect the donor's view of the world
        self.hyper = dict(answer["hyper"])
        self.normalizer.gamma = self.hyper["gamma"]
        self.counters["pbt_exploits"] += 1
        self.recent.clear()
        self.log.info("PBT: copied worker %d (score %.3f vs ours %.3f); hyperparameters now %s",
                      answer["donor"], answer["donor_score"], score, self.hyper)
        self.link.send("pbt_copied", {"step": step, "copied": answer["donor"], "score": score,
                                      "donor_score": answer["donor_score"], "hyper": dict(self.hyper)})

    def pbt_answer(self, step: int) -> dict | None:
        """The coordinator's answer to this step's ``pbt_ready`` if it names a donor; None if it names none,
        if none came within worker_timeout_s (the coordinator answers once every running worker waits: the
        slowest may be far behind), or if a stop came instead. An answer to an earlier step, which came after
        this worker had stopped waiting for it, is out of date and skipped."""
        deadline = time.monotonic() + self.cfg.worker_timeout_s
        while (message := self.link.receive(timeout=max(0.0, deadline - time.monotonic()))) is not None:
            command, payload = message
            if command == "stop":
                self.stop_payload = self.stop_payload or payload or {"evaluate": False}
                return None
            if command != "pbt":
                raise ValueError(f"worker {self.index}: unknown command {command!r} during PBT")
            if payload.get("step") == step:
                return payload if payload.get("donor") is not None else None
        self.log.warning("PBT: no answer from the coordinator within %.0f s; continuing unchanged",
                         self.cfg.worker_timeout_s)
        return None

    def finish(self) -> None:
        """Done: the final checkpoint and an evaluation, or, when stopped early, a checkpoint to continue from.
        The evaluation ends by the stop order's ``report_by`` (with the episodes it finished), so that the
        coordinator hears from this worker before it kills what is left at the end of stop_timeout_s."""
        c = self.counters
        finished = not self.link.stop_requested or bool(self.stop_payload.get("evaluate"))
        path = self.save(f"worker_{self.index}_final.pt" if finished else
                         f"worker_{self.index}_step_{c['global_step']}.pt")
        result = {"step": c["global_step"], "episodes": c["episodes"], "recent_return": self.recent_return(),
                  "hyper": self.hyper, "pbt_exploits": c["pbt_exploits"], "finished": finished,
                  "checkpoint": str(path), "eval": self.evaluate() if finished else None, **self.rates()}
        if result["eval"]:
            self.log.info("worker %d evaluation: %s", self.index, result["eval"])
        self.envs.close()
        self.link.send("done", result)

    def evaluate(self) -> dict[str, float] | None:
        cfg = self.cfg
        envs = envs_lib.make_vec_env(cfg.env_id, cfg.eval_num_envs, cfg.eval_seed,
                                     **split_kwargs(self.setup.env_kwargs, "eval", self.data, self.setup.item_indices))
        policy = policy_actions(self.acting_network(), envs.single_action_space, cfg.eval_deterministic,
                                self.normalizer)

        def act(obs: np.ndarray, masks) -> np.ndarray:
            # Evaluation episodes can be long (a greedy Atari policy that never serves plays on until the
            # 108k-frame limit): keep telling the coordinator we are alive, or it kills us as hung.
            self.link.beat()
            return policy(obs, masks)

        return evaluate(envs, act, cfg.eval_episodes, cfg.eval_seed, stop=self.out_of_time)

    def acting_network(self):
        """The torch network evaluation plays with: the actor, or the numpy learner's weights in an ActorCritic."""
        if self.actor is not None:
            return self.actor
        network = networks.build_network(self.learner.spec)
        network.load_state_dict({name: torch.from_numpy(value) for name, value in self.learner.state_dict().items()})
        return network

    def out_of_time(self) -> bool:
        """Past the stop order's ``report_by`` (a stop may also come while a worker done by itself evaluates)."""
        for command, payload in self.link.commands():
            if command == "stop":
                self.stop_payload = self.stop_payload or payload or {"evaluate": False}
        report_by = self.stop_payload.get("report_by")
        return report_by is not None and time.time() >= report_by


def policy_actions(agent, action_space, deterministic: bool, normalizer):
    """``act(obs, masks)`` for play_episodes: greedy (argmax, or a Box action's mean) or sampled."""
    low, high = rollout.action_bounds(action_space)

    def act(obs: np.ndarray, _masks) -> np.ndarray:
        with torch.inference_mode():
            seen = normalizer.observations(obs)
            obs_t = torch.from_numpy(seen if seen.dtype == np.uint8 else seen.astype(np.float32, copy=False))
            if not deterministic:
                action = agent.act(obs_t)[0]
            else:
                out = agent.head(obs_t)
                action = out.argmax(-1) if agent.discrete else out
        action = action.numpy()
        return action if low is None else np.clip(action, low, high)

    return act


def random_actions(action_space, seed: int):
    rng = np.random.default_rng(seed)
    if hasattr(action_space, "n"):
        return lambda obs, _masks: rng.integers(0, action_space.n, len(obs))
    return lambda obs, _masks: rng.uniform(action_space.low, action_space.high,
                                           (len(obs), *action_space.shape)).astype(action_space.dtype)


def evaluate(envs, act, episodes: int, seed: int, stop=None) -> dict[str, float] | None:
    """Play whole episodes on ``envs`` (held-out windows for Market-v0); their mean return and episode info.
    ``stop()`` true ends it early with the episodes finished so far (``episodes`` says how many; None if none)."""
    try:
        done, _ = envs_lib.play_episodes(envs, act, episodes, seed=seed, stop=stop)
    finally:
        envs.close()
    if not done:
        return None
    returns = np.array([e["return"] for e in done])
    out = {"mean_return": float(returns.mean()), "std_return": float(returns.std()), "episodes": len(done)}
    for key, value in done[0].items():  # the env's own episode info: net worth, trades, fees ...
        if key not in ("return", "length", "terminated") and isinstance(value, float):
            out[f"mean_{key}"] = float(np.mean([e[key] for e in done]))
    return out


# ------------------------------------------------------------------------- the coordinator

# Past one machine (common.population_relay): where the files a member's messages name land on the
# rank that receives them, what a rank's workers may report to rank 0, and what rank 0 may answer one.
FILE_PLACES = (Place(r"worker_(?P<member>\d+)_(step_\d+|final)\.pt", "checkpoints"),
               Place(r"worker_(?P<member>\d+)\.log", "logs", append=True))
REPORTS = ("ready", "update", "pbt_ready", "pbt_copied", "done", "diverged", "restarted", "given_up")
COMMANDS = ("pbt",)  # the stop reaches every rank at once (RemoteMembers.stop_members)
# Settings that may differ between nodes; every other one must equal rank 0's (the fingerprint).
NODE_LOCAL = ("output_dir", "resume", "data_source", "cache_dir", "device", "gpu_strategy", "num_gpus",
              "threads_per_worker", "tensorboard", "log_interval_s")
REMOTE_STOP_SLACK_S = 5.0  # past stop_timeout_s, for the other ranks' last reports to arrive
REPORT_MARGIN_S = 1.0  # a stopped worker reports this long before stop_timeout_s ends (a quarter of it at most)


@dataclass
class WorkerStatus:
    rank: int = 0  # whose node runs it
    step: int = 0
    episodes: int = 0
    recent_return: float = math.nan
    sps: float = 0.0
    hyper: dict = field(default_factory=dict)
    result: dict | None = None  # the "done" report
    failures: list[str] = field(default_factory=list)
    restarts: int = 0
    gave_up: bool = False
    diverged: str | None = None
    lost: str | None = None  # its node was lost, and why
    pbt_score: float | None = None
    pbt_path: str | None = None

    @property
    def active(self) -> bool:
        return self.result is None and not self.gave_up and self.diverged is None and self.lost is None


def share_market_data(run) -> tuple[Any, dict | None]:
    """Market-v0: this node's one copy of the history in shared memory, which every worker here
    attaches (under torchrun each rank makes its own); (None, None) for other envs."""
    data = run.env.extra.pop("data", None)
    if data is None:
        return None, None
    cache = run.env.extra["cache"]
    if not (Path(cache["path"]) / "meta.json").is_file():  # built by the checks, which write nothing
        started = time.perf_counter()
        market.write_cache(data, cache["path"])
        cache["seconds"] += time.perf_counter() - started
    shared, specs = market.share_market_data(data)
    run.defer(shared.unlink_all)
    run.log.info("market cache %s: %d items x %d steps (%s), %s in %.2f s, shared as %s", cache["path"],
                 data.num_items, data.num_steps, format_bytes(data.nbytes), "built" if cache["built"] else "loaded",
                 cache["seconds"], specs["prices"].name)
    return market.MarketData(*(shared[f"market_{k}"] for k in market.CACHE_ARRAYS), [], "shared memory"), specs


def fingerprint(run, data) -> dict:
    """What every rank must share with rank 0 to train members of one population: the code, the
    settings (but NODE_LOCAL), the env's spaces and the market history itself."""
    history = None
    if data is not None:
        digest = hashlib.sha1()
        for array in (data.prices, data.volumes):
            digest.update(memoryview(np.ascontiguousarray(array)).cast("B"))
        history = digest.hexdigest()[:12]
    settings = {k: v for k, v in config_dict(run.cfg).items() if k not in NODE_LOCAL}
    return {"script": MODE.script, "code": code_digest(__file__), "settings": settings,
            "spaces": [str(run.env.observation_space), str(run.env.action_space)], "market": history,
            "item_indices": run.env.extra.get("item_indices")}


def member_workers(run, args_for, name: str = "worker") -> Supervisor:
    """This rank's workers, one process per member, restarted from their newest checkpoint when they die."""
    cfg = run.cfg
    return run.supervise(Supervisor(
        population_worker, cfg.num_workers, args_for, name=name, max_restarts=cfg.max_worker_restarts,
        start_timeout_s=max(cfg.worker_timeout_s, 120.0), hang_timeout_s=cfg.worker_timeout_s,
        on_give_up="worker", logger=run.log))


def check_learner(cfg, env) -> None:
    """Refuse ``--learner numpy`` where a worker could not learn with it, before anything is written (exit 2)."""
    if cfg.learner == "numpy" and not all(rollout.numpy_learner_fits(device, env.observation_space)
                                          for device in worker_devices(cfg, env.observation_space)):
        raise ConfigError("learner", cfg.learner, "numpy learns an MLP policy (vector observations) on the CPU; "
                          "use torch or auto for images or a GPU")


def worker_devices(cfg, observation_space) -> list[str]:
    """Each of this rank's workers' device: worker i on cuda:(i mod G) with --gpu-strategy round-robin (G =
    --num-gpus or every visible GPU), all on one GPU with single or an explicit cuda:N, CPU without CUDA.
    ``auto`` uses the GPUs for a CNN policy (image observations) only: MLP policies train faster on the CPU."""
    return assign_devices(cfg.num_workers, cfg.device, cfg.gpu_strategy, cfg.num_gpus,
                          gpu_pays=not rollout.acts_in_numpy(observation_space))


def population(run):
    """The trainer of every rank: the coordinator on rank 0 (and on one machine), a node of members elsewhere."""
    return Population(run) if run.is_main else PopulationNode(run)


class Population:
    """The coordinator: shares the data, starts one worker per agent, follows their reports, answers
    PBT, stops them at the end (or on Ctrl+C / the duration) and ranks the final agents. Under
    torchrun it follows the members of every rank: the others' reach it through ``self.remote``."""

    def __init__(self, run):
        self.run, cfg = run, run.cfg
        self.items, self.cache = run.env.extra.get("item_indices"), run.env.extra.get("cache")
        self.data, self.data_specs = share_market_data(run)
        members = cfg.num_workers * run.dist.world_size
        self.status = [WorkerStatus(rank=m // cfg.num_workers, hyper=h)
                       for m, h in enumerate(worker_hyperparams(cfg, members, cfg.seed))]
        self.devices = worker_devices(cfg, run.env.observation_space)
        self.threads = cfg.threads_per_worker or threads_per_process(cfg.num_workers)
        # The target is each worker's own (independent agents are judged one by one), never the population's.
        self.target, run.target_return = run.target_return, None
        self.pbt_events: list[dict] = (run.resumed or {}).get("pbt_events", [])
        self.pbt_rng = np.random.default_rng(cfg.seed + 17 + len(self.pbt_events))
        self.pbt_waiting: dict[int, int] = {}  # worker -> the step at which it waits for the PBT answer
        self.leaderboard, self.baseline = [], None
        self.sources = [run.run_dir / "checkpoints"]
        if run.resume_path is not None and checkpoint_run_dir(run.resume_path) != run.run_dir:
            self.sources.append(checkpoint_run_dir(run.resume_path) / "checkpoints")  # a population continued elsewhere
        self.next_status_log, self.reported = time.monotonic() + cfg.log_interval_s, run.counters["updates"]
        self.remote = None
        if run.dist.world_size > 1:
            self.remote = RemoteMembers(run, fingerprint(run, self.data), cfg.num_workers, FILE_PLACES, REPORTS,
                                        run.run_dir)
            run.defer(self.remote.close, {"reason": "rank 0 failed", "exit_code": 1})  # unless train() closed it
        self.supervisor = member_workers(run, self.args_for)
        run.log.info("train_ppo_multiprocess: %d workers x %d envs of %s%s, devices %s, target %s, run dir %s",
                     cfg.num_workers, cfg.num_envs_per_worker, cfg.env_id,
                     f" on each of {run.dist.world_size} ranks ({members} in all)" if self.remote else "",
                     sorted(set(self.devices)), self.target, run.run_dir)
        self.save()  # from the start, so that a resume always finds the population's counters
        if self.remote is not None:
            self.hand_over()
        self.supervisor.start()

    def hand_over(self) -> None:
        """Each other rank starts its workers once it has its members' newest checkpoints (on resume)."""
        for rank in self.remote.ranks:
            newest = [self.newest_checkpoint(m) for m in self.remote.members_of(rank)]
            self.remote.hand_over(rank, [path for path in newest if path is not None])

    def newest_checkpoint(self, index: int) -> Path | None:
        for directory in self.sources:
            found = checkpoints.latest_checkpoint(directory, rf"worker_{index}_(step_\d+|final)\.pt")
            if found is not None:
                return found
        return None

    def args_for(self, index: int) -> tuple:
        """Called at the start and at every restart: a worker always continues from its newest checkpoint."""
        cfg, latest = self.run.cfg, self.newest_checkpoint(index)
        return (WorkerSetup(index, config_dict(cfg), self.run.env_kwargs, str(self.run.run_dir), self.data_specs,
                            self.items, self.devices[index], self.threads, self.status[index].hyper, self.target,
                            str(latest) if latest else None),)

    # -- the run
    def train(self) -> None:
        run = self.run
        # --duration starts once this node's workers are up, as in the ultra mode: it is training time,
        # however long the workers took to start on a busy machine.
        while not self.supervisor.all_ready() and not run.graceful.requested:
            with run.budget.part("wait"):
                messages = self.poll(0.1)
            for message in messages:
                self.handle(message.index, message.kind, message.payload)
        run.start_duration()
        while any(s.active for s in self.status) and run.stop_reason() is None:
            with run.budget.part("wait"):
                messages = self.poll(0.5)
            for message in messages:
                self.handle(message.index, message.kind, message.payload)
            if run.checkpoint_due():
                self.save()
            self.log_status()
        if run.stop_reason() is None:
            run.request_stop("every worker is done (its step budget or its target return)")
        self.stop_workers()
        self.save()
        self.rank()
        failure = None if run.graceful.requested else self.failure()  # interrupted, the run exits 130 regardless
        if self.remote is not None:  # every rank ends as rank 0 does
            self.remote.close({**stop_message(run), **({"reason": f"failed: {failure}", "exit_code": 1}
                                                       if failure else {})})
        if failure is not None:
            raise failure

    def poll(self, timeout: float) -> list:
        """What the workers of every rank reported (the other ranks' through the relay)."""
        if self.remote is None:
            return self.supervisor.poll(timeout)
        return self.supervisor.poll(min(timeout, POLL_S)) + self.remote.poll()

    def tell(self, index: int, kind: str, payload: Any, files: dict[str, Path] | None = None) -> None:
        """A command for one worker, on this node or (with the files it names) on another."""
        if self.status[index].rank == 0:
            self.supervisor.send(index, kind, payload)
        else:
            self.remote.send(index, kind, payload, files)

    def stop_workers(self) -> None:
        """Every worker finishes its rollout, saves and reports (a duration's end also evaluates), or is killed."""
        reason, cfg = self.run.stop_reason(), self.run.cfg
        if reason is not None and any(s.active for s in self.status):
            self.run.log.info("stopping (%s): every worker finishes its rollout and saves (up to %.0f s)", reason,
                              cfg.stop_timeout_s)
            # The time budget ends training as planned (final checkpoints, evaluation); a signal
            # only interrupts it (checkpoints to continue from). Workers report by report_by (wall clock,
            # which other nodes share too), a moment before the end of stop_timeout_s: an evaluation
            # still running then ends with the episodes it finished rather than being killed.
            order = {"evaluate": not self.run.graceful.requested,
                     "report_by": time.time() + cfg.stop_timeout_s - min(REPORT_MARGIN_S, cfg.stop_timeout_s / 4)}
            self.supervisor.broadcast("stop", order)
            if self.remote is not None:
                self.remote.stop_members(order, cfg.stop_timeout_s)
        deadline = time.monotonic() + cfg.stop_timeout_s
        if self.remote is not None:  # the other ranks' final reports, while this node's workers stop too
            self.supervisor.request_stop()
            while (any(s.active and s.rank for s in self.status)
                   and time.monotonic() < deadline + REMOTE_STOP_SLACK_S):
                for message in self.poll(POLL_S):
                    self.handle(message.index, message.kind, message.payload)
        for message in self.supervisor.stop(max(0.0, deadline - time.monotonic())):
            self.handle(message.index, message.kind, message.payload)
        for status in self.status:
            if status.active and reason is not None:
                status.failures.append(f"stopped ({reason}) before it reported")

    def handle(self, index: int, kind: str, payload: Any) -> None:
        status, log = self.status[index], self.run.log
        if kind != "pbt_ready":
            # A worker waits for its PBT answer from its pbt_ready until it says anything else: then it has
            # stopped waiting (its wait timed out), finished, died or been lost, and takes no part in a round.
            self.pbt_waiting.pop(index, None)
        if kind == "ready":
            status.step, status.hyper = payload["step"], payload["hyper"]
            log.info("worker %d running (pid %d) from step %d%s", index, payload["pid"], payload["step"],
                     f" on rank {status.rank}" if status.rank else "")
        elif kind == "update":
            self.record(index, payload)
        elif kind == "pbt_ready":
            status.pbt_score, status.pbt_path, status.hyper = payload["score"], payload["path"], payload["hyper"]
            self.pbt_waiting[index] = payload["step"]
        elif kind == "pbt_copied":
            self.record_pbt_copy(index, payload)
        elif kind == "done":
            status.result = payload
            status.step, status.recent_return, status.sps = payload["step"], payload["recent_return"], payload["sps"]
            log.info("worker %d done at step %d (%s)", index, payload["step"],
                     "finished" if payload["finished"] else "stopped")
            self.check_evaluation(index, payload)
        elif kind == "diverged":
            status.diverged = payload["reason"]
            log.error("worker %d diverged: %s; it is stopped, the others go on", index, payload["reason"])
        elif kind == "restarted":
            status.restarts += 1
            status.failures.append(payload.splitlines()[-1])
            latest = self.newest_checkpoint(index)
            log.info("worker %d continues from %s", index, latest.name if latest else "scratch (no checkpoint yet)")
        elif kind == "given_up":
            status.gave_up = True
            status.failures.append(payload.splitlines()[-1])
        elif kind == "lost":
            status.lost = payload
            status.failures.append(payload)
            latest = self.newest_checkpoint(index)
            log.error("worker %d lost with its node (%s); its newest checkpoint here: %s; the others go on", index,
                      payload, latest.name if latest else "none")
        else:
            raise ValueError(f"worker {index} sent an unknown message {kind!r}")
        self.pbt_round()

    def check_evaluation(self, index: int, result: dict) -> None:
        """Say so where a finished worker's evaluation ended at the stop deadline (fewer episodes, or none)."""
        wanted, evaluation = self.run.cfg.eval_episodes, result.get("eval")
        if not result["finished"] or (evaluation is not None and evaluation["episodes"] >= wanted):
            return
        if evaluation is None:
            note = "no evaluation episode ended before the stop deadline (stop_timeout_s); not ranked"
            self.status[index].failures.append(note)
        else:
            note = (f"evaluation ended at the stop deadline (stop_timeout_s) after {evaluation['episodes']} of "
                    f"{wanted} episodes (leaderboard eval_episodes)")
        self.run.log.warning("worker %d: %s", index, note)

    def record(self, index: int, report: dict) -> None:
        """One worker's update: the population's counters, one metrics.csv row, the progress display."""
        run, status = self.run, self.status[index]
        status.step, status.recent_return, status.sps = report["step"], report["recent_return"], report["sps"]
        status.episodes += len(report["episodes"])
        run.budget.mark_first_step(report["started"])
        run.counters["global_step"] += report["steps"]  # every step taken, also ones a restart takes again
        run.counters["updates"] += 1
        run.record_episodes(report["episodes"])
        running = sum(s.active for s in self.status)
        run.write_metrics({"worker": index, "worker_step": report["step"], "worker_sps": report["sps"],
                           "worker_cpu_sps": report["cpu_sps"], "learning_rate": report["learning_rate"],
                           **report["stats"], "workers_running": running},
                          {"running": f"{running}/{len(self.status)}"})

    def log_status(self) -> None:
        """Every log_interval_s in which some worker reported, one line per worker in main.log."""
        if time.monotonic() < self.next_status_log or self.reported == self.run.counters["updates"]:
            return
        self.next_status_log = time.monotonic() + self.run.cfg.log_interval_s
        self.reported = self.run.counters["updates"]
        budget = self.run.cfg.max_steps_per_worker
        for index, s in enumerate(self.status):
            state = ("given up" if s.gave_up else "diverged" if s.diverged else "lost" if s.lost else
                     "done" if s.result else f"{s.sps:.0f} steps/s")
            self.run.log.info("  worker %d: step %d%s, recent return %.3f, %s", index, s.step,
                              f"/{budget}" if budget else "", s.recent_return, state)

    def pbt_round(self) -> None:
        """Synchronous PBT: once every running worker waits at a PBT step, the weakest copy the strongest.
        Each answer names the step it answers, so that a worker that stopped waiting can tell it is late."""
        if self.run.stop_reason() is not None:
            self.pbt_waiting = {}  # the stop order ends every wait; a copy now would be lost with the stop
            return
        if not self.pbt_waiting or any(s.active and i not in self.pbt_waiting for i, s in enumerate(self.status)):
            return
        cfg, waiting = self.run.cfg, dict(sorted(self.pbt_waiting.items()))
        self.pbt_waiting = {}
        workers = list(waiting)
        scores = [self.status[i].pbt_score for i in workers]
        for position, index in enumerate(workers):
            donor = pbt_donor(scores, position, cfg.pbt_fraction, self.pbt_rng)
            answer = {"step": waiting[index], **(self.pbt_offer(workers[donor]) if donor is not None else {})}
            # A worker on another node gets the donor's checkpoint with the answer (the bytes rank 0 holds).
            self.tell(index, "pbt", answer, {"path": Path(answer["path"])} if "path" in answer else None)

    def pbt_offer(self, donor: int) -> dict:
        """What a copier gets: the donor's checkpoint of this step and its hyperparameters, perturbed (explore)."""
        strong = self.status[donor]
        return {"donor": donor, "donor_score": strong.pbt_score, "path": strong.pbt_path,
                "hyper": perturb(strong.hyper, self.run.cfg.pbt_perturb, self.pbt_rng)}

    def record_pbt_copy(self, index: int, copy: dict) -> None:
        """A worker made the copy it was offered: its new hyperparameters, one more PBT event."""
        self.status[index].hyper = copy["hyper"]
        self.pbt_events.append({"step": copy["step"], "worker": index, "copied": copy["copied"],
                                "hyper": copy["hyper"]})
        self.run.log.info("PBT: worker %d (score %.3f) copies worker %d (score %.3f), new hyperparameters %s",
                          index, copy["score"], copy["copied"], copy["donor_score"], copy["hyper"])

    def save(self) -> None:
        """``checkpoints/population.pt``: the population's counters (the workers save their own agents)."""
        self.run.save_checkpoint({"pbt_events": self.pbt_events}, "population.pt")

    def state_dict(self) -> None:
        return None  # population.pt is written by train(), after the workers' final reports

    def failure(self) -> Exception | None:
        """What fails the run (exit 1) once every other worker is done: a worker diverged, given up, or
        lost with its node."""
        diverged = [f"worker {i}: {s.diverged}" for i, s in enumerate(self.status) if s.diverged]
        if diverged:
            newest = [self.newest_checkpoint(i) for i, s in enumerate(self.status) if s.diverged]
            self.run.last_good_checkpoint = next((p for p in newest if p is not None), None)
            return TrainingDiverged("; ".join(diverged))
        given_up = [i for i, s in enumerate(self.status) if s.gave_up]
        if given_up:
            return WorkerFailed(f"worker(s) {given_up} died more than --max-worker-restarts "
                                f"{self.run.cfg.max_worker_restarts} times; the others finished")
        lost = [i for i, s in enumerate(self.status) if s.lost]
        if lost:
            return WorkerFailed(f"worker(s) {lost} lost with their node; the others finished; --resume auto "
                                "continues them from their newest checkpoints")
        return None

    # -- the results
    def rank(self) -> None:
        """leaderboard.csv (best first, then a random policy on the same windows) and best.pt."""
        run, cfg = self.run, self.run.cfg
        rows = []
        for index, s in enumerate(self.status):
            result = s.result or {}
            if result.get("eval"):
                rows.append({"worker": index, "steps": s.step, "train_recent_return": s.recent_return,
                             "restarts": s.restarts, "pbt_exploits": result["pbt_exploits"], **result["hyper"],
                             "checkpoint": result["checkpoint"], **{f"eval_{k}": v for k, v in result["eval"].items()}})
        if not rows:
            return
        rows.sort(key=lambda r: -r["eval_mean_return"])
        for rank, row in enumerate(rows, start=1):
            row["rank"] = rank
        if cfg.eval_random_baseline:
            envs = envs_lib.make_vec_env(cfg.env_id, cfg.eval_num_envs, cfg.eval_seed,
                                         **split_kwargs(run.env_kwargs, "eval", self.data, self.items))
            # Bounded like the members' own evaluations: stop_timeout_s, or a Ctrl+C, ends it with the
            # episodes finished so far (the row's eval_episodes says how many).
            deadline = time.monotonic() + cfg.stop_timeout_s
            self.baseline = evaluate(envs, random_actions(envs.single_action_space, cfg.eval_seed),
                                     cfg.eval_episodes, cfg.eval_seed,
                                     stop=lambda: run.graceful.requested or time.monotonic() >= deadline)
        self.leaderboard = rows
        baseline_row = [{"worker": "random", **{f"eval_{k}": v for k, v in self.baseline.items()}}] \
            if self.baseline else []
        write_csv(run.run_dir / "leaderboard.csv", rows + baseline_row)
        copy_atomic(Path(rows[0]["checkpoint"]), run.run_dir / "best.pt")
        run.log.info("leaderboard: best is worker %d (eval mean return %.3f%s) -> best.pt", rows[0]["worker"],
                     rows[0]["eval_mean_return"],
                     f", random policy {self.baseline['mean_return']:.3f}" if self.baseline else "")

    def summary(self) -> dict[str, Any]:
        workers = [{"rank": s.rank, "step": s.step, "recent_return": s.recent_return, "sps": s.sps, "hyper": s.hyper,
                    "finished": bool(s.result and s.result["finished"]), "gave_up": s.gave_up,
                    "diverged": s.diverged, "lost": s.lost, "failures": s.failures, "restarts": s.restarts}
                   for s in self.status]
        return {"target_return": self.target, "target_per_worker": True, "cache": self.cache,
                "item_indices": self.items, "training_sps": round(sum(s.sps for s in self.status), 1),
                "population_size": len(self.status), "worker_restarts": sum(s.restarts for s in self.status),
                "workers": workers, "leaderboard": self.leaderboard, "random_baseline": self.baseline,
                "pbt_events": self.pbt_events,
                "best_worker": self.leaderboard[0]["worker"] if self.leaderboard else None,
                **(self.remote.summary() if self.remote else {})}

    def plots(self, run) -> list[dict]:
        return [{"plot": "population", "out": str(run.run_dir / "plots" / "population.png"),
                 "title": f"train_ppo_multiprocess: {run.cfg.env_id}, {run.cfg.num_workers} members"}]


class PopulationNode:
    """A rank other than 0 under torchrun: this node's members, coordinated by rank 0.

    It shares the market data into this node's memory and runs one worker per member as the
    coordinator does, but decides nothing: every report goes to rank 0 with the checkpoints it
    names (common.population_relay), and rank 0's answers (PBT, the stop) go to the workers. Their
    files live in a scratch directory of this node, removed at the end: rank 0 holds copies.
    """

    def __init__(self, run):
        self.run, cfg = run, run.cfg
        self.items = run.env.extra.get("item_indices")
        self.data, self.data_specs = share_market_data(run)
        self.first = run.dist.rank * cfg.num_workers
        self.hyper = worker_hyperparams(cfg, cfg.num_workers * run.dist.world_size, cfg.seed)
        self.devices = worker_devices(cfg, run.env.observation_space)
        self.threads = cfg.threads_per_worker or threads_per_process(cfg.num_workers)
        self.target, run.target_return = run.target_return, None
        run.counters.update(global_step=0, episodes=0, updates=0)  # this node's own, for its last log lines
        self.scratch = Path(tempfile.mkdtemp(prefix=f"prl-population-rank{run.dist.rank}-"))
        run.defer(shutil.rmtree, self.scratch, True)
        for sub in ("checkpoints", "logs"):
            (self.scratch / sub).mkdir()
        self.relay = MemberForwarder(run, fingerprint(run, self.data), cfg.num_workers, FILE_PLACES, COMMANDS,
                                     self.scratch)
        run.log.info("workers %d to %d of the population run here (local worker i is worker %d + i); their files "
                     "go to rank 0 as they report them, from %s", self.first, self.first + cfg.num_workers - 1,
                     self.first, self.scratch)
        self.supervisor = None
        if self.relay.receive_start():  # on resume, it brings our members' newest checkpoints
            self.supervisor = member_workers(run, self.args_for, name="local worker")
            self.supervisor.start()

    def args_for(self, index: int) -> tuple:
        cfg, member = self.run.cfg, self.first + index
        latest = checkpoints.latest_checkpoint(self.scratch / "checkpoints", rf"worker_{member}_(step_\d+|final)\.pt")
        return (WorkerSetup(member, config_dict(cfg), self.run.env_kwargs, str(self.scratch), self.data_specs,
                            self.items, self.devices[index], self.threads, self.hyper[member], self.target,
                            str(latest) if latest else None),)

    def train(self) -> None:
        if self.supervisor is not None:
            self.relay.serve(self.supervisor, self.files_of, self.count)

    def files_of(self, member: int, kind: str, payload: Any) -> dict[str, Path]:
        """What rank 0 must hold with this report: the checkpoint it names and, once the worker is
        through (done, diverged, given up), its log."""
        files = {key: Path(payload[key]) for key in ("checkpoint", "path")
                 if isinstance(payload, dict) and payload.get(key)}
        if kind in ("done", "diverged", "given_up"):
            files["log"] = self.scratch / "logs" / f"worker_{member}.log"
        return files

    def count(self, member: int, kind: str, payload: Any) -> None:
        if kind == "update":
            self.run.budget.mark_first_step(payload["started"])
            self.run.counters["global_step"] += payload["steps"]
            self.run.counters["updates"] += 1
            self.run.record_episodes(payload["episodes"])

    def state_dict(self) -> None:
        return None  # rank 0 saves the population


def pbt_donor(scores: list[float | None], index: int, fraction: float, rng: np.random.Generator) -> int | None:
    """The worker ``index`` should copy: one of the strongest ``fraction``, if ``index`` is among the
    weakest, every worker has a score, and the donor scores higher; else None."""
    if any(score is None for score in scores):
        return None
    ranked = sorted(range(len(scores)), key=lambda i: scores[i])
    cut = max(1, int(len(scores) * fraction))
    if index not in ranked[:cut]:
        return None
    donor = int(rng.choice(ranked[-cut:]))
    return donor if donor != index and scores[donor] > scores[index] else None


def perturb(hyper: dict[str, float], amount: float, rng: np.random.Generator) -> dict[str, float]:
    """PBT explore: scale each value by 1 - amount or 1 + amount (discounts on their 1 - x scale)."""
    out = {}
    for name, value in hyper.items():
        factor = 1.0 + amount * float(rng.choice([-1.0, 1.0]))  # plain floats: checkpoints load weights_only
        if name in ("gamma", "gae_lambda"):
            out[name] = round(min(0.9999, 1.0 - (1.0 - value) * factor), 6)
        else:
            out[name] = float(f"{value * factor:.6g}")
    return out


def write_csv(path: Path, rows: list[dict]) -> None:
    columns = ["rank", "worker", "eval_mean_return", "eval_std_return", "eval_episodes"]
    columns += sorted({k for r in rows for k in r if k.startswith("eval_mean_")} - set(columns))
    columns += ["steps", "train_recent_return", "restarts", "pbt_exploits", *PER_WORKER, "checkpoint"]
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in row.items()})
    os.replace(tmp, path)


def copy_atomic(source: Path, target: Path) -> None:
    tmp = target.with_name(f".{target.name}.tmp")
    tmp.write_bytes(source.read_bytes())
    os.replace(tmp, target)


# ------------------------------------------------------------------------------ the mode

WORKER_CHECKPOINT = re.compile(r"worker_\d+_(step_\d+|final)\.pt")


def probe(cfg) -> EnvInfo:
    """The env, checked before anything is written; Market-v0 loads its cache here, once, or builds the
    history in memory (share_market_data writes the cache once the run goes ahead: --validate-only writes
    nothing)."""
    if WORKER_CHECKPOINT.fullmatch(Path(cfg.resume or "").name) and Path(cfg.resume).is_file():
        cfg.resume = str(checkpoint_run_dir(Path(cfg.resume)))  # one worker's file: continue its population
    if not cfg.is_market:
        return probe_env(cfg.env_id, env_kwargs_of(MODE, cfg), ("Discrete", "Box"), cfg.seed)
    try:
        data, info = market.load_market_data(cfg.data_source, cfg.cache_dir, cfg.num_items, cfg.history_steps,
                                             cfg.data_seed, write=False)
        items = [int(i) for i in data.top_items(cfg.top_n_items)]
        for split in ("eval", "train"):  # fails early if the history is too short for a split
            env = market.MarketVectorEnv(1, **split_kwargs(env_kwargs_of(MODE, cfg), split, data, items))
            env.close()
    except market.MarketDataError as err:
        raise ConfigError("data_source", cfg.data_source, str(err)) from None
    shortfall = shm_shortfall(data.nbytes, "the market cache")
    if shortfall:
        raise ConfigError("data_source", cfg.data_source, shortfall)
    return EnvInfo(cfg.env_id, env.single_observation_space, env.single_action_space,
                   extra={"data": data, "item_indices": items, "cache": info})


MODE = Mode("train_ppo_multiprocess", CONFIG_GROUPS, population, description=__doc__.split("\n\n")[0],
            probe=probe, env_kwargs=market_kwargs, checkpoint_pattern=r"population\.pt", resume_requires=("counters",),
            check=check_learner,
            metrics_columns=["worker", "worker_step", "worker_sps", "worker_cpu_sps", "learning_rate",
                             "policy_loss", "value_loss", "entropy", "approx_kl", "clipfrac", "explained_variance",
                             "update_ms", "workers_running"],
            # Under torchrun every rank runs members; rank 0 coordinates them and writes. The ranks exchange
            # CPU arrays only (gloo), whatever devices the members train on.
            distributed=True, cpu_collectives=True)


def train(config: Config | None = None, **settings) -> dict:
    """The same run from Python: ``train(Config(env_id="CartPole-v1", num_workers=2))``; returns the
    summary (``summary.json``'s keys and ``run_dir``); see ``common.run.train_in_process``."""
    return train_in_process(MODE, config if config is not None else Config(**settings))


def main(argv: list[str] | None = None) -> int:
    return run_training(MODE, argv)


if __name__ == "__main__":
    sys.exit(main())
