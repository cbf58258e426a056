"""Asynchronous actor-learner DQN over a replay buffer in shared memory (Ape-X style).

``--num-workers`` actor processes (``common.dqn_actors``) each step ``--num-envs-per-worker``
environments with one batched forward pass per step, each actor with its own exploration rate,
and write n-step transitions straight into a replay buffer in shared memory (no transition is
pickled).
The learner (this process; GPU when present) samples large batches and runs Double DQN
(``common.dqn.DQNLearner``: target network, gradient accumulation, mixed precision where it
is safe, optionally prioritized replay) at ``--replay-ratio`` gradient updates per env
transition, and publishes its weights through shared memory with a version counter that the
actors poll. ``--no-async-training`` alternates collecting and learning instead, for comparison.

Under ``torchrun`` rank 0 runs all of the above, and every other rank runs only its own
``--num-workers`` actors, whose transitions its main process ships to rank 0's replay in
batches (``common.transition_relay``); the weights go back the same way
(docs/multi-node.md#ultra_parallel_train_dqnpy-ape-x).

Checkpoints: ``checkpoints/ultra_model_ep<N>.pt`` (the newest ``--keep-checkpoints``) and, when
the run finishes, ``ultra_final_model.pth`` in the run directory.

    python ultra_parallel_train_dqn.py                                   # GridCoverage-v0
    python ultra_parallel_train_dqn.py --config configs/ultra_cartpole.yaml
    python ultra_parallel_train_dqn.py --num-workers 8 --prioritized --duration 0.5 --resume auto
    torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint HOST:29400 --rdzv-id apex \
        ultra_parallel_train_dqn.py --num-workers 8 --output-dir runs/apex      # on each machine
"""

from __future__ import annotations

import os

# Idle OpenMP threads must sleep, not spin: spinning threads collapse throughput as soon as
# the cores are shared with actors or anything else (see "Threads" in docs/conventions.md).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import math
import re
import shutil
import sys
import time
from collections import deque
from dataclasses import dataclass, field, replace

import numpy as np

from common.config import aliased, require, require_positive
from common.distributed import launched_by_torchrun
from common.envs.grid_coverage import VIEWS as GRID_VIEWS
from common.rank_exchange import code_digest, stop_message
from common.replay import fit_buffer_size, storage_dtype
from common.replay_shm import ReplayLayout, make_replay
from common.run import Mode, RunConfig, run_training, train_in_process
from common.runlog import RecentRate, of_budget
from common.shm import SharedArrays
from common.supervisor import WorkerFailed
from common.system import resolve_device

# torch and the modules that import it (common.dqn, common.dqn_actors, common.networks,
# common.transition_relay) are imported where they are used, so that --help and --validate-only
# answer without loading it.

DEFAULT_BUFFER = 200_000
CHECKPOINT_PATTERN = r"ultra_model_ep\d+\.pt|latest\.pt"
FINAL_MODEL = "ultra_final_model.pth"  # the final model, in the run directory (what common.evaluate plays)


@aliased  # seed 001's names (n_workers, n_episodes, envs_per_worker) read and write the same fields
@dataclass
class Config(RunConfig):
    env_id: str = "GridCoverage-v0"  # any Gymnasium id with a Discrete action space and a Box observation
    seed: int = 1  # environment i of the run is seeded seed + i
    grid_size: int | None = None  # GridCoverage-v0 only: side of the grid (None = the env's default, 6)
    grid_view: str = "egocentric"  # GridCoverage-v0 only: egocentric (maps centred on the agent) or global
    num_workers: int = 2  # actor processes (per rank under torchrun: every rank runs this many)
    num_envs_per_worker: int = 16  # environments each actor steps together (one batched forward pass)
    total_timesteps: int | None = None  # stop after this many env steps, all actors together (None = no limit)
    total_episodes: int | None = 100_000  # stop after this many finished training episodes (None = no limit)
    duration: float | None = None  # hours of wall time for this invocation (None = no limit)
    target_return: str | None = "auto"  # stop once the mean of the last 100 returns reaches this; auto = the env's own
    target_coverage: float | None = None  # stop once the mean coverage of the last 100 episodes reaches this
    async_training: bool = True  # learn while actors collect; false alternates collect and learn phases
    sync_steps: int = 16  # sync mode: vector steps each actor takes per collect phase
    learning_rate: float = 2.5e-4  # Adam step size
    anneal_lr: bool = False  # decay the learning rate linearly to 0 over the budget (duration, steps or episodes)
    gamma: float = 0.99  # discount factor
    batch_size: int = 256  # transitions per micro-batch
    grad_accum_steps: int = 1  # micro-batches per gradient update (effective batch = batch_size * this)
    buffer_size: int | None = None  # replay capacity in transitions, split among actors (None = 200 000 or what fits)
    learning_starts: int = 2_000  # transitions in the buffer before learning starts
    replay_ratio: float = 0.03125  # gradient updates per env transition the learner keeps to (it waits beyond it)
    rate_limit: bool = True  # async: actors also wait when the learner falls behind replay_ratio (false = Ape-X)
    rate_limit_slack: int | None = None  # async: env steps actors may run ahead of the learner (None = derived)
    n_step: int = 3  # n-step returns (1 = plain one-step TD targets)
    target_update_interval: int = 250  # gradient updates between target-network updates
    tau: float = 1.0  # target update rate (1 = hard copy)
    max_grad_norm: float = 10.0  # gradient-norm clipping
    hidden_sizes: list[int] = field(default_factory=lambda: [256, 256])  # Q-network MLP widths
    epsilon_start: float = 1.0  # exploration rate at the start (before the per-actor spread)
    epsilon_end: float = 0.4  # base rate after the decay; actor i uses eps ** (1 + epsilon_alpha * i / (n - 1))
    epsilon_decay_steps: int = 50_000  # env steps (all actors) over which epsilon decays from start to end
    epsilon_alpha: float = 7.0  # Ape-X spread of exploration rates across actors (0 = all equal)
    prioritized: bool = False  # proportional prioritized replay (priorities computed by actors on insertion)
    per_alpha: float = 0.6  # how strongly priorities skew sampling
    per_beta: float = 0.4  # importance-sampling correction at the start, annealed to 1 over the run
    mixed_precision: str = "auto"  # auto (fp32, measured fastest for these networks), bf16, fp16 (CUDA), off
    weight_poll_steps: int = 1  # actors check for new weights every this many vector steps
    replay_backend: str = "auto"  # auto (shared memory, else messages to the learner), shm, queue (messages)
    ship_interval_s: float = 0.05  # under torchrun: seconds between an actor rank's batches to rank 0 (and new weights)
    save_replay: bool = False  # also save the replay buffer with each checkpoint (large)
    device: str = "auto"  # learner device: auto, cpu, cuda, cuda:N
    save_every_episodes: int = 5_000  # write checkpoints/ultra_model_ep<N>.pt every this many episodes (and by time)
    keep_checkpoints: int = 5  # periodic checkpoints kept (older ones are deleted)
    metrics_interval_s: float = 1.0  # seconds between metrics.csv rows

    ALIASES = {"n_workers": "num_workers", "n_episodes": "total_episodes", "envs_per_worker": "num_envs_per_worker"}

    @property
    def num_actors(self) -> int:
        """Actors of the whole run: num_workers on every rank of a torchrun job."""
        return self.num_workers * torchrun_ranks()

    @property
    def min_slack(self) -> int:
        """The least rate-limit slack that cannot stall: n-step windows of every env, and one update's transitions."""
        return self.n_step * self.num_envs_per_worker * self.num_actors + math.ceil(1 / self.replay_ratio)

    @property
    def slack(self) -> int:
        return self.rate_limit_slack if self.rate_limit_slack is not None else max(5_000, 2 * self.min_slack)

    def validate(self) -> None:
        super().validate()
        require_positive(self, "sync_steps", "grad_accum_steps", "buffer_size", "replay_ratio", "n_step",
                         "target_update_interval", "tau", "max_grad_norm", "weight_poll_steps", "save_every_episodes",
                         "keep_checkpoints", "metrics_interval_s", "epsilon_decay_steps", "rate_limit_slack",
                         "ship_interval_s")
        require(self.grid_size is None or self.grid_size >= 2, "grid_size", self.grid_size, "must be >= 2")
        require(self.grid_size is None or self.env_id == "GridCoverage-v0", "grid_size", self.grid_size,
                "applies to GridCoverage-v0 only")
        require(self.grid_view in GRID_VIEWS, "grid_view", self.grid_view, f"must be one of {GRID_VIEWS}")
        require(self.learning_starts >= 0, "learning_starts", self.learning_starts, "must be >= 0")
        require(self.rate_limit_slack is None or self.rate_limit_slack >= self.min_slack, "rate_limit_slack",
                self.rate_limit_slack, f"must be >= {self.min_slack} (n_step * envs in total + 1 / replay_ratio) or "
                "the rate limiter could stall learner and actors; leave it unset to derive it")
        require(self.tau <= 1, "tau", self.tau, "must be in (0, 1]")
        for name in ("epsilon_start", "epsilon_end", "per_beta"):
            require(0 <= getattr(self, name) <= 1, name, getattr(self, name), "must be in [0, 1]")
        for name in ("epsilon_alpha", "per_alpha"):
            require(getattr(self, name) >= 0, name, getattr(self, name), "must be >= 0")
        require(self.replay_backend in ("auto", "shm", "queue"), "replay_backend", self.replay_backend,
                "must be auto, shm or queue")
        require(self.async_training or torchrun_ranks() == 1, "async_training", self.async_training,
                "must be true under torchrun with several ranks (remote actors do not wait for collect phases)")
        require(self.mixed_precision in ("auto", "bf16", "fp16", "off"), "mixed_precision", self.mixed_precision,
                "must be auto, bf16, fp16 or off")
        require(self.mixed_precision != "fp16" or resolve_device(self.device).startswith("cuda"), "mixed_precision",
                "fp16", "needs a CUDA device (use bf16 on CPU)")
        if self.buffer_size is not None:
            self.check_buffer(self.buffer_size)

    def check_buffer(self, capacity: int) -> None:
        actors = self.num_actors
        slots = capacity // actors * actors
        require(self.learning_starts <= slots, "learning_starts", self.learning_starts,
                f"must not exceed the replay capacity ({slots} slots)")
        burst = self.n_step * self.num_envs_per_worker  # most transitions one vector step can emit
        require(capacity // actors >= burst, "buffer_size", capacity,
                f"must hold n_step * num_envs_per_worker = {burst} transitions per actor ({actors} actors)")

    def grid_kwargs(self) -> dict:
        if self.env_id != "GridCoverage-v0":
            return {}
        return {"view": self.grid_view, **({"size": self.grid_size} if self.grid_size is not None else {})}


UltraTrainingConfig = Config  # the name seed 001 promised its users


def torchrun_ranks() -> int:
    """Ranks of the torchrun job this process belongs to (1 outside torchrun), known before any
    process group exists: the config is checked before the ranks meet."""
    return int(os.environ["WORLD_SIZE"]) if launched_by_torchrun() else 1


def check_memory(cfg: Config, env) -> None:
    """The replay buffer must fit in RAM (and /dev/shm, with ``--replay-backend shm``): one the user sized
    is refused if not, the default shrinks to fit."""
    layout = ReplayLayout(1, 1, env.observation_space.shape, storage_dtype(env.observation_space).name,
                          cfg.prioritized)
    least = max(cfg.learning_starts + cfg.num_actors, cfg.n_step * cfg.num_envs_per_worker * cfg.num_actors)
    cfg.buffer_size, note = fit_buffer_size(cfg.buffer_size, DEFAULT_BUFFER, layout.nbytes(),
                                            shared=cfg.replay_backend == "shm", minimum=least)
    cfg.check_buffer(cfg.buffer_size)
    env.extra["notes"] = [note] if note else []


def replay_layout(cfg: Config, env) -> ReplayLayout:
    """Rank 0's replay: buffer_size slots, one partition per actor of every rank (rank r's block follows r - 1's)."""
    space = env.observation_space
    return ReplayLayout(cfg.buffer_size, cfg.num_actors, space.shape, storage_dtype(space).name, cfg.prioritized)


def replay_buffers(cfg: Config, env) -> dict[str, int]:
    """The shared replay :func:`replay_layout` describes (DEFAULT_BUFFER slots where buffer_size is unset)."""
    if cfg.buffer_size is None:
        cfg = replace(cfg, buffer_size=DEFAULT_BUFFER)
    return {"replay": replay_layout(cfg, env).nbytes()}


# --------------------------------------------------------------------------- learner

class UltraTrainer:
    """The learner: sample, update, publish, at the replay ratio, while the actors collect.

    Under torchrun (rank 0) it also serves the actor ranks (``common.transition_relay.RemoteActors``):
    their transitions go into their own partitions of the replay, their env steps and episodes
    into the run's counters, and the weights and the rate limit go back with every reply."""

    def __init__(self, run):
        from common.dqn import DQNLearner
        from common.dqn_actors import STEPS_BEFORE, control_arrays, start_actors
        from common.networks import SharedParams, flat_size
        from common.transition_relay import RemoteActors

        cfg, env, counters = run.cfg, run.env, run.counters
        self.run, self.cfg, self.world = run, cfg, run.dist.world_size
        self.learner = DQNLearner.for_run(run)
        self.recent_coverage = deque(counters.setdefault("recent_coverage", []), maxlen=100)
        arrays = SharedArrays()
        run.defer(arrays.unlink_all)
        control_arrays(arrays, cfg.num_workers)
        self.params = SharedParams.allocate(arrays, flat_size(self.learner.q_net))
        self.params.publish(self.learner.q_net)
        self.shared = {name: arrays[name] for name in arrays.specs()}
        self.rank_episodes = [0] * self.world  # episodes each rank finished in this invocation
        self.allowed: int | None = None  # the rate limiter's bound on every rank's env steps together
        self.ranks = RemoteActors(run, MODE.fingerprint(run), self.params) if self.world > 1 else None
        # env steps of each actor rank in this invocation, as it reported them (kept by self.ranks)
        self.remote_steps: dict[int, int] = self.ranks.steps if self.ranks is not None else {}
        self.step_offset = counters["global_step"]
        self.shared["control"][STEPS_BEFORE] = self.step_offset
        self.replay = self.make_replay()
        self.cursor_base = self.replay.arrays["cursors"].copy()  # where this invocation's transitions start
        self.updates_base, self.inserted_base = self.learner.updates, self.replay.inserted()  # again at the start
        self.count_steps()
        self.window = self.new_window()
        self.episode_rate = RecentRate(cfg.log_interval_s, counters["episodes"])  # the progress line's eps/s
        self.saved_at: tuple[int, int] | None = None  # (updates, steps) of the newest checkpoint
        self.last_saved_episodes = counters["episodes"]
        for note in env.extra.get("notes", []):
            run.log.info("%s", note)
        self.supervisor = start_actors(run, arrays.specs(), self.replay.writer_spec, rank=0)
        layout = self.replay.layout
        limit = f"rate-limit slack {cfg.slack} steps" if cfg.async_training and cfg.rate_limit else "no rate limit"
        run.log.info("ultra_parallel_train_dqn: %s, %d actor(s) x %d envs%s, %s, replay %d slots (%s, %.1f MiB, %s), "
                     "replay ratio %g (%s), learner on %s (precision %s), run dir %s", cfg.env_id, cfg.num_workers,
                     cfg.num_envs_per_worker, f" on each of {self.world} ranks" if self.world > 1 else "",
                     "async" if cfg.async_training else "sync", layout.slots,
                     self.replay.backend, layout.nbytes() / 2**20, "prioritized" if cfg.prioritized else "uniform",
                     cfg.replay_ratio, limit, self.learner.device, self.learner.precision, run.run_dir)

    def make_replay(self):
        cfg, run = self.cfg, self.run
        replay = make_replay(replay_layout(cfg, run.env), cfg.replay_backend, alpha=cfg.per_alpha)
        run.defer(replay.close)
        run.log.info("%s", replay.describe())
        replay.seed(cfg.seed)
        replay_file = run.run_dir / "checkpoints" / "replay.npz"
        if run.resumed is not None and cfg.save_replay and replay_file.exists():
            try:
                with np.load(replay_file) as saved:
                    replay.load_state(dict(saved))
                run.log.info("replay buffer restored: %d transitions", len(replay))
            except ValueError as err:  # the run changed its buffer (size, actors): it refills, as Ape-X would
                run.log.warning("replay buffer not restored from %s, %s; it fills again", replay_file, err)
        return replay

    # -- the loop
    def train(self) -> None:
        self.train_until_stopped()
        if self.ranks is not None:  # after the last checkpoint: every rank ends as this one
            self.ranks.stop(stop_message(self.run))

    def train_until_stopped(self) -> None:
        from common.dqn_actors import GO

        run, cfg = self.run, self.cfg

        def stop_waiting() -> bool:
            self.poll_ranks()  # a signal on an actor rank stops the start-up too
            return run.graceful.requested

        for message in self.supervisor.wait_ready(stop=stop_waiting):
            self.handle(message)
        if run.graceful.requested:
            self.save()  # a resumed run keeps its checkpoint under the ultra names; a fresh one has nothing yet
            return
        run.start_clock()  # the training clock (and --duration) starts once every actor is up
        run.budget.mark_first_step()
        self.window = self.new_window()
        self.episode_rate = RecentRate(cfg.log_interval_s, run.counters["episodes"])
        self.updates_base, self.inserted_base = self.learner.updates, self.replay.inserted()
        self.allow_inserts()
        self.shared["control"][GO] = 1
        self.share_with_ranks(force=True)
        try:
            while run.stop_reason() is None:
                if self.checkpoint_due():
                    self.save()  # before the next update: the last good state, should that update diverge
                if cfg.async_training:
                    self.step_async()
                else:
                    self.step_sync()
                if time.monotonic() - self.window["time"] >= cfg.metrics_interval_s:
                    self.record()
            self.poll(0.0)  # episodes already in the pipes belong to this run's last metrics row
        except WorkerFailed:
            self.save()  # the run cannot go on without that actor, but what it learned so far is kept
            raise
        self.record()
        self.save(final=run.stop_reason() != "interrupted")

    def step_async(self) -> None:
        if self.may_learn():
            with self.run.budget.part("learn"):
                self.learn_once()
            self.params.publish(self.learner.q_net)
            self.allow_inserts()
            self.poll(0.0)
        else:
            with self.run.budget.part("wait"):
                self.poll(0.0005)  # actors are behind the replay ratio (or the buffer is filling)

    def step_sync(self) -> None:
        """Every actor takes sync_steps vector steps with the same weights, then the learner catches up."""
        shared, graceful = self.shared, self.run.graceful
        shared["collect_until"][:] = shared["actor_vsteps"] + self.cfg.sync_steps
        with self.run.budget.part("collect"):
            while (shared["actor_vsteps"] < shared["collect_until"]).any() and not graceful.requested:
                self.poll(0.0005)
            self.poll(0.0)
        with self.run.budget.part("learn"):
            while self.may_learn() and not graceful.requested:
                self.learn_once()
        self.params.publish(self.learner.q_net)

    def may_learn(self) -> bool:
        inserted = self.replay.inserted() - self.inserted_base  # this invocation's, as the rate limiter counts
        updates = self.learner.updates - self.updates_base
        return len(self.replay) >= self.cfg.learning_starts and updates + 1 <= self.cfg.replay_ratio * inserted

    def allow_inserts(self) -> None:
        """Rate limiter: the env steps actors may reach before the learner's next updates.

        The bound holds for the actors of every rank together: this rank's may go as far as the
        bound less what the actor ranks took (each actor rank gets the same sum in its replies)."""
        from common.dqn_actors import ALLOWED

        cfg = self.cfg
        if cfg.async_training and cfg.rate_limit:
            updates = self.learner.updates - self.updates_base
            self.allowed = cfg.learning_starts + cfg.slack + int(updates / cfg.replay_ratio)
        others = sum(self.remote_steps.values())
        self.shared["control"][ALLOWED] = np.iinfo(np.int64).max if self.allowed is None else self.allowed - others

    def learn_once(self) -> None:
        cfg, counters = self.cfg, self.run.counters
        progress = self.run.budget_used()
        self.learner.anneal(progress)
        stats = self.learner.update(self.replay, cfg.batch_size, cfg.per_beta + (1 - cfg.per_beta) * progress)
        counters["updates"] = self.learner.updates
        self.window["losses"].append(stats["loss"])
        self.window["updates"] += 1
        self.window["rejected"] += stats["rejected"]

    def poll(self, timeout: float) -> None:
        """What the actors sent (episodes; transitions for a message-fed buffer), deaths and restarts handled;
        then what the actor ranks sent."""
        for message in self.supervisor.poll(timeout):
            self.handle(message)
        self.poll_ranks()
        self.replay.sync()
        self.count_steps()

    def count_steps(self) -> None:
        # What the summary reports per rank is what global_step counted (the actors step on until stopped).
        self.counted = self.rank_steps(), self.replay.arrays["cursors"] - self.cursor_base
        self.run.counters["global_step"] = self.step_offset + sum(self.counted[0])

    def rank_steps(self) -> list[int]:
        """Env steps each rank's actors took in this invocation, rank 0 first (a lost rank keeps its count)."""
        return [int(self.shared["actor_steps"].sum())] + [self.remote_steps.get(r, 0) for r in range(1, self.world)]

    def handle(self, message) -> None:
        if message.kind == "transitions":
            self.replay.receive(message.index, message.payload)
        elif message.kind == "episodes":
            self.count_steps()
            self.record_episodes(message.payload)

    def record_episodes(self, episodes: list[dict], rank: int = 0) -> None:
        run, cfg = self.run, self.cfg
        run.record_episodes(episodes)
        self.rank_episodes[rank] += len(episodes)
        coverage = [e["coverage"] for e in episodes if "coverage" in e]
        self.recent_coverage.extend(coverage)
        self.window["coverage"] += coverage
        self.window["episodes"] += len(episodes)
        mean = self.coverage_mean100()
        if cfg.target_coverage is not None and mean is not None and mean >= cfg.target_coverage:
            run.request_stop(f"target coverage {cfg.target_coverage} reached (mean of the last 100 = {mean:.3f})")

    # -- the actor ranks (under torchrun)
    def poll_ranks(self) -> None:
        if self.ranks is None:
            return
        self.ranks.receive(self.replay, self.episodes_from_rank)
        self.allow_inserts()
        self.share_with_ranks()

    def episodes_from_rank(self, episodes: list[dict], rank: int) -> None:
        self.count_steps()
        self.record_episodes(episodes, rank)

    def share_with_ranks(self, force: bool = False) -> None:
        """What the next replies to the actor ranks carry: the start flag, the rate limit, every rank's steps
        and, when the learner has published newer ones, the weights (at most every ship_interval_s)."""
        from common.dqn_actors import GO

        if self.ranks is not None and (force or self.ranks.share_due()):
            self.ranks.share({"go": bool(self.shared["control"][GO]), "allowed": self.allowed,
                              "rank_steps": self.rank_steps()})

    def new_window(self) -> dict:
        return {"time": time.monotonic(), "steps": self.run.counters["global_step"], "episodes": 0, "losses": [],
                "updates": 0, "rejected": 0, "coverage": [], "rank_steps": self.rank_steps()}

    def coverage_mean100(self) -> float | None:
        return float(np.mean(self.recent_coverage)) if len(self.recent_coverage) == 100 else None

    def record(self) -> None:
        """One metrics row: the window since the last one (none if the actors took no step meanwhile)."""
        from common.dqn_actors import actor_epsilon

        cfg, run, window, shared = self.cfg, self.run, self.window, self.shared
        now = time.monotonic()
        if run.counters["global_step"] == window["steps"]:
            return
        seconds = max(1e-9, now - window["time"])
        epsilons = [actor_epsilon(cfg, i, cfg.num_actors, run.counters["global_step"]) for i in (0, cfg.num_actors - 1)]
        version = self.params.version(0)
        rank_sps = [(now_steps - then) / seconds for now_steps, then in zip(self.rank_steps(), window["rank_steps"])]
        row = {"coverage": _mean(window["coverage"]), "coverage_mean100": self.coverage_mean100(),
               "loss": _mean(window["losses"]), "learning_rate": self.learner.learning_rate,
               "epsilon_max": max(epsilons), "epsilon_min": min(epsilons),
               "buffer_size": len(self.replay), "buffer_fill": len(self.replay) / self.replay.layout.slots,
               "learner_updates": self.learner.updates, "updates_per_s": window["updates"] / seconds,
               "samples_per_s": window["updates"] * cfg.batch_size * cfg.grad_accum_steps / seconds,
               "episodes_per_s": window["episodes"] / seconds,
               "policy_lag": float(version - shared["actor_version"].mean()), "weights_version": version,
               "torn_samples_skipped": window["rejected"], "rank_sps": ":".join(f"{v:.0f}" for v in rank_sps)}
        progress = {"buf": len(self.replay), "loss": row["loss"], "upd/s": round(row["updates_per_s"]),
                    "lag": round(row["policy_lag"], 1)}
        if self.recent_coverage:
            progress = {"cov": f"{100 * np.mean(self.recent_coverage):.1f}%", **progress}
        if cfg.total_episodes:  # seed 001's budget: the episodes done of it, and how fast they come
            progress = {"episodes": of_budget(run.counters["episodes"], cfg.total_episodes),
                        "eps/s": round(self.episode_rate.update(run.counters["episodes"], now), 1), **progress}
        run.write_metrics(row, progress)
        self.window = self.new_window()

    # -- checkpoints
    def checkpoint_due(self) -> bool:
        episodes = self.run.counters["episodes"]
        return self.run.checkpoint_due() or episodes >= self.last_saved_episodes + self.cfg.save_every_episodes

    def save(self, final: bool = False) -> None:
        """checkpoints/ultra_model_ep<N>.pt (the newest keep_checkpoints kept); ultra_final_model.pth at the end."""
        run, cfg, counters = self.run, self.cfg, self.run.counters
        if counters["global_step"] == 0 and run.resumed is None:
            return  # stopped before the first step: nothing worth saving
        counters["recent_coverage"] = list(self.recent_coverage)
        path = run.save_checkpoint(self.learner.state_dict(), f"ultra_model_ep{counters['episodes']}.pt")
        self.saved_at, self.last_saved_episodes = (self.learner.updates, counters["global_step"]), counters["episodes"]
        if final:  # a copy, atomically: the name users ask for
            tmp = run.run_dir / f".{FINAL_MODEL}.tmp"
            shutil.copyfile(path, tmp)
            os.replace(tmp, run.run_dir / FINAL_MODEL)
        if cfg.save_replay:
            tmp = run.run_dir / "checkpoints" / ".replay.tmp.npz"
            np.savez(tmp, **self.replay.state())
            os.replace(tmp, run.run_dir / "checkpoints" / "replay.npz")
        periodic = sorted((p for p in path.parent.iterdir() if re.fullmatch(r"ultra_model_ep\d+\.pt", p.name)),
                          key=lambda p: int(re.findall(r"\d+", p.name)[-1]))
        for old in periodic[:-cfg.keep_checkpoints]:
            if old != path:
                old.unlink(missing_ok=True)

    def state_dict(self) -> dict | None:
        """What the lifecycle saves at the end: nothing when train() already saved this state itself."""
        if self.saved_at == (self.learner.updates, self.run.counters["global_step"]):
            return None
        return self.learner.state_dict()

    def summary(self) -> dict:
        cfg, (steps, written) = self.cfg, self.counted
        return {"async_training": cfg.async_training, "prioritized": cfg.prioritized,
                "precision": self.learner.precision, "replay_backend": self.replay.backend,
                "buffer_size": cfg.buffer_size, "final_mean_coverage": self.coverage_mean100(),
                "rank_steps": {str(r): n for r, n in enumerate(steps)},
                "rank_transitions": {str(r): int(n) for r, n in enumerate(written.reshape(self.world, -1).sum(1))},
                "rank_episodes": {str(r): n for r, n in enumerate(self.rank_episodes)},
                **(self.ranks.summary() if self.ranks is not None else {})}

    def plots(self, run) -> list[dict]:
        cfg = run.cfg
        return [{"plot": "ultra_results", "out": str(run.run_dir / "plots" / "ultra_training_results.png"),
                 "title": f"ultra_parallel_train_dqn: {cfg.env_id}, {cfg.num_workers} actor(s) x "
                          f"{cfg.num_envs_per_worker} envs, {'async' if cfg.async_training else 'sync'}"}]



# --------------------------------------------------------------------------- the mode

# Settings that shape the transitions, the network or the actors: equal on every rank, or a rank is refused.
FINGERPRINT_FIELDS = ("n_step", "gamma", "prioritized", "hidden_sizes", "num_workers", "num_envs_per_worker",
                      "async_training", "epsilon_start", "epsilon_end", "epsilon_decay_steps", "epsilon_alpha")


def fingerprint(run) -> dict:
    """What every rank must share with rank 0 for its transitions to fit rank 0's replay and network."""
    cfg, space = run.cfg, run.env.observation_space
    return {"script": MODE.script, "code": code_digest(__file__), "env_id": cfg.env_id, "env_kwargs": run.env_kwargs,
            "observation": [list(space.shape), storage_dtype(space).name], "actions": int(run.env.action_space.n),
            **{name: getattr(cfg, name) for name in FINGERPRINT_FIELDS}}


def trainer_for(run):
    """The learner on rank 0 (and without torchrun); actors only on every other rank."""
    if run.dist.is_main:
        return UltraTrainer(run)
    from common.transition_relay import ActorRank

    return ActorRank(run, MODE.fingerprint(run), replay_layout(run.cfg, run.env))


def _mean(values) -> float:
    return float(np.mean(values)) if len(values) else math.nan


MODE = Mode("ultra_parallel_train_dqn", Config, trainer_for, description=__doc__.split("\n\n")[0],
            actions=("Discrete",), checkpoint_pattern=CHECKPOINT_PATTERN, result_files=(FINAL_MODEL,),
            resume_requires=("model", "target", "optimizer"), buffers=replay_buffers, shm_buffers=("replay",),
            env_kwargs=lambda cfg: cfg.grid_kwargs(), check=check_memory,
            metrics_columns=["coverage", "coverage_mean100", "loss", "learning_rate", "epsilon_max", "epsilon_min",
                             "buffer_size", "buffer_fill", "learner_updates", "updates_per_s", "samples_per_s",
                             "episodes_per_s", "policy_lag", "weights_version", "torn_samples_skipped", "rank_sps"],
            distributed=True, cpu_collectives=True, fingerprint=fingerprint)


def train(config: Config | None = None, env_factory=None, **fields) -> dict:
    """The same run from Python, seed 001's way::

        config = UltraTrainingConfig(n_episodes=100_000, n_workers=120, batch_size=256, async_training=True)
        summary = train(config)
        summary = train(config, env_factory=MyEnv)  # your own env class or function, unregistered

    Returns the summary (``summary.json``'s keys and ``run_dir``); see ``common.run.train_in_process``.
    """
    return train_in_process(MODE, config if config is not None else Config(**fields), env_factory)


def main(argv: list[str] | None = None) -> int:
    return run_training(MODE, argv)


if __name__ == "__main__":
    sys.exit(main())
