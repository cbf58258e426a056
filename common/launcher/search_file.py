"""The search file of ``--search FILE.yaml``: what a study searches, read and checked before anything runs.

The file names the training script, the settings every trial shares, the ranges to search, the objective, the
number of trials, the seeds each is scored over and the pruner (its keys and defaults: ``SEARCH_KEYS``).
:func:`load_search` reads it into a :class:`Search`, refusing in one line what the script would refuse: each range
is checked against the script's config, the settings with each range's ends, one field at a time.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import tempfile
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common import script_modes
from common.config import ConfigError, flag_name, unusable_directory
from common.launcher import ROOT, UsageError
from common.launcher.modes import MODES

SEARCH_REQUIREMENTS = "requirements-tracking.txt"  # the optional extra that installs optuna
OBJECTIVES = {"time_to_target": "minimize", "final_return": "maximize"}
AGGREGATES = {"median": statistics.median, "mean": statistics.fmean}
PRUNERS = ("median", "successive_halving", "none")
SET_BY_SEARCH = ("seed", "output_dir", "resume")  # each run's: --seeds, the trial's directory, --resume auto

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
