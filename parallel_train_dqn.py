"""Central Double-DQN learner fed by rollout processes, with self-play on ConnectFour-v0.

The main process owns the Q-network, its target network, the replay buffer and the
optimizer. ``--num-workers`` rollout processes (``common.manager.ParallelManager``) play
whole episodes with the latest weights (epsilon-greedy over legal actions) and send them
back, ``--episodes-per-batch`` episodes at a time. Per iteration the learner adds the
episodes to the replay buffer (as n-step transitions), makes ``--replay-ratio`` Double-DQN
updates per new transition, and publishes the new weights through shared memory.

On a two-player built-in (``ConnectFour-v0``, the default) the opponent of each game is
drawn from the latest policy, a pool of past snapshots of the learner and fixed players.
Every game is stored one ply at a time, the moves of both players, and each ply is
bootstrapped with minus gamma times the best value of the side to move next (negamax), so
the network learns what a move is worth against the best reply, not against the opponents
it happened to meet. Evaluation plays the greedy policy from both seats against a random and
a heuristic player and against search players it never meets in training. Any
single-agent Gymnasium id with a Discrete action space works too.

Started by ``torchrun``, rank 0 does all of the above, and every other rank runs rollout
workers only (``--num-workers`` of them on each rank): their whole episodes travel to rank 0
as typed arrays (``common.hub``), are checked, and enter the replay buffer like local ones;
the weights, epsilon and the opponent pool travel back (docs/multi-node.md).

    python parallel_train_dqn.py                                   # ConnectFour-v0 self-play
    python parallel_train_dqn.py --config configs/parallel_dqn_cartpole.yaml
    python parallel_train_dqn.py --duration 0.25 --resume auto --output-dir runs/c4
"""

from __future__ import annotations

import os

# Idle OpenMP threads must sleep, not spin: spinning threads collapse throughput as soon as
# the cores are shared with workers or anything else (see "Threads" in docs/conventions.md).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import math
import sys
import time
from collections import Counter, deque
from dataclasses import dataclass, field

import numpy as np

from common.config import aliased, require, require_positive
from common.distributed import PeerFailure
from common.hub import Field, Hub, Schema, Spoke, code_digest, follow_stop, interrupt_from_peer, stop_message
from common.lazy import lazy_import
from common.replay import ReplayBuffer, episode_transitions, fit_buffer_size, replay_bytes, storage_dtype
from common.run import Mode, RunConfig, TrainingDiverged, run_training, train_in_process
from common.system import resolve_device, usable_cores

# Loaded on first use, so that --help and --validate-only answer at once (see common/lazy.py).
torch = lazy_import("torch")
dqn = lazy_import("common.dqn")
manager_lib = lazy_import("common.manager")
networks = lazy_import("common.networks")

DEFAULT_BUFFER = 100_000
PFSP_WINDOW = 200  # games against a snapshot that its win rate is measured over


@aliased  # seed 002's n_episodes reads and writes total_episodes
@dataclass
class Config(RunConfig):
    env_id: str = "ConnectFour-v0"  # any Gymnasium id with a Discrete action space; two-player built-ins use self-play
    seed: int = 1  # seeds the networks, the replay sampling and every worker's environments
    num_workers: int = field(default_factory=lambda: max(1, usable_cores() - 2))  # rollout processes per rank
    episodes_per_batch: int = 64  # whole episodes each worker plays per batch it sends
    total_timesteps: int | None = None  # stop after this many environment steps (None = no limit)
    total_episodes: int | None = None  # stop after this many training episodes (None = no limit)
    duration: float | None = 0.25  # hours of wall time for this invocation (None = no limit)
    target_return: str | None = "auto"  # stop once the mean of the last 100 returns reaches this; auto = the env's own
    target_win_rate: list[float] | None = None  # two-player: stop once eval win rates vs random, heuristic reach these
    learning_rate: float = 5e-4  # Adam step size
    anneal_lr: bool = True  # decay the learning rate linearly to 0 over the budget (duration, steps or episodes)
    gamma: float = 0.99  # discount factor
    batch_size: int = 256  # transitions per gradient update
    buffer_size: int | None = None  # replay capacity in transitions (None = 100 000, or as many as RAM holds)
    learning_starts: int = 1_000  # transitions in the buffer before the first update
    replay_ratio: float = 0.05  # gradient updates per environment transition
    n_step: int = 1  # n-step returns (n rewards, then the bootstrap value times gamma**n; n plies with negamax)
    target_update_interval: int = 250  # gradient updates between target-network updates
    tau: float = 1.0  # target update rate: 1 = hard copy, < 1 = Polyak averaging at every interval
    max_grad_norm: float = 10.0  # gradient-norm clipping
    hidden_sizes: list[int] = field(default_factory=lambda: [256, 256])  # Q-network MLP widths
    conv_channels: list[int] | None = None  # 3x3 conv layers before the MLP, for board observations (None = MLP only)
    epsilon_start: float = 1.0  # exploration rate at the start
    epsilon_end: float = 0.05  # exploration rate after the decay
    epsilon_decay_steps: int = 50_000  # environment steps over which epsilon decays linearly
    mixed_precision: str = "auto"  # auto (fp32, measured fastest for these networks), bf16, fp16 (CUDA), off
    device: str = "cpu"  # learner device: auto, cpu, cuda, cuda:N (workers always act on CPU)
    eval_interval: int = 500  # iterations between parallel greedy evaluations (0 = only at the end)
    eval_episodes: int = 100  # evaluation episodes (per opponent and seat in two-player games)
    snapshot_sampling: str = "pfsp"  # which snapshot a game is against: pfsp (those that beat the learner) or uniform
    snapshot_interval: int = 10  # iterations between snapshots of the learner added to the opponent pool
    pool_size: int = 10  # most snapshots kept in the opponent pool (oldest dropped)
    opponent_latest: float = 0.5  # share of self-play games against the latest policy
    opponent_snapshot: float = 0.3  # share against a past snapshot (drawn by snapshot_sampling)
    opponent_random: float = 0.2  # share against the random player
    opponent_heuristic: float = 0.0  # share against the heuristic player (0 = pure self-play + random)
    opponent_epsilon: float = 0.25  # exploration of policy opponents: games do not repeat, positions vary
    mirror_augment: bool | None = None  # also store moves under the symmetries the env declares (None = if any)
    learn_both_seats: bool | None = None  # two-player: also store the opponent's moves (None = if the env can)
    negamax: bool | None = None  # two-player: a move is worth minus the opponent's best reply (None = if the env can)
    max_game_length: int | None = None  # cut episodes after this many steps (None = the environment's own limit)
    model_sync_interval: int = 1  # gradient updates between weight publications (checked once per iteration)
    worker_reset_interval: int | None = None  # iterations between worker resets (fresh envs and seeds; None = never)
    experience_queue_size: int = 2  # batches a worker may play ahead of the learner

    ALIASES = {"n_episodes": "total_episodes"}  # seed 002's name

    def validate(self) -> None:
        super().validate()
        require_positive(self, "episodes_per_batch", "buffer_size", "replay_ratio", "n_step", "target_update_interval",
                         "max_grad_norm", "epsilon_decay_steps", "eval_episodes", "snapshot_interval", "pool_size",
                         "max_game_length", "model_sync_interval", "worker_reset_interval", "experience_queue_size")
        for name in ("learning_starts", "eval_interval"):
            require(getattr(self, name) >= 0, name, getattr(self, name), "must be >= 0")
        for name in ("epsilon_start", "epsilon_end", "opponent_epsilon"):
            require(0 <= getattr(self, name) <= 1, name, getattr(self, name), "must be in [0, 1]")
        require(0 < self.tau <= 1, "tau", self.tau, "must be in (0, 1]")
        shares = [self.opponent_latest, self.opponent_snapshot, self.opponent_random, self.opponent_heuristic]
        require(min(shares) >= 0 and sum(shares) > 0, "opponent_latest", shares,
                "opponent shares must be >= 0 and not all 0")
        if self.target_win_rate is not None:
            require(len(self.target_win_rate) == 2 and all(0 <= r <= 1 for r in self.target_win_rate),
                    "target_win_rate", self.target_win_rate, "must be two rates in [0, 1] (vs random, vs heuristic)")
        require(self.snapshot_sampling in ("pfsp", "uniform"), "snapshot_sampling", self.snapshot_sampling,
                "must be pfsp or uniform")
        require(self.mixed_precision in ("auto", "bf16", "fp16", "off"), "mixed_precision", self.mixed_precision,
                "must be auto, bf16, fp16 or off")
        require(self.mixed_precision != "fp16" or resolve_device(self.device).startswith("cuda"), "mixed_precision",
                "fp16", "needs a CUDA device (use bf16 on CPU)")


def check_env(cfg: Config, env) -> None:
    """The symmetries to augment the replay with, the other seat to learn from, and a replay buffer that fits
    in RAM."""
    env.extra["symmetries"] = augmenting_symmetries(cfg, env)
    env.extra["other_seat"] = other_seat(cfg)
    env.extra["plies"] = negamax_plies(cfg)
    check_memory(cfg, env)


def augmenting_symmetries(cfg: Config, env) -> tuple:
    """What the env declares (common/envs/symmetry.py), unless --no-mirror-augment; --mirror-augment on an
    env that declares none is refused rather than left doing nothing."""
    from common.envs.symmetry import declared_symmetries

    symmetries = declared_symmetries(cfg.env_id)
    require(bool(symmetries) or cfg.mirror_augment is not True, "mirror_augment", True,
            f"{cfg.env_id} declares no symmetry to augment the replay with (common/envs/symmetry.py); leave it unset")
    for symmetry in symmetries:
        problem = symmetry.mismatch(env.observation_space, env.action_space)
        require(problem is None, "env_id", cfg.env_id, f"{problem} (its declared symmetries)")
    return () if cfg.mirror_augment is False else symmetries


def other_seat(cfg: Config):
    """The env's ``other_seat`` (the opponent's side of a recorded game, common/envs/symmetry.py), unless
    --no-learn-both-seats; --learn-both-seats on an env that declares none is refused."""
    from common.envs.symmetry import declared_other_seat

    rebuild = declared_other_seat(cfg.env_id)
    require(rebuild is not None or cfg.learn_both_seats is not True, "learn_both_seats", True,
            f"{cfg.env_id} declares no other_seat to rebuild the opponent's moves from (common/envs/symmetry.py)")
    return None if cfg.learn_both_seats is False else rebuild


def negamax_plies(cfg: Config):
    """The env's ``plies`` (a recorded game as both players' alternating moves, common/envs/symmetry.py), unless
    --no-negamax; --negamax on an env that declares none is refused, and so is --no-learn-both-seats with it
    (negamax learns every ply of both players)."""
    from common.envs.symmetry import declared_plies

    plies = declared_plies(cfg.env_id)
    require(plies is not None or cfg.negamax is not True, "negamax", True,
            f"{cfg.env_id} declares no plies to learn negamax values from (common/envs/symmetry.py)")
    if cfg.negamax is False or plies is None:
        return None
    require(cfg.learn_both_seats is not False, "learn_both_seats", False,
            "negamax targets learn from both players' moves; set negamax false too")
    return plies


def check_memory(cfg: Config, env) -> None:
    """The replay buffer must fit in RAM: one the user sized is refused if not, the default shrinks to fit."""
    per_transition = replay_bytes(1, env.observation_space.shape, storage_dtype(env.observation_space),
                                  env.action_space.n if env.action_mask else None)
    cfg.buffer_size, note = fit_buffer_size(cfg.buffer_size, DEFAULT_BUFFER, per_transition)
    env.extra["notes"] = [note] if note else []


# --------------------------------------------------------------------------- self-play opponents

class OpponentPool:
    """Past snapshots of the learner for self-play: one every ``snapshot_interval`` iterations,
    at most ``pool_size``, published to the workers through shared memory.

    With ``snapshot_sampling: pfsp`` (prioritized fictitious self-play, as in AlphaStar) a
    snapshot is drawn in proportion to ``(1 - x) ** 2``, ``x`` the learner's win rate in its
    last ``PFSP_WINDOW`` games against it (1/2 before any): the past selves that still beat
    the learner are played most, the ones it has mastered hardly at all."""

    def __init__(self, pool_size: int, snapshots: list[dict] | None = None, ids: list[int] | None = None):
        snapshots = snapshots or []
        self.snapshots: deque[dict] = deque(snapshots, maxlen=pool_size)
        self.ids: deque[int] = deque(ids if ids and len(ids) == len(snapshots) else range(len(snapshots)),
                                     maxlen=pool_size)
        self.next_id = max(self.ids, default=-1) + 1
        # snapshot id -> the learner's last results against it (1 = won); resumed snapshots are measured afresh
        self.results: dict[int, deque[float]] = {i: deque(maxlen=PFSP_WINDOW) for i in self.ids}

    def add(self, model) -> None:
        self.snapshots.append({k: v.detach().cpu().clone() for k, v in model.state_dict().items()})
        self.ids.append(self.next_id)
        self.next_id += 1
        self.results = {i: self.results.get(i, deque(maxlen=PFSP_WINDOW)) for i in self.ids}

    def record(self, episodes: list[dict]) -> None:
        """The learner's results against its snapshots, from the ``opponent`` id a game ends with."""
        for ep in episodes:
            games = self.results.get(int(ep.get("opponent", -1)))
            if games is not None and "result" in ep:
                games.append(float(ep["result"] == 1.0))

    def win_rates(self) -> list[float]:
        """The learner's win rate against each snapshot (1/2 before any game against it)."""
        return [(sum(self.results[i]) + 1) / (len(self.results[i]) + 2) for i in self.ids]

    def mixture(self, cfg: Config) -> dict:
        """Who the workers' games are against: shares of latest / snapshot / random / heuristic, and
        how the snapshot share is split among the snapshots."""
        probs = {"latest": cfg.opponent_latest, "snapshot": cfg.opponent_snapshot if self.snapshots else 0.0,
                 "random": cfg.opponent_random, "heuristic": cfg.opponent_heuristic}
        if sum(probs.values()) == 0:  # only snapshots were asked for and there are none yet
            probs["random"] = 1.0
        weights = ([(1.0 - x) ** 2 for x in self.win_rates()] if cfg.snapshot_sampling == "pfsp"
                   else [1.0] * len(self.snapshots))
        return {"probs": probs, "epsilon": cfg.opponent_epsilon, "snapshot_weights": weights,
                "snapshot_ids": list(self.ids)}

    def send(self, manager, cfg: Config) -> None:
        mixture = self.mixture(cfg)
        manager.set_opponents(list(self.snapshots), mixture["probs"], mixture["epsilon"],
                              mixture["snapshot_weights"], mixture["snapshot_ids"])

    def flat(self, net_spec: dict) -> np.ndarray:
        """The snapshots as rows of flat float32 parameters, ``[snapshots, parameters]`` (for other ranks)."""
        scratch = networks.build_network(net_spec)
        out = np.zeros((len(self.snapshots), networks.flat_size(scratch)), dtype=np.float32)
        for row, snapshot in zip(out, self.snapshots):
            scratch.load_state_dict(snapshot)
            networks.write_flat_params(scratch, row)
        return out


def make_manager(run, model, epsilon: float, seed: int, log_dir: str | None):
    """Rollout workers playing with ``model``'s weights (not started yet), released when the run ends."""
    cfg = run.cfg
    spec = manager_lib.WorkerSpec(cfg.env_id, seed, tuple(cfg.hidden_sizes), run.env_kwargs, log_dir=log_dir)
    config = manager_lib.ManagerConfig(
        num_workers=cfg.num_workers, games_per_worker=cfg.episodes_per_batch,
        max_game_length=cfg.max_game_length or 0, model_sync_interval=cfg.model_sync_interval,
        timeout=cfg.worker_timeout_s, max_restarts=cfg.max_worker_restarts,
        experience_queue_size=cfg.experience_queue_size, hang_timeout=cfg.worker_timeout_s,
        start_timeout=max(cfg.worker_timeout_s, 120.0), opponent_slots=cfg.pool_size)
    manager = manager_lib.ParallelManager(spec, parallel_config=config, model=model, epsilon=epsilon, logger=run.log)
    run.defer(manager.stop_workers)
    run.supervise(manager.supervisor)
    return manager


# --------------------------------------------------------------------------- the learner

def store_episodes(buffer: ReplayBuffer, episodes: list[dict], symmetries: tuple, gamma: float, n_step: int,
                   other_seat=None, plies=None) -> None:
    """Whole episodes into the replay buffer in one write, then once more under each of the env's symmetries.

    With ``other_seat`` the opponent's side of each game is stored too, before the learner's. With ``plies``
    each game is stored one ply at a time, both players' moves, each bootstrapped with ``-gamma`` times the
    value of the position it leads to for the side to move there (negamax; ``n_step`` then counts plies).
    """
    records = []
    for ep in episodes:
        if plies is not None:
            records.append(plies(ep))
        else:
            records += [r for r in (other_seat(ep) if other_seat is not None else None, ep) if r is not None]
    if not records:
        return
    discount = -gamma if plies is not None else gamma
    rows = [episode_transitions(r["obs"], r["actions"], r["rewards"], r["terminated"], r.get("masks"), discount,
                                n_step) for r in records]
    batch = {key: None if rows[0][key] is None else np.concatenate([row[key] for row in rows]) for key in rows[0]}
    buffer.add_batch(**batch)
    masks = batch["next_masks"]
    for symmetry in symmetries:
        buffer.add_batch(**{**batch, "obs": symmetry.observations(batch["obs"]), "actions": symmetry.actions(
            batch["actions"]), "next_obs": symmetry.observations(batch["next_obs"]),
            "next_masks": None if masks is None else symmetry.masks(masks)})


class DQNTrainer:
    """Collect whole episodes from the workers, store them, learn, publish the weights; repeat."""

    def __init__(self, run):
        cfg, env = run.cfg, run.env
        self.run, self.cfg = run, cfg
        self.learner = dqn.DQNLearner.for_run(run)
        run.counters.setdefault("iteration", 0)
        resumed = run.resumed or {}
        self.pool = OpponentPool(cfg.pool_size, resumed.get("snapshots", []), resumed.get("snapshot_ids"))
        self.buffer = ReplayBuffer(cfg.buffer_size, env.observation_space.shape, storage_dtype(env.observation_space),
                                   env.action_space.n if env.action_mask else None, cfg.seed)
        run.log.info("%s", self.buffer.describe())
        self.symmetries = env.extra.get("symmetries", ())
        if self.symmetries:
            run.log.info("replay augmented with the env's symmetries (%s): %d transitions stored per step",
                         ", ".join(s.name for s in self.symmetries), 1 + len(self.symmetries))
        self.other_seat, self.plies = env.extra.get("other_seat"), env.extra.get("plies")
        if self.plies is not None:
            run.log.info("replay holds every ply of both players, each worth minus the best reply's value (negamax)")
        elif self.other_seat is not None:
            run.log.info("replay also learns the opponent's moves of every game (each stored like the learner's)")
        self.update_credit = 0.0  # gradient updates owed to the replay ratio, carried between iterations
        self.last_eval: dict[str, float] = {}
        self.final_eval: dict[str, float] | None = None
        self.episodes_by_rank: Counter[int] = Counter()  # episodes stored from each rank (0 = this one)
        self.steps_by_rank: Counter[int] = Counter()
        for note in env.extra.get("notes", []):
            run.log.info("%s", note)
        self.manager = make_manager(run, self.learner.q_net, self.epsilon(),
                                    cfg.seed + 1000 * run.counters["iteration"], str(run.run_dir / "logs"))
        if run.env.two_player:
            self.pool.send(self.manager, cfg)
        self.manager.start_workers()
        # Past one machine, ranks > 0 send episodes too; they play with what rank 0 publishes.
        self.remote = RemoteRollouts(run) if run.dist.world_size > 1 else None
        if self.remote is not None:
            self.remote.publish_weights(self.learner.q_net, self.manager.model_version, self.epsilon())
            if run.env.two_player:
                self.remote.publish_pool(self.pool, cfg, self.learner.q_net.spec)
            self.remote.start()
        run.log.info("parallel_train_dqn: %s, %d rollout worker(s) x %d episodes per batch, replay ratio %g, "
                     "buffer %d, learner on %s (precision %s), world size %d, run dir %s", cfg.env_id,
                     cfg.num_workers, cfg.episodes_per_batch, cfg.replay_ratio, cfg.buffer_size, self.learner.device,
                     self.learner.precision, run.dist.world_size, run.run_dir)

    def epsilon(self) -> float:
        cfg = self.cfg
        return dqn.linear_schedule(cfg.epsilon_start, cfg.epsilon_end, cfg.epsilon_decay_steps,
                                   self.run.counters["global_step"])

    def train(self) -> None:
        run = self.run
        while run.stop_reason() is None:
            started = time.perf_counter()
            with run.budget.part("wait"):
                batches = self.manager.collect_experiences(self.cfg.worker_timeout_s,
                                                           stop=lambda: run.graceful.requested)
            by_rank = {0: batches, **(self.remote.receive() if self.remote is not None else {})}
            if not any(by_rank.values()):
                if not run.graceful.requested:
                    run.log.warning("no experience from any worker within %.0f s", self.cfg.worker_timeout_s)
                continue
            if batches:
                run.budget.mark_first_step(time.time() - max(b.collect_seconds for b in batches))
            stats = self.store(by_rank)
            learn_started = time.perf_counter()
            with run.budget.part("learn"):
                learned = self.learn(stats["steps"])
            stats["learn_seconds"] = time.perf_counter() - learn_started
            self.after_iteration()
            self.record(stats, learned, time.perf_counter() - started)
            if run.checkpoint_due():
                run.save_checkpoint(self.state_dict())
        if self.remote is not None:
            self.remote.close(stop_message(run))  # the other ranks stop now; evaluation is rank 0's alone
        if run.stop_reason() != "interrupted":
            self.final_eval = self.evaluate()

    def store(self, by_rank: dict[int, list]) -> dict[str, float]:
        """Every episode of every rank's batches into the replay buffer (and into the run's counts)."""
        cfg, episodes, staleness = self.cfg, [], []
        for rank, batch in ((rank, batch) for rank, batches in by_rank.items() for batch in batches):
            staleness.append(self.manager.model_version - batch.model_version)
            if rank and not self.episodes_by_rank[rank]:
                self.run.log.info("rank %d: its first %d episode(s) arrived", rank, len(batch.episodes))
            self.episodes_by_rank[rank] += len(batch.episodes)
            self.steps_by_rank[rank] += sum(ep["length"] for ep in batch.episodes)
            episodes += batch.episodes
        store_episodes(self.buffer, episodes, self.symmetries, cfg.gamma, cfg.n_step, self.other_seat, self.plies)
        steps = sum(ep["length"] for ep in episodes)
        self.pool.record(episodes)
        self.run.counters["global_step"] += steps
        self.run.record_episodes(episodes)
        results = [ep["result"] for ep in episodes if "result" in ep]
        return {"steps": steps, "episodes": len(episodes), "staleness": _mean(staleness),
                "win_rate": _mean([r == 1.0 for r in results])}

    def learn(self, new_steps: int) -> list[dict[str, float]]:
        """The updates the replay ratio owes for ``new_steps`` new transitions (none before learning_starts)."""
        cfg = self.cfg
        if len(self.buffer) < max(cfg.learning_starts, cfg.batch_size):
            return []
        self.update_credit += cfg.replay_ratio * new_steps
        count = int(self.update_credit)
        self.update_credit -= count
        if cfg.anneal_lr:
            self.learner.anneal(cfg.learning_rate, self.run.budget_used())
        stats = []
        for _ in range(count):
            if self.run.graceful.requested:  # a signal stops after the update in flight, not after all owed
                break
            stats.append(self.learner.update(self.buffer, cfg.batch_size))
            if not math.isfinite(stats[-1]["loss"]):
                raise TrainingDiverged(f"loss became {stats[-1]['loss']} at update {self.learner.updates + 1}")
        self.run.counters["updates"] = self.learner.updates
        return stats

    def after_iteration(self) -> None:
        """New weights and epsilon for the workers; snapshots, resets and evaluations when due."""
        cfg, counters, manager = self.cfg, self.run.counters, self.manager
        counters["iteration"] += 1
        iteration = counters["iteration"]
        if manager.synchronizer.should_sync(self.learner.updates):
            manager.sync_model_to_workers(epsilon=self.epsilon(), learner_step=self.learner.updates)
            if self.remote is not None:
                self.remote.publish_weights(self.learner.q_net, manager.model_version, self.epsilon())
        else:
            manager.set_epsilon(self.epsilon())
            if self.remote is not None:
                self.remote.publish_epsilon(self.epsilon())
        if self.run.env.two_player and iteration % cfg.snapshot_interval == 0:
            self.pool.add(self.learner.q_net)
            self.pool.send(manager, cfg)
            self.run.log.info("opponent pool: the learner's win rate against snapshots %s: %s", list(self.pool.ids),
                              " ".join(f"{x:.2f}" for x in self.pool.win_rates()))
            if self.remote is not None:
                self.remote.publish_pool(self.pool, cfg, self.learner.q_net.spec)
        if cfg.worker_reset_interval and iteration % cfg.worker_reset_interval == 0:
            manager.reset_workers()
        if cfg.eval_interval and iteration % cfg.eval_interval == 0:
            self.last_eval = self.evaluate()
            if win_rates_reached(cfg.target_win_rate, self.last_eval):
                self.run.request_stop(f"target win rates {cfg.target_win_rate} reached")

    def record(self, stats: dict, learned: list[dict], seconds: float) -> None:
        counters = self.run.counters
        row = {"epsilon": self.epsilon(), "learning_rate": self.learner.learning_rate,
               "loss": _mean([s["loss"] for s in learned]), "q_mean": _mean([s["q_mean"] for s in learned]),
               "learner_updates": counters["updates"],
               "updates_per_s": len(learned) / stats["learn_seconds"] if learned else math.nan,
               "episodes_per_s": stats["episodes"] / max(seconds, 1e-9), "model_version": self.manager.model_version,
               "staleness": stats["staleness"], "buffer_size": len(self.buffer), "train_win_rate": stats["win_rate"],
               "iteration": counters["iteration"], "world_size": self.run.dist.world_size,
               "episodes_by_rank": self.by_rank_text(), "ranks_lost": self.remote.lost if self.remote else 0,
               **self.last_eval}
        self.last_eval = {}
        shown = {"eps": round(row["epsilon"], 3), "ver": row["model_version"], "buf": len(self.buffer)}
        if self.remote is not None:
            shown["episodes by rank"] = row["episodes_by_rank"]
        self.run.write_metrics(row, shown)

    def by_rank_text(self) -> str:
        """Episodes stored from each rank so far, in rank order: ``"1200:1150"``."""
        return ":".join(str(self.episodes_by_rank[rank]) for rank in range(self.run.dist.world_size))

    def evaluate(self) -> dict[str, float]:
        """Greedy episodes played by the workers in parallel; win/draw/loss rates for two-player games."""
        cfg, log = self.cfg, self.run.log
        if not self.run.env.two_player:
            episodes = self.manager.evaluate(cfg.eval_episodes)
            result = {"eval_return": _mean([e["return"] for e in episodes])}
            log.info("eval: mean return %.2f over %d greedy episodes", result["eval_return"], len(episodes))
            return result
        out: dict[str, float] = {}
        for opponent in EVALUATION_OPPONENTS:  # the training mix's fixed players, then search players it never met
            games = {seat: np.array([e["result"] for e in self.manager.evaluate(cfg.eval_episodes, opponent, first)])
                     for seat, first in (("first", True), ("second", False))}
            both = np.concatenate(list(games.values()))
            out.update({f"eval_win_{opponent}_{seat}": float(np.mean(g == 1.0)) for seat, g in games.items()})
            out.update({f"eval_win_{opponent}": float(np.mean(both == 1.0)),
                        f"eval_draw_{opponent}": float(np.mean(both == 0.0)),
                        f"eval_loss_{opponent}": float(np.mean(both == -1.0))})
        log.info("eval: win/draw/loss %% vs %s", ", ".join(
            f"{o} {100 * out[f'eval_win_{o}']:.0f}/{100 * out[f'eval_draw_{o}']:.0f}/{100 * out[f'eval_loss_{o}']:.0f}"
            for o in EVALUATION_OPPONENTS))
        return out

    def state_dict(self) -> dict:
        return {**self.learner.state_dict(), "snapshots": list(self.pool.snapshots),
                "snapshot_ids": list(self.pool.ids)}

    def summary(self) -> dict:
        by_rank = {"episodes_by_rank": {str(r): n for r, n in sorted(self.episodes_by_rank.items())},
                   "transitions_by_rank": {str(r): n for r, n in sorted(self.steps_by_rank.items())}}
        return {"final_eval": self.final_eval, "iterations": self.run.counters["iteration"],
                "model_version": self.manager.model_version, "buffer_size": self.cfg.buffer_size,
                "precision": self.learner.precision, **by_rank,
                **(self.remote.hub.summary() if self.remote is not None else {})}


# --------------------------------------------------------------------------- past one machine
# Under torchrun, ranks > 0 run rollout workers only. Their episodes travel to rank 0 as typed
# arrays with one row per observation (T + 1 rows for an episode of T steps): the action taken
# there and the reward that followed (0 on the episode's final row), ``last`` marking that final
# row and ``terminated`` on it whether the episode ended rather than being cut, plus the
# legal-action masks where the env has them. Per-episode numbers (a game's result) travel in the
# message's JSON info. Nothing is pickled, and rank 0 checks every message before it is stored.

EXCHANGE_S = 1.0  # a rank > 0 reports to rank 0 at least this often, so a stop reaches it within a second


def episode_schema(env) -> Schema:
    """What a rank > 0 may send: this env's observations, actions in [0, n), finite rewards, whole episodes."""
    space, n = env.observation_space, int(env.action_space.n)
    low, high = float(np.min(space.low)), float(np.max(space.high))
    in_range = space.dtype != np.uint8 and math.isfinite(low) and math.isfinite(high)
    fields = {"obs": Field(str(space.dtype), tuple(space.shape), low if in_range else None, high if in_range else None),
              "actions": Field("int64", (), 0, n - 1, integral=True), "rewards": Field("float32"),
              "last": Field("bool"), "terminated": Field("bool")}
    if env.action_mask:
        fields["masks"] = Field("bool", (n,))
    return Schema(fields, rule=lambda info, arrays: check_episodes(info, arrays, tuple(fields)))


def check_episodes(info: dict, arrays: dict[str, np.ndarray], names: tuple[str, ...]) -> str | None:
    """What the fields cannot check: whole episodes, legal actions, and the JSON info's numbers."""
    unknown = set(info) - {"episodes", "model_version", "signal"}
    if unknown:
        return f"unknown info key(s) {sorted(unknown)}"
    if info.get("signal", 2) not in (2, 15) or not _is_number(info.get("model_version", 0)):
        return f"a signal or model version that is not one: {info.get('signal')!r}, {info.get('model_version')!r}"
    stats = info.get("episodes", [])
    if not isinstance(stats, list) or not all(isinstance(s, dict) and all(map(_is_number, s.values())) for s in stats):
        return "episode statistics that are not numbers"
    if not arrays:
        return f"statistics of {len(stats)} episode(s) without the episodes" if stats else None
    if set(arrays) != set(names):
        return f"arrays {sorted(arrays)}, expected {sorted(names)}"
    last = arrays["last"]
    ends = np.flatnonzero(last)
    if not last[-1] or (np.diff(ends, prepend=-1) < 2).any():
        return "rows that are not whole episodes (each needs a step and a final observation)"
    if (arrays["terminated"] & ~last).any():
        return "terminated on a row that ends no episode"
    if len(stats) != len(ends):
        return f"statistics of {len(stats)} episode(s) for {len(ends)}"
    if "masks" in arrays and not arrays["masks"][~last, arrays["actions"][~last]].all():
        return "an action its legal-action mask forbids"
    return None


def _is_number(value) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)


def pack_episodes(episodes: list[dict], obs_dtype) -> tuple[dict[str, np.ndarray], list[dict]]:
    """Whole episodes as the arrays above, and each episode's other numbers (for the JSON info)."""
    if not episodes:
        return {}, []
    rows = np.cumsum([len(ep["obs"]) for ep in episodes])
    last = np.zeros(rows[-1], dtype=bool)
    last[rows - 1] = True
    terminated = np.zeros_like(last)
    terminated[rows - 1] = [ep["terminated"] for ep in episodes]
    arrays = {"obs": np.concatenate([ep["obs"] for ep in episodes]).astype(obs_dtype, copy=False),
              "actions": np.concatenate([np.append(ep["actions"], 0) for ep in episodes]).astype(np.int64),
              "rewards": np.concatenate([np.append(ep["rewards"], 0) for ep in episodes]).astype(np.float32),
              "last": last, "terminated": terminated}
    if "masks" in episodes[0]:
        arrays["masks"] = np.concatenate([ep["masks"] for ep in episodes]).astype(bool)
    stats = [{k: float(v) for k, v in ep.items() if k not in ("obs", "actions", "rewards", "masks", "return",
                                                              "length", "terminated")
              and isinstance(v, int | float | np.number) and math.isfinite(v)} for ep in episodes]
    return arrays, stats


def unpack_episodes(arrays: dict[str, np.ndarray], stats: list[dict]) -> list[dict]:
    """The episodes of a checked message, as the local workers' episodes look."""
    ends = np.flatnonzero(arrays["last"])
    episodes = []
    for start, end, numbers in zip(np.concatenate([[0], ends[:-1] + 1]), ends, stats):
        rewards = arrays["rewards"][start:end]
        episode = {**numbers, "obs": arrays["obs"][start:end + 1], "actions": arrays["actions"][start:end],
                   "rewards": rewards, "terminated": bool(arrays["terminated"][end]), "length": int(end - start),
                   "return": float(rewards.sum())}
        if "masks" in arrays:
            episode["masks"] = arrays["masks"][start:end + 1]
        episodes.append(episode)
    return episodes


def fingerprint(run) -> dict:
    """What every rank must share with rank 0 to send it episodes: the code, the env and the network."""
    cfg, env = run.cfg, run.env
    return {"script": "parallel_train_dqn", "code": code_digest(__file__), "env_id": cfg.env_id,
            "env_kwargs": run.env_kwargs, "observation": [list(env.observation_space.shape),
                                                          str(env.observation_space.dtype)],
            "actions": int(env.action_space.n), "action_mask": env.action_mask, "hidden_sizes": list(cfg.hidden_sizes),
            "conv_channels": cfg.conv_channels,
            "max_game_length": cfg.max_game_length}


class RemoteRollouts:
    """Rank 0's end: the hub the other ranks send episodes to, and what its replies tell them."""

    def __init__(self, run):
        self.run = run
        # Each rank may be experience_queue_size messages ahead of the learner, as each local worker
        # may be batches ahead: an iteration stores a bounded amount, and a full inbox slows the ranks.
        inbox = max(1, run.cfg.experience_queue_size) * (run.dist.world_size - 1)
        self.hub = Hub(run.dist, episode_schema(run.env), run.log, inbox_size=inbox)
        self.closed = False
        run.defer(self.close, {"reason": "rank 0 failed", "exit_code": 1})  # only if train() did not close it
        self.hub.refuse_mismatched(fingerprint(run))

    def start(self) -> None:
        self.hub.start()

    def publish_weights(self, q_net, model_version: int, epsilon: float) -> None:
        params = np.empty(networks.flat_size(q_net), dtype=np.float32)
        networks.write_flat_params(q_net, params)
        self.hub.publish({"epsilon": epsilon, "model_version": model_version}, params)

    def publish_epsilon(self, epsilon: float) -> None:
        self.hub.publish({"epsilon": epsilon})

    def publish_pool(self, pool: OpponentPool, cfg: Config, net_spec: dict) -> None:
        """The mixture and the snapshots in one reply: a rank never plays a mixture with the wrong pool."""
        self.hub.publish({"opponents": pool.mixture(cfg)}, arrays={"snapshots": pool.flat(net_spec)})

    def receive(self) -> dict[int, list]:
        """The episodes other ranks sent since the last call (checked by the hub), per rank."""
        by_rank: dict[int, list] = {}
        for message in self.hub.drain():
            if "signal" in message.info:
                interrupt_from_peer(self.run, message.rank, message.info["signal"])
            if message.arrays:
                episodes = unpack_episodes(message.arrays, message.info.get("episodes", []))
                by_rank.setdefault(message.rank, []).append(manager_lib.ExperienceBatch(
                    -1, int(message.info.get("model_version", 0)), math.nan, episodes,
                    sum(ep["length"] for ep in episodes), 0.0))
        return by_rank

    @property
    def lost(self) -> int:
        return len(self.hub.lost_events)

    def close(self, stop: dict) -> None:
        """Every live rank gets ``stop`` in its last reply (once)."""
        if not self.closed:
            self.closed = True
            self.hub.close(stop)


class RolloutRank:
    """A rank other than 0: rollout workers only, playing with the weights, epsilon and opponents
    rank 0 publishes; their whole episodes go to rank 0 until rank 0 stops the run."""

    def __init__(self, run):
        cfg, env = run.cfg, run.env
        self.run, self.rank = run, run.dist.rank
        torch.set_num_threads(1)  # this process only packs episodes; the cores are the workers'
        self.spoke = Spoke(run.dist)
        self.spoke.refuse_mismatched(fingerprint(run))
        self.obs_dtype = env.observation_space.dtype
        model = networks.QNetwork(env.observation_space, env.action_space, tuple(cfg.hidden_sizes),
                                  tuple(cfg.conv_channels or ()))
        seed = cfg.seed + 1000 * run.counters.get("iteration", 0) + 1_000_003 * self.rank
        self.manager = make_manager(run, model, cfg.epsilon_start, seed, log_dir=None)  # rank 0 alone writes files
        self.learner_versions: dict[int, int] = {}  # this rank's weights version -> the learner's
        # This rank's counts are what it sent (its log and summary line); rank 0 counts the run's.
        run.counters.update(global_step=0, episodes=0, updates=0)
        run.recent.clear()
        self.epsilon, self.pool_size, self.last_report = cfg.epsilon_start, 0, time.monotonic()
        self.apply(self.spoke.exchange())  # the learner's weights, epsilon and opponents, before the first game
        self.manager.start_workers()
        run.log.info("rank %d: %d rollout worker(s) x %d episodes per batch, sending whole episodes to rank 0",
                     self.rank, cfg.num_workers, cfg.episodes_per_batch)

    def train(self) -> None:
        run = self.run
        while True:
            batches = self.manager.collect_experiences(EXCHANGE_S)
            info, arrays = self.pack(batches)
            if run.graceful.requested:  # rank 0 stops every rank; its last reply says so
                info["signal"] = run.graceful.signum
            reply = self.spoke.exchange(info, arrays)
            self.apply(reply)
            if reply.stop is not None:
                break
            if time.monotonic() - self.last_report >= run.cfg.log_interval_s:
                self.report()
        self.report()
        if int(reply.stop.get("exit_code", 0)) not in (0, 130, 143):
            raise PeerFailure(f"rank {self.rank}: rank 0 ended the run: {reply.stop.get('reason')}")
        follow_stop(run, reply.stop)

    def pack(self, batches) -> tuple[dict, dict[str, np.ndarray]]:
        episodes = [ep for batch in batches for ep in batch.episodes]
        if not episodes:
            return {}, {}
        self.run.budget.mark_first_step(time.time() - max(b.collect_seconds for b in batches))
        arrays, stats = pack_episodes(episodes, self.obs_dtype)
        oldest = min(b.model_version for b in batches)
        self.learner_versions = {k: v for k, v in self.learner_versions.items() if k >= oldest}
        self.run.counters["global_step"] += sum(ep["length"] for ep in episodes)
        self.run.counters["episodes"] += len(episodes)
        self.run.recent.extend(ep["return"] for ep in episodes)
        return {"episodes": stats, "model_version": self.learner_versions.get(oldest, 0)}, arrays

    def apply(self, reply) -> None:
        """New weights, epsilon and opponent pool from rank 0, for this rank's workers."""
        control = reply.control
        if reply.params is not None:
            networks.read_flat_params(self.manager.model, reply.params)
            local = self.manager.sync_model_to_workers()
            self.learner_versions[local] = int(control.get("model_version", 0))
        if "epsilon" in control:
            self.epsilon = float(control["epsilon"])
            self.manager.set_epsilon(self.epsilon)
        if reply.arrays is not None and "opponents" in control:
            snapshots = reply.arrays["snapshots"]
            scratch = networks.build_network(self.manager.model.spec)
            state_dicts = []
            for row in snapshots:
                networks.read_flat_params(scratch, row)
                state_dicts.append({k: v.clone() for k, v in scratch.state_dict().items()})
            mixture = control["opponents"]
            self.manager.set_opponents(state_dicts, mixture["probs"], mixture["epsilon"],
                                       mixture.get("snapshot_weights"), mixture.get("snapshot_ids"))
            self.pool_size = len(state_dicts)
            self.run.log.info("rank %d: opponent pool of %d snapshot(s) from rank 0 (pool version %d)",
                              self.rank, self.pool_size, reply.arrays_version)

    def report(self) -> None:
        self.last_report = time.monotonic()
        counters = self.run.counters
        self.run.log.info("rank %d: %d episodes (%d transitions, %.1f MiB) sent to rank 0; learner weights "
                          "version %d, epsilon %.3f, %d snapshot(s) in the opponent pool", self.rank,
                          counters["episodes"], counters["global_step"], self.spoke.sent_bytes / 2**20,
                          max(self.learner_versions.values(), default=0), self.epsilon, self.pool_size)

    def state_dict(self) -> None:
        return None  # rank 0 holds the run's state and writes its checkpoints


def make_trainer(run):
    """Rank 0 (or the only process) learns; every other rank only plays."""
    return DQNTrainer(run) if run.dist.is_main else RolloutRank(run)


def win_rates_reached(target: list[float] | None, evaluation: dict[str, float]) -> bool:
    """--target-win-rate: an evaluation's win rates against random and heuristic both at least the target's."""
    if target is None or "eval_win_random" not in evaluation:
        return False
    return evaluation["eval_win_random"] >= target[0] and evaluation["eval_win_heuristic"] >= target[1]


def _mean(values) -> float:
    return float(np.mean(values)) if len(values) else math.nan


# ConnectFour's evaluation opponents: the training mix's fixed players, then the search players it never
# meets (common.envs.connect_four.EVALUATION_OPPONENTS, which a test holds equal; named here so that
# --help loads no gymnasium).
EVALUATION_OPPONENTS = ("random", "heuristic", "search1", "search2", "search3", "search4")
EVAL_COLUMNS = ["eval_return"] + [f"eval_{what}_{opponent}{seat}" for opponent in EVALUATION_OPPONENTS
                                  for what, seat in (("win", ""), ("win", "_first"), ("win", "_second"),
                                                     ("draw", ""), ("loss", ""))]
MODE = Mode("parallel_train_dqn", Config, make_trainer, description=__doc__.split("\n\n")[0],
            actions=("Discrete",), resume_requires=("model", "target", "optimizer"), check=check_env,
            distributed=True, cpu_collectives=True,  # ranks exchange CPU arrays only: an actor node needs no GPU
            metrics_columns=["epsilon", "learning_rate", "loss", "q_mean", "learner_updates", "updates_per_s",
                             "episodes_per_s", "model_version", "staleness", "buffer_size", "train_win_rate",
                             "iteration", "world_size", "episodes_by_rank", "ranks_lost", *EVAL_COLUMNS])


def train(config: Config | None = None, **fields) -> dict:
    """The same run from Python: ``train(Config(env_id="CartPole-v1", duration=0.1))``; returns the summary
    (``summary.json``'s keys and ``run_dir``); see ``common.run.train_in_process``."""
    return train_in_process(MODE, config if config is not None else Config(**fields))


def train_dqn(n_episodes: int | None = None, num_workers: int | None = None, **fields) -> dict:
    """Seed 002's call: ``train_dqn(n_episodes=100_000, num_workers=46, episodes_per_batch=4, batch_size=256)``.

    ``num_workers=None`` keeps the default (every core but two); any other keyword is a field of
    ``Config``. Seed 002's ``learning_steps_per_batch`` is ``replay_ratio`` here (gradient updates per
    env transition, the same in every script), so a batch's updates follow its length.
    """
    if "learning_steps_per_batch" in fields:
        raise TypeError("learning_steps_per_batch: set replay_ratio instead (gradient updates per env transition; "
                        f"the default {Config.replay_ratio} makes one update per {1 / Config.replay_ratio:g} steps)")
    if n_episodes is not None:
        fields["total_episodes"] = n_episodes
    if num_workers is not None:
        fields["num_workers"] = num_workers
    return train(Config(**fields))


def main(argv: list[str] | None = None) -> int:
    return run_training(MODE, argv)


if __name__ == "__main__":
    sys.exit(main())
