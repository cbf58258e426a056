"""Synchronous parallel PPO on a wall-clock budget.

``--num-workers`` rollout processes each step ``--num-envs-per-worker`` environments with
the current policy for ``--n-steps`` steps, writing the rollout straight into shared
memory. The main process then computes GAE, runs the PPO update and publishes the new
parameters through shared memory, and the next rollout starts. ``--num-workers 0`` runs
the very same rollout code in the main process: the sequential baseline.

``--async-training`` overlaps the two: the workers collect rollout k+1 while the learner
runs update k on rollout k. They start it with the parameters the learner had when rollout k
came in and take up new ones at their next step whenever the learner publishes them, after
every epoch of the update (as Sample Factory's actors do), so a rollout is a fraction of an
update behind (``policy_lag`` in metrics.csv). The workers run 10 nicer than the learner, so that
where they share cores its update, which the fresher parameters wait on, goes first. The update is
then decoupled PPO: the ratio is clipped around the learner's own policy, and importance weights
carry the lag.

Started by ``torchrun``, every rank does the above with its own workers and the
gradients are averaged across ranks before every optimizer step (DD-PPO).

    python train_parallel_timed.py                       # LunarLander-v3 until solved
    python train_parallel_timed.py --config configs/cartpole_fast.yaml
    python train_parallel_timed.py --duration 1.0 --num-workers 4 --resume auto
    python train_parallel_timed.py --async-training      # collect while learning
"""

from __future__ import annotations  # noqa: I001 (common first: its numpy settings must precede numpy's import)

import common  # noqa: F401 (one BLAS thread per process, which numpy reads once as it loads: common/__init__.py)
import math
import os
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from common import distributed
from common.config import require, to_dict
from common.gae import flat_batch
from common.normalize import NormalizationSettings
from common.numpy_actor_critic import NumpyActing, actor_critic_shapes, acts_in_numpy, parameter_count
from common.ppo_learner import LEARNERS, PPOSettings, choose_learner, make_learner
from common.rollout import PublishedParams, RolloutCollector, describe_rollout, make_normalizer, rollout_layout
from common.run import Mode, RunConfig, TrainingDiverged, run_training, train_in_process
from common.shm import Seqlock, SharedArrays, attach_all
from common.supervisor import Supervisor, set_torch_threads
from common.system import resolve_device, threads_per_process

# torch, gymnasium and the environments (common.envs) are imported by the functions that use them, so that
# --help and --validate-only answer at once, and a worker acting in numpy never imports torch.


@dataclass
class Config(RunConfig, NormalizationSettings):
    env_id: str = "LunarLander-v3"  # any Gymnasium id with a Discrete or Box action space
    seed: int = 1  # environment i of the run is seeded seed + i
    num_workers: int = 2  # rollout processes; 0 runs the same loop in the main process (sequential baseline)
    num_envs_per_worker: int = 8  # environments each worker steps (the main process, with 0 workers)
    n_steps: int = 128  # steps per environment per rollout
    total_timesteps: int | None = 5_000_000  # stop after this many env steps (all workers together)
    total_episodes: int | None = None  # also stop after this many finished episodes
    duration: float | None = 0.17  # hours of wall time for this invocation; stops after the update in flight
    target_return: str | None = "auto"  # stop once the mean of the last 100 returns reaches this; auto = the env's own
    # The PPO settings below are the best of a 20-minute search on LunarLander-v3 (docs/search.md), as it found them:
    # over seeds 1-5 they reach 200 in 0.26M-0.57M env steps, where the earlier ones took 0.77M-1.76M.
    learning_rate: float = 0.0024053518404793615  # Adam step size (annealed linearly to 0 over total_timesteps)
    anneal_lr: bool = True  # linearly decay the learning rate
    gamma: float = 0.990733307498571  # discount factor
    gae_lambda: float = 0.9351947341265949  # GAE lambda
    batch_size: int = 256  # minibatch size; must divide the rollout (n_steps * envs in total)
    n_epochs: int = 7  # passes over each rollout
    clip_coef: float = 0.17306510474389675  # PPO surrogate (and value) clipping range
    clip_vloss: bool = False  # clip the value loss as in the PPO paper's code (slows learning of large returns)
    ent_coef: float = 0.016119598795958586  # entropy bonus
    vf_coef: float = 0.5  # value loss weight
    max_grad_norm: float = 0.5  # gradient-norm clipping
    norm_adv: bool = True  # normalize advantages per minibatch
    target_kl: float | None = None  # stop the epochs of an update early past this approximate KL
    hidden_sizes: list[int] = field(default_factory=lambda: [64, 64])  # actor and critic MLP widths
    activation: str = "tanh"  # of the hidden layers: tanh or relu
    log_std_init: float = 0.0  # Box actions: the first policy's log standard deviation (then learned)
    torch_threads: int = 1  # learner's torch threads (0 = every core); 64-wide MLPs update fastest on one
    device: str = "cpu"  # learner device: auto, cpu, cuda, cuda:N (small MLPs are fastest on CPU)
    # numpy updates an MLP policy on the CPU 1.5-2.2x faster than torch, without importing it (docs/performance.md)
    learner: str = "auto"  # auto (numpy for an MLP policy on the CPU outside torchrun, else torch), numpy or torch
    # Workers collect the next rollout while the learner updates, taking up its parameters after every epoch; needs
    # workers. Off by default: it takes LunarLander's median steps and a sixth less time per step on 2 cores, but
    # spreads wider over seeds, and only a synchronous run repeats exactly for its seed (docs/performance.md).
    async_training: bool = False  # collect while learning (a decoupled PPO update)

    MIN_WORKERS = 0

    def validate(self) -> None:
        super().validate()
        require(self.n_steps > 0, "n_steps", self.n_steps, "must be > 0")
        require(self.n_epochs > 0, "n_epochs", self.n_epochs, "must be > 0")
        rollout = self.n_steps * self.total_envs
        require(rollout % self.batch_size == 0, "batch_size", self.batch_size,
                f"must divide the rollout of n_steps * envs = {self.n_steps} * {self.total_envs} = {rollout}")
        require(0 <= self.gae_lambda <= 1, "gae_lambda", self.gae_lambda, "must be in [0, 1]")
        require(self.torch_threads >= 0, "torch_threads", self.torch_threads, "must be >= 0 (0 = all cores)")
        require(self.activation in ("tanh", "relu"), "activation", self.activation, "must be tanh or relu")
        require(self.learner in LEARNERS, "learner", self.learner, "must be auto, numpy or torch")
        require(not (self.async_training and self.num_workers == 0), "async_training", self.async_training,
                "needs num_workers >= 1 (with 0 workers the rollout runs in the learner's own process)")

    @property
    def total_envs(self) -> int:
        return max(1, self.num_workers) * self.num_envs_per_worker


# --------------------------------------------------------------------------- rollout
# The same function fills the rollout in a worker process and, with 0 workers, in the
# main process, so the sequential baseline measures exactly the same code.
#
# Shared memory holds the rollout (two with --async-training: the workers fill one while the
# learner learns from the other), the parameters and the normalization statistics. The learner
# publishes its parameters after every update (overlapped, after every epoch of it), under a seqlock
# (common.shm.Seqlock) whose version counts them; workers take up a new version at their next step, so an overlapped
# rollout acts with parameters at most one update old, and fresher with every epoch (Sample
# Factory's actors, too, take up new weights as soon as they exist). The statistics are a rollout's
# own: the learner writes them only while every worker is between rollouts, as the snapshot of the
# rollout it asks for next.

def rollout_arrays(arrays: SharedArrays, cfg: Config, obs_space, action_space, num_params: int,
                   norm_size: int) -> None:
    """Allocate the shared rollouts, ``rollout<slot>_<key>`` of ``[n_steps, envs, ...]`` (each worker
    owns a column slice), the parameters (``params``, ``params_versions``: a seqlock) and ``norm``."""
    layout = rollout_layout(cfg.n_steps, cfg.total_envs, obs_space, action_space)
    for slot in range(2 if cfg.async_training else 1):
        for key, (shape, dtype) in layout.items():
            arrays.create(f"rollout{slot}_{key}", shape, dtype)
    arrays.create("params", (1, num_params), np.float32)
    arrays.create("params_versions", (1, 2), np.int64)
    arrays.create("norm", (norm_size,), np.float64)


def rollout_buffers(cfg: Config, env) -> dict[str, int]:
    """Bytes of the shared rollouts :func:`rollout_arrays` allocates, and of the learner's batch built from one
    (normalized observations, advantages, returns: counted as one rollout's size)."""
    layout = rollout_layout(cfg.n_steps, cfg.total_envs, env.observation_space, env.action_space)
    one = sum(math.prod(shape) * np.dtype(dtype).itemsize for shape, dtype in layout.values())
    return {"rollout": (2 if cfg.async_training else 1) * one, "batch": one}


def policy_size(cfg: Config, obs_space, action_space) -> int:
    """How many parameters the policy has: counted from its shapes for an MLP, so that workers can start
    before this process imports torch; from a network built for the purpose for an image policy."""
    if acts_in_numpy(obs_space):
        return parameter_count(actor_critic_shapes(obs_space, action_space, cfg.hidden_sizes))
    from common.networks import ActorCritic, flat_size

    return flat_size(ActorCritic(obs_space, action_space, tuple(cfg.hidden_sizes)))


def split_rollouts(shared: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
    """The rollouts among the shared arrays, in slot order, each as ``{key: array}``."""
    rollouts: list[dict[str, np.ndarray]] = []
    while f"rollout{len(rollouts)}_obs" in shared:
        prefix = f"rollout{len(rollouts)}_"
        rollouts.append({name[len(prefix):]: array for name, array in shared.items() if name.startswith(prefix)})
    return rollouts


@dataclass(frozen=True)
class Snapshot:
    """What the learner published for one rollout: the version of its parameters then and the
    normalization statistics (flat, as ``Normalizer.publish`` writes them), with their digest."""

    version: int
    norm: np.ndarray
    digest: str


def shared_params(shared: dict[str, np.ndarray]) -> Seqlock:
    return Seqlock(shared["params"], shared["params_versions"])


def make_collector(cfg: Config, envs, buf: dict[str, np.ndarray], first_env: int, seed: int,
                   shared: dict[str, np.ndarray], learner=None):
    """A rollout collector over ``envs`` filling their columns of ``buf``, acting with the newest parameters
    the learner published in ``shared`` (or with ``learner`` itself, when it is a CPU network in this process).

    An MLP policy acts in numpy, so a worker process of one never imports torch (a second or more of
    its start-up); an image policy acts with a torch network."""
    spaces = envs.single_observation_space, envs.single_action_space
    cols = slice(first_env, first_env + envs.num_envs)
    published = PublishedParams(shared_params(shared))
    if acts_in_numpy(spaces[0]):
        acting = NumpyActing(*spaces, cfg.hidden_sizes, cfg.activation, published, seed)
    else:
        from common.networks import ActorCritic
        from common.ppo import TorchActing

        if learner is not None:
            acting, published = TorchActing(learner), None
        else:
            agent = ActorCritic(*spaces, tuple(cfg.hidden_sizes), cfg.activation, cfg.log_std_init)
            acting = TorchActing(agent, published)
    return RolloutCollector(acting, envs, buf, cols, make_normalizer(cfg, *spaces), published)


def collect_published(collector, shared: dict[str, np.ndarray], into: dict[str, np.ndarray],
                      n_steps: int) -> tuple[list[dict], dict]:
    """One rollout into the rollout ``into`` with the snapshot the learner published. Also returns what the
    learner checks (the first version of the parameters that acted, a digest of the statistics used), the
    steps acted with each version of the parameters, and when the rollout ran."""
    collector.normalizer.read(shared["norm"])
    collector.buf = into
    started = time.time()
    episodes = collector.collect(n_steps)
    versions = dict(collector.steps_by_version)
    return episodes, {"version": min(versions, default=0), "steps_by_version": versions,
                      "norm_digest": collector.normalizer.digest(), "started": started, "ended": time.time()}


WORKER_NICENESS = 10  # added to the learner's niceness in an overlapped run's workers


def rollout_worker(link, cfg_dict: dict, env_kwargs: dict, specs: dict, first_env: int, seed: int) -> None:
    """Worker process: owns ``num_envs_per_worker`` environments and a copy of the policy."""
    cfg = Config(**cfg_dict)
    if cfg.async_training:
        # Overlapped, the workers collect while the learner updates, and the next rollout's freshness waits on
        # that update: workers yield the cores it needs and fill the rest (Sample Factory's run 10 nicer than its
        # learner, too). Where cores outnumber processes this changes nothing; on 2 cores it roughly halves the
        # policy lag (docs/performance.md).
        os.nice(WORKER_NICENESS)
    from common.envs import make_vec_env

    shared, handles = attach_all(specs)
    rollouts = split_rollouts(shared)
    envs = make_vec_env(cfg.env_id, cfg.num_envs_per_worker, seed, first_index=first_env, **env_kwargs)
    if not acts_in_numpy(envs.single_observation_space):
        # A rollout step runs the policy on a handful of observations, where extra torch threads
        # only add wake-up latency (one LunarLander worker: 14.8k steps/s with one thread, 12.0k with two).
        set_torch_threads(1)
    try:
        collector = make_collector(cfg, envs, rollouts[0], first_env, seed, shared)
        link.ready()
        while True:
            command, slot = link.receive()
            if command == "stop":
                break
            if command != "collect":
                raise ValueError(f"worker {link.index}: unknown command {command!r}")
            episodes, report = collect_published(collector, shared, rollouts[slot], cfg.n_steps)
            link.send("collected", {"episodes": episodes, "slot": slot, **report})
    finally:
        envs.close()
        for arrays in (*rollouts, shared):
            arrays.clear()
        for handle in handles:
            handle.close()


class InProcessCollector:
    """Sequential baseline: the rollout runs in this process, with the same code as in a worker.

    An MLP policy acts in numpy from the published parameters, as in a worker; an image policy
    acts with the learner's own network on the CPU, or with a CPU copy refreshed from the published
    parameters when the learner lives on a GPU (rollouts step one small batch at a time, where a GPU
    only adds transfer latency). Collecting and learning take turns here (``async_training`` needs
    workers).
    """

    def __init__(self, run, shared: dict[str, np.ndarray], seed: int, cpu_agent=None):
        """``cpu_agent``: the learner's torch network when it is on the CPU (an image policy acts with it)."""
        from common.envs import make_vec_env

        self.cfg, self.shared, self.run = run.cfg, shared, run
        self.rollout = split_rollouts(shared)[0]
        envs = make_vec_env(self.cfg.env_id, self.cfg.num_envs_per_worker, seed, **run.env_kwargs)
        run.defer(envs.close)
        self.collector = make_collector(self.cfg, envs, self.rollout, 0, seed, shared, cpu_agent)

    def start(self, slot: int, snapshot: Snapshot) -> None:
        pass  # the rollout runs in wait(), in the one slot there is

    def wait(self) -> tuple[list[dict], float, dict[int, int]] | None:
        """The finished episodes of one rollout, the seconds it took and its steps by parameter version."""
        self.run.budget.mark_first_step()
        episodes, report = collect_published(self.collector, self.shared, self.rollout, self.cfg.n_steps)
        return episodes, report["ended"] - report["started"], report["steps_by_version"]


class WorkerCollector:
    """``num_workers`` processes, each filling its own columns of the shared rollout.

    A worker that dies is reported and restarted by the supervisor; its share of the rollout
    is then collected again, with the same statistics (the learner publishes the next ones only
    once it holds the whole rollout) and the newest parameters.
    """

    def __init__(self, run, arrays: SharedArrays, seed: int):
        cfg, specs, cfg_dict = run.cfg, arrays.specs(), to_dict(run.cfg)
        self.run = run

        def args_for(index: int) -> tuple:
            lives = self.supervisor.workers[index].restarts if hasattr(self, "supervisor") else 0
            # A restarted worker gets fresh seeds so it does not replay the episodes it died in.
            return cfg_dict, run.env_kwargs, specs, index * cfg.num_envs_per_worker, seed + 1_000_003 * lives

        self.supervisor = run.supervise(Supervisor(
            rollout_worker, cfg.num_workers, args_for, name="worker", max_restarts=cfg.max_worker_restarts,
            start_timeout_s=max(cfg.worker_timeout_s, 120.0), hang_timeout_s=cfg.worker_timeout_s, logger=run.log))
        self.supervisor.start()
        self.pending: set[int] = set()

    def start(self, slot: int, snapshot: Snapshot) -> None:
        """Ask every worker for its share of a rollout into ``slot``, acting with ``snapshot`` (published)."""
        self.slot, self.snapshot = slot, snapshot
        self.pending = set(range(self.run.cfg.num_workers))
        for index in self.pending:
            self.supervisor.send(index, "collect", slot)

    def wait(self) -> tuple[list[dict], float, dict[int, int]] | None:
        """The finished episodes of the rollout started last, the seconds it took (the workers' clocks) and its
        steps by parameter version, or None if a stop was requested meanwhile."""
        episodes, spans, versions = [], [], Counter()
        while self.pending:
            if self.run.graceful.requested:
                return None
            for message in self.supervisor.poll(0.5):
                if message.kind == "collected" and message.index in self.pending:
                    self.check(message)
                    self.run.budget.mark_first_step(message.payload["started"])
                    episodes.extend(message.payload["episodes"])
                    spans.append((message.payload["started"], message.payload["ended"]))
                    versions.update(message.payload["steps_by_version"])
                    self.pending.discard(message.index)
                elif message.kind == "restarted" and message.index in self.pending:
                    self.supervisor.send(message.index, "collect", self.slot)  # redo its share, same snapshot
        return episodes, max(end for _, end in spans) - min(start for start, _ in spans), dict(versions)

    def check(self, message) -> None:
        """The worker filled the rollout asked for, with the statistics published for it and parameters no
        older than those published then (newer ones may arrive while it collects)."""
        got, want = message.payload, self.snapshot
        if (got["slot"], got["norm_digest"]) != (self.slot, want.digest) or got["version"] < want.version:
            raise RuntimeError(
                f"worker {message.index} filled rollout {got['slot']} acting with parameters {got['version']} "
                f"(statistics {got['norm_digest']}), but the learner published parameters {want.version} "
                f"(statistics {want.digest}) for rollout {self.slot}")


# --------------------------------------------------------------------------- learner
# The PPO learner of common/ppo_learner.py: an MLP policy on the CPU in one process learns in numpy
# (common/numpy_ppo.py), without torch's per-operation overhead and without importing torch before the first
# update; images, GPUs and DD-PPO (whose gradients torch.distributed averages) learn with torch. Both save the
# same checkpoint, so a run can resume with either.

def ppo_settings(cfg: Config) -> PPOSettings:
    # Overlapped, a rollout was collected partly by the policy of the update before: a decoupled update.
    return PPOSettings(cfg.n_epochs, cfg.batch_size, cfg.clip_coef, cfg.clip_vloss, cfg.ent_coef, cfg.vf_coef,
                       cfg.max_grad_norm, cfg.norm_adv, cfg.target_kl, decoupled=cfg.async_training)


def check_learner(cfg: Config, env) -> None:
    """Refuse ``--learner numpy`` where it cannot learn, before anything is written (exit 2)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1")) if distributed.launched_by_torchrun() else 1
    choose_learner(cfg.learner, resolve_device(cfg.device), env.observation_space, world_size)


def build_learner(run, spaces):
    """This rank's learner, numpy or torch (``--learner``), from the checkpoint when the run resumes; its
    minibatch order is seeded by the seed and the updates done so far (a resumed run does not replay its first)."""
    cfg, dist = run.cfg, run.dist
    device = resolve_device(cfg.device)
    name = choose_learner(cfg.learner, device, spaces[0], dist.world_size)
    if name == "torch":
        import torch

        # Synchronous workers sit idle while the learner updates: --torch-threads 0 gives the update every
        # core (every core the workers leave free when they collect meanwhile).
        busy = 1 + cfg.num_workers if cfg.async_training else 1
        torch.set_num_threads(cfg.torch_threads or threads_per_process(busy))
    return make_learner(name, *spaces, cfg, cfg.learning_rate, ppo_settings(cfg), seed=cfg.seed,
                        shuffle_seed=cfg.seed + run.counters["updates"], device=device, dist=dist, state=run.resumed)


class PPOTrainer:
    """The learner: publish a snapshot, collect a rollout, GAE, PPO update; repeat. With
    ``async_training`` it asks for the next rollout before it updates on this one."""

    def __init__(self, run):
        cfg, dist = run.cfg, run.dist
        self.run, self.cfg, self.dist = run, cfg, dist
        spaces = run.env.observation_space, run.env.action_space
        self.normalizer = make_normalizer(cfg, *spaces)
        self.behaviour = make_normalizer(cfg, *spaces)  # a rollout's own
        arrays = SharedArrays()
        run.defer(arrays.unlink_all)
        rollout_arrays(arrays, cfg, *spaces, policy_size(cfg, *spaces), self.normalizer.size())
        self.shared = {key: arrays[key] for key in arrays.specs()}
        self.rollouts = split_rollouts(self.shared)
        self.params = shared_params(self.shared)
        self.progress: dict[int, float] = {}  # parameter version -> the updates it had, in fractions of one
        run.log.info("%s%s", describe_rollout(self.rollouts[0], spaces[0]),
                     " x 2 (one filled while the other is learned from)" if cfg.async_training else "")
        seed = cfg.seed + dist.rank * cfg.total_envs  # ranks never share an environment seed
        # Workers start first: they build their envs (and, acting in numpy, never import torch) while this
        # process builds the learner.
        self.collector = WorkerCollector(run, arrays, seed) if cfg.num_workers else None
        np.random.seed(cfg.seed)
        self.learner = build_learner(run, spaces)
        # A resumed run learns at the configured rate (annealed from it), not at the one its checkpoint ended with.
        self.learner.learning_rate = cfg.learning_rate
        if run.resumed is not None:
            self.normalizer.load_state_dict(run.resumed)
        self.publish()
        if self.collector is None:
            self.collector = InProcessCollector(run, self.shared, seed, self.learner.cpu_agent)
        run.log.info("train_parallel_timed: %s, %d worker(s) x %d envs, rollout %d steps, %s, %s learner on %s, "
                     "world size %d%s, run dir %s", cfg.env_id, cfg.num_workers, cfg.num_envs_per_worker,
                     cfg.n_steps * cfg.total_envs, "collecting while learning" if cfg.async_training else "synchronous",
                     self.learner.name, self.learner.device, dist.world_size,
                     f" (backend {dist.backend})" if dist.world_size > 1 else "", run.run_dir)

    def stop_reason(self) -> str | None:
        """Every rank stops after the same update: a signal anywhere, or rank 0's decision."""
        # A signal that reached some ranks only stops every rank, and each exits with its status (130/143).
        signum = self.dist.highest(self.run.graceful.signum or 0)
        if signum:
            if not self.run.graceful.requested:
                self.run.graceful.signum = signum
            return "interrupted"
        reason = self.dist.agree_on_stop(self.run.stop_reason())
        if reason is not None:  # every rank's log and summary give the reason it stopped for, rank 0's
            self.run.request_stop(reason)
        return reason

    def train(self) -> None:
        run, cfg = self.run, self.cfg
        slot, in_flight = 0, None  # the rollout being collected: its slot and its snapshot
        while self.stop_reason() is None:
            if in_flight is None:  # synchronous, or the first rollout of an overlapped run
                in_flight = self.request_rollout(slot)
            started = time.perf_counter()
            # Synchronous, the learner waits for the whole rollout; overlapped, for what its update did not hide.
            with run.budget.part("wait" if cfg.async_training else "collect"):
                collected = self.collector.wait()
            wait_seconds = time.perf_counter() - started
            if self.dist.any_rank(collected is None):
                return  # a signal arrived during the rollout: skip its update and save
            episodes, collect_seconds, steps_by_version = collected
            behaviour, in_flight = in_flight, None
            lag = self.policy_lag(steps_by_version)
            if cfg.async_training:  # the next rollout starts with these parameters, and takes up each epoch's
                in_flight = self.request_rollout(1 - slot)
            with run.budget.part("learn"):
                stats, update_seconds = self.update(self.rollouts[slot], behaviour)
            self.record(episodes, {**stats, "policy_lag": lag}, collect_seconds, update_seconds, wait_seconds)
            if run.checkpoint_due():
                run.save_checkpoint(self.state_dict())
            slot = (slot + 1) % len(self.rollouts)
        # An overlapped run stops with a rollout in flight: its workers finish it and stop; it is not learned.

    def publish(self, epochs: int = 0) -> None:
        """Publish the parameters, after ``epochs`` epochs of the update in progress (overlapped, after every
        epoch: the workers collect with each epoch's parameters from their next step on)."""
        version = self.params.write(self.learner.publish)
        self.progress[version] = self.run.counters["updates"] + epochs / self.cfg.n_epochs
        self.progress.pop(version - 16 * self.cfg.n_epochs, None)  # far older than any rollout in flight

    def policy_lag(self, steps_by_version: dict[int, int]) -> float:
        """How many updates (in fractions of one) the parameters that collected a rollout were behind the
        learner's when it starts to learn from it, averaged over the rollout's steps: 0 when synchronous."""
        now = self.progress[self.params.version()]
        steps = sum(steps_by_version.values())
        return sum((now - self.progress[v]) * n for v, n in steps_by_version.items()) / steps if steps else 0.0

    def request_rollout(self, slot: int) -> Snapshot:
        """Publish the statistics as they are now, and have the rollout in ``slot`` collected with them and the
        newest parameters (workers are between rollouts whenever this runs)."""
        self.normalizer.publish(self.shared["norm"])
        snapshot = Snapshot(self.params.version(), self.shared["norm"].copy(), self.normalizer.digest())
        self.collector.start(slot, snapshot)
        return snapshot

    def update(self, filled: dict[str, np.ndarray], behaviour: Snapshot) -> tuple[dict[str, float], float]:
        """GAE and the PPO update on the rollout ``filled``, collected with the snapshot ``behaviour``.

        GAE uses the values the rollout stored, the behaviour policy's: the rollout keeps neither the
        observation after its last step nor the final observations at time limits, only their values, so
        stored values are the ones consistent with those bootstraps (Sample Factory's APPO also bootstraps
        GAE from the actors' values). Synchronous, the PPO ratio is taken against the log-probabilities the
        rollout stored. Overlapped, the steps collected before the learner's previous update ended acted with
        older parameters (``policy_lag``), and the update is decoupled (``common.ppo_learner.PPOSettings``).
        """
        cfg, started = self.cfg, time.perf_counter()
        if cfg.anneal_lr and cfg.total_timesteps:
            frac = max(0.0, 1.0 - self.run.counters["global_step"] / cfg.total_timesteps)
            self.learner.learning_rate = frac * cfg.learning_rate
        # The batch is normalized with the statistics the rollout was collected with (overlapped, the
        # learner's own have taken in one more rollout since); only then does this rollout enter them.
        self.behaviour.read(behaviour.norm)
        batch = flat_batch(filled, cfg.gamma, cfg.gae_lambda, self.behaviour)
        self.normalizer.update(filled["obs"], filled["disc_returns"], self.dist.total)
        # Overlapped, the workers collect during the update and take up each epoch's parameters; synchronous,
        # they wait for the next rollout, so one copy after the update is enough (from a GPU, a device copy).
        stats = self.learner.update(batch, self.publish if cfg.async_training else None)
        if not cfg.async_training:
            self.publish(cfg.n_epochs)
        return stats, time.perf_counter() - started

    def record(self, episodes: list[dict], stats: dict, collect_seconds: float, update_seconds: float,
               wait_seconds: float) -> None:
        run, dist = self.run, self.dist
        allreduce = (dist.allreduce_seconds, dist.allreduce_bytes)
        dist.allreduce_seconds, dist.allreduce_bytes = 0.0, 0
        params_hash = self.learner.params_digest()
        steps = self.cfg.n_steps * self.cfg.total_envs
        total_steps, all_episodes, rank_hashes = dist.gather_progress(steps, episodes, params_hash)
        run.counters["global_step"] += total_steps
        run.counters["updates"] += 1
        run.record_episodes(all_episodes)
        run.write_metrics({"collect_sps": total_steps / max(1e-9, collect_seconds),
                           "learning_rate": self.learner.learning_rate, **stats,
                           "update_ms": 1000 * update_seconds, "wait_ms": 1000 * wait_seconds,
                           "allreduce_ms": 1000 * allreduce[0], "allreduce_kib": allreduce[1] / 1024,
                           "params_hash": ":".join(rank_hashes), "world_size": dist.world_size},
                          {"restarts": run.worker_restarts})
        if len(set(rank_hashes)) > 1:
            raise TrainingDiverged(f"ranks hold different parameters after update {run.counters['updates']}")
        if not (math.isfinite(stats["policy_loss"]) and math.isfinite(stats["value_loss"])):
            raise TrainingDiverged(f"loss became {stats['policy_loss']} at update {run.counters['updates']}")

    def state_dict(self) -> dict:
        return {**self.learner.state_dict(), **self.normalizer.state_dict()}

    def summary(self) -> dict:
        return {"async_training": self.cfg.async_training, "learner": self.learner.name,
                "device": str(self.learner.device)}


MODE = Mode("train_parallel_timed", Config, PPOTrainer, description=__doc__.split("\n\n")[0],
            actions=("Discrete", "Box"), resume_requires=("model", "optimizer"), distributed=True, check=check_learner,
            buffers=rollout_buffers, shm_buffers=("rollout",),
            metrics_columns=["collect_sps", "learning_rate", "policy_loss", "value_loss", "entropy", "approx_kl",
                             "clipfrac", "explained_variance", "policy_lag", "update_ms", "wait_ms", "allreduce_ms",
                             "allreduce_kib", "params_hash", "world_size"])


def train(config: Config | None = None, env_factory=None, **fields) -> dict:
    """The same run from Python (``common.run.train_in_process``), its summary back: ``summary.json``'s keys
    and ``run_dir``::

        summary = train(Config(env_id="CartPole-v1"))  # or train(env_id="CartPole-v1")
        summary = train(Config(env_kwargs=["length=8"]), env_factory=MyEnv)  # your env class or function
    """
    return train_in_process(MODE, config if config is not None else Config(**fields), env_factory)


def main(argv: list[str] | None = None) -> int:
    return run_training(MODE, argv)


if __name__ == "__main__":
    sys.exit(main())
