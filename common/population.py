"""The coordinator of a population of independent agents, one process per member, and PBT.

A training script defines its members' agent; :class:`Members` holds it with what each member is
given, and this module runs them. On rank 0 (or on one machine) :class:`Population` starts one
worker per member, restarts a dead one from its newest checkpoint, turns every report into the
run's counters and a ``metrics.csv`` row, answers population-based training, stops the workers at
the end and ranks the final agents (``leaderboard.csv``, ``best.pt``). Under torchrun the members
of the other ranks reach it through :mod:`common.population_relay`, as the same messages.

How a member talks to the coordinator: :mod:`common.population_member`.

PBT runs in synchronous rounds: once every running member waits at a PBT step, the weakest
``pbt_fraction`` each copy one of the strongest (exploit) and take its hyperparameters scaled by
1 -/+ ``pbt_perturb`` (explore).
"""

from __future__ import annotations

import csv
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from common.checkpoint import latest_checkpoint
from common.config import require
from common.distributed import launched_by_torchrun
from common.population_member import (
    BEST_AGENT,
    MemberSetup,
    evaluate_policy,
    member_checkpoints,
    member_process,
    random_actions,
    split_kwargs,
)
from common.population_relay import FILE_PLACES, POLL_S, REPORTS, RemoteMembers
from common.ppo_learner import choose_learner
from common.rank_exchange import stop_message
from common.run import TrainingDiverged, checkpoint_run_dir, config_dict
from common.supervisor import Supervisor, WorkerFailed
from common.system import format_bytes, threads_per_process

REMOTE_STOP_SLACK_S = 5.0  # past stop_timeout_s, for the other ranks' last reports to arrive
REPORT_MARGIN_S = 1.0  # a stopped worker reports this long before stop_timeout_s ends (a quarter of it at most)


def population_size(num_workers: int) -> int:
    """Members in all: ``num_workers`` on every rank of a torchrun job, else ``num_workers``."""
    return num_workers * (int(os.environ["WORLD_SIZE"]) if launched_by_torchrun() else 1)


def check_member_values(cfg, names: tuple[str, ...], num_workers: int) -> None:
    """Each field of ``names`` holds one value for every member, one per member, or (named in
    ``cfg.sample_ranges``) a range ``low high``; ConfigError otherwise."""
    members = population_size(num_workers)
    each = (f"one per worker ({members})" if members == num_workers else
            f"one per member ({members}: {members // num_workers} ranks x {num_workers} workers)")
    for name in names:
        values = getattr(cfg, name)
        if name in cfg.sample_ranges:
            require(len(values) == 2 and values[0] <= values[1], name, values,
                    "is in sample_ranges, so it needs two values low high")
        else:
            require(len(values) in (1, members), name, values, f"needs 1 value or {each}")


def member_hyperparams(cfg, names: tuple[str, ...], members: int, seed: int) -> list[dict[str, float]]:
    """Each member's own values of the fields ``names``: shared, listed per member, or sampled from a range.

    Ranges are sampled log-uniformly when both ends are > 0 (learning rates span decades),
    uniformly otherwise, from a generator seeded with ``seed``: the same run, the same population.
    """
    rng = np.random.default_rng(seed)
    population: list[dict[str, float]] = [{} for _ in range(members)]
    for name in names:
        values = getattr(cfg, name)
        for index, hyper in enumerate(population):
            if name in cfg.sample_ranges:
                low, high = values
                hyper[name] = float(math.exp(rng.uniform(math.log(low), math.log(high))) if low > 0
                                    else rng.uniform(low, high))
            else:
                hyper[name] = float(values[0] if len(values) == 1 else values[index])
    return population


# ------------------------------------------------------------------------ the members

def share_market_cache(run) -> tuple[Any, dict | None]:
    """Market-v0: this node's one copy of the history in shared memory, which every worker here
    attaches (under torchrun each rank makes its own); (None, None) for other envs. The shared copy
    replaces the loaded one in ``run.env.extra["data"]`` (the fingerprint hashes it)."""
    from common.envs import market

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
    run.env.extra["data"] = market.MarketData(*(shared[f"market_{k}"] for k in market.CACHE_ARRAYS), [],
                                              "shared memory")
    return run.env.extra["data"], specs


@dataclass
class Members:
    """A rank's share of the population: the training script's agent class and what each member is given.
    Rank 0's :class:`Population` and the other ranks' nodes start (and restart) the same processes from it."""

    agent: type  # the training script's agent (see member_process): a module-level class (spawn)
    fingerprint: Callable[[Any], dict]  # the mode's (Mode.fingerprint): what a rank must share with rank 0
    cfg: Any  # the run's config (each member gets it flat)
    env_kwargs: dict[str, Any]  # the run's gymnasium.make kwargs, plain values
    hyper: list[dict[str, float]]  # every member's hyperparameters at the start (every rank's members)
    devices: list[str]  # this rank's workers' devices
    threads: int  # torch threads per worker
    target: float | None  # each member's own target return (independent agents are judged one by one)
    data: Any  # Market-v0's history in this node's shared memory, None for other envs
    data_specs: dict | None  # what a worker attaches that memory by
    items: list[int] | None  # Market-v0's traded items
    first: int  # this rank's first member

    @classmethod
    def of_rank(cls, run, agent: type, hyper_names: tuple[str, ...], devices: list[str],
                fingerprint: Callable[[Any], dict]) -> Members:
        """This rank's members: the market data shared here, every member's hyperparameters (``hyper_names``,
        see member_hyperparams), ``devices`` for this rank's workers."""
        cfg = run.cfg
        items = run.env.extra.get("item_indices")
        data, data_specs = share_market_cache(run)
        hyper = member_hyperparams(cfg, hyper_names, cfg.num_workers * run.dist.world_size, cfg.seed)
        threads = cfg.threads_per_worker or threads_per_process(cfg.num_workers)
        # The target is each worker's own (independent agents are judged one by one), never the population's.
        target, run.target_return = run.target_return, None
        return cls(agent, fingerprint, cfg, run.env_kwargs, hyper, devices, threads, target, data, data_specs, items,
                   run.dist.rank * cfg.num_workers)

    def setup(self, member: int, hyper: dict[str, float], run_dir: Path, checkpoint: Path | None) -> tuple:
        """The process arguments of ``member`` (of this rank), continuing from ``checkpoint`` if not None."""
        return self.agent, MemberSetup(member, config_dict(self.cfg), self.env_kwargs, str(run_dir), self.data_specs,
                                       self.items, self.devices[member - self.first], self.threads, hyper, self.target,
                                       str(checkpoint) if checkpoint else None)

    def eval_envs(self):
        """The held-out evaluation's envs, for the random policy's row of the leaderboard."""
        from common.envs import make_vec_env

        cfg = self.cfg
        return make_vec_env(cfg.env_id, cfg.eval_num_envs, cfg.eval_seed,
                            **split_kwargs(self.env_kwargs, "eval", self.data, self.items))

    def supervisor(self, run, args_for, name: str = "worker") -> Supervisor:
        """This rank's workers, one process per member, restarted from their newest checkpoint when they die."""
        cfg = run.cfg
        return run.supervise(Supervisor(
            member_process, cfg.num_workers, args_for, name=name, max_restarts=cfg.max_worker_restarts,
            start_timeout_s=max(cfg.worker_timeout_s, 120.0), hang_timeout_s=cfg.worker_timeout_s,
            on_give_up="worker", logger=run.log))


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


class Population:
    """The coordinator: starts one worker per member, follows their reports, answers PBT, stops them
    at the end (or on Ctrl+C / the duration) and ranks the final agents. Under torchrun it follows the
    members of every rank: the others' reach it through ``self.remote``."""

    def __init__(self, run, members: Members):
        self.run, self.members, cfg = run, members, run.cfg
        self.items, self.cache = members.items, run.env.extra.get("cache")
        count = cfg.num_workers * run.dist.world_size
        self.status = [WorkerStatus(rank=m // cfg.num_workers, hyper=h) for m, h in enumerate(members.hyper)]
        self.target = members.target
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
            self.remote = RemoteMembers(run, members.fingerprint(run), cfg.num_workers, FILE_PLACES, REPORTS,
                                        run.run_dir)
            run.defer(self.remote.close, {"reason": "rank 0 failed", "exit_code": 1})  # unless train() closed it
        self.supervisor = members.supervisor(run, self.args_for)
        # The members' learners, as common.ppo_learner chooses them for their devices (one name where they agree).
        learners = sorted({choose_learner(cfg.learner, device, run.env.observation_space)
                           for device in members.devices})
        self.learner = "/".join(learners)
        run.log.info("%s: %d workers x %d envs of %s%s, devices %s, %s learner, target %s, run dir %s",
                     run.script, cfg.num_workers, cfg.num_envs_per_worker, cfg.env_id,
                     f" on each of {run.dist.world_size} ranks ({count} in all)" if self.remote else "",
                     sorted(set(members.devices)), self.learner, self.target, run.run_dir)
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
            found = latest_checkpoint(directory, member_checkpoints(index))
            if found is not None:
                return found
        return None

    def args_for(self, index: int) -> tuple:
        """Called at the start and at every restart: a worker always continues from its newest checkpoint."""
        return self.members.setup(index, self.status[index].hyper, self.run.run_dir, self.newest_checkpoint(index))

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
                          {"running": f"{running}/{len(self.status)}"}, member=(index, report["step"]))

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

    # -- population-based training
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

    # -- the lifecycle's hooks
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
            envs = self.members.eval_envs()
            # Bounded like the members' own evaluations: stop_timeout_s, or a Ctrl+C, ends it with the
            # episodes finished so far (the row's eval_episodes says how many).
            deadline = time.monotonic() + cfg.stop_timeout_s
            self.baseline = evaluate_policy(envs, random_actions(envs.single_action_space, cfg.eval_seed),
                                            cfg.eval_episodes, cfg.eval_seed,
                                            stop=lambda: run.graceful.requested or time.monotonic() >= deadline)
        self.leaderboard = rows
        baseline_row = [{"worker": "random", **{f"eval_{k}": v for k, v in self.baseline.items()}}] \
            if self.baseline else []
        write_leaderboard(run.run_dir / "leaderboard.csv", rows + baseline_row, list(self.members.hyper[0]))
        copy_atomic(Path(rows[0]["checkpoint"]), run.run_dir / BEST_AGENT)
        run.log.info("leaderboard: best is worker %d (eval mean return %.3f%s) -> best.pt", rows[0]["worker"],
                     rows[0]["eval_mean_return"],
                     f", random policy {self.baseline['mean_return']:.3f}" if self.baseline else "")

    def summary(self) -> dict[str, Any]:
        workers = [{"rank": s.rank, "step": s.step, "recent_return": s.recent_return, "sps": s.sps, "hyper": s.hyper,
                    "finished": bool(s.result and s.result["finished"]), "gave_up": s.gave_up,
                    "diverged": s.diverged, "lost": s.lost, "failures": s.failures, "restarts": s.restarts}
                   for s in self.status]
        return {"target_return": self.target, "target_per_worker": True, "learner": self.learner, "cache": self.cache,
                "item_indices": self.items, "training_sps": round(sum(s.sps for s in self.status), 1),
                "population_size": len(self.status), "worker_restarts": sum(s.restarts for s in self.status),
                "workers": workers, "leaderboard": self.leaderboard, "random_baseline": self.baseline,
                "pbt_events": self.pbt_events,
                "best_worker": self.leaderboard[0]["worker"] if self.leaderboard else None,
                **(self.remote.summary() if self.remote else {})}

    def plots(self, run) -> list[dict]:
        return [{"plot": "population", "out": str(run.run_dir / "plots" / "population.png"),
                 "title": f"{run.script}: {run.cfg.env_id}, {run.cfg.num_workers} members"}]


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


def write_leaderboard(path: Path, rows: list[dict], hyper_names: list[str]) -> None:
    """``leaderboard.csv``, atomically: rank and evaluation first, then training, hyperparameters, checkpoint."""
    columns = ["rank", "worker", "eval_mean_return", "eval_std_return", "eval_episodes"]
    columns += sorted({k for r in rows for k in r if k.startswith("eval_mean_")} - set(columns))
    columns += ["steps", "train_recent_return", "restarts", "pbt_exploits", *hyper_names, "checkpoint"]
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
