"""One training run while it trains: :class:`Run` (counters, metrics, stop rules, checkpoints),
the Ctrl+C / SIGTERM handling it installs (:class:`GracefulExit`) and where the process's wall
time went (:class:`TimeBudget`). :mod:`common.run` builds it and drives it from start to exit.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import time
from collections import deque
from collections.abc import Callable
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from common.run_setup import EnvInfo, config_dict, parse_target
from common.runlog import MetricsWriter, Progress, RunLock, close_log_files

RECENT = 100  # "solved" and the reported mean return are over the last 100 episodes


class GracefulExit:
    """First Ctrl+C or SIGTERM asks the run to stop (checkpoint, summary, exit 130/143);
    a second Ctrl+C ends the process at once."""

    def __init__(self, logger: logging.Logger):
        self.signum: int | None = None
        self.logger = logger
        self._previous: dict[int, Any] = {}

    def install(self) -> GracefulExit:
        import threading

        if threading.current_thread() is not threading.main_thread():
            return self  # Python accepts handlers from the main thread only; a run from a thread keeps the defaults
        for signum in (signal.SIGINT, signal.SIGTERM):
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def uninstall(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _handle(self, signum, frame) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            os._exit(130)  # the workers die with us (common.supervisor)
        self.signum = self.signum or signum
        self.logger.warning("%s received: finishing the current step, saving, then exiting "
                            "(Ctrl+C again to exit at once)", signal.Signals(signum).name)

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def exit_code(self) -> int:
        return 128 + self.signum if self.signum else 0


# ------------------------------------------------------------------------ where the time goes

BUDGET_PARTS = ("startup", "collect", "learn", "wait", "checkpoint", "log", "shutdown")


class TimeBudget:
    """Where the wall time of the whole process went: start-up (process start to the first env
    step), collecting, learning, waiting on workers, checkpointing, logging, shutting down."""

    def __init__(self, started: float | None = None):
        # A run called from Python (train()) counts from the call: the process may have run others before.
        self.process_start = started or _process_start_time()
        self.seconds = dict.fromkeys(BUDGET_PARTS, 0.0)
        self.first_step: float | None = None

    def mark_first_step(self, when: float | None = None) -> None:
        """The first env step of the run happened at ``when`` (``time.time()``, any process)."""
        if self.first_step is None:
            self.first_step = when or time.time()
            self.seconds["startup"] = max(0.0, self.first_step - self.process_start)

    @contextmanager
    def part(self, name: str):
        """Count the time spent in the ``with`` block towards ``name`` (time before the first env
        step is start-up, whatever the block was doing, so it is not counted twice)."""
        started = time.time()
        try:
            yield
        finally:
            ended = time.time()
            begin = max(started, self.first_step) if self.first_step is not None else ended
            self.seconds[name] += max(0.0, ended - begin)

    def report(self) -> dict[str, float]:
        total = time.time() - self.process_start
        parts = {f"{k}_s": round(v, 3) for k, v in self.seconds.items()}
        parts["other_s"] = round(max(0.0, total - sum(self.seconds.values())), 3)
        parts["process_s"] = round(total, 3)
        return parts


def _process_start_time() -> float:
    """When this process started, to the clock tick. On Linux from its start in ticks since boot and the
    uptime, both exact; psutil adds the boot time, which Linux gives in whole seconds, so its start
    times are up to a second early (and a 3 s run's start-up read 1.3 s instead of 0.8 s)."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        pass
    try:
        import psutil

        return psutil.Process().create_time()
    except Exception:  # no psutil, or no permission: the module's import time is close
        return time.time() - time.perf_counter() + _IMPORTED_AT


_IMPORTED_AT = time.perf_counter()


# ------------------------------------------------------------------------ the run

class TrainingDiverged(RuntimeError):
    """The loss became NaN or infinite: stop without saving, keep the last good checkpoint."""


class Run:
    """One training run: its config, env, directory, logs, counters, stop rules and checkpoints."""

    def __init__(self, script: str, cfg: Any, env: EnvInfo, run_dir: Path, lock: RunLock | None,
                 resume_path: Path | None, resumed: dict | None, budget: TimeBudget, metrics_columns: list[str],
                 dist: Any = None, env_kwargs: dict | None = None):
        from common.distributed import SingleProcess
        from common.system import ProcessTreeSampler

        self.script, self.cfg, self.env, self.run_dir = script, cfg, env, run_dir
        self.env_kwargs = dict(env_kwargs or {})  # gymnasium.make kwargs: checkpoints keep them for evaluation
        self.resume_path, self.resumed = resume_path, resumed
        self.budget, self._lock = budget, lock
        self.dist = dist or SingleProcess()  # under torchrun: this rank; rank 0 alone writes files
        self.is_main = self.dist.is_main
        self.log = logging.getLogger(f"prl.{script}")
        self.sampler = ProcessTreeSampler()
        self.supervisors: list = []
        self.plotter = None  # rank 0's plotter process (common/plots.py), started by execute()
        self.counters = {"global_step": 0, "episodes": 0, "updates": 0, "wall_time": 0.0,
                         "best_mean_return": None, "recent_returns": []}
        if resumed is not None:
            self.counters.update(resumed.get("counters", {}))
        self.recent = deque(self.counters["recent_returns"], maxlen=RECENT)
        target = parse_target(getattr(cfg, "target_return", None))
        self.target_return = env.reward_threshold if target == "auto" else target
        self.graceful = GracefulExit(self.log)
        self._wall_offset = float(self.counters["wall_time"])
        self.start_clock()
        self._stop: str | None = None
        self._window: list[dict] = []  # episodes since the last metrics row
        self.last_good_checkpoint: Path | None = resume_path
        self._cleanup = ExitStack()
        self.metrics = self.progress = None
        if self.is_main:
            columns = ["return_mean100", *metrics_columns, "worker_restarts", "cpu_percent", "rss_mb", "pss_mb"]
            tracker = None
            if getattr(cfg, "track", None):  # the library is imported by the tracker, and only with --track
                from common.tracking import Tracker

                tracker = Tracker(cfg.track, script, run_dir, config_dict(cfg), resume_path, self.log)
            self.metrics = MetricsWriter(run_dir, columns, tensorboard=cfg.tensorboard, tracker=tracker)
            total = getattr(cfg, "total_timesteps", None)
            self.progress = Progress(total, "steps", self.log, cfg.log_interval_s, initial=self.counters["global_step"])

    def start_clock(self) -> None:
        """Training starts now: wall_time, the duration budget and the checkpoint interval count from here."""
        self._started = time.monotonic()
        self._deadline = self._started + self.cfg.duration * 3600 if getattr(self.cfg, "duration", None) else math.inf
        self._last_checkpoint = self._started
        self._window_start = (self._started, self.counters["global_step"])

    def start_duration(self) -> None:
        """--duration counts from now (a mode whose workers train as soon as each is up calls it once all
        are): wall_time and the checkpoint interval keep counting from start_clock."""
        duration = getattr(self.cfg, "duration", None)
        self._deadline = time.monotonic() + duration * 3600 if duration else math.inf

    def defer(self, callback: Callable[..., Any], *args: Any) -> None:
        """Run ``callback(*args)`` when the run ends, however it ends (last registered, first run).

        A trainer registers here what it starts (workers, shared memory) as soon as it starts
        it, so nothing outlives the run even if the trainer's own set-up fails halfway.
        """
        self._cleanup.callback(callback, *args)

    def supervise(self, supervisor: Any) -> Any:
        """Count ``supervisor``'s restarts in the metrics and the summary, and stop its workers at the end."""
        self.supervisors.append(supervisor)
        self.defer(supervisor.stop, min(30.0, self.cfg.worker_timeout_s))
        return supervisor

    @property
    def worker_restarts(self) -> int:
        return sum(s.total_restarts for s in self.supervisors)

    # -- counters and metrics
    @property
    def wall_time(self) -> float:
        return self._wall_offset + time.monotonic() - self._started

    def mean_return(self) -> float:
        return float(sum(self.recent) / len(self.recent)) if len(self.recent) == RECENT else math.nan

    def record_episodes(self, episodes: list[dict], global_step: int | None = None) -> None:
        """Count finished episodes (dicts with ``return`` and ``length``) and log each one to TensorBoard."""
        step = self.counters["global_step"] if global_step is None else global_step
        for episode in episodes:
            self.recent.append(float(episode["return"]))
            if self.metrics is not None:
                self.metrics.episode(step, float(episode["return"]), int(episode["length"]))
        self.counters["episodes"] += len(episodes)
        self._window.extend(episodes)
        mean = self.mean_return()
        best = self.counters["best_mean_return"]
        if math.isfinite(mean) and (best is None or mean > best):
            self.counters["best_mean_return"] = mean

    def write_metrics(self, row: dict[str, Any], progress: dict[str, Any] | None = None,
                      member: tuple[int, int] | None = None) -> None:
        """One row of ``metrics.csv``: the core columns from the counters, then ``row``; ``member``: (index, its
        own step) of the population member the row is about (--track logs it to that member's run too)."""
        if not self.is_main:
            return
        with self.budget.part("log"):
            now, steps = time.monotonic(), self.counters["global_step"]
            since, steps_then = self._window_start
            episodes = self._window
            resources = self.sampler.sample()
            core = {"wall_time": self.wall_time, "global_step": steps, "episodes": self.counters["episodes"],
                    "episodic_return": _mean([e["return"] for e in episodes]),
                    "episodic_length": _mean([e["length"] for e in episodes]),
                    "sps": (steps - steps_then) / max(now - since, 1e-9), "return_mean100": self.mean_return()}
            usage = {"worker_restarts": self.worker_restarts, "cpu_percent": resources.cpu_percent,
                     "rss_mb": resources.rss_bytes / 2**20, "pss_mb": resources.pss_bytes / 2**20}
            self.metrics.write({**core, **row, **usage}, member)
            self._window, self._window_start = [], (now, steps)
            shown = {"return100": core["return_mean100"], "sps": round(core["sps"]), **(progress or {})}
            self.progress.update(steps, shown)

    # -- stopping
    def request_stop(self, reason: str) -> None:
        """A mode's own stop rule was met (a target coverage, a win rate ...)."""
        self._stop = self._stop or reason

    def stop_reason(self) -> str | None:
        """Why the run should stop now, or None: a signal, a budget, the deadline, the target."""
        cfg, c = self.cfg, self.counters
        if self.graceful.requested:
            return "interrupted"
        if self._stop:
            return self._stop
        total_steps, total_episodes = getattr(cfg, "total_timesteps", None), getattr(cfg, "total_episodes", None)
        if total_steps is not None and c["global_step"] >= total_steps:
            return f"total_timesteps {total_steps} reached"
        if total_episodes is not None and c["episodes"] >= total_episodes:
            return f"total_episodes {total_episodes} reached"
        if time.monotonic() >= self._deadline:
            return f"duration {cfg.duration} h reached"
        if self.target_return is not None and self.mean_return() >= self.target_return:
            return f"target return {self.target_return:g} reached (mean of the last {RECENT} episodes)"
        return None

    def budget_used(self) -> float:
        """How far the run is through its budget, 0 to 1: the largest of the fractions of
        ``total_timesteps`` and ``total_episodes`` done (counted over resumes) and of this invocation's
        ``--duration`` gone; 0 when there is no budget. Schedules over "the run" (a learning rate
        annealed to 0, prioritized replay's beta) read it, so they end when the run does."""
        cfg, c = self.cfg, self.counters
        fractions = [0.0]
        for total, done in ((getattr(cfg, "total_timesteps", None), c["global_step"]),
                            (getattr(cfg, "total_episodes", None), c["episodes"])):
            if total:
                fractions.append(done / total)
        duration = getattr(cfg, "duration", None)
        if duration and math.isfinite(self._deadline):
            fractions.append(1.0 - (self._deadline - time.monotonic()) / (duration * 3600))
        return min(1.0, max(fractions))

    # -- checkpoints
    def checkpoint_due(self) -> bool:
        return time.monotonic() - self._last_checkpoint >= self.cfg.checkpoint_interval_s

    def save_checkpoint(self, state: dict | None, name: str = "latest.pt") -> Path | None:
        """Write ``state`` (model, optimizer, ...) with the counters, config and RNG state, atomically."""
        if state is None or not self.is_main:
            return None
        from common.checkpoint import rng_state, save_checkpoint

        with self.budget.part("checkpoint"):
            self.counters["wall_time"] = self.wall_time
            self.counters["recent_returns"] = list(self.recent)
            full = {"script": self.script, "config": config_dict(self.cfg), "counters": dict(self.counters),
                    "env": {"id": self.cfg.env_id, "kwargs": self.env_kwargs}, "rng": rng_state(), **state}
            path = save_checkpoint(full, self.run_dir / "checkpoints" / name)
        self._last_checkpoint = time.monotonic()
        self.last_good_checkpoint = path
        self.log.info("checkpoint saved: %s (step %d)", path, self.counters["global_step"])
        return path

    # -- the end
    def summary(self, stop_reason: str, exit_code: int, extra: dict) -> dict:
        cfg, c = self.cfg, self.counters
        wall = self.wall_time
        return {"script": self.script, "env_id": cfg.env_id, "seed": cfg.seed, "stop_reason": stop_reason,
                "exit_code": exit_code, "global_step": c["global_step"], "episodes": c["episodes"],
                "updates": c["updates"], "wall_time_s": round(wall, 3), "sps": round(c["global_step"] / wall, 1)
                if wall > 0 else None, "final_mean_return": _finite(self.mean_return()),
                "best_mean_return": c["best_mean_return"], "target_return": self.target_return,
                "num_workers": getattr(cfg, "num_workers", None),
                "num_envs_per_worker": getattr(cfg, "num_envs_per_worker", None),
                "worker_restarts": self.worker_restarts, "world_size": self.dist.world_size,
                "peak_rss_mb": round(self.sampler.peak_rss / 2**20, 1),
                "peak_pss_mb": round(self.sampler.peak_pss / 2**20, 1),
                "resumed_from": str(self.resume_path) if self.resume_path else None,
                "time_budget": self.budget.report(), **extra}

    def close_resources(self) -> None:
        """Stop what the trainer started (see :meth:`defer`); errors are logged, never raised."""
        try:
            self._cleanup.close()
        except Exception:
            self.log.exception("error while releasing the run's resources")

    def close(self) -> None:
        if self.is_main:
            self.progress.close()
            self.metrics.close()
            self._lock.release()
        close_log_files(self.log)


def _mean(values: list[float]) -> float:
    return float(sum(values) / len(values)) if values else math.nan


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None
