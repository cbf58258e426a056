"""The asynchronous actor-learner DQN past one machine: actor ranks ship transitions to rank 0's replay.

Under torchrun every rank but 0 runs actors only (:class:`ActorRank`). Their transitions reach
the rank's main process on their pipes (the message-fed replay path, with no replay on that
rank); it ships them to rank 0 in one message every ``ship_interval_s``, and rank 0
(:class:`RemoteActors`) writes them into the partitions of that rank's actors. Rank 0's
replies carry the weights, the start flag and the rate limit back. The messages are typed
arrays checked against :func:`transition_schema` (:mod:`common.rank_exchange`): nothing an
actor rank sends is unpickled.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import numpy as np

from common.distributed import PeerFailure
from common.dqn_actors import ALLOWED, GO, STEPS_BEFORE, control_arrays, start_actors
from common.networks import QNetwork, SharedParams, flat_size, read_flat_params
from common.rank_exchange import Field, Hub, Schema, Spoke, follow_stop, interrupt_from_peer
from common.replay import storage_dtype
from common.replay_shm import ReplayLayout
from common.run import EXIT_FAILED
from common.shm import SharedArrays
from common.supervisor import set_torch_threads


def transition_schema(cfg, env) -> Schema:
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


class RemoteActors:
    """Rank 0's end: the hub the actor ranks ship to, their transitions written into their actors'
    partitions of the replay, and what the replies carry back. ``steps`` holds each actor rank's env
    steps in this invocation, as it last reported them (a lost rank keeps its count)."""

    def __init__(self, run, fingerprint: dict, params: SharedParams):
        self.run, self.params = run, params
        self.hub = Hub(run.dist, transition_schema(run.cfg, run.env), run.log)
        self.hub.refuse_mismatched(fingerprint)
        self.hub.publish(control={"go": False}, params=params.params[0])
        self.published = (time.monotonic(), params.version(0))  # what the actor ranks were last sent
        self.steps: dict[int, int] = {}
        self.stopped = False
        self.hub.start()
        # Reached only when the run ends before the learner stops the ranks itself: a failure.
        run.defer(self.stop, {"reason": "rank 0 failed", "exit_code": EXIT_FAILED})

    def receive(self, replay, on_episodes: Callable[[list[dict], int], None]) -> None:
        """Every message the actor ranks sent (the hub checked it with :func:`transition_schema`): a signal
        one caught, its env steps, its transitions into ``replay``, its finished episodes to ``on_episodes``."""
        for message in self.hub.drain():
            info, arrays, rank = message.info, message.arrays, message.rank
            if "signal" in info:
                interrupt_from_peer(self.run, rank, info["signal"])
            self.steps[rank] = max(self.steps.get(rank, 0), info.get("steps", 0))
            start = 0
            for index, rows in enumerate(info.get("rows", [])):  # the rank's actor k writes partition k of its block
                batch = {k: a[start:start + rows] for k, a in arrays.items()}
                self.write(replay, rank * self.run.cfg.num_workers + index, batch)
                start += rows
            episodes = episode_numbers(info.get("episodes", []))
            if episodes:
                on_episodes(episodes, rank)

    @staticmethod
    def write(replay, writer: int, batch: dict[str, np.ndarray]) -> None:
        part = replay.layout.part_capacity  # a partition takes at most its own size at once
        for lo in range(0, len(batch["actions"]), part):
            replay.receive(writer, {k: a[lo:lo + part] for k, a in batch.items()})

    def share_due(self) -> bool:
        return time.monotonic() - self.published[0] >= self.run.cfg.ship_interval_s

    def share(self, control: dict) -> None:
        """What the next replies carry: ``control`` and, when the learner has published newer ones, the weights."""
        changed = self.params.version(0) != self.published[1]
        self.hub.publish(control, params=self.params.params[0] if changed else None)
        self.published = (time.monotonic(), self.params.version(0))

    def summary(self) -> dict:
        return self.hub.summary()

    def stop(self, stop: dict) -> None:
        """Every actor rank's last reply says why the run stopped and with which exit status (once)."""
        if not self.stopped:
            self.stopped = True
            self.hub.close(stop)


class ActorRank:
    """A rank other than 0: its own ``num_workers`` actors, and what they collect shipped to rank 0.

    Nothing here decides when the run ends: the loop ships until rank 0's reply says stop (a
    signal caught here goes to rank 0 with the next message, and its stop comes back)."""

    def __init__(self, run, fingerprint: dict, layout: ReplayLayout):
        cfg, env = run.cfg, run.env
        self.run, self.cfg, self.rank = run, cfg, run.dist.rank
        set_torch_threads(1)  # this process only copies weights: the cores are the actors'
        self.spoke = Spoke(run.dist)
        self.spoke.refuse_mismatched(fingerprint)
        self.schema = transition_schema(cfg, env)
        self.q_net = QNetwork(env.observation_space, env.action_space, tuple(cfg.hidden_sizes))
        arrays = SharedArrays()
        run.defer(arrays.unlink_all)
        control_arrays(arrays, cfg.num_workers)
        self.params = SharedParams.allocate(arrays, flat_size(self.q_net))
        self.shared = {name: arrays[name] for name in arrays.specs()}
        self.shared["control"][STEPS_BEFORE] = run.counters["global_step"]
        self.shared["control"][ALLOWED] = np.iinfo(np.int64).max  # until rank 0's rate limiter says otherwise
        self.pending: list[list[dict]] = [[] for _ in range(cfg.num_workers)]  # transition batches, per actor
        self.episodes: list[dict] = []
        self.steps_sent, self.shipped_at, self.stop = 0, 0.0, None
        self.ship()  # the first reply brings rank 0's weights, which the actors wait for
        writer_spec = {"backend": "queue", "layout": layout}  # actors send on their pipes
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
            read_flat_params(self.q_net, reply.params)
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
