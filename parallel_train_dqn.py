"""Central Double-DQN learner fed by rollout processes, with self-play on ConnectFour-v0.

The main process owns the Q-network, its target network, the replay buffer and the
optimizer. ``--num-workers`` rollout processes (``common.parallel_manager.ParallelManager``) play
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
a heuristic player and against search players it never meets in training. PettingZoo's two-player
classic games (``pettingzoo/tictactoe-v3`` ...) train the same way against their own players
(common/envs/pettingzoo_games.py). Any single-agent Gymnasium id with a Discrete action space works too.

That is the Q-network learner (``--learner q_network``). On ConnectFour-v0 on one machine the default,
``--learner auto``, takes the n-tuple learner instead unless a setting of the Q-network is given
(``common.ntuple_trainer``): an n-tuple value function
learned by TD self-play, every process playing over one table in shared memory, much the stronger player there.

Started by ``torchrun``, rank 0 does all of the above, and every other rank runs rollout
workers only (``--num-workers`` of them on each rank): their whole episodes travel to rank 0
as typed arrays (``common.dqn_rollouts``), are checked, and enter the replay buffer like local
ones; the weights, epsilon and the opponent pool travel back (docs/multi-node.md).

    python parallel_train_dqn.py                                   # ConnectFour-v0 self-play (n-tuple learner)
    python parallel_train_dqn.py --learner q_network               # ... with the Q-network
    python parallel_train_dqn.py --config configs/parallel_dqn_cartpole.yaml
    python parallel_train_dqn.py --config configs/tictactoe_selfplay.yaml     # PettingZoo's tic-tac-toe, until perfect
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
from dataclasses import MISSING, dataclass, field

import numpy as np

from common.config import ConfigError, aliased, require, require_positive
from common.rank_exchange import code_digest, stop_message
from common.replay import LocalReplay, episode_transitions, fit_buffer_size, replay_bytes, storage_dtype
from common.run import Mode, RunConfig, run_training, train_in_process
from common.system import resolve_device, shm_shortfall, usable_cores

# torch and the modules that import it (common.dqn, common.dqn_rollouts, common.networks) are
# imported where they are used, so that --help and --validate-only answer without loading it.

DEFAULT_BUFFER = 100_000
PFSP_WINDOW = 200  # games against a snapshot that its win rate is measured over


@aliased  # seed 002's n_episodes reads and writes total_episodes
@dataclass
class Config(RunConfig):
    env_id: str = "ConnectFour-v0"  # any Gymnasium id with a Discrete action space; two-player built-ins use self-play
    learner: str = "auto"  # auto (ntuple on ConnectFour-v0 on one machine, else q_network), q_network (Double DQN)
    seed: int = 1  # seeds the networks, the replay sampling and every worker's environments
    num_workers: int = field(default_factory=lambda: max(1, usable_cores() - 2))  # rollout processes per rank
    episodes_per_batch: int = 64  # whole episodes each worker plays per batch it sends
    total_timesteps: int | None = None  # stop after this many environment steps (None = no limit)
    total_episodes: int | None = None  # stop after this many training episodes (None = no limit)
    duration: float | None = 0.25  # hours of wall time for this invocation (None = no limit)
    target_return: str | None = "auto"  # stop once the mean of the last 100 returns reaches this; auto = the env's own
    target_win_rate: list[float] | None = None  # two-player: stop once eval win rates vs random, heuristic reach these
    target_unbeaten: str | None = None  # two-player: stop at the first evaluation losing no game to this player
    learning_rate: float = 5e-4  # Adam step size
    anneal_lr: bool = True  # decay the learning rate linearly to 0 over the budget (duration, steps or episodes)
    gamma: float = 0.99  # discount factor
    batch_size: int = 256  # transitions per gradient update
    buffer_size: int | None = None  # replay capacity in transitions (None = 100 000, or as many as RAM holds)
    learning_starts: int = 1_000  # transitions in the buffer before the first update
    replay_ratio: float = 0.05  # gradient updates per environment transition
    learning_steps_per_batch: int | None = None  # updates per num_workers x episodes_per_batch episodes; none = auto
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
    # --learner ntuple (common/ntuple.py); the settings above it uses: num_workers (self-play processes beside the
    # main process, which plays too), seed, the budgets, eval_interval (in iterations of 32 lockstep plies),
    # eval_episodes and the targets. The defaults won comparisons graded by the perfect player, 15 minutes on
    # 2 cores, 3 seeds (docs/parallel_train_dqn.md): 140 tuples of 9 cells play 1.6 times the games of 280 of 8
    # and grade as well or better; a constant step blundered least, and a run resumed from cron each night then
    # learns at one rate, not at a rate that decays within every invocation. 2 x 140 x 4 ** 9 float32 weights
    # are 294 MB, in /dev/shm.
    ntuple_tuples: int = 140  # random-walk tuples of adjacent cells, drawn from the seed
    ntuple_length: int = 9  # cells per tuple: each tuple's table has 4 ** length entries per seat
    ntuple_learning_rate: float = 1.0  # TD step shared by the entries a board reads (the start, if a final one is set)
    ntuple_final_learning_rate: float | None = None  # at the end of the budget, decaying exponentially (None: constant)
    ntuple_td_lambda: float = 0.0  # TD(lambda): afterstates learn the lambda-return of the errors after them (0: TD(0))
    ntuple_epsilon: float = 0.2  # share of self-play moves played at random (after the random opening)
    ntuple_random_opening: list[int] = field(default_factory=lambda: [0, 8])  # random plies opening a game: low, high
    ntuple_games_in_lockstep: int = 1024  # games each process plays together, one ply of all at a time

    # seed 002's name; num_envs_per_worker as in every script: a worker steps one env per episode of its batch
    ALIASES = {"n_episodes": "total_episodes", "num_envs_per_worker": "episodes_per_batch"}

    def validate(self) -> None:
        super().validate()
        require_positive(self, "episodes_per_batch", "buffer_size", "replay_ratio", "learning_steps_per_batch",
                         "n_step", "target_update_interval",
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
        require(self.learner in ("auto", "q_network", "ntuple"), "learner", self.learner,
                "must be auto, q_network or ntuple")
        q_network_set = settings_set(self, Q_NETWORK_SETTINGS)
        requested, self.learner = self.learner, chosen_learner(self.learner, self.env_id, None, q_network_set)
        refuse_the_other_learners_settings(self, requested, q_network_set)  # config.yaml names the learner that ran
        require_positive(self, "ntuple_tuples", "ntuple_length", "ntuple_learning_rate", "ntuple_final_learning_rate",
                         "ntuple_games_in_lockstep")
        require(self.ntuple_length <= 10, "ntuple_length", self.ntuple_length,
                "must be <= 10 (a tuple's table has 4 ** length entries per seat)")
        require(0 <= self.ntuple_td_lambda < 1, "ntuple_td_lambda", self.ntuple_td_lambda, "must be in [0, 1)")
        require(0 <= self.ntuple_epsilon <= 1, "ntuple_epsilon", self.ntuple_epsilon, "must be in [0, 1]")
        opening = self.ntuple_random_opening
        require(len(opening) == 2 and 0 <= opening[0] <= opening[1] <= 41, "ntuple_random_opening", opening,
                "must be two ply counts, 0 <= low <= high <= 41")


def chosen_learner(requested: str, env_id: str, world_size: int | None = None,
                   q_network_set: tuple[str, ...] = ()) -> str:
    """The learner that runs for ``--learner requested``: auto is the n-tuple learner where it applies (ConnectFour-v0,
    on one machine: its processes share one table in shared memory) unless a setting of the Q-network is given
    (``q_network_set``: a command such as seed 002's ``--episodes-per-batch 4 --batch-size 256`` means the
    Q-network), else the Q-network. ``world_size`` is the torchrun world's (WORLD_SIZE where it is None)."""
    if requested != "auto":
        return requested
    world_size = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
    return "ntuple" if env_id == "ConnectFour-v0" and world_size == 1 and not q_network_set else "q_network"


# What only one learner reads. A Q-network setting given makes auto the Q-network; set away from its default for the
# learner that runs, a setting of the other is refused in one line rather than ignored (a --buffer-size would
# otherwise do nothing to an n-tuple run).
NTUPLE_SETTINGS = ("ntuple_tuples", "ntuple_length", "ntuple_learning_rate", "ntuple_final_learning_rate",
                   "ntuple_td_lambda", "ntuple_epsilon", "ntuple_random_opening", "ntuple_games_in_lockstep")
Q_NETWORK_SETTINGS = (
    "episodes_per_batch", "learning_rate", "anneal_lr", "gamma", "batch_size", "buffer_size", "learning_starts",
    "replay_ratio", "learning_steps_per_batch", "n_step", "target_update_interval", "tau", "max_grad_norm",
    "hidden_sizes", "conv_channels", "epsilon_start", "epsilon_end", "epsilon_decay_steps", "mixed_precision",
    "device", "snapshot_sampling", "snapshot_interval", "pool_size", "opponent_latest", "opponent_snapshot",
    "opponent_random", "opponent_heuristic", "opponent_epsilon", "mirror_augment", "learn_both_seats", "negamax",
    "max_game_length", "model_sync_interval", "worker_reset_interval", "experience_queue_size")


def settings_set(cfg: Config, names: tuple[str, ...]) -> tuple[str, ...]:
    """Which of the fields ``names`` differ from their defaults."""
    fields = Config.__dataclass_fields__
    return tuple(name for name in names if getattr(cfg, name) != (
        fields[name].default_factory() if fields[name].default is MISSING else fields[name].default))


def refuse_the_other_learners_settings(cfg: Config, requested: str, q_network_set: tuple[str, ...]) -> None:
    given = q_network_set if cfg.learner == "ntuple" else settings_set(cfg, NTUPLE_SETTINGS)
    if not given:
        return
    other = "q_network" if cfg.learner == "ntuple" else "ntuple"
    why = ""
    if requested == "auto":
        why = (f", auto's choice since --{q_network_set[0].replace('_', '-')} is set" if q_network_set else
               f", auto's choice on {cfg.env_id}{' under torchrun' if cfg.env_id == 'ConnectFour-v0' else ''}")
    raise ConfigError(given[0], getattr(cfg, given[0]),
                      f"is a setting of --learner {other}; this run's learner is {cfg.learner}{why}")


def check_env(cfg: Config, env) -> None:
    """The symmetries to augment the replay with, the other seat to learn from, the players a two-player game is
    evaluated against, and a replay buffer that fits in RAM; the n-tuple learner's game and machine."""
    env.extra["evaluation_opponents"] = game_players(cfg, env)
    if cfg.learner == "ntuple":
        require(cfg.env_id == "ConnectFour-v0", "learner", "ntuple", f"learns ConnectFour-v0 only, not {cfg.env_id}")
        require(int(os.environ.get("WORLD_SIZE", "1")) == 1, "learner", "ntuple",
                "runs on one machine (its processes share one table in shared memory); start it without torchrun")
        table = replay_buffers(cfg, env)["ntuple_weights"]
        short = shm_shortfall(table, f"the n-tuple table ({cfg.ntuple_tuples} tuples of {cfg.ntuple_length} cells)")
        require(short is None, "ntuple_tuples", cfg.ntuple_tuples,
                f"{short}: fewer or shorter tuples fit, or a larger /dev/shm (docker: --shm-size=1g)")
        return
    env.extra["symmetries"] = augmenting_symmetries(cfg, env)
    env.extra["other_seat"] = other_seat(cfg)
    env.extra["plies"] = negamax_plies(cfg)
    check_memory(cfg, env)


def game_players(cfg: Config, env) -> tuple[str, ...]:
    """The fixed players the game declares for evaluation (``EVALUATION_OPPONENTS``: ConnectFour-v0's, or a
    PettingZoo game's, common/envs/pettingzoo_games.py); the training mix and the targets may name only those."""
    from common.evaluate import evaluation_opponents

    players = evaluation_opponents(cfg.env_id) if env.two_player else ()
    known = ", ".join(players) or "none: it is not a two-player game"
    require(cfg.opponent_heuristic == 0 or not env.two_player or "heuristic" in players, "opponent_heuristic",
            cfg.opponent_heuristic, f"{cfg.env_id} has no heuristic player (its players: {known})")
    require(cfg.target_win_rate is None or {"random", "heuristic"} <= set(players), "target_win_rate",
            cfg.target_win_rate, f"needs a random and a heuristic player; {cfg.env_id} has {known}")
    require(cfg.target_unbeaten is None or cfg.target_unbeaten in players, "target_unbeaten", cfg.target_unbeaten,
            f"must be a player {cfg.env_id} is evaluated against ({known})")
    return players


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
    cfg.buffer_size, note = fit_buffer_size(cfg.buffer_size, DEFAULT_BUFFER, replay_capacity_bytes(1, env))
    env.extra["notes"] = [note] if note else []


def replay_capacity_bytes(capacity: int, env) -> int:
    """Bytes of the learner's LocalReplay of ``capacity`` transitions (with next-action masks where the env masks
    actions)."""
    return replay_bytes(capacity, env.observation_space.shape, storage_dtype(env.observation_space),
                        int(env.action_space.n) if env.action_mask else None)


def replay_buffers(cfg: Config, env) -> dict[str, int]:
    """The replay in the learner's process: ``buffer_size`` transitions, DEFAULT_BUFFER where it is unset; the
    n-tuple learner's weights (shared memory) instead."""
    if chosen_learner(cfg.learner, cfg.env_id, None, settings_set(cfg, Q_NETWORK_SETTINGS)) == "ntuple":
        return {"ntuple_weights": 2 * cfg.ntuple_tuples * 4 ** cfg.ntuple_length * 4}
    return {"replay": replay_capacity_bytes(DEFAULT_BUFFER if cfg.buffer_size is None else cfg.buffer_size, env)}


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
        from common.networks import build_network, flat_size, write_flat_params

        scratch = build_network(net_spec)
        out = np.zeros((len(self.snapshots), flat_size(scratch)), dtype=np.float32)
        for row, snapshot in zip(out, self.snapshots):
            scratch.load_state_dict(snapshot)
            write_flat_params(scratch, row)
        return out



# --------------------------------------------------------------------------- the learner

def store_episodes(buffer: LocalReplay, episodes: list[dict], symmetries: tuple, gamma: float, n_step: int,
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
        from common.dqn import DQNLearner
        from common.dqn_rollouts import RemoteRollouts, make_manager

        cfg, env = run.cfg, run.env
        self.run, self.cfg = run, cfg
        self.learner = DQNLearner.for_run(run)
        run.counters.setdefault("iteration", 0)
        resumed = run.resumed or {}
        self.pool = OpponentPool(cfg.pool_size, resumed.get("snapshots", []), resumed.get("snapshot_ids"))
        self.buffer = LocalReplay(cfg.buffer_size, env.observation_space.shape, storage_dtype(env.observation_space),
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
        self.remote = RemoteRollouts(run, MODE.fingerprint(run)) if run.dist.world_size > 1 else None
        if self.remote is not None:
            self.remote.publish_weights(self.learner.q_net, self.manager.model_version, self.epsilon())
            if run.env.two_player:
                self.publish_pool()
            self.remote.start()
        updates = (f"replay ratio {cfg.replay_ratio:g}" if cfg.learning_steps_per_batch is None else
                   f"{cfg.learning_steps_per_batch} updates per {cfg.num_workers * cfg.episodes_per_batch} episodes")
        run.log.info("parallel_train_dqn: %s, %d rollout worker(s) x %d episodes per batch, %s, "
                     "buffer %d, learner on %s (precision %s), world size %d, run dir %s", cfg.env_id,
                     cfg.num_workers, cfg.episodes_per_batch, updates, cfg.buffer_size, self.learner.device,
                     self.learner.precision, run.dist.world_size, run.run_dir)

    def epsilon(self) -> float:
        from common.dqn import linear_schedule

        cfg = self.cfg
        return linear_schedule(cfg.epsilon_start, cfg.epsilon_end, cfg.epsilon_decay_steps,
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
                learned = self.learn(stats["steps"], stats["episodes"])
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

    def learn(self, new_steps: int, new_episodes: int) -> list[dict[str, float]]:
        """The updates owed for ``new_steps`` new transitions in ``new_episodes`` episodes (none before
        learning_starts): ``replay_ratio`` per transition, or with ``learning_steps_per_batch`` that many per
        num_workers x episodes_per_batch episodes (seed 002's batch, one from each worker)."""
        cfg = self.cfg
        if len(self.buffer) < max(cfg.learning_starts, cfg.batch_size):
            return []
        if cfg.learning_steps_per_batch is None:
            self.update_credit += cfg.replay_ratio * new_steps
        else:
            seed_batch = cfg.num_workers * cfg.episodes_per_batch
            self.update_credit += cfg.learning_steps_per_batch * new_episodes / seed_batch
        count = int(self.update_credit)
        self.update_credit -= count
        self.learner.anneal(self.run.budget_used())
        stats = []
        for _ in range(count):
            if self.run.graceful.requested:  # a signal stops after the update in flight, not after all owed
                break
            stats.append(self.learner.update(self.buffer, cfg.batch_size))
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
                self.publish_pool()
        if cfg.worker_reset_interval and iteration % cfg.worker_reset_interval == 0:
            manager.reset_workers()
        if cfg.eval_interval and iteration % cfg.eval_interval == 0:
            self.last_eval = self.evaluate()
            stop_at_targets(self.run, self.last_eval)

    def publish_pool(self) -> None:
        """The opponent pool for the other ranks' workers."""
        self.remote.publish_pool(self.pool.mixture(self.cfg), self.pool.flat(self.learner.q_net.spec))

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
        opponents = self.run.env.extra.get("evaluation_opponents", EVALUATION_OPPONENTS)
        for opponent in opponents:  # the training mix's fixed players, then held-out players it never met
            games = {seat: np.array([e["result"] for e in self.manager.evaluate(cfg.eval_episodes, opponent, first)])
                     for seat, first in (("first", True), ("second", False))}
            both = np.concatenate(list(games.values()))
            out.update({f"eval_win_{opponent}_{seat}": float(np.mean(g == 1.0)) for seat, g in games.items()})
            out.update({f"eval_win_{opponent}": float(np.mean(both == 1.0)),
                        f"eval_draw_{opponent}": float(np.mean(both == 0.0)),
                        f"eval_loss_{opponent}": float(np.mean(both == -1.0))})
        log.info("eval: win/draw/loss %% vs %s", ", ".join(
            f"{o} {100 * out[f'eval_win_{o}']:.0f}/{100 * out[f'eval_draw_{o}']:.0f}/{100 * out[f'eval_loss_{o}']:.0f}"
            for o in opponents))
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


# --------------------------------------------------------------------------- the mode

def fingerprint(run) -> dict:
    """What every rank must share with rank 0 to send it episodes: the code, the env and the network."""
    cfg, env = run.cfg, run.env
    return {"script": "parallel_train_dqn", "code": code_digest(__file__), "env_id": cfg.env_id,
            "env_kwargs": run.env_kwargs, "observation": [list(env.observation_space.shape),
                                                          str(env.observation_space.dtype)],
            "actions": int(env.action_space.n), "action_mask": env.action_mask, "hidden_sizes": list(cfg.hidden_sizes),
            "conv_channels": cfg.conv_channels,
            "max_game_length": cfg.max_game_length}


def make_trainer(run):
    """Rank 0 (or the only process) learns; every other rank only plays."""
    if run.cfg.learner == "ntuple":
        from common.ntuple_trainer import NTupleTrainer

        return NTupleTrainer(run, stop_at_targets)
    if run.dist.is_main:
        return DQNTrainer(run)
    from common.dqn_rollouts import RolloutRank

    return RolloutRank(run, MODE.fingerprint(run))


def stop_at_targets(run, evaluation: dict[str, float]) -> None:
    """--target-win-rate and --target-unbeaten, checked after each evaluation (of either learner)."""
    cfg = run.cfg
    if win_rates_reached(cfg.target_win_rate, evaluation):
        run.request_stop(f"target win rates {cfg.target_win_rate} reached")
    elif unbeaten(cfg.target_unbeaten, evaluation):
        run.request_stop(f"no game lost to {cfg.target_unbeaten} from either seat")


def win_rates_reached(target: list[float] | None, evaluation: dict[str, float]) -> bool:
    """--target-win-rate: an evaluation's win rates against random and heuristic both at least the target's."""
    if target is None or "eval_win_random" not in evaluation:
        return False
    return evaluation["eval_win_random"] >= target[0] and evaluation["eval_win_heuristic"] >= target[1]


def unbeaten(player: str | None, evaluation: dict[str, float]) -> bool:
    """--target-unbeaten: an evaluation that lost no game to ``player``, from either seat."""
    return player is not None and evaluation.get(f"eval_loss_{player}") == 0


def _mean(values) -> float:
    return float(np.mean(values)) if len(values) else math.nan


# ConnectFour's evaluation opponents: the training mix's fixed players, then the search players it never
# meets (common.envs.connect_four.EVALUATION_OPPONENTS, which a test holds equal; named here so that
# --help loads no gymnasium).
EVALUATION_OPPONENTS = ("random", "heuristic", "search1", "search2", "search3", "search4")
# The PettingZoo games' held-out players beyond those (common.envs.pettingzoo_games.GAMES, a test holds them equal).
PETTINGZOO_OPPONENTS = ("minimax",)
EVAL_COLUMNS = ["eval_return"] + [f"eval_{what}_{opponent}{seat}" for opponent in (*EVALUATION_OPPONENTS,
                                                                                   *PETTINGZOO_OPPONENTS)
                                  for what, seat in (("win", ""), ("win", "_first"), ("win", "_second"),
                                                     ("draw", ""), ("loss", ""))]
MODE = Mode("parallel_train_dqn", Config, make_trainer, description=__doc__.split("\n\n")[0],
            actions=("Discrete",), resume_requires=("model",), check=check_env,
            resume_must_match=("learner", "ntuple_tuples", "ntuple_length"),  # a checkpoint holds one learner's state
            distributed=True, cpu_collectives=True,  # ranks exchange CPU arrays only: an actor node needs no GPU
            fingerprint=fingerprint, buffers=replay_buffers, shm_buffers=("ntuple_weights",),  # the replay is not
            metrics_columns=["epsilon", "learning_rate", "loss", "q_mean", "learner_updates", "updates_per_s",
                             "episodes_per_s", "model_version", "staleness", "buffer_size", "train_win_rate",
                             "iteration", "world_size", "episodes_by_rank", "ranks_lost", *EVAL_COLUMNS])


def train(config: Config | None = None, env_factory=None, **fields) -> dict:
    """The same run from Python: ``train(Config(env_id="CartPole-v1", duration=0.1))``, or your own env class
    or function with ``train(config, env_factory=MyEnv)``; returns the summary (``summary.json``'s keys and
    ``run_dir``); see ``common.run.train_in_process``."""
    return train_in_process(MODE, config if config is not None else Config(**fields), env_factory)


def train_dqn(n_episodes: int | None = None, num_workers: int | None = None, **fields) -> dict:
    """Seed 002's call: ``train_dqn(n_episodes=100_000, num_workers=46, episodes_per_batch=4, batch_size=256)``.

    ``num_workers=None`` keeps the default (every core but two); any other keyword is a field of
    ``Config``. ``learning_steps_per_batch=None`` is auto: ``replay_ratio`` updates per env transition
    (one per 20 steps by default), so a batch's updates follow its length; a number is that many
    updates per ``num_workers * episodes_per_batch`` episodes, as in seed 002.
    """
    if n_episodes is not None:
        fields["total_episodes"] = n_episodes
    if num_workers is not None:
        fields["num_workers"] = num_workers
    return train(Config(**fields))


def main(argv: list[str] | None = None) -> int:
    return run_training(MODE, argv)


if __name__ == "__main__":
    sys.exit(main())
