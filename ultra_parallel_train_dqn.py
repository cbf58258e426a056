"""Asynchronous actor-learner DQN over a replay buffer in shared memory (Ape-X style).

``--num-workers`` actor processes each step ``--num-envs-per-worker`` environments with one
batched forward pass per step, each actor with its own exploration rate, and write n-step
transitions straight into a replay buffer in shared memory (no transition is pickled).
The learner (this process; GPU when present) samples large batches and runs Double DQN
(``common.dqn.DQNLearner``: target network, gradient accumulation, mixed precision where it
is safe, optionally prioritized replay) at ``--replay-ratio`` gradient updates per env
transition, and publishes its weights through shared memory with a version counter that the
actors poll. ``--no-async-training`` alternates collecting and learning instead, for comparison.

Under ``torchrun`` rank 0 runs all of the above, and every other rank runs only its own
``--num-workers`` actors (``ActorRank``), whose transitions its main process ships to rank 0's
replay in batches over ``common.hub``; the weights go back the same way
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
from dataclasses import dataclass, field

import numpy as np

from common.config import aliased, require, require_positive, to_dict
from common.distributed import PeerFailure, launched_by_torchrun
from common.envs import make_vec_env
from common.envs.grid_coverage import VIEWS as GRID_VIEWS
from common.hub import Field, Hub, Schema, Spoke, code_digest, follow_stop, interrupt_from_peer, stop_message
from common.lazy import lazy_import
from common.replay import fit_buffer_size, nstep_returns, storage_dtype
from common.replay_shm import ReplayLayout, make_replay, open_writer
from common.run import EXIT_FAILED, Mode, RunConfig, TrainingDiverged, run_training, train_in_process
from common.shm import SharedArrays, attach_all
from common.supervisor import Supervisor, WorkerConfigError, WorkerFailed, set_torch_threads
from common.system import resolve_device

DEFAULT_BUFFER = 200_000
CHECKPOINT_PATTERN = r"ultra_model_ep\d+\.pt|latest\.pt"
# torch and what imports it load on first use, so that --help and --validate-only answer at once.
torch, dqn, networks = lazy_import("torch"), lazy_import("common.dqn"), lazy_import("common.networks")


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


# --------------------------------------------------------------------------- actors
# Everything an actor shares with the learner lives in shared memory: the weights (SharedParams),
# per-actor step counters and weight versions, and the control words below.

GO, STEPS_BEFORE, ALLOWED = range(3)  # control: start flag, env steps before this invocation, steps actors may reach


def control_arrays(arrays: SharedArrays, num_workers: int) -> None:
    arrays.create("actor_steps", (num_workers,), np.int64)  # env steps (transitions) each actor took
    arrays.create("actor_vsteps", (num_workers,), np.int64)  # vector steps each actor took
    arrays.create("actor_version", (num_workers,), np.int64)  # weights version each actor acts with
    arrays.create("collect_until", (num_workers,), np.int64)  # sync mode: vector steps an actor may reach
    arrays.create("control", (3,), np.int64)


def actor_epsilon(cfg: Config, actor: int, num_actors: int, global_step: int) -> float:
    """Ape-X spread: eps_i = eps ** (1 + alpha * i / (n - 1)) over the n actors of every rank, with eps
    decaying over the run."""
    base = dqn.linear_schedule(cfg.epsilon_start, cfg.epsilon_end, cfg.epsilon_decay_steps, global_step)
    if num_actors == 1:
        return base
    return base ** (1 + cfg.epsilon_alpha * actor / (num_actors - 1))


class NStepAccumulator:
    """Turns per-step transitions of ``num_envs`` environments into n-step transitions.

    A transition leaves once it has ``n`` rewards, or when its episode ends (then with
    fewer rewards and the final observation); ``discounts`` holds gamma ** rewards used.
    """

    def __init__(self, n: int, gamma: float, num_envs: int, obs_shape: tuple[int, ...], obs_dtype):
        self.n, self.gamma = n, gamma
        self.obs = np.zeros((n, num_envs, *obs_shape), dtype=obs_dtype)
        self.actions = np.zeros((n, num_envs), dtype=np.int64)
        self.rewards = np.zeros((n, num_envs), dtype=np.float32)
        self.count = np.zeros(num_envs, dtype=np.int64)  # steps stored since the episode began
        self.pos = 0

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
            returns = nstep_returns(self.rewards[order][:, full], self.gamma, n)[0][0]
            out.append({"obs": self.obs[order[0], full], "actions": self.actions[order[0], full], "rewards": returns,
                        "next_obs": final_obs[full], "dones": np.zeros(len(full)),
                        "discounts": np.full(len(full), self.gamma ** n)})
        for env in np.flatnonzero(done):  # flush every pending transition of a finished episode
            steps = order[n - min(int(self.count[env]), n):]
            returns, counts = nstep_returns(self.rewards[steps, env], self.gamma, n)
            out.append({"obs": self.obs[steps, env], "actions": self.actions[steps, env], "rewards": returns,
                        "next_obs": np.repeat(final_obs[env][None], len(steps), axis=0),
                        "dones": np.full(len(steps), float(terminations[env])), "discounts": self.gamma ** counts})
            self.count[env] = 0
        if not out:
            return None
        batch = {key: np.concatenate([part[key] for part in out]) for key in out[0]}
        for key in ("rewards", "dones", "discounts"):
            batch[key] = batch[key].astype(np.float32)
        return batch


def initial_priorities(q_net, batch: dict[str, np.ndarray]) -> np.ndarray:
    """|TD error| under the actor's own network, as Ape-X actors compute it on insertion."""
    with torch.inference_mode():
        q = q_net(torch.as_tensor(batch["obs"])).gather(1, torch.as_tensor(batch["actions"])[:, None]).squeeze(1)
        next_q = q_net(torch.as_tensor(batch["next_obs"])).max(dim=1).values
        target = torch.as_tensor(batch["rewards"]) + torch.as_tensor(batch["discounts"]) * next_q * \
            (1 - torch.as_tensor(batch["dones"]))
        return (target - q).abs().numpy()


class Actor:
    """One actor process: epsilon-greedy steps of its envs, n-step transitions into its replay partition.

    ``index`` is its place among this rank's actors (the shared counters), ``actor`` among the
    ``num_actors`` of every rank (its exploration rate)."""

    def __init__(self, link, cfg: Config, shared: dict, replay, envs, seed: int, actor: int, num_actors: int):
        self.link, self.cfg, self.shared, self.replay, self.envs = link, cfg, shared, replay, envs
        self.index, self.actor, self.num_actors = link.index, actor, num_actors
        self.params = networks.SharedParams(shared)
        self.q_net = networks.QNetwork(envs.single_observation_space, envs.single_action_space,
                                       tuple(cfg.hidden_sizes))
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
        actions = dqn.epsilon_greedy(q_values, epsilon, self.rng)
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


def actor_main(link, cfg_dict: dict, env_kwargs: dict, shared_specs: dict, replay_spec: dict, seed: int, actor: int,
               num_actors: int) -> None:
    """Actor process (run by the supervisor, which reports a crash and restarts it)."""
    set_torch_threads(1)
    cfg = Config(**cfg_dict)
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
    cfg = run.cfg
    cfg_dict, supervisor = to_dict(cfg), None

    def args_for(index: int) -> tuple:
        lives = supervisor.workers[index].restarts if supervisor is not None else 0
        actor = rank * cfg.num_workers + index
        # Fresh seeds for a restarted actor, so it does not replay the episodes it died in.
        seed = cfg.seed + actor * cfg.num_envs_per_worker + 1_000_003 * lives
        return cfg_dict, run.env_kwargs, shared_specs, replay_spec, seed, actor, cfg.num_actors

    supervisor = run.supervise(Supervisor(
        actor_main, cfg.num_workers, args_for, name="worker", max_restarts=cfg.max_worker_restarts,
        start_timeout_s=max(cfg.worker_timeout_s, 120.0), hang_timeout_s=cfg.worker_timeout_s, logger=run.log))
    supervisor.start()
    return supervisor


# --------------------------------------------------------------------------- learner

class UltraTrainer:
    """The learner: sample, update, publish, at the replay ratio, while the actors collect.

    Under torchrun (rank 0) it also serves the actor ranks through a :class:`common.hub.Hub`:
    their transitions go into their own partitions of the replay, their env steps and episodes
    into the run's counters, and the weights and the rate limit go back with every reply."""

    def __init__(self, run):
        cfg, env, counters = run.cfg, run.env, run.counters
        self.run, self.cfg, self.world = run, cfg, run.dist.world_size
        self.learner = dqn.DQNLearner.for_run(run)
        self.recent_coverage = deque(counters.setdefault("recent_coverage", []), maxlen=100)
        arrays = SharedArrays()
        run.defer(arrays.unlink_all)
        control_arrays(arrays, cfg.num_workers)
        self.params = networks.SharedParams.allocate(arrays, networks.flat_size(self.learner.q_net))
        self.params.publish(self.learner.q_net)
        self.shared = {name: arrays[name] for name in arrays.specs()}
        self.remote_steps: dict[int, int] = {}  # env steps of each actor rank in this invocation, as it reported
        self.rank_episodes = [0] * self.world  # episodes each rank finished in this invocation
        self.allowed: int | None = None  # the rate limiter's bound on every rank's env steps together
        self.hub, self.ranks_stopped = self.open_hub() if self.world > 1 else None, False
        self.step_offset = counters["global_step"]
        self.shared["control"][STEPS_BEFORE] = self.step_offset
        self.replay = self.make_replay()
        self.cursor_base = self.replay.arrays["cursors"].copy()  # where this invocation's transitions start
        self.updates_base, self.inserted_base = self.learner.updates, self.replay.inserted()  # again at the start
        self.count_steps()
        self.window = self.new_window()
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

    def open_hub(self) -> Hub:
        """Meet the actor ranks: refuse those that run something else, hand the others the weights."""
        run = self.run
        hub = Hub(run.dist, transition_schema(self.cfg, run.env), run.log)
        hub.refuse_mismatched(fingerprint(run))
        hub.publish(control={"go": False}, params=self.params.params[0])
        self.published = (time.monotonic(), self.params.version(0))  # what the actor ranks were last sent
        hub.start()
        # Reached only when the run ends before train() stops the ranks itself: a failure.
        run.defer(self.stop_ranks, {"reason": "rank 0 failed", "exit_code": EXIT_FAILED})
        return hub

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
        self.stop_ranks(stop_message(self.run))  # after the last checkpoint: every rank ends as this one

    def train_until_stopped(self) -> None:
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
        cfg = self.cfg
        if cfg.async_training and cfg.rate_limit:
            updates = self.learner.updates - self.updates_base
            self.allowed = cfg.learning_starts + cfg.slack + int(updates / cfg.replay_ratio)
        others = sum(self.remote_steps.values())
        self.shared["control"][ALLOWED] = np.iinfo(np.int64).max if self.allowed is None else self.allowed - others

    def learn_once(self) -> None:
        cfg, counters = self.cfg, self.run.counters
        progress = self.run.budget_used()
        if cfg.anneal_lr:
            self.learner.anneal(cfg.learning_rate, progress)
        stats = self.learner.update(self.replay, cfg.batch_size, cfg.per_beta + (1 - cfg.per_beta) * progress)
        if not math.isfinite(stats["loss"]):
            raise TrainingDiverged(f"loss became {stats['loss']} at update {self.learner.updates + 1}")
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
        if self.hub is None:
            return
        for message in self.hub.drain():
            self.handle_rank(message)
        self.allow_inserts()
        self.share_with_ranks()

    def handle_rank(self, message) -> None:
        """An actor rank's message (the hub checked it with transition_schema): a signal it caught, its env
        steps, its transitions, its finished episodes."""
        info, arrays, rank = message.info, message.arrays, message.rank
        if "signal" in info:
            interrupt_from_peer(self.run, rank, info["signal"])
        self.remote_steps[rank] = max(self.remote_steps.get(rank, 0), info.get("steps", 0))
        start = 0
        for index, rows in enumerate(info.get("rows", [])):  # the rank's actor k writes partition k of its block
            self.write_rank(rank * self.cfg.num_workers + index, {k: a[start:start + rows] for k, a in arrays.items()})
            start += rows
        episodes = episode_numbers(info.get("episodes", []))
        if episodes:
            self.count_steps()
            self.record_episodes(episodes, rank)

    def write_rank(self, writer: int, batch: dict[str, np.ndarray]) -> None:
        part = self.replay.layout.part_capacity  # a partition takes at most its own size at once
        for lo in range(0, len(batch["actions"]), part):
            self.replay.receive(writer, {k: a[lo:lo + part] for k, a in batch.items()})

    def share_with_ranks(self, force: bool = False) -> None:
        """What the next replies to the actor ranks carry: the start flag, the rate limit, every rank's steps
        and, when the learner has published newer ones, the weights (at most every ship_interval_s)."""
        if self.hub is None or not force and time.monotonic() - self.published[0] < self.cfg.ship_interval_s:
            return
        control = {"go": bool(self.shared["control"][GO]), "allowed": self.allowed, "rank_steps": self.rank_steps()}
        changed = self.params.version(0) != self.published[1]
        self.hub.publish(control, params=self.params.params[0] if changed else None)
        self.published = (time.monotonic(), self.params.version(0))

    def stop_ranks(self, stop: dict) -> None:
        """Every actor rank's last reply says why the run stopped and with which exit status (once)."""
        if self.hub is not None and not self.ranks_stopped:
            self.ranks_stopped = True
            self.hub.close(stop)

    def new_window(self) -> dict:
        return {"time": time.monotonic(), "steps": self.run.counters["global_step"], "episodes": 0, "losses": [],
                "updates": 0, "rejected": 0, "coverage": [], "rank_steps": self.rank_steps()}

    def coverage_mean100(self) -> float | None:
        return float(np.mean(self.recent_coverage)) if len(self.recent_coverage) == 100 else None

    def record(self) -> None:
        """One metrics row: the window since the last one (none if the actors took no step meanwhile)."""
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
            tmp = run.run_dir / ".ultra_final_model.pth.tmp"
            shutil.copyfile(path, tmp)
            os.replace(tmp, run.run_dir / "ultra_final_model.pth")
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
                **(self.hub.summary() if self.hub is not None else {})}

    def plots(self, run) -> list[dict]:
        cfg = run.cfg
        return [{"plot": "ultra_results", "out": str(run.run_dir / "plots" / "ultra_training_results.png"),
                 "title": f"ultra_parallel_train_dqn: {cfg.env_id}, {cfg.num_workers} actor(s) x "
                          f"{cfg.num_envs_per_worker} envs, {'async' if cfg.async_training else 'sync'}"}]


# --------------------------------------------------------------------------- past one machine
# Under torchrun every rank but 0 runs actors only. Their transitions reach the rank's main process
# on their pipes (the message-fed replay path, with no replay on this rank); it ships them to rank 0
# in one message every ship_interval_s, and rank 0 writes them into the partitions of that rank's
# actors. Rank 0's replies carry the weights, the start flag and the rate limit back.

# Settings that shape the transitions, the network or the actors: equal on every rank, or a rank is refused.
FINGERPRINT_FIELDS = ("n_step", "gamma", "prioritized", "hidden_sizes", "num_workers", "num_envs_per_worker",
                      "async_training", "epsilon_start", "epsilon_end", "epsilon_decay_steps", "epsilon_alpha")


def replay_layout(cfg: Config, env) -> ReplayLayout:
    """Rank 0's replay: buffer_size slots, one partition per actor of every rank (rank r's block follows r - 1's)."""
    space = env.observation_space
    return ReplayLayout(cfg.buffer_size, cfg.num_actors, space.shape, storage_dtype(space).name, cfg.prioritized)


def fingerprint(run) -> dict:
    """What every rank must share with rank 0 for its transitions to fit rank 0's replay and network."""
    cfg, space = run.cfg, run.env.observation_space
    return {"script": MODE.script, "code": code_digest(__file__), "env_id": cfg.env_id, "env_kwargs": run.env_kwargs,
            "observation": [list(space.shape), storage_dtype(space).name], "actions": int(run.env.action_space.n),
            **{name: getattr(cfg, name) for name in FINGERPRINT_FIELDS}}


def transition_schema(cfg: Config, env) -> Schema:
    """The arrays an actor rank may send: n-step transitions of this run's shapes, observations in the
    replay's own dtype (uint8 frames stay uint8 on the wire), values in their ranges."""
    space = env.observation_space
    obs = Field(storage_dtype(space).name, tuple(space.shape))
    fields = {"obs": obs, "next_obs": obs,
              "actions": Field("int64", low=0, high=env.action_space.n - 1, integral=True),
              "rewards": Field("float32"),  # any finite value (the hub refuses NaN and infinities)
              "dones": Field("float32", low=0, high=1, integral=True),
              "discounts": Field("float32", low=0, high=1)}
    if cfg.prioritized:
        fields["priorities"] = Field("float32", low=0)
    return Schema(fields, rule=lambda info, arrays: remote_problem(info, arrays, set(fields), cfg.num_workers))


def remote_problem(info: dict, arrays: dict[str, np.ndarray], names: set[str], num_workers: int) -> str | None:
    """Why an actor rank's message cannot be used (None when it can): the hub's rule, after it checked
    every array's dtype, row shape and range. The arrays must form one whole batch, its split among
    the rank's actors and the counts must add up, and the episodes must be numbers."""
    steps, signal = info.get("steps", 0), info.get("signal", 2)
    if type(steps) is not int or steps < 0 or type(signal) is not int:
        return f"an env step count of {str(steps)[:40]} or a signal {str(signal)[:40]}"
    if episode_numbers(info.get("episodes", [])) is None:
        return f"episodes that are not numbers ({str(info.get('episodes'))[:80]})"
    if not arrays:
        return None
    if set(arrays) != names:
        return f"the arrays {sorted(arrays)} instead of {sorted(names)}"
    rows = info.get("rows")
    if not (isinstance(rows, list) and len(rows) == num_workers and all(type(n) is int and n >= 0 for n in rows)
            and sum(rows) == len(arrays["actions"])):
        return f"{len(arrays['actions'])} transitions split among {num_workers} actors as {str(rows)[:80]}"
    return None


def one_batch(batches: list[dict[str, np.ndarray]], schema: Schema) -> dict[str, np.ndarray]:
    """Transition batches as one array per field of ``schema``, in its dtype (the replay's: uint8 stays uint8)."""
    if not batches:
        return {}
    return {name: np.concatenate([batch[name] for batch in batches]).astype(spec.dtype, copy=False)
            for name, spec in schema.fields.items()}


def episode_numbers(episodes) -> list[dict] | None:
    """Finished episodes as plain numbers (return, length, coverage), or None if they are not numbers:
    what an actor rank sends, and what rank 0 accepts from one."""
    try:
        out = [{"return": float(e["return"]), "length": int(e["length"]),
                **({"coverage": float(e["coverage"])} if "coverage" in e else {})} for e in episodes]
    except (TypeError, KeyError, ValueError, OverflowError):
        return None
    if all(math.isfinite(e["return"]) and e["length"] >= 0 and 0 <= e.get("coverage", 0) <= 1 for e in out):
        return out
    return None


class ActorRank:
    """A rank other than 0: its own ``num_workers`` actors, and what they collect shipped to rank 0.

    Nothing here decides when the run ends: the loop ships until rank 0's reply says stop (a
    signal caught here goes to rank 0 with the next message, and its stop comes back)."""

    def __init__(self, run):
        cfg, env = run.cfg, run.env
        self.run, self.cfg, self.rank = run, cfg, run.dist.rank
        set_torch_threads(1)  # this process only copies weights: the cores are the actors'
        self.spoke = Spoke(run.dist)
        self.spoke.refuse_mismatched(fingerprint(run))
        self.schema = transition_schema(cfg, env)
        self.q_net = networks.QNetwork(env.observation_space, env.action_space, tuple(cfg.hidden_sizes))
        arrays = SharedArrays()
        run.defer(arrays.unlink_all)
        control_arrays(arrays, cfg.num_workers)
        self.params = networks.SharedParams.allocate(arrays, networks.flat_size(self.q_net))
        self.shared = {name: arrays[name] for name in arrays.specs()}
        self.shared["control"][STEPS_BEFORE] = run.counters["global_step"]
        self.shared["control"][ALLOWED] = np.iinfo(np.int64).max  # until rank 0's rate limiter says otherwise
        self.pending: list[list[dict]] = [[] for _ in range(cfg.num_workers)]  # transition batches, per actor
        self.episodes: list[dict] = []
        self.steps_sent, self.shipped_at, self.stop = 0, 0.0, None
        self.ship()  # the first reply brings rank 0's weights, which the actors wait for
        writer_spec = {"backend": "queue", "layout": replay_layout(cfg, env)}  # actors send on their pipes
        self.supervisor = start_actors(run, arrays.specs(), writer_spec, self.rank)
        first = self.rank * cfg.num_workers
        run.log.info("actor rank %d: actors %d-%d of %d (x %d envs), shipping transitions to rank 0 every %.0f ms",
                     self.rank, first, first + cfg.num_workers - 1, cfg.num_actors, cfg.num_envs_per_worker,
                     cfg.ship_interval_s * 1000)

    def train(self) -> None:
        while self.stop is None:
            wait = self.cfg.ship_interval_s - (time.monotonic() - self.shipped_at)
            for message in self.supervisor.poll(max(0.0, wait)):
                self.handle(message)
            if time.monotonic() - self.shipped_at >= self.cfg.ship_interval_s:
                self.ship()
        if self.stop.get("exit_code") == EXIT_FAILED:
            raise PeerFailure(f"rank {self.rank}: {self.stop.get('reason', 'rank 0 failed')}")
        follow_stop(self.run, self.stop)

    def handle(self, message) -> None:
        if message.kind == "transitions":
            self.pending[message.index].append(message.payload)
        elif message.kind == "episodes":
            self.episodes += episode_numbers(message.payload) or []

    def ship(self) -> None:
        """One message to rank 0 with what is new (nothing at all: a heartbeat), and its reply applied."""
        run, shared = self.run, self.shared
        info: dict = {}
        steps = int(shared["actor_steps"].sum())
        if steps != self.steps_sent:
            info["steps"] = steps
        rows = [sum(len(batch["actions"]) for batch in batches) for batches in self.pending]
        if sum(rows):
            info["rows"] = rows
        if self.episodes:
            run.record_episodes(self.episodes)  # for this rank's own closing log line
            info["episodes"], self.episodes = self.episodes, []
        if run.graceful.requested:
            info["signal"] = run.graceful.signum
        batches = [batch for per_actor in self.pending for batch in per_actor]  # actor 0's first, as in rows
        self.pending = [[] for _ in self.pending]
        reply = self.spoke.exchange(info, one_batch(batches, self.schema))
        self.steps_sent, self.shipped_at = steps, time.monotonic()
        run.counters["global_step"] = int(shared["control"][STEPS_BEFORE]) + steps
        self.apply(reply)

    def apply(self, reply) -> None:
        if reply.stop is not None:
            self.stop = reply.stop
            return
        if reply.params is not None:
            networks.read_flat_params(self.q_net, reply.params)
            self.params.publish(self.q_net)
        control = reply.control
        if control.get("allowed") is not None:  # the bound is on every rank's steps: the others' count against it
            others = sum(control["rank_steps"]) - control["rank_steps"][self.rank]
            self.shared["control"][ALLOWED] = control["allowed"] - others
        if control.get("go"):
            self.shared["control"][GO] = 1

    def state_dict(self) -> None:
        return None  # rank 0 keeps the run's state

    def summary(self) -> dict:
        return {}


def trainer_for(run):
    """The learner on rank 0 (and without torchrun); actors only on every other rank."""
    return UltraTrainer(run) if run.dist.is_main else ActorRank(run)


def _mean(values) -> float:
    return float(np.mean(values)) if len(values) else math.nan


MODE = Mode("ultra_parallel_train_dqn", Config, trainer_for, description=__doc__.split("\n\n")[0],
            actions=("Discrete",), checkpoint_pattern=CHECKPOINT_PATTERN,
            resume_requires=("model", "target", "optimizer"),
            env_kwargs=lambda cfg: cfg.grid_kwargs(), check=check_memory,
            metrics_columns=["coverage", "coverage_mean100", "loss", "learning_rate", "epsilon_max", "epsilon_min",
                             "buffer_size", "buffer_fill", "learner_updates", "updates_per_s", "samples_per_s",
                             "episodes_per_s", "policy_lag", "weights_version", "torn_samples_skipped", "rank_sps"],
            distributed=True, cpu_collectives=True)


def train(config: Config | None = None, **fields) -> dict:
    """The same run from Python, seed 001's way::

        config = UltraTrainingConfig(n_episodes=100_000, n_workers=120, batch_size=256, async_training=True)
        summary = train(config)

    Returns the summary (``summary.json``'s keys and ``run_dir``); see ``common.run.train_in_process``.
    """
    return train_in_process(MODE, config if config is not None else Config(**fields))


def main(argv: list[str] | None = None) -> int:
    return run_training(MODE, argv)


if __name__ == "__main__":
    sys.exit(main())
