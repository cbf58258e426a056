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

This file holds the config and the agent (``Agent``: rollouts, PPO updates, checkpoints, reports, the
member's side of PBT, evaluation). common.population runs one agent per process and coordinates them
(restarts, PBT's rounds, the stop, the leaderboard). Under torchrun every rank runs ``num_workers``
members of one population, numbered globally (rank r's worker i is member ``r * num_workers + i``):
rank 0 coordinates them all and alone writes the run directory, and the other ranks forward their
workers' reports and checkpoints to it (common.population_relay).

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

import math
import re
import sys
import time
from collections import deque
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

from common.checkpoint import CheckpointError, load_checkpoint, rng_state, save_checkpoint, set_rng_state
from common.config import ConfigError, require, require_env_id, require_positive
from common.gae import flat_batch
from common.normalize import NormalizationSettings
from common.numpy_actor_critic import acts_in_numpy
from common.population import Members, Population, check_member_values
from common.population_member import (
    BEST_AGENT,
    MEMBER_CHECKPOINTS,
    MemberSetup,
    Orders,
    evaluate_policy,
    member_checkpoint,
    member_checkpoints,
    policy_actions,
    split_kwargs,
)
from common.population_relay import PopulationNode
from common.population_relay import fingerprint as population_fingerprint
from common.ppo_learner import LEARNERS, PPOSettings, choose_learner, make_learner
from common.run import (
    RECENT,
    EnvInfo,
    FlatConfig,
    Mode,
    RunConfig,
    checkpoint_run_dir,
    env_kwargs_of,
    probe_env,
    run_training,
    train_in_process,
)
from common.supervisor import WorkerConfigError
from common.system import assign_devices, shm_shortfall

# torch, gymnasium and the modules that load them are imported inside the functions that use them,
# so that --help and --validate-only answer without loading torch.

PER_WORKER = ("learning_rate", "gamma", "gae_lambda", "clip_coef", "ent_coef")  # may differ between workers


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
        check_member_values(ppo_cfg, PER_WORKER, train.num_workers)  # one value, one per member, or a range


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
        require(self.learner in LEARNERS, "learner", self.learner, "must be auto, numpy or torch")


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


# ------------------------------------------------------------------------------ the agent
# Everything down to "the mode" runs inside a worker process (common.population_member.member_process).

class Agent:
    """One independent PPO agent: rollouts, updates, checkpoints, reports, PBT, evaluation."""

    def __init__(self, link, setup: MemberSetup, data, log):
        import torch

        from common import rollout
        from common.envs import make_vec_env

        self.link, self.setup, self.data, self.log = link, setup, data, log
        self.orders = Orders(link, setup.member, log)  # the coordinator's stop order and PBT answers
        self.cfg = cfg = config_from_dict(setup.config)
        self.index, self.hyper = setup.member, dict(setup.hyper)
        # torch's generator too, whichever learner runs: a sampled evaluation draws from it, checkpoints keep it.
        torch.manual_seed(cfg.seed + self.index)
        np.random.seed(cfg.seed + self.index)
        n = cfg.num_envs_per_worker
        self.envs = make_vec_env(cfg.env_id, n, cfg.seed, first_index=self.index * n,
                                 **split_kwargs(setup.env_kwargs, "train", data, setup.item_indices))
        obs_space, action_space = self.envs.single_observation_space, self.envs.single_action_space
        seed = cfg.seed + 7919 * self.index
        # An MLP policy on the CPU learns in numpy (common/numpy_ppo.py): the same network, loss and Adam
        # without torch's per-operation overhead, about twice as fast an update on the market's 333 inputs.
        name = choose_learner(cfg.learner, setup.device, obs_space)
        self.learner = make_learner(name, obs_space, action_space, cfg, self.hyper["learning_rate"],
                                    self.ppo_settings(), seed=cfg.seed + self.index, shuffle_seed=seed,
                                    device=setup.device)
        acting = self.learner.acting(seed)
        self.counters = {"global_step": 0, "episodes": 0, "updates": 0, "wall_time": 0.0, "pbt_exploits": 0,
                         "recent_returns": []}
        self.normalizer = rollout.make_normalizer(cfg, obs_space, action_space, self.hyper["gamma"])
        if setup.checkpoint:
            self.restore(setup.checkpoint)
            self.learner.seed_minibatches(seed + self.counters["updates"])  # not the order of its first updates
        self.recent = deque(self.counters["recent_returns"], maxlen=RECENT)
        layout = rollout.rollout_layout(cfg.n_steps, n, obs_space, action_space)
        self.buf = {key: np.zeros(shape, dtype) for key, (shape, dtype) in layout.items()}
        # Each agent is its own learner: its normalization statistics are its own too.
        self.collector = rollout.RolloutCollector(acting, self.envs, self.buf, slice(None), self.normalizer)
        self.clock = (time.monotonic(), time.process_time(), self.counters["global_step"], self.counters["wall_time"])
        log.info("worker %d: pid %d, device %s (%s learner), %d envs of %s, hyperparameters %s", self.index,
                 os.getpid(), self.learner.device, self.learner.name, n, cfg.env_id, self.hyper)
        log.info("worker %d %s", self.index, rollout.describe_rollout(self.buf, obs_space))

    def ppo_settings(self) -> PPOSettings:
        """The next update's settings: this worker's own clip_coef and ent_coef (PBT may change them)."""
        cfg, h = self.cfg, self.hyper
        return PPOSettings(cfg.n_epochs, cfg.batch_size, h["clip_coef"], cfg.clip_vloss, h["ent_coef"], cfg.vf_coef,
                           cfg.max_grad_norm, cfg.norm_adv, cfg.target_kl)

    # -- checkpoints
    def restore(self, path: str) -> None:
        """Continue from one of this worker's checkpoints; one that cannot fit is a configuration error."""
        try:
            state = load_checkpoint(path, map_location=self.learner.device,
                                    required=("model", "optimizer", "counters", "hyper", "rng"))
            self.learner.load_state_dict(state)
        except (CheckpointError, RuntimeError, ValueError) as err:
            reason = str(err).strip().splitlines()[0][:200]
            raise WorkerConfigError(f"worker {self.index} cannot continue from {path}: {reason}") from None
        self.normalizer.load_state_dict(state)
        self.hyper = dict(state["hyper"])  # PBT may have changed them
        self.normalizer.gamma = self.hyper["gamma"]
        self.counters.update(state["counters"])
        set_rng_state(state["rng"])
        self.log.info("worker %d resumed from %s at step %d", self.index, path, self.counters["global_step"])

    def save(self, name: str) -> Path:
        """The same keys as the lifecycle's checkpoints, so ``build_network(ckpt["policy"])`` rebuilds the agent."""
        c = self.counters
        c["recent_returns"], c["wall_time"] = list(self.recent), self.wall_time()
        state = {"script": MODE.script, "config": self.setup.config, "counters": dict(c),
                 "env": {"id": self.cfg.env_id, "kwargs": self.setup.env_kwargs},
                 "rng": rng_state(), **self.learner.state_dict(), **self.normalizer.state_dict(),
                 "worker": self.index, "hyper": dict(self.hyper),
                 "item_indices": self.setup.item_indices}
        path = save_checkpoint(state, Path(self.setup.run_dir) / "checkpoints" / name)
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
            saved = self.save(member_checkpoint(self.index, c["global_step"])) if self.crossed(
                cfg.checkpoint_every, rollout) else None
            self.report(episodes, stats, rollout, started, saved)
            if cfg.pbt_interval and self.crossed(cfg.pbt_interval, rollout) and not self.done():
                self.pbt_step(saved)
            self.orders.read()
        return True

    def update(self) -> dict[str, float] | None:
        h = self.hyper
        started = time.perf_counter()
        batch = flat_batch(self.buf, h["gamma"], h["gae_lambda"], self.normalizer)
        self.normalizer.update(self.buf["obs"], self.buf["disc_returns"])  # after the batch used the old statistics
        self.learner.settings = self.ppo_settings()
        stats = self.learner.update(batch)
        self.counters["updates"] += 1
        if not (self.learner.finite() and math.isfinite(stats["policy_loss"]) and math.isfinite(stats["value_loss"])):
            reason = f"loss became {stats['policy_loss']} at update {self.counters['updates']}"
            self.log.error("worker %d: %s; stopping without saving", self.index, reason)
            self.link.send("diverged", {"reason": reason})
            return None
        return {**stats, "update_ms": 1000 * (time.perf_counter() - started)}

    def set_learning_rate(self) -> None:
        """This worker's own rate (PBT may have changed it), annealed over its step budget when anneal_lr is on.
        Set before every update: a checkpoint or a PBT donor's optimizer state carries another rate."""
        budget = self.cfg.max_steps_per_worker
        frac = max(0.0, 1.0 - self.counters["global_step"] / budget) if self.cfg.anneal_lr and budget else 1.0
        self.learner.learning_rate = frac * self.hyper["learning_rate"]

    def crossed(self, every: int, rollout: int) -> bool:
        """Did the last rollout pass a multiple of ``every`` steps?"""
        step = self.counters["global_step"]
        return step // every > (step - rollout) // every

    def done(self) -> bool:
        budget = self.cfg.max_steps_per_worker
        return (self.orders.stopped or (budget is not None and self.counters["global_step"] >= budget)
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
                                  "learning_rate": self.learner.learning_rate, "started": started,
                                  "recent_return": self.recent_return(), "checkpoint": str(saved or ""),
                                  **self.rates()})
        self.log.info("update %d: step %d, episodes %d, recent return %.3f, policy loss %.4f, value loss %.4f, "
                      "entropy %.3f, %.0f ms", c["updates"], c["global_step"], c["episodes"], self.recent_return(),
                      stats["policy_loss"], stats["value_loss"], stats["entropy"], stats["update_ms"])

    def pbt_step(self, saved: Path | None) -> None:
        """Report the score and a fresh checkpoint; the coordinator may answer: copy a stronger worker.
        A copy made is reported (``pbt_copied``): the coordinator counts only copies that happened."""
        step = self.counters["global_step"]
        path = saved or self.save(member_checkpoint(self.index, step))
        score = float(np.mean(self.recent)) if self.recent else -math.inf
        self.link.send("pbt_ready", {"step": step, "score": score, "path": str(path), "hyper": dict(self.hyper)})
        answer = self.orders.pbt_answer(step, self.cfg.worker_timeout_s)
        if answer is None:
            return
        donor = load_checkpoint(answer["path"], map_location=self.learner.device, required=("model", "optimizer"))
        self.learner.load_state_dict(donor)
        self.normalizer.load_state_dict(donor)  # the copied weights expect the donor's view of the world
        self.hyper = dict(answer["hyper"])
        self.normalizer.gamma = self.hyper["gamma"]
        self.counters["pbt_exploits"] += 1
        self.recent.clear()
        self.log.info("PBT: copied worker %d (score %.3f vs ours %.3f); hyperparameters now %s",
                      answer["donor"], answer["donor_score"], score, self.hyper)
        self.link.send("pbt_copied", {"step": step, "copied": answer["donor"], "score": score,
                                      "donor_score": answer["donor_score"], "hyper": dict(self.hyper)})

    def finish(self) -> None:
        """Done: the final checkpoint and an evaluation, or, when stopped early, a checkpoint to continue from.
        The evaluation ends by the stop order's ``report_by`` (with the episodes it finished), so that the
        coordinator hears from this worker before it kills what is left at the end of stop_timeout_s."""
        c = self.counters
        finished = self.orders.finishes
        path = self.save(member_checkpoint(self.index, None if finished else c["global_step"]))
        result = {"step": c["global_step"], "episodes": c["episodes"], "recent_return": self.recent_return(),
                  "hyper": self.hyper, "pbt_exploits": c["pbt_exploits"], "finished": finished,
                  "checkpoint": str(path), "eval": self.evaluate() if finished else None, **self.rates()}
        if result["eval"]:
            self.log.info("worker %d evaluation: %s", self.index, result["eval"])
        self.envs.close()
        self.link.send("done", result)

    def evaluate(self) -> dict[str, float] | None:
        from common.envs import make_vec_env

        cfg = self.cfg
        envs = make_vec_env(cfg.env_id, cfg.eval_num_envs, cfg.eval_seed,
                            **split_kwargs(self.setup.env_kwargs, "eval", self.data, self.setup.item_indices))
        policy = policy_actions(self.learner.torch_network(), envs.single_action_space, cfg.eval_deterministic,
                                self.normalizer)

        def act(obs: np.ndarray, masks) -> np.ndarray:
            # Evaluation episodes can be long (a greedy Atari policy that never serves plays on until the
            # 108k-frame limit): keep telling the coordinator we are alive, or it kills us as hung.
            self.link.beat()
            return policy(obs, masks)

        return evaluate_policy(envs, act, cfg.eval_episodes, cfg.eval_seed, stop=self.orders.past_report_by)


# ------------------------------------------------------------------------------ the mode

def population(run):
    """The trainer of every rank: the coordinator on rank 0 (and on one machine), a node of members elsewhere.
    Either runs one ``Agent`` per member of this rank."""
    members = Members.of_rank(run, Agent, PER_WORKER, worker_devices(run.cfg, run.env.observation_space),
                              MODE.fingerprint)
    return Population(run, members) if run.is_main else PopulationNode(run, members)


def fingerprint(run) -> dict:
    """What a rank must share with rank 0 to train members of this population (see
    common.population_relay.fingerprint): this script's code, the settings, the env and the market history."""
    return population_fingerprint(run, run.env.extra.get("data"), __file__)


def check_learner(cfg, env) -> None:
    """Refuse ``--learner numpy`` where a worker could not learn with it, before anything is written (exit 2)."""
    for device in worker_devices(cfg, env.observation_space):
        choose_learner(cfg.learner, device, env.observation_space)


def worker_devices(cfg, observation_space) -> list[str]:
    """Each of this rank's workers' device: worker i on cuda:(i mod G) with --gpu-strategy round-robin (G =
    --num-gpus or every visible GPU), all on one GPU with single or an explicit cuda:N, CPU without CUDA.
    ``auto`` uses the GPUs for a CNN policy (image observations) only: MLP policies train faster on the CPU."""
    return assign_devices(cfg.num_workers, cfg.device, cfg.gpu_strategy, cfg.num_gpus,
                          gpu_pays=not acts_in_numpy(observation_space))


def probe(cfg) -> EnvInfo:
    """The env, checked before anything is written; Market-v0 loads its cache here, once, or builds the
    history in memory (share_market_cache writes the cache once the run goes ahead: --validate-only writes
    nothing)."""
    from common.envs import market

    if re.fullmatch(member_checkpoints(), Path(cfg.resume or "").name) and Path(cfg.resume).is_file():
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


def market_cache(cfg, env) -> dict[str, int]:
    """The synthetic Market-v0's history, which the run shares through /dev/shm (common.envs.market.MarketData:
    float32 prices and volumes, one row per item): counted, since building it to measure it takes seconds."""
    return {"cache": cfg.num_items * cfg.history_steps * 2 * np.dtype(np.float32).itemsize} if cfg.is_market else {}


MODE = Mode("train_ppo_multiprocess", CONFIG_GROUPS, population, description=__doc__.split("\n\n")[0],
            probe=probe, env_kwargs=market_kwargs, checkpoint_pattern=r"population\.pt", resume_requires=("counters",),
            check=check_learner, fingerprint=fingerprint, buffers=market_cache, shm_buffers=("cache",),
            result_files=(BEST_AGENT,), member_checkpoints=MEMBER_CHECKPOINTS,  # what common.evaluate plays
            metrics_columns=["worker", "worker_step", "worker_sps", "worker_cpu_sps", "learning_rate",
                             "policy_loss", "value_loss", "entropy", "approx_kl", "clipfrac", "explained_variance",
                             "update_ms", "workers_running"],
            # Under torchrun every rank runs members; rank 0 coordinates them and writes. The ranks exchange
            # CPU arrays only (gloo), whatever devices the members train on.
            distributed=True, cpu_collectives=True)


def train(config: Config | None = None, env_factory=None, **settings) -> dict:
    """The same run from Python: ``train(Config(env_id="CartPole-v1", num_workers=2))``, or your own env class
    or function with ``train(config, env_factory=MyEnv)``; returns the summary (``summary.json``'s keys and
    ``run_dir``); see ``common.run.train_in_process``."""
    return train_in_process(MODE, config if config is not None else Config(**settings), env_factory)


def main(argv: list[str] | None = None) -> int:
    return run_training(MODE, argv)


if __name__ == "__main__":
    sys.exit(main())
