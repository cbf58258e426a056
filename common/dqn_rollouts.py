"""Rollout workers for the central DQN learner (parallel_train_dqn.py), on this machine and past it.

:func:`make_manager` starts a rank's rollout processes (``common.parallel_manager.ParallelManager``):
whole episodes played with the learner's latest weights, epsilon-greedy over legal actions,
against the opponents of a self-play mixture.

Under torchrun, ranks > 0 run rollout workers only (:class:`RolloutRank`). Their episodes travel
to rank 0 (:class:`RemoteRollouts`) as typed arrays with one row per observation (T + 1 rows for
an episode of T steps): the action taken there and the reward that followed (0 on the episode's
final row), ``last`` marking that final row and ``terminated`` on it whether the episode ended
rather than being cut, plus the legal-action masks where the env has them. Per-episode numbers
(a game's result) travel in the message's JSON info. Nothing is pickled, and rank 0 checks every
message (:func:`episode_schema`, :func:`check_episodes`) before it is stored. Rank 0's replies
carry the weights, epsilon and the opponent pool back.
"""

from __future__ import annotations

import math
import time

import numpy as np
import torch

from common.distributed import PeerFailure
from common.manager_config import ManagerConfig, WorkerSpec
from common.networks import QNetwork, build_network, flat_size, read_flat_params, write_flat_params
from common.parallel_manager import ParallelManager
from common.rank_exchange import Field, Hub, Schema, Spoke, follow_stop, interrupt_from_peer
from common.rollout_worker import ExperienceBatch


def make_manager(run, model, epsilon: float, seed: int, log_dir: str | None):
    """Rollout workers playing with ``model``'s weights (not started yet), released when the run ends."""
    cfg = run.cfg
    spec = WorkerSpec(cfg.env_id, seed, tuple(cfg.hidden_sizes), run.env_kwargs, log_dir=log_dir)
    config = ManagerConfig(
        num_workers=cfg.num_workers, games_per_worker=cfg.episodes_per_batch,
        max_game_length=cfg.max_game_length or 0, model_sync_interval=cfg.model_sync_interval,
        timeout=cfg.worker_timeout_s, max_restarts=cfg.max_worker_restarts,
        experience_queue_size=cfg.experience_queue_size, hang_timeout=cfg.worker_timeout_s,
        start_timeout=max(cfg.worker_timeout_s, 120.0), opponent_slots=cfg.pool_size)
    manager = ParallelManager(spec, parallel_config=config, model=model, epsilon=epsilon, logger=run.log)
    run.defer(manager.stop_workers)
    run.supervise(manager.supervisor)
    return manager


# --------------------------------------------------------------------------- past one machine

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



class RemoteRollouts:
    """Rank 0's end: the hub the other ranks send episodes to, and what its replies tell them."""

    def __init__(self, run, fingerprint: dict):
        self.run = run
        # Each rank may be experience_queue_size messages ahead of the learner, as each local worker
        # may be batches ahead: an iteration stores a bounded amount, and a full inbox slows the ranks.
        inbox = max(1, run.cfg.experience_queue_size) * (run.dist.world_size - 1)
        self.hub = Hub(run.dist, episode_schema(run.env), run.log, inbox_size=inbox)
        self.closed = False
        run.defer(self.close, {"reason": "rank 0 failed", "exit_code": 1})  # only if train() did not close it
        self.hub.refuse_mismatched(fingerprint)

    def start(self) -> None:
        self.hub.start()

    def publish_weights(self, q_net, model_version: int, epsilon: float) -> None:
        params = np.empty(flat_size(q_net), dtype=np.float32)
        write_flat_params(q_net, params)
        self.hub.publish({"epsilon": epsilon, "model_version": model_version}, params)

    def publish_epsilon(self, epsilon: float) -> None:
        self.hub.publish({"epsilon": epsilon})

    def publish_pool(self, mixture: dict, snapshots: np.ndarray) -> None:
        """The opponent mixture and the snapshots (rows of flat parameters) in one reply: a rank never plays
        a mixture with the wrong pool."""
        self.hub.publish({"opponents": mixture}, arrays={"snapshots": snapshots})

    def receive(self) -> dict[int, list]:
        """The episodes other ranks sent since the last call (checked by the hub), per rank."""
        by_rank: dict[int, list] = {}
        for message in self.hub.drain():
            if "signal" in message.info:
                interrupt_from_peer(self.run, message.rank, message.info["signal"])
            if message.arrays:
                episodes = unpack_episodes(message.arrays, message.info.get("episodes", []))
                by_rank.setdefault(message.rank, []).append(ExperienceBatch(
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

    def __init__(self, run, fingerprint: dict):
        cfg, env = run.cfg, run.env
        self.run, self.rank = run, run.dist.rank
        torch.set_num_threads(1)  # this process only packs episodes; the cores are the workers'
        self.spoke = Spoke(run.dist)
        self.spoke.refuse_mismatched(fingerprint)
        self.obs_dtype = env.observation_space.dtype
        model = QNetwork(env.observation_space, env.action_space, tuple(cfg.hidden_sizes),
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
            read_flat_params(self.manager.model, reply.params)
            local = self.manager.sync_model_to_workers()
            self.learner_versions[local] = int(control.get("model_version", 0))
        if "epsilon" in control:
            self.epsilon = float(control["epsilon"])
            self.manager.set_epsilon(self.epsilon)
        if reply.arrays is not None and "opponents" in control:
            snapshots = reply.arrays["snapshots"]
            scratch = build_network(self.manager.model.spec)
            state_dicts = []
            for row in snapshots:
                read_flat_params(scratch, row)
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

