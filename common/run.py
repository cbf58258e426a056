"""The run lifecycle every training script shares, written once.

A script declares its settings (a dataclass deriving from :class:`RunConfig`) and its
algorithm (a trainer class), and its ``main()`` is one call to :func:`run_training`, which
does, in this order and the same way for every mode:

1. **Config**: defaults < ``--config FILE.yaml`` < flags; a bad value, an unknown key, an env
   the mode cannot train, a ``--resume`` file that is missing, not a checkpoint, or from
   another script, env or network width, or an output directory that is a file: one line,
   exit 2, nothing written. ``--validate-only`` stops here and prints the resolved config.
2. **Run directory and lock**: ``runs/<script>/<env>__<seed>__<time>`` unless
   ``--output-dir``; a second run into a directory in use exits 3; a fresh run into a
   directory that holds checkpoints exits 2 (``--resume auto`` continues it).
3. **Logs, metrics, progress**: ``logs/main.log``, ``metrics.csv`` (the core columns first) and
   TensorBoard under CleanRL's tag names (``charts/episodic_return`` per finished episode),
   a tqdm bar on a terminal, otherwise a log line every ``log_interval_s``.
4. **Resume**: counters, RNG state and the recent returns come back with the model, so the
   step count and ``metrics.csv`` continue where the checkpoint left them.
5. **Signals**: the first Ctrl+C or SIGTERM lets the step in flight finish, then the run
   saves and exits 130 / 143; a second Ctrl+C exits at once (workers die with their parent).
6. **Checkpoints** every ``checkpoint_interval_s`` (the trainer says when it is at a safe
   point) and at the end, atomically, with everything needed to continue and to rebuild the
   policy.
7. **The end**: ``summary.json`` with the same keys in every script (and a time budget of the
   whole process), ``plots/training_curve.png``, exit status 0 (a budget, the deadline or the
   target reached), 1 (training failed), 2 (bad config), 3 (locked), 130 / 143 (signal).

A trainer is a class ``Trainer(run)`` with ``train()`` (the loop: it returns when
:meth:`Run.stop_reason` says so) and ``state_dict()`` (a checkpoint's content, or None when
there is nothing worth saving), and optionally ``summary()`` (extra summary keys) and
``plot(run)``. Whatever it starts (workers, shared memory) it hands to :meth:`Run.defer`, which
releases it at the end whatever happens, also when the trainer's own set-up fails halfway.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import sys
import time
from collections import deque
from collections.abc import Callable
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.config import (
    EXIT_BAD_CONFIG,
    ConfigError,
    config_yaml,
    parse_args,
    require,
    require_env_id,
    require_positive,
    save_config,
    to_dict,
    unusable_directory,
)
from common.distributed import PeerFailure, PeerRefused
from common.runlog import (
    EXIT_LOCKED,
    MetricsWriter,
    Progress,
    RunLock,
    close_log_files,
    default_run_dir,
    setup_logging,
    write_summary,
)
from common.supervisor import WorkerConfigError, WorkerFailed

EXIT_OK, EXIT_FAILED = 0, 1
RECENT = 100  # "solved" and the reported mean return are over the last 100 episodes


@dataclass
class RunConfig:
    """Settings every script shares; each script's ``Config`` derives from this class."""

    output_dir: str | None = None  # run directory (default runs/<script>/<env>__<seed>__<time>)
    resume: str | None = None  # continue a run: a checkpoint file, a run directory, or auto (the newest here)
    checkpoint_interval_s: float = 60.0  # seconds between checkpoints (one more at the end)
    log_interval_s: float = 10.0  # seconds between progress lines when stderr is not a terminal
    tensorboard: bool = True  # also write TensorBoard events to tb/
    max_worker_restarts: int | None = 3  # restarts per worker before the run gives up (exit 1); None = no limit
    worker_timeout_s: float = 120.0  # a worker not started, or silent, this long is killed and restarted
    env_kwargs: list[str] = field(default_factory=list)  # KEY=VALUE keyword arguments for gymnasium.make

    MIN_WORKERS = 1  # the fewest worker processes the mode can run with (0: in-process)

    def validate(self) -> None:
        """Checks of the shared fields; a script's ``validate`` calls this first."""
        if hasattr(self, "env_id"):
            require_env_id(self.env_id)
        if hasattr(self, "num_workers"):
            require(self.num_workers >= self.MIN_WORKERS, "num_workers", self.num_workers,
                    f"must be >= {self.MIN_WORKERS}" + (" (0 = in the main process)" if self.MIN_WORKERS == 0 else ""))
        require_positive(self, *[name for name in ("num_envs_per_worker", "total_timesteps", "total_episodes",
                                                   "duration", "learning_rate", "batch_size")
                                 if hasattr(self, name)])
        require_positive(self, "checkpoint_interval_s", "log_interval_s", "worker_timeout_s")
        require(self.max_worker_restarts is None or self.max_worker_restarts >= 0, "max_worker_restarts",
                self.max_worker_restarts, "must be >= 0 or none")
        if hasattr(self, "gamma"):
            require(0 <= self.gamma <= 1, "gamma", self.gamma, "must be in [0, 1]")
        if hasattr(self, "hidden_sizes"):
            require(len(self.hidden_sizes) > 0 and all(h > 0 for h in self.hidden_sizes), "hidden_sizes",
                    self.hidden_sizes, "widths must be > 0")
        if hasattr(self, "target_return"):
            parse_target(self.target_return)
        if hasattr(self, "device"):
            from common.system import resolve_device

            resolve_device(self.device)
        parse_env_kwargs(self.env_kwargs)


def parse_env_kwargs(pairs: list[str]) -> dict[str, Any]:
    """``["size=8", "view=global"]`` -> ``{"size": 8, "view": "global"}`` (values read as YAML scalars)."""
    import yaml

    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = str(pair).partition("=")
        if not sep or not key.strip().isidentifier():
            raise ConfigError("env_kwargs", pair, "must be KEY=VALUE with KEY a Python identifier")
        try:
            out[key.strip()] = yaml.safe_load(value)
        except yaml.YAMLError:
            out[key.strip()] = value
    return out


def parse_target(value: str | None) -> float | str | None:
    """``target_return``: a number, ``auto`` (the env's own reward_threshold) or none."""
    if value is None or str(value).lower() in ("none", "null", "off"):
        return None
    if str(value).lower() == "auto":
        return "auto"
    try:
        return float(value)
    except ValueError:
        raise ConfigError("target_return", value, "must be a number, auto (the env's own threshold) or none") \
            from None


class FlatConfig:
    """One object over a script's config groups (field names are unique across groups)."""

    def __init__(self, groups: dict[str, Any]):
        self.__dict__["_groups"] = groups

    def __getattr__(self, name: str) -> Any:
        for group in self._groups.values():
            if hasattr(group, name):
                return getattr(group, name)
        raise AttributeError(name)

    def __setattr__(self, name: str, value: Any) -> None:
        for group in self._groups.values():
            if hasattr(group, name):
                setattr(group, name, value)
                return
        raise AttributeError(name)


def config_dict(cfg: Any) -> dict[str, Any]:
    """A config as one flat dict (grouped configs merged), as checkpoints store it."""
    if isinstance(cfg, FlatConfig):
        return {k: v for group in cfg._groups.values() for k, v in to_dict(group).items()}
    return to_dict(cfg)


def _groups_or_config(cfg: Any) -> Any:
    return cfg._groups if isinstance(cfg, FlatConfig) else cfg


# ------------------------------------------------------------------------ the env a mode can train

@dataclass
class EnvInfo:
    """What one probe of the env told: its spaces and what the mode must know about it."""

    env_id: str
    observation_space: Any
    action_space: Any
    action_mask: bool = False  # info["action_mask"] marks legal actions
    two_player: bool = False  # a built-in game with a pluggable opponent
    reward_threshold: float | None = None  # the env's own "solved" return, if it has one
    extra: dict = field(default_factory=dict)


def probe_env(env_id: str, env_kwargs: dict | None = None, actions: tuple[str, ...] = ("Discrete", "Box"),
              seed: int = 0) -> EnvInfo:
    """Make and reset one env; refuse (ConfigError) an id that fails or spaces the mode cannot train."""
    import gymnasium as gym

    from common.envs import make_env

    try:
        env = make_env(env_id, seed, **(env_kwargs or {}))()
        _, info = env.reset(seed=seed)
    except Exception as err:  # missing extras (Box2D, ALE), bad env kwargs and broken ids all land here
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError("env_id", env_id, f"cannot create it ({reason[:160]})") from None
    obs_space, act_space = env.observation_space, env.action_space
    two_player = hasattr(env.unwrapped, "set_opponent")
    threshold = env.spec.reward_threshold if env.spec is not None else None
    env.close()
    kind = type(act_space).__name__
    if kind not in actions:
        raise ConfigError("env_id", env_id, f"its action space {act_space} is not {' or '.join(actions)}, "
                                            "which this mode needs")
    if not isinstance(obs_space, gym.spaces.Box):
        raise ConfigError("env_id", env_id, f"its observation space {obs_space} is not a Box, which this mode needs")
    return EnvInfo(env_id, obs_space, act_space, "action_mask" in info, two_player, threshold)


# ------------------------------------------------------------------------ resume

def checkpoint_run_dir(path: Path) -> Path:
    """The run directory a checkpoint file belongs to (``<run>/checkpoints/x.pt`` or ``<run>/x.pt``)."""
    return path.parent.parent if path.parent.name == "checkpoints" else path.parent


def find_checkpoint(resume: str, output_dir: str | None, script: str, env_id: str, seed: int,
                    pattern: str) -> Path | None:
    """The file a ``--resume`` value names; None for ``auto`` with nothing to continue (a fresh start)."""
    from common.checkpoint import latest_checkpoint

    if resume == "auto":
        if output_dir:
            candidates = [Path(output_dir)]
        else:
            found = Path("runs", script).glob(f"{env_id.replace('/', '_')}__{seed}__*")
            candidates = sorted(found, key=os.path.getmtime, reverse=True)
        for run_dir in candidates:
            path = latest_checkpoint(run_dir / "checkpoints", pattern)
            if path is not None:
                return path
        return None
    path = Path(resume)
    if path.is_dir():
        found = latest_checkpoint(path / "checkpoints", pattern)
        if found is None:
            raise ConfigError("resume", resume, "this run directory holds no checkpoint")
        return found
    if not path.is_file():
        raise ConfigError("resume", resume, "no such checkpoint file or run directory")
    return path


def load_resume(script: str, cfg: Any, pattern: str, required: tuple[str, ...]) -> tuple[Path | None, dict | None]:
    """Find and check the checkpoint to continue; ConfigError names what does not match."""
    if cfg.resume is None:
        return None, None
    from common.checkpoint import CheckpointError, load_checkpoint

    path = find_checkpoint(cfg.resume, cfg.output_dir, script, cfg.env_id, cfg.seed, pattern)
    if path is None:
        return None, None
    try:
        state = load_checkpoint(path, required=("script", "config", *required))
    except CheckpointError as err:
        raise ConfigError("resume", cfg.resume, str(err)) from None
    saved = state["config"]
    if state["script"] != script:
        raise ConfigError("resume", str(path), f"is a checkpoint of {state['script']}.py, not of {script}.py")
    for name in ("env_id", "hidden_sizes"):
        if hasattr(cfg, name) and name in saved and saved[name] != getattr(cfg, name):
            raise ConfigError("resume", str(path), f"was trained with {name} {saved[name]!r}, "
                                                   f"not {getattr(cfg, name)!r}")
    return path, state


# ------------------------------------------------------------------------ signals

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
            self.metrics = MetricsWriter(run_dir, columns, tensorboard=cfg.tensorboard)
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

    def write_metrics(self, row: dict[str, Any], progress: dict[str, Any] | None = None) -> None:
        """One row of ``metrics.csv``: the core columns from the counters, then ``row``."""
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
            self.metrics.write({**core, **row, **usage})
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


# ------------------------------------------------------------------------ from argv to exit status

@dataclass
class Mode:
    """What the lifecycle needs to know about a script."""

    script: str  # file name without .py: runs/<script>/, checkpoint["script"]
    config: type | dict[str, type]  # the dataclass(es) at the top of the script
    trainer: Callable[[Run], Any]  # the algorithm
    description: str = ""
    actions: tuple[str, ...] = ("Discrete", "Box")  # action spaces the mode trains
    checkpoint_pattern: str = r".*\.pt"  # files --resume auto considers
    resume_requires: tuple[str, ...] = ("model",)  # keys a checkpoint to continue from must have
    metrics_columns: list[str] = field(default_factory=list)  # metrics.csv columns after the core ones
    env_kwargs: Callable[[Any], dict] = lambda cfg: {}  # gymnasium.make kwargs from the config (plain values)
    check: Callable[[Any, EnvInfo], None] | None = None  # the mode's own checks (RAM, /dev/shm ...): ConfigError
    probe: Callable[[Any], EnvInfo] | None = None  # replaces probe_env (e.g. to load a data cache once)
    distributed: bool = False  # under torchrun, every rank runs the trainer (DD-PPO); rank 0 writes
    # The ranks exchange CPU data only (common.hub's messages, the handshake): gloo between them, also where
    # the learner is on a GPU and the actor nodes have none (NCCL would need a GPU on every rank).
    cpu_collectives: bool = False


def env_kwargs_of(mode: Mode, cfg: Any) -> dict[str, Any]:
    """What every env of the run is made with: the mode's own settings, then ``--env-kwargs``."""
    return {**mode.env_kwargs(cfg), **parse_env_kwargs(getattr(cfg, "env_kwargs", []))}


def prepare(mode: Mode, argv: list[str] | None,
            exit_on_error: bool = True) -> tuple[Any, EnvInfo, Path, Path | None, dict | None, bool]:
    """Steps 1 and the checks of step 2: everything that may exit 2 before anything is written."""
    parsed, actions = parse_args(mode.config, argv, mode.description, exit_on_error)
    cfg = FlatConfig(parsed) if isinstance(parsed, dict) else parsed
    env = mode.probe(cfg) if mode.probe else probe_env(cfg.env_id, env_kwargs_of(mode, cfg), mode.actions, cfg.seed)
    if mode.check is not None:
        mode.check(cfg, env)
    if cfg.resume is None and mode.distributed and elastic_restarts() > 0:
        cfg.resume = "auto"  # torchrun restarted the job (--max-restarts): continue from its newest checkpoint
    resume_path, state = (None, None)
    if not (mode.distributed and torchrun_rank() > 0):  # rank 0 loads it and hands it to the others
        resume_path, state = load_resume(mode.script, cfg, mode.checkpoint_pattern, mode.resume_requires)
    if resume_path is not None and cfg.output_dir is None:
        cfg.output_dir = str(checkpoint_run_dir(resume_path))
    run_dir = Path(cfg.output_dir) if cfg.output_dir else default_run_dir(mode.script, cfg.env_id, cfg.seed)
    unusable = unusable_directory(run_dir) if torchrun_rank() == 0 else None  # rank 0 alone writes it
    if unusable:
        raise ConfigError("output_dir", str(run_dir), unusable)
    return cfg, env, run_dir, resume_path, state, actions.validate_only


def elastic_restarts() -> int:
    """How many times torchrun has restarted this job's workers (0 outside torchrun)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def torchrun_rank() -> int:
    from common.distributed import launched_by_torchrun

    return int(os.environ["RANK"]) if launched_by_torchrun() else 0


def _held_by_another_run(run_dir: Path) -> bool:
    lock_file = run_dir / ".lock"
    if not lock_file.exists():
        return False
    probe = RunLock(run_dir)
    if not probe.acquire(create=False):
        return True
    probe.release()
    return False


def open_run(mode: Mode, cfg: Any, env: EnvInfo, run_dir: Path, resume_path: Path | None, state: dict | None,
             budget: TimeBudget) -> Run:
    """Step 2 and 3: the run directory, its lock (exit 3), logs and metrics."""
    from common.checkpoint import latest_checkpoint

    if _held_by_another_run(run_dir):
        print(f"error: another run holds the lock on {run_dir} (see {run_dir / '.lock'})", file=sys.stderr)
        sys.exit(EXIT_LOCKED)
    if state is None and latest_checkpoint(run_dir / "checkpoints", mode.checkpoint_pattern) is not None:
        raise ConfigError("output_dir", str(run_dir), "holds checkpoints of an earlier run; pass --resume auto to "
                                                      "continue it, or choose another directory")
    for sub in ("logs", "checkpoints", "plots"):
        (run_dir / sub).mkdir(parents=True, exist_ok=True)
    lock = RunLock(run_dir)
    if not lock.acquire():
        print(f"error: another run holds the lock on {run_dir} (see {lock.path})", file=sys.stderr)
        sys.exit(EXIT_LOCKED)
    setup_logging(run_dir / "logs" / "main.log", f"prl.{mode.script}", console=True)
    save_config(_groups_or_config(cfg), run_dir / "config.yaml")
    return Run(mode.script, cfg, env, run_dir, lock, resume_path, state, budget, mode.metrics_columns,
               env_kwargs=env_kwargs_of(mode, cfg))


def run_training(mode: Mode, argv: list[str] | None = None) -> int:
    """The whole lifecycle of one run of ``mode``; returns the exit status."""
    try:
        run = open_any_run(mode, argv)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    return EXIT_OK if run is None else execute(mode, run)


def open_any_run(mode: Mode, argv: list[str] | None, exit_on_error: bool = True,
                 budget: TimeBudget | None = None) -> Run | None:
    """Steps 1 to 3 (None for --validate-only, after printing the config); ConfigError for a bad one."""
    budget = budget or TimeBudget()
    cfg, env, run_dir, resume_path, state, validate_only = prepare(mode, argv, exit_on_error)
    if validate_only:
        print(config_yaml(_groups_or_config(cfg)), end="")
        return None
    from common.shm import reclaim_stale_segments

    reclaim_stale_segments()
    if mode.distributed:
        return open_distributed_run(mode, cfg, env, run_dir, resume_path, state, budget)
    return open_run(mode, cfg, env, run_dir, resume_path, state, budget)


def train_in_process(mode: Mode, config: Any) -> dict:
    """The Python entry point (``train(config)`` in every script): the same run as the command line.

    ``config`` is the script's ``Config`` (or, for a grouped script, a dict of its group
    dataclasses); it goes through the same checks as a ``--config`` file. Returns what
    ``summary.json`` holds, plus ``run_dir``. A bad config raises ValueError (nothing written),
    a directory locked by another run RuntimeError; a run that fails returns its summary with
    ``exit_code`` 1 and ``stop_reason`` saying why. Ctrl+C (KeyboardInterrupt in a notebook) stops
    the run as on the command line: a checkpoint, then the summary is returned with
    ``stop_reason`` "interrupted" and ``exit_code`` 130. Nothing outlives the call: workers,
    shared memory, signal handlers and log files are all released, so it can be called again.
    """
    import tempfile

    budget = TimeBudget(started=time.time())
    with tempfile.TemporaryDirectory(prefix="prl_config_") as tmp:
        path = Path(tmp) / "config.yaml"
        path.write_text(config_yaml(_groups_or_config(config)))
        try:
            run = open_any_run(mode, ["--config", str(path)], exit_on_error=False, budget=budget)
        except ConfigError as err:
            raise ValueError(str(err).replace(f"--config {str(path)!r}: ", "")) from None
        except SystemExit as exit_:
            raise RuntimeError(f"cannot start the run (exit status {exit_.code}); see the line above") from None
    execute(mode, run)
    return {**run.final_summary, "run_dir": str(run.run_dir)}


def open_distributed_run(mode: Mode, cfg: Any, env: EnvInfo, run_dir: Path, resume_path: Path | None,
                         state: dict | None, budget: TimeBudget) -> Run:
    """Under torchrun: rank 0 opens the run as usual; the other ranks continue its checkpoint and
    log to stderr, tagged with their rank, and write no file."""
    from common import distributed

    dist = distributed.from_environment("cpu" if mode.cpu_collectives else getattr(cfg, "device", "cpu"))
    # torchrun restarts the ranks of every node, but only the node whose rank failed counts a restart
    # (TORCHELASTIC_RESTART_COUNT): rank 0 may be one that does not know the job is continuing.
    restarted = dist.world_size > 1 and any(dist.gather_objects(elastic_restarts() > 0))
    if restarted and dist.is_main and cfg.resume is None:
        cfg.resume = "auto"
        resume_path, state = load_resume(mode.script, cfg, mode.checkpoint_pattern, mode.resume_requires)
        if resume_path is not None and cfg.output_dir is None:
            run_dir = checkpoint_run_dir(resume_path)
    resume_path, state = dist.broadcast_object((resume_path, state))
    run_dir = dist.agree_on_path(run_dir)
    if resume_path is not None:
        cfg.output_dir = str(run_dir)
    if dist.is_main:
        run = open_run(mode, cfg, env, run_dir, resume_path, state, budget)
        run.dist, run.is_main = dist, True
        return run
    distributed.log_to_stderr(dist.rank)
    return Run(mode.script, cfg, env, run_dir, None, resume_path, state, budget, mode.metrics_columns, dist,
               env_kwargs_of(mode, cfg))


def execute(mode: Mode, run: Run) -> int:
    """Steps 4 to 7: build the trainer, train, save, summarize; every failure has its exit status.
    The run's Ctrl+C and SIGTERM handlers are in place for exactly this long, however it ends (a
    program that calls train() again, or goes on, gets its own handlers back)."""
    from common.plots import Plotter

    run.graceful.install()
    # The plotter imports matplotlib while this process starts its workers, imports torch and trains.
    run.plotter = Plotter.start() if run.is_main else None
    try:
        return _train_save_summarize(mode, run)
    finally:
        if run.plotter is not None:
            run.plotter.close()
        run.graceful.uninstall()


def _train_save_summarize(mode: Mode, run: Run) -> int:
    from common.checkpoint import set_rng_state

    log = run.log
    trainer, exit_code, reason, save = None, EXIT_OK, "finished", True
    try:
        if run.resumed is not None:
            set_rng_state(run.resumed["rng"])
            log.info("resumed from %s at step %d", run.resume_path, run.counters["global_step"])
        trainer = mode.trainer(run)
        run.start_clock()
        trainer.train()
        reason = run.stop_reason() or "finished"
    except WorkerConfigError as err:
        log.error("a worker cannot run with this configuration: %s", err)
        print(f"error: {err}", file=sys.stderr)
        exit_code, reason, save = EXIT_BAD_CONFIG, f"bad configuration: {err}", False
    except WorkerFailed as err:
        log.error("training failed: %s", err)
        exit_code, reason = EXIT_FAILED, f"failed: {err}"
    except PeerRefused as err:
        log.error("%s", err)
        print(f"error: {err}", file=sys.stderr)
        exit_code, reason, save = EXIT_BAD_CONFIG, f"refused: {err}", False
    except PeerFailure as err:
        log.error("training failed: %s", err)
        exit_code, reason, save = EXIT_FAILED, f"failed: {err}", False
    except TrainingDiverged as err:
        log.error("training failed: %s; stopping without saving. Last good checkpoint: %s", err,
                  run.last_good_checkpoint or "none (no checkpoint was written yet)")
        exit_code, reason, save = EXIT_FAILED, f"diverged: {err}", False
    except Exception as err:
        log.exception("training failed")
        exit_code, reason, save = EXIT_FAILED, f"failed: {type(err).__name__}: {err}", False
    if run.graceful.requested and exit_code == EXIT_OK:
        exit_code, reason = run.graceful.exit_code, "interrupted"
    return finish(run, trainer, exit_code, reason, save)


def finish(run: Run, trainer: Any, exit_code: int, reason: str, save: bool) -> int:
    log = run.log
    extra: dict = {}
    try:
        with run.budget.part("shutdown"):
            if trainer is not None and save and (run.counters["global_step"] > 0 or run.resumed is not None):
                run.save_checkpoint(trainer.state_dict())
            if trainer is not None:
                extra = dict(trainer.summary()) if hasattr(trainer, "summary") else {}
    except Exception:
        log.exception("could not save the final checkpoint")
        exit_code = exit_code or EXIT_FAILED
    finally:
        with run.budget.part("shutdown"):
            run.close_resources()
    log.info("stopping after update %d: %s", run.counters["updates"], reason)
    summary = run.summary(reason, exit_code, extra)
    if run.is_main:
        write_summary(run.run_dir, summary)
        _plot(run, trainer)
    budget = summary["time_budget"]
    log.info("summary: %d steps in %.1f s (%s steps/s), final mean return %s, best %s; process %.1f s: %s -> %s",
             summary["global_step"], summary["wall_time_s"], summary["sps"], summary["final_mean_return"],
             summary["best_mean_return"], budget["process_s"],
             ", ".join(f"{k[:-2]} {v:.1f}" for k, v in budget.items() if k != "process_s"), run.run_dir)
    log.info("exit status %d", exit_code)
    run.final_summary = summary
    run.close()
    run.dist.close(abort=exit_code == EXIT_FAILED)
    return exit_code


def _plot(run: Run, trainer: Any) -> None:
    """``plots/training_curve.png`` and the trainer's own plots (``trainer.plots(run)``), drawn by the
    run's plotter (common/plots.py); a plot that fails is logged and the run goes on."""
    metrics = str(run.run_dir / "metrics.csv")
    plots = [{"plot": "training_curve", "metrics": metrics, "out": str(run.run_dir / "plots" / "training_curve.png"),
              "title": f"{run.script}: {run.cfg.env_id}"}]
    try:
        if trainer is not None and hasattr(trainer, "plots"):
            plots += [{"metrics": metrics, **plot} for plot in trainer.plots(run)]
        errors = run.plotter.draw(plots)
    except Exception:  # a plot is never worth failing a finished run
        run.log.exception("could not draw the plots")
        return
    for error in errors:
        run.log.error("could not draw the plots:\n%s", error.rstrip())
