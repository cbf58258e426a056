"""``--search FILE.yaml``: an Optuna study over a training script's config fields, each trial an ordinary run.

The search file names the script, the settings every trial shares, the ranges to search, the objective
(``time_to_target``: seconds of training until the mean of the last 100 returns reaches the target, lower is
better; ``final_return``: that mean at the end, higher is better), the number of trials and the seeds each is
scored over. A trial runs the script once per seed, side by side, each into its own run directory
(``trial_<n>/seed_<s>/``), and its value is the median (or mean) of its runs' scores. As the runs write
``metrics.csv`` the search reads it and reports the trial's mean of the last 100 returns to the pruner every
``prune_every_steps`` env steps; a trial the pruner calls hopeless is stopped with SIGINT, which its runs
answer as they answer Ctrl+C (checkpoint, summary, exit 130). How many trials run at once comes from the
launcher's plan: the cores and RAM one run takes (:func:`common.launcher.plan.runs_at_once`).

The study lives in a database: SQLite in the search's directory by default, or any RDB URL, or an Optuna
journal file (``journal:PATH``), which several processes, on several machines, share. Ctrl+C (or SIGTERM, or
``search_hours`` running out) stops the running trials as above; they are recorded as failed with the user
attribute ``interrupted`` and queued again, so the same command continues the study: a trial whose runs have
a step or episode budget continues from their checkpoints, one with a ``duration`` (hours per invocation)
starts again. After every finished trial the best trial's settings are written to ``best.yaml``, a file the
script's ``--config`` takes.
"""

from __future__ import annotations

import csv
import ctypes
import dataclasses
import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common import script_modes, system
from common.config import ConfigError, flag_name, unusable_directory
from common.launcher import ROOT, UsageError
from common.launcher.modes import MODES
from common.launcher.plan import cores_per_run, run_bytes, runs_at_once

SEARCH_REQUIREMENTS = "requirements-tracking.txt"  # the optional extra that installs optuna
OBJECTIVES = {"time_to_target": "minimize", "final_return": "maximize"}
AGGREGATES = {"median": statistics.median, "mean": statistics.fmean}
PRUNERS = ("median", "successive_halving", "none")
SET_BY_SEARCH = ("seed", "output_dir", "resume")  # each run's: --seeds, the trial's directory, --resume auto
MAX_SHORTFALL = 2.0  # time_to_target: an unreached target costs at most 3x the run's time (see run_score)
POLL_S = 0.5
EXIT_INTERRUPTED = {signal.SIGINT: 130, signal.SIGTERM: 143}

# The keys of a search file, with their defaults (None: decided from the others, see load_search).
SEARCH_KEYS = {
    "script": None,  # the training script (its file name)
    "config": None,  # a --config file every trial starts from
    "settings": {},  # fields every trial sets (flat, or in the script's YAML sections)
    "ranges": None,  # field: {low, high, log, step} or {choices: [...]} (a list is its choices)
    "objective": "time_to_target",  # or final_return
    "trials": 20,  # trials in the study, counting those of earlier invocations and other processes
    "seeds": 1,  # runs per trial, seeds seed .. seed + seeds - 1
    "aggregate": "median",  # of the seeds' scores: median or mean
    "pruner": "median",  # median, successive_halving or none
    "prune_every_steps": 10_000,  # env steps between the scores a trial reports to the pruner
    "prune_warmup_steps": 50_000,  # no trial is pruned before this many env steps
    "prune_startup_trials": 3,  # median: no pruning before this many trials have finished
    "trials_at_once": "auto",  # auto: as many as the machine's cores and RAM hold (the launcher's plan)
    "search_hours": None,  # stop (as Ctrl+C does) after this many hours; the same command continues
    "storage": None,  # default sqlite:///<output_dir>/study.db; an RDB URL; journal:PATH
    "study_name": None,  # default: the search file's name without .yaml
    "output_dir": None,  # default runs/search/<study_name>
    "enqueue": [],  # trials to run first (field: value), e.g. the script's defaults as the baseline
}


@dataclass
class FieldRange:
    """One searched field: an int or float range (``log``, ``step``) or a list of choices."""

    name: str
    low: float | int | None = None
    high: float | int | None = None
    log: bool = False
    step: float | int | None = None
    choices: list | None = None

    def distribution(self):
        from optuna import distributions

        if self.choices is not None:
            return distributions.CategoricalDistribution([encode(c) for c in self.choices])
        if isinstance(self.low, int):  # an integer field's range (parse_range made its ends ints)
            return distributions.IntDistribution(self.low, self.high, log=self.log, step=self.step or 1)
        return distributions.FloatDistribution(self.low, self.high, log=self.log, step=self.step)

    def value(self, param: Any) -> Any:
        """The field's value for an Optuna parameter (a choice that is a list travels as its YAML text)."""
        if self.choices is not None:
            return next(c for c in self.choices if encode(c) == param)
        return param

    def contains(self, value: Any) -> bool:
        if self.choices is not None:
            return encode(value) in [encode(c) for c in self.choices]
        return isinstance(value, (int, float)) and not isinstance(value, bool) and self.low <= value <= self.high

    def extremes(self) -> list:
        return list(self.choices) if self.choices is not None else [self.low, self.high]

    def largest(self) -> Any:
        numbers = [v for v in self.extremes() if isinstance(v, (int, float))]
        return max(numbers) if numbers else None


def encode(choice: Any) -> Any:
    """A choice as Optuna stores it: scalars as they are, anything else (a list of widths) as its JSON text."""
    return choice if choice is None or isinstance(choice, (bool, int, float, str)) else json.dumps(choice)


@dataclass
class Search:
    """A checked search file, with the launcher's flags applied."""

    path: Path
    script: str
    mode: str  # the launcher's name for the script's mode
    settings: dict  # flat fields every trial sets
    ranges: dict[str, FieldRange]
    objective: str
    trials: int
    seeds: int
    aggregate: str
    pruner: str
    prune_every_steps: int
    prune_warmup_steps: int
    prune_startup_trials: int
    trials_at_once: int | None
    search_hours: float | None
    storage: str
    study_name: str
    output_dir: Path
    enqueue: list[dict]
    target: float | None = None  # the target return time_to_target counts to (resolved from the env)
    first_seed: int = 1
    resumable: bool = True  # the runs' budget is steps or episodes (no duration): an interrupted run continues
    sizing: str = ""  # how trials at once were decided
    sizing_config: tuple = ()  # the settings' config and env, as the script checked them

    @property
    def direction(self) -> str:
        return OBJECTIVES[self.objective]


def refuse(path: Path, message: str) -> typing.NoReturn:
    raise UsageError(f"{path}: {message}")


def require_optuna() -> Any:
    try:
        import optuna
    except ImportError:
        raise UsageError(f"--search needs optuna: pip install -r {SEARCH_REQUIREMENTS}") from None
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna


# --------------------------------------------------------------------------- the search file

def load_search(path: str, overrides: dict[str, Any], passthrough: list[str]) -> Search:
    """Read and check the search file (``overrides``: the launcher's flags, set ones only). UsageError, one
    line, for anything wrong; the script's own flags in ``passthrough`` are checked by its parser."""
    import yaml

    file = Path(path)
    if not file.is_file():
        raise UsageError(f"--search {path}: no such file")
    try:
        data = yaml.safe_load(file.read_text()) or {}
    except yaml.YAMLError as err:
        refuse(file, f"not valid YAML ({str(err).splitlines()[0]})")
    if not isinstance(data, dict):
        refuse(file, "must hold a mapping (script, settings, ranges, objective, trials ...)")
    unknown = sorted(set(data) - set(SEARCH_KEYS))
    if unknown:
        refuse(file, f"unknown key {unknown[0]!r}; a search file takes {', '.join(SEARCH_KEYS)}")
    spec = {**SEARCH_KEYS, **data, **{k: v for k, v in overrides.items() if v is not None}}
    script = str(spec["script"] or "")
    if script.removesuffix(".py") not in script_modes.SCRIPTS:
        refuse(file, f"script {script!r}: must be one of {', '.join(s + '.py' for s in script_modes.SCRIPTS)}")
    script = script.removesuffix(".py") + ".py"
    mode_name = next(name for name, m in MODES.items() if m.script == script)
    module = script_modes.script_module(script)
    groups = module.MODE.config if isinstance(module.MODE.config, dict) else {"": module.MODE.config}
    hints = {name: hint for cls in groups.values() for name, hint in typing.get_type_hints(cls).items()
             if name in {f.name for f in dataclasses.fields(cls)}}

    settings = flat_settings(file, spec["config"], spec["settings"], groups)
    for name in settings:
        if name not in hints:
            refuse(file, f"settings.{name}: not a field of {script} (its fields: python {script} --help)")
    for name in SET_BY_SEARCH[1:]:
        if name in settings or name in (spec["ranges"] or {}):
            refuse(file, f"{name}: set by the search for each run (trial_<n>/seed_<s>/, --resume auto)")
    if not isinstance(spec["ranges"], dict) or not spec["ranges"]:
        refuse(file, "ranges: give at least one field to search (field: {low: .., high: ..} or {choices: [..]})")
    ranges = {str(name): parse_range(file, str(name), entry, hints) for name, entry in spec["ranges"].items()}
    if "seed" in ranges:
        refuse(file, "ranges.seed: a trial's seeds are --seeds K (seed .. seed + K - 1)")

    objective = str(spec["objective"])
    if objective not in OBJECTIVES:
        refuse(file, f"objective {objective!r}: must be time_to_target or final_return")
    if str(spec["aggregate"]) not in AGGREGATES:
        refuse(file, f"aggregate {spec['aggregate']!r}: must be median or mean")
    if str(spec["pruner"]) not in PRUNERS:
        refuse(file, f"pruner {spec['pruner']!r}: must be median, successive_halving or none")
    counts = {}
    for key in ("trials", "seeds", "prune_every_steps", "prune_warmup_steps", "prune_startup_trials"):
        counts[key] = as_int(file, key, spec[key], minimum=0 if key in ("prune_warmup_steps",
                                                                         "prune_startup_trials") else 1)
    at_once = spec["trials_at_once"]
    at_once = None if str(at_once) == "auto" else as_int(file, "trials_at_once", at_once, minimum=1)
    hours = spec["search_hours"]
    if hours is not None and (not isinstance(hours, (int, float)) or isinstance(hours, bool) or hours <= 0):
        refuse(file, f"search_hours {hours!r}: must be a number of hours > 0")
    study_name = str(spec["study_name"] or file.stem)
    output_dir = Path(spec["output_dir"] or Path("runs") / "search" / study_name)
    unusable = unusable_directory(output_dir)
    if unusable:
        refuse(file, f"output_dir {str(output_dir)!r}: {unusable}")
    storage = str(spec["storage"] or f"sqlite:///{output_dir / 'study.db'}")
    if not (storage.startswith("journal:") or "://" in storage):
        refuse(file, f"storage {storage!r}: an RDB URL (sqlite:///PATH, postgresql://...) or journal:PATH")
    enqueue = spec["enqueue"] or []
    if not isinstance(enqueue, list) or not all(isinstance(e, dict) for e in enqueue):
        refuse(file, "enqueue: a list of trials, each a mapping of field: value")
    for i, trial in enumerate(enqueue):
        for name, value in trial.items():
            if name not in ranges:
                refuse(file, f"enqueue[{i}].{name}: not a searched field (ranges: {', '.join(ranges)})")
            if not ranges[name].contains(value):
                refuse(file, f"enqueue[{i}].{name} {value!r}: outside its range")

    search = Search(file, script, mode_name, settings, ranges, objective, counts["trials"], counts["seeds"],
                    str(spec["aggregate"]), str(spec["pruner"]), counts["prune_every_steps"],
                    counts["prune_warmup_steps"], counts["prune_startup_trials"], at_once,
                    None if hours is None else float(hours), storage, study_name, output_dir, enqueue)
    for flag in (flag_name(n) for n in (*SET_BY_SEARCH, *ranges)):
        if any(a == flag or a.startswith(flag + "=") for a in passthrough):
            refuse(file, f"{flag}: set by the search for each run; leave it out of the command line")
    check_against_script(search, module, passthrough)
    return search


def flat_settings(file: Path, config: str | None, settings: Any, groups: dict[str, type]) -> dict:
    """``config`` (a --config file) overlaid by ``settings``, as one flat mapping of field: value."""
    import yaml

    from common.config import yaml_sections

    sections = yaml_sections(groups)

    def flatten(data: Any, where: str) -> dict:
        if not isinstance(data, dict):
            refuse(file, f"{where}: must be a mapping of field: value")
        flat = {}
        for key, value in data.items():
            key = str(key).replace("-", "_")
            if key in sections and isinstance(value, dict):
                flat.update({str(k).replace("-", "_"): v for k, v in value.items()})
            else:
                flat[key] = value
        return flat

    base = {}
    if config:
        path = Path(config) if Path(config).is_file() else ROOT / config
        if not path.is_file():
            refuse(file, f"config {config!r}: no such file")
        base = flatten(yaml.safe_load(path.read_text()) or {}, f"config {config}")
    return {**base, **flatten(settings or {}, "settings")}


def parse_range(file: Path, name: str, entry: Any, hints: dict) -> FieldRange:
    """One entry of ``ranges``, checked against the field's type."""
    where = f"ranges.{name}"
    if name not in hints:
        refuse(file, f"{where}: not a field of the script (its fields: its --help)")
    if isinstance(entry, list):
        entry = {"choices": entry}
    if not isinstance(entry, dict) or set(entry) - {"low", "high", "log", "step", "choices"}:
        refuse(file, f"{where}: give {{low: .., high: .., log: true|false, step: ..}} or {{choices: [..]}}")
    kind = field_kind(hints[name])
    if "choices" in entry:
        if set(entry) != {"choices"}:
            refuse(file, f"{where}: choices exclude low, high, log and step")
        choices = entry["choices"]
        if not isinstance(choices, list) or not choices:
            refuse(file, f"{where}: choices must be a non-empty list")
        return FieldRange(name, choices=choices)
    if kind not in (int, float):
        refuse(file, f"{where}: a {getattr(kind, '__name__', kind)} field is searched over choices: [..]")
    low, high, log, step = entry.get("low"), entry.get("high"), entry.get("log", False), entry.get("step")
    numbers = [v for v in (low, high, step) if v is not None]
    if low is None or high is None or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                              for v in numbers):
        refuse(file, f"{where}: low and high must both be numbers (low {low!r}, high {high!r})")
    if kind is int and not all(float(v).is_integer() for v in numbers):
        refuse(file, f"{where}: an integer field needs integer low, high and step (low {low!r}, high {high!r})")
    if kind is int:
        low, high, step = int(low), int(high), None if step is None else int(step)
    else:
        low, high, step = float(low), float(high), None if step is None else float(step)
    if not isinstance(log, bool):
        refuse(file, f"{where}: log must be true or false")
    if not low < high:
        refuse(file, f"{where}: low {low!r} must be below high {high!r}")
    if log and low <= 0:
        refuse(file, f"{where}: a log range needs low > 0 (low {low!r})")
    if step is not None and (step <= 0 or log):
        refuse(file, f"{where}: step {step!r} must be > 0, and excludes log")
    return FieldRange(name, low, high, log, step)


def field_kind(hint: Any) -> Any:
    """The type a field holds, ``X | None`` unwrapped; ``list`` for list fields."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 1:
        hint = args[0]
    return list if typing.get_origin(hint) is list else hint


def as_int(file: Path, key: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        refuse(file, f"{key} {value!r}: must be an integer >= {minimum}")
    return value


def check_against_script(search: Search, module: Any, passthrough: list[str]) -> None:
    """Every trial's config must pass the script's own checks: the settings (with the user's flags) as one run
    would get them, then each range's ends, one field at a time. Also resolves the target return, the first seed
    and whether an interrupted run can continue."""
    from common import run
    from common.run_setup import parse_target

    with tempfile.TemporaryDirectory(prefix="prl_search_") as tmp:
        def prepared(fields: dict, argv: list[str]) -> tuple[Any, Any]:
            path = Path(tmp) / "trial.yaml"
            path.write_text(json.dumps(fields))  # JSON is YAML
            cfg, env, *_ = run.prepare(module.MODE, ["--config", str(path), *argv], exit_on_error=False)
            return cfg, env

        try:
            cfg, env = prepared(search.settings, passthrough)
        except ConfigError as err:
            refuse(search.path, f"settings: {err}")
        for name, entry in search.ranges.items():
            for value in entry.extremes():
                try:
                    prepared({**search.settings, name: value}, passthrough)
                except ConfigError as err:
                    refuse(search.path, f"ranges.{name}: {err}")
    search.first_seed = int(cfg.seed)
    search.resumable = not getattr(cfg, "duration", None) and "duration" not in search.ranges
    if search.objective == "time_to_target":
        if "target_return" in search.ranges:
            refuse(search.path, "ranges.target_return: time_to_target needs one target for every trial")
        target = parse_target(getattr(cfg, "target_return", None))
        target = env.reward_threshold if target == "auto" else target
        if target is None:
            refuse(search.path, "objective time_to_target needs target_return: a number, or auto for an env with "
                                "a reward_threshold")
        search.target = float(target)
    search.sizing_config = (cfg, env)


# --------------------------------------------------------------------------- trials at once

def size_trials(search: Search, machine: system.Machine) -> int:
    """Trials at once: the runs of the launcher's plan that fit side by side, divided by the seeds per trial."""
    cfg, env = search.sizing_config
    for name, entry in search.ranges.items():  # size for the largest value of every searched number
        if entry.largest() is not None:
            setattr(cfg, name, entry.largest())
    mode = script_modes.script_module(search.script).MODE
    workers = int(getattr(cfg, "num_workers", 0) or 0)
    buffers = mode.buffers(cfg, None if mode.probe else env) if mode.buffers else {}
    shm = sum(buffers.get(k, 0) for k in mode.shm_buffers)
    cuda = bool(machine.gpus) and str(getattr(cfg, "device", "cpu")) != "cpu"
    cores = cores_per_run(search.mode, workers, bool(getattr(cfg, "async_training", False)))
    runs, bound = runs_at_once(machine, cores, run_bytes(workers, buffers, cuda), shm)
    fitted = max(1, runs // search.seeds)
    search.sizing = (f"{runs} run(s) of {cores} core(s) fit side by side (bounded by {', '.join(bound)}); "
                     f"{search.seeds} seed(s) per trial")
    if search.trials_at_once is None:
        return fitted
    search.sizing = f"set to {search.trials_at_once} ({search.sizing}: {fitted} trial(s) at once)"
    return search.trials_at_once


# --------------------------------------------------------------------------- scores from a run's files

def read_rows(path: Path) -> list[dict[str, str]]:
    """The complete rows of ``metrics.csv`` so far (a row still being written is left for the next read)."""
    try:
        text = path.read_text()
    except OSError:
        return []
    if not text.endswith("\n"):
        text = text[: text.rfind("\n") + 1]
    return list(csv.DictReader(text.splitlines()))


def _number(row: dict, key: str) -> float:
    try:
        return float(row.get(key) or "nan")
    except ValueError:
        return math.nan


def last_mean(rows: list[dict]) -> float | None:
    """The last mean of the last 100 returns in ``rows``, or before there were 100 the mean of every return so far
    (each row's mean return weighted by the episodes it counts); None before the first episode."""
    means = [m for m in (_number(r, "return_mean100") for r in rows) if math.isfinite(m)]
    if means:
        return means[-1]
    total = episodes = 0.0
    for row in rows:
        count, mean = _number(row, "episodes") - episodes, _number(row, "episodic_return")
        if math.isfinite(mean) and count > 0:
            total, episodes = total + count * mean, episodes + count
    return total / episodes if episodes else None


def run_score(rows: list[dict], objective: str, target: float | None, summary: dict | None = None) -> float | None:
    """One run's score from its metrics rows (and, once it has ended, its summary); None where it has none yet.

    ``final_return``: the mean of the last 100 returns at the end (the summary's ``final_mean_return``; a run with
    fewer episodes: the mean of them all). ``time_to_target``: the training seconds at the first row where that mean
    reached the target; a run that has not reached it scores its seconds so far times ``1 + shortfall``, the
    shortfall being how far its best mean stayed below the target in units of the target (at most MAX_SHORTFALL),
    so that any run that reached the target within a budget beats any that did not, and of those the one that
    came closer in as long wins.
    """
    if objective == "final_return":
        final = (summary or {}).get("final_mean_return")
        return float(final) if final is not None else last_mean(rows)
    means = [(_number(r, "wall_time"), _number(r, "return_mean100")) for r in rows]
    means = [(wall, mean) for wall, mean in means if math.isfinite(mean)]
    reached = next((wall for wall, mean in means if mean >= target), None)
    if summary and str(summary.get("stop_reason", "")).startswith("target return"):
        reached = min(reached or math.inf, float(summary["wall_time_s"]))
    if reached is not None:
        return reached
    walls = [_number(r, "wall_time") for r in rows]
    seconds = float(summary["wall_time_s"]) if summary and summary.get("wall_time_s") else max(walls, default=0.0)
    if not seconds:
        return None
    best = max((mean for _, mean in means), default=None) if means else last_mean(rows)
    shortfall = MAX_SHORTFALL if best is None else (target - best) / max(abs(target), 1.0)
    return seconds * (1.0 + min(MAX_SHORTFALL, max(0.0, shortfall)))


# --------------------------------------------------------------------------- the trials

@dataclass
class SeedRun:
    seed: int
    run_dir: Path
    output: Path  # its console output
    process: subprocess.Popen
    stopped: int = 0  # SIGINTs sent

    def exit_code(self) -> int | None:
        return self.process.poll()

    def stop(self) -> None:
        if self.exit_code() is None:
            try:
                os.kill(self.process.pid, signal.SIGINT)
            except ProcessLookupError:
                pass
        self.stopped += 1

    def rows(self) -> list[dict]:
        return read_rows(self.run_dir / "metrics.csv")

    def summary(self) -> dict | None:
        try:
            return json.loads((self.run_dir / "summary.json").read_text())
        except (OSError, ValueError):
            return None


@dataclass
class TrialRuns:
    """A trial in flight: its runs, and how far its scores have been reported to the pruner."""

    trial: Any  # optuna.Trial
    runs: list[SeedRun]
    next_report: int
    pruned_at: int | None = None
    interrupted: bool = False

    def ended(self) -> bool:
        return all(r.exit_code() is not None for r in self.runs)

    def stop(self) -> None:
        for r in self.runs:
            if r.stopped < 1:
                r.stop()


def die_with_search() -> None:
    """In a trial's run, before it starts: SIGTERM when the search process dies, however it dies (the run then
    saves a checkpoint and exits 143), so that no trial outlives its search."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Searcher:
    """Runs trials of one study from this process until it has its trials, or is stopped."""

    def __init__(self, search: Search, study: Any, trials_at_once: int, passthrough: list[str]):
        self.search, self.study, self.at_once, self.passthrough = search, study, trials_at_once, passthrough
        self.active: list[TrialRuns] = []
        self.stop_signal: int | None = None
        self.stop_reason: str | None = None
        self.signals = 0
        self.name = f"{socket.gethostname()}:{os.getpid()}"
        self.deadline = time.monotonic() + search.search_hours * 3600 if search.search_hours else math.inf
        self.best_number: int | None = None

    # -- signals
    def on_signal(self, signum: int, _frame: Any) -> None:
        self.signals += 1
        self.stop_signal = self.stop_signal or signum
        self.stop_reason = self.stop_reason or signal.Signals(signum).name
        if self.signals == 1:
            print(f"{signal.Signals(signum).name}: stopping the running trials (checkpoints, summaries); "
                  "run the same command again to continue the study", file=sys.stderr, flush=True)
        else:  # a second Ctrl+C: the runs' own second Ctrl+C ends them at once
            for trial in self.active:
                for r in trial.runs:
                    r.stop()

    # -- the loop
    def counted_trials(self) -> int:
        """Trials that count towards ``trials``: finished ones (pruned and failed too, but not those interrupted,
        which run again), of every process, and those this process runs."""
        from optuna.trial import TrialState

        done = [t for t in self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED,
                                                                           TrialState.FAIL))
                if not t.user_attrs.get("interrupted")]
        return len(done) + len(self.active)

    def run(self) -> int:
        handlers = {s: signal.signal(s, self.on_signal) for s in EXIT_INTERRUPTED}
        try:
            while True:
                if self.stop_reason is None and time.monotonic() >= self.deadline:
                    self.stop_reason = f"search_hours {self.search.search_hours:g} reached"
                    print(f"{self.stop_reason}: stopping the running trials", flush=True)
                if self.stop_reason is not None:
                    for trial in self.active:
                        if trial.pruned_at is None and not trial.interrupted and not trial.ended():
                            trial.interrupted = True
                            trial.stop()
                while self.stop_reason is None and len(self.active) < self.at_once and \
                        self.counted_trials() < self.search.trials:
                    self.active.append(self.start_trial())
                if not self.active:
                    break
                for trial in list(self.active):
                    self.follow(trial)
                time.sleep(POLL_S)
        finally:
            for trial in self.active:  # an error in the search itself: no run outlives it
                trial.stop()
                for r in trial.runs:
                    r.process.wait()
            for s, handler in handlers.items():
                signal.signal(s, handler)
        if self.stop_signal is not None:
            return EXIT_INTERRUPTED[self.stop_signal]
        return 0

    def start_trial(self) -> TrialRuns:
        distributions = {name: entry.distribution() for name, entry in self.search.ranges.items()}
        trial = self.study.ask(distributions)
        values = {name: self.search.ranges[name].value(trial.params[name]) for name in self.search.ranges}
        settings = {**self.search.settings, **values}
        trial_dir = self.search.output_dir / f"trial_{trial.number:04d}"
        continued = trial.user_attrs.get("run_dirs") if self.search.resumable else None
        seeds = [self.search.first_seed + i for i in range(self.search.seeds)]
        run_dirs = [Path(d) for d in continued] if continued else [trial_dir / f"seed_{s}" for s in seeds]
        trial_dir.mkdir(parents=True, exist_ok=True)
        settings_file = trial_dir / "settings.yaml"
        settings_file.write_text(settings_yaml(settings, f"trial {trial.number} of study {self.study.study_name}"))
        trial.set_user_attr("searcher", self.name)
        trial.set_user_attr("settings", settings)
        trial.set_user_attr("run_dirs", [str(d) for d in run_dirs])
        runs = []
        for seed, run_dir in zip(seeds, run_dirs):
            command = [sys.executable, str(ROOT / self.search.script), "--config", str(settings_file),
                       "--seed", str(seed), "--output-dir", str(run_dir), "--resume", "auto", *self.passthrough]
            output = trial_dir / f"seed_{seed}.out"
            with open(output, "a") as out:
                process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                           preexec_fn=die_with_search,
                                           env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                               filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))})
            runs.append(SeedRun(seed, run_dir, output, process))
        print(f"trial {trial.number} started ({len(runs)} run(s) in {trial_dir}): {shown(values)}", flush=True)
        return TrialRuns(trial, runs, self.search.prune_every_steps)

    def follow(self, trial: TrialRuns) -> None:
        """Report the trial's new scores to the pruner, stop it if hopeless, finish it once its runs have ended."""
        ended = trial.ended()
        if trial.pruned_at is None and not trial.interrupted:
            self.report(trial)
            if not ended and self.search.pruner != "none" and trial.trial.should_prune():
                trial.pruned_at = trial.next_report - self.search.prune_every_steps
                print(f"trial {trial.trial.number} pruned at {trial.pruned_at} env steps", flush=True)
                trial.stop()
        if ended:
            self.finish(trial)

    def report(self, trial: TrialRuns) -> None:
        """At every ``prune_every_steps`` env steps that all of its runs have passed (or ended before), the trial's
        mean of the last 100 returns there (the aggregate over its runs; negated where the study minimizes, as it
        does time to target), for the pruner to compare with other trials' at the same step."""
        search = self.search
        sign = 1.0 if search.direction == "maximize" else -1.0
        rows = [r.rows() for r in trial.runs]
        while True:
            step, means, ended = trial.next_report, [], 0
            for run_rows, r in zip(rows, trial.runs):
                if max((_number(row, "global_step") for row in run_rows), default=-1.0) >= step:
                    means.append(last_mean([row for row in run_rows if _number(row, "global_step") <= step]))
                elif r.exit_code() is None:
                    return  # this run has not got there yet
                else:  # it ended before this step (a budget, the target): its last mean stands
                    means.append(last_mean(run_rows))
                    ended += 1
            if ended == len(trial.runs):
                return
            if all(m is not None for m in means):  # no episode has ended yet: nothing to compare at this step
                trial.trial.report(sign * AGGREGATES[search.aggregate](means), step)
            trial.next_report += search.prune_every_steps

    def finish(self, trial: TrialRuns) -> None:
        from optuna.trial import TrialState

        self.active.remove(trial)
        t, number = trial.trial, trial.trial.number
        codes = [r.exit_code() for r in trial.runs]
        summaries = [r.summary() for r in trial.runs]
        t.set_user_attr("exit_codes", codes)
        if trial.interrupted:
            t.set_user_attr("interrupted", True)
            self.study.tell(t, state=TrialState.FAIL)
            again = {"continues": number, **({"run_dirs": t.user_attrs["run_dirs"]} if self.search.resumable else {})}
            self.study.enqueue_trial(t.params, user_attrs=again)
            print(f"trial {number} interrupted; queued to run again", flush=True)
            return
        if trial.pruned_at is not None and any(c == EXIT_INTERRUPTED[signal.SIGINT] for c in codes):
            t.set_user_attr("pruned_at_step", trial.pruned_at)
            self.study.tell(t, state=TrialState.PRUNED)
            return
        # (runs that had ended their budget before the stop came are scored as they are)
        failed = [(r, s) for r, c, s in zip(trial.runs, codes, summaries) if c != 0]
        scores = [run_score(r.rows(), self.search.objective, self.search.target, s)
                  for r, s in zip(trial.runs, summaries)]
        if failed or any(s is None for s in scores):
            r, s = failed[0] if failed else (trial.runs[scores.index(None)], summaries[scores.index(None)])
            why = (s or {}).get("stop_reason") or last_line(r.output)
            reason = f"seed {r.seed} exited {r.exit_code()}: {why}" if failed else f"seed {r.seed}: no score ({why})"
            t.set_user_attr("failure", reason)
            self.study.tell(t, state=TrialState.FAIL)
            print(f"trial {number} failed: {reason}", flush=True)
            return
        value = AGGREGATES[self.search.aggregate](scores)
        t.set_user_attr("scores", dict(zip([str(r.seed) for r in trial.runs], scores)))
        self.study.tell(t, value)
        print(f"trial {number} finished: {self.search.objective} {value:.4g} ({self.search.aggregate} of "
              f"{', '.join(f'{s:.4g}' for s in scores)})", flush=True)
        self.write_best()

    def write_best(self) -> None:
        """``best.yaml``: the best trial's settings (of every process), for the script's ``--config``."""
        try:
            best = self.study.best_trial
        except ValueError:  # no trial has finished
            return
        if best.number == self.best_number:
            return
        self.best_number = best.number
        seeds = best.user_attrs.get("scores", {})
        header = (f"the best trial of study {self.study.study_name} ({self.search.storage}): trial {best.number}, "
                  f"{self.search.objective} {best.value:.6g}, the {self.search.aggregate} over seed(s) "
                  f"{', '.join(seeds)}\nrun: python {self.search.script} --config "
                  f"{' '.join([str(self.search.output_dir / 'best.yaml'), *self.passthrough])}")
        (self.search.output_dir / "best.yaml").write_text(settings_yaml(best.user_attrs["settings"], header))


def shown(values: dict) -> str:
    return ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in values.items())


def last_line(path: Path) -> str:
    try:
        lines = [line for line in path.read_text().splitlines() if line.strip()]
    except OSError:
        return "no output"
    return lines[-1] if lines else "no output"


def settings_yaml(settings: dict, header: str) -> str:
    import yaml

    comment = "".join(f"# {line}\n" for line in header.splitlines())
    return comment + yaml.safe_dump(settings, sort_keys=False, default_flow_style=None)


# --------------------------------------------------------------------------- the study

def open_storage(optuna: Any, url: str) -> Any:
    """The study's database: an Optuna journal file (``journal:PATH``) or an RDB URL; SQLite waits for a lock
    held by another searching process instead of failing."""
    if url.startswith("journal:"):
        from optuna.storages.journal import JournalFileBackend

        path = Path(url.removeprefix("journal:"))
        path.parent.mkdir(parents=True, exist_ok=True)
        return optuna.storages.JournalStorage(JournalFileBackend(str(path)))
    if url.startswith("sqlite:///"):
        Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
        return optuna.storages.RDBStorage(url, engine_kwargs={"connect_args": {"timeout": 60}})
    return optuna.storages.RDBStorage(url)


def make_pruner(optuna: Any, search: Search) -> Any:
    if search.pruner == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=search.prune_startup_trials,
                                           n_warmup_steps=search.prune_warmup_steps)
    if search.pruner == "successive_halving":
        return optuna.pruners.SuccessiveHalvingPruner(
            min_resource=max(search.prune_warmup_steps, search.prune_every_steps))
    return optuna.pruners.NopPruner()


def open_study(optuna: Any, search: Search) -> Any:
    # TPE, its first third of the trials (3 to 10) drawn at random.
    sampler = optuna.samplers.TPESampler(n_startup_trials=min(10, max(3, search.trials // 3)))
    try:
        study = optuna.create_study(storage=open_storage(optuna, search.storage), study_name=search.study_name,
                                    direction=search.direction, sampler=sampler, pruner=make_pruner(optuna, search),
                                    load_if_exists=True)
    except Exception as err:  # an unreachable server, a file that is not a study, a missing driver
        raise UsageError(f"storage {search.storage}: {str(err).splitlines()[0]}") from None
    if study.direction.name.lower() != search.direction:
        raise UsageError(f"study {search.study_name} in {search.storage} {study.direction.name.lower()}s; "
                         f"objective {search.objective} {search.direction}s: use another study_name")
    for values in search.enqueue:
        study.enqueue_trial({k: encode(v) for k, v in values.items()}, skip_if_exists=True)
    return study


def print_table(search: Search, study: Any) -> None:
    from optuna.trial import TrialState

    trials = study.get_trials(deepcopy=False)
    print(f"study {search.study_name}: {len(trials)} trial(s) in {search.storage}")
    for t in trials:
        value = f"{t.value:.4g}" if t.state == TrialState.COMPLETE else "-"
        note = ("interrupted" if t.user_attrs.get("interrupted") else
                f"at {t.user_attrs['pruned_at_step']} steps" if "pruned_at_step" in t.user_attrs else
                t.user_attrs.get("failure", ""))
        params = shown({k: search.ranges[k].value(v) if k in search.ranges else v for k, v in t.params.items()})
        print(f"  {t.number:>4}  {t.state.name:<8} {value:>10}  {params}  {note}".rstrip())
    try:
        best = study.best_trial
        print(f"best: trial {best.number}, {search.objective} {best.value:.4g}; settings in "
              f"{search.output_dir / 'best.yaml'}")
    except ValueError:
        print("no trial has finished yet")


def search_main(path: str, overrides: dict[str, Any], passthrough: list[str], machine: system.Machine,
                dry_run: bool = False) -> int:
    """``launch_parallel_training.py --search FILE.yaml``: the exit status (0: the study has its trials, or
    ``search_hours`` ran out; 130/143: stopped by a signal; 1: it has its trials and none has a value, every one
    failed; refusals are UsageError)."""
    optuna = require_optuna()
    search = load_search(path, overrides, passthrough)
    at_once = size_trials(search, machine)
    print(f"search {search.study_name}: {search.script}, {search.objective} ({search.direction}, the "
          f"{search.aggregate} over {search.seeds} seed(s)), {search.trials} trial(s), {at_once} at once: "
          f"{search.sizing}; study in {search.storage}", flush=True)
    if dry_run:
        return 0
    study = open_study(optuna, search)
    search.output_dir.mkdir(parents=True, exist_ok=True)
    searcher = Searcher(search, study, at_once, passthrough)
    status = searcher.run()
    searcher.write_best()
    print_table(search, study)
    if status == 0 and searcher.best_number is None and searcher.stop_reason is None:
        return 1  # every trial failed: nothing to recommend
    return status
