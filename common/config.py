"""Dataclass configs <-> ``--kebab-case`` flags <-> YAML overlays, with validation.

A script declares its settings as one or more dataclasses whose defaults are what a
user edits; the comment after each field becomes that flag's help text. Precedence is
defaults < ``--config FILE.yaml`` < explicit flags. Any problem (unknown key, wrong
type, impossible value) stops the run with one line naming the field, the value and
what is allowed, and exit status 2, before anything is written to disk.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any

EXIT_BAD_CONFIG = 2


class ConfigError(ValueError):
    """A config value that cannot be used; the message names field, value and what is allowed."""

    def __init__(self, field: str, value: Any, allowed: str):
        self.field, self.value, self.allowed = field, value, allowed
        super().__init__(f"{flag_name(field)} {value!r}: {allowed}")


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def fail(message: str) -> typing.NoReturn:
    """Print one clear line and exit with the bad-config status."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(EXIT_BAD_CONFIG)


@functools.cache  # parsing a class's source costs ~30 ms; once per class is enough
def _field_comments(cls: type) -> dict[str, str]:
    """Map field name -> the trailing ``# comment`` on its line in the class source."""
    comments: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        for line in source.splitlines():
            match = re.match(r"\s*(\w+)\s*:[^#]*#\s*(.*)$", line)
            if match:
                comments[match.group(1)] = match.group(2).strip()
    return comments


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    """``Optional[X]`` / ``X | None`` -> (X, True); anything else -> (tp, False)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0], True
    return tp, False


def _coerce(field: str, tp: Any, value: Any) -> Any:
    """Convert a YAML or command-line value to the field's declared type, or raise ConfigError."""
    base, optional = _unwrap_optional(tp)
    if value is None or (optional and isinstance(value, str) and value.lower() in ("none", "null")):
        if optional:
            return None
        raise ConfigError(field, value, f"must be a {getattr(base, '__name__', base)}, not empty")
    origin = typing.get_origin(base)
    if origin is list:
        (item_type,) = typing.get_args(base) or (str,)
        if isinstance(value, dict):  # YAML's key: value form of a KEY=VALUE list (env_kwargs)
            value = [f"{k}={v}" for k, v in value.items()]
        items = value if isinstance(value, (list, tuple)) else [value]
        return [_coerce(field, item_type, item) for item in items]
    if base is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "yes", "1", "on", "false", "no", "0", "off"):
            return value.lower() in ("true", "yes", "1", "on")
        raise ConfigError(field, value, "must be true or false")
    if base is int:
        if isinstance(value, bool):
            raise ConfigError(field, value, "must be an integer")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value.replace("_", ""))
            except ValueError:
                try:  # "1e6" is a common way to write a step budget
                    number = float(value)
                    if number.is_integer():
                        return int(number)
                except ValueError:
                    pass
        raise ConfigError(field, value, "must be an integer")
    if base is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(field, value, "must be a number")
    if base is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(field, value, "must be a string")
    return value


def _aliases(cls: type) -> dict[str, str]:
    """``ALIASES = {"old_name": "field"}`` on a config class: other names users were promised."""
    return dict(getattr(cls, "ALIASES", {}))


def aliased(cls: type) -> type:
    """Make a config dataclass's ``ALIASES`` work from Python too: ``Config(n_workers=8)`` sets
    ``num_workers``, and ``cfg.n_workers`` reads and writes it (flags and YAML keys take them already).
    Apply above ``@dataclass``."""
    aliases = _aliases(cls)
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        for alias, target in aliases.items():
            if alias in kwargs:
                if target in kwargs:
                    raise TypeError(f"{alias} and {target} are the same setting; give one")
                kwargs[target] = kwargs.pop(alias)
        init(self, *args, **kwargs)

    cls.__init__ = __init__
    for alias, target in aliases.items():
        setattr(cls, alias, property(lambda self, t=target: getattr(self, t),
                                     lambda self, value, t=target: setattr(self, t, value), doc=f"same as {target}"))
    return cls


def _groups(spec: type | dict[str, type]) -> dict[str, type]:
    return spec if isinstance(spec, dict) else {"": spec}


def _build_parser(groups: dict[str, type], description: str | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", metavar="FILE.yaml", help="YAML file whose keys override the defaults below")
    parser.add_argument("--validate-only", action="store_true",
                        help="check the config, the env and the resources, print the resolved config and exit "
                             "(0 if it would run, 2 if not); nothing is written")
    for group_name, cls in groups.items():
        comments = _field_comments(cls)
        hints = typing.get_type_hints(cls)  # once per class: it evaluates every annotation
        group = parser.add_argument_group(group_name or "settings")
        for field in dataclasses.fields(cls):
            tp, _ = _unwrap_optional(hints[field.name])
            default = field.default if field.default is not dataclasses.MISSING else field.default_factory()
            kwargs: dict[str, Any] = {"dest": field.name, "default": argparse.SUPPRESS,
                                      "help": f"{comments.get(field.name, '')} (default: {default})"}
            if tp is bool:
                kwargs["action"] = argparse.BooleanOptionalAction
            elif typing.get_origin(tp) is list:
                kwargs["nargs"] = "+"
            else:
                kwargs["metavar"] = getattr(tp, "__name__", "VALUE").upper()
            group.add_argument(flag_name(field.name), **kwargs)
        for alias, target in _aliases(cls).items():
            group.add_argument(flag_name(alias), dest=target, default=argparse.SUPPRESS,
                               metavar="VALUE", help=f"same as {flag_name(target)}")
    return parser


def parse_args(spec: type | dict[str, type], argv: list[str] | None = None,
               description: str | None = None, exit_on_error: bool = True) -> tuple[Any, argparse.Namespace]:
    """Like :func:`parse_config`, and also returns the command-line actions (``validate_only``).
    With ``exit_on_error=False`` a bad value raises ConfigError instead of exiting (the Python API)."""
    groups = _groups(spec)
    owner = {f.name: name for name, cls in groups.items() for f in dataclasses.fields(cls)}
    parser = _build_parser(groups, description)
    parser.error = lambda message: fail(message)  # one line, exit 2, no usage dump
    args = vars(parser.parse_args(argv))
    actions = argparse.Namespace(validate_only=args.pop("validate_only", False))
    config_file = args.pop("config", None)
    try:
        values: dict[str, Any] = {}
        hints = {name: hint for cls in groups.values() for name, hint in typing.get_type_hints(cls).items()}
        # YAML values are checked even where a flag overrides them: a wrong file is wrong either way.
        sources = [_read_yaml(config_file, groups, owner)] if config_file else []
        for source in [*sources, args]:
            values.update({k: _coerce(k, hints[k], v) for k, v in source.items()})
        configs = {}
        for name, cls in groups.items():
            configs[name] = cls(**{k: v for k, v in values.items() if owner[k] == name})
            if hasattr(configs[name], "validate"):
                configs[name].validate()
        if len(configs) > 1:
            for hook in {type(c).__dict__.get("validate_together") for c in configs.values()} - {None}:
                hook(configs)
    except ConfigError as err:
        if not exit_on_error:
            raise
        fail(str(err))
    return (configs[""] if "" in configs else configs), actions


def parse_config(spec: type | dict[str, type], argv: list[str] | None = None,
                 description: str | None = None):
    """Build config object(s) from defaults, an optional YAML file and command-line flags.

    ``spec`` is a dataclass, or a dict ``{group_name: dataclass}`` whose field names are
    unique across groups; the return value is then an instance, or a dict of instances.
    A YAML file may be flat or nested by group name. Each instance's ``validate()``
    method, if present, is called; any ConfigError exits 2 with one line.
    """
    return parse_args(spec, argv, description)[0]


# YAML sections every script accepts (seed 003's ``parallel:`` and ``training:``): named sets of the
# script's own flat fields. ``parallel`` holds how the work is spread over processes and devices,
# ``training`` everything else; a script whose config is split into dataclasses (the population's
# ENV_KWARGS, PPO_KWARGS ...) accepts those names as sections too.
PARALLEL_FIELDS = ("num_workers", "num_envs_per_worker", "threads_per_worker", "torch_threads", "device",
                   "gpu_strategy", "num_gpus", "replay_backend", "async_training", "weight_poll_steps")


def yaml_sections(groups: dict[str, type]) -> dict[str, set[str]]:
    """Section name -> the fields it may set (and in ``parallel``, a parallel name that is a script's alias)."""
    names = {f.name for cls in groups.values() for f in dataclasses.fields(cls)}
    aliases = {alias for cls in groups.values() for alias in _aliases(cls)}
    parallel = {name for name in PARALLEL_FIELDS if name in names or name in aliases}
    sections = {"parallel": parallel, "training": names - parallel}
    sections.update({group: {f.name for f in dataclasses.fields(cls)} for group, cls in groups.items() if group})
    return sections


def find_config_file(path: str) -> Path:
    """``--config``'s file. Seed 003's users write ``config/NAME.yaml`` where this project has ``configs/``:
    when the path named does not exist and the same path under ``configs/`` does, that file is read, and
    one line on stderr says so (a file the user has at the path named is always the one read)."""
    file = Path(path)
    if file.is_file():
        return file
    directories = file.parts[:-1]
    if "config" in directories:
        last = len(directories) - 1 - directories[::-1].index("config")
        twin = Path(*directories[:last], "configs", *file.parts[last + 1:])
        if twin.is_file():
            print(f"note: --config {path}: no such file; reading {twin} (this project's directory is configs/)",
                  file=sys.stderr)
            return twin
    raise ConfigError("config", path, "no such file")


def _read_yaml(path: str, groups: dict[str, type], owner: dict[str, str]) -> dict[str, Any]:
    import yaml

    file = find_config_file(path)
    path = path if file == Path(path) else str(file)  # what follows names the file read
    try:
        data = yaml.safe_load(file.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError("config", path, f"not valid YAML ({str(err).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise ConfigError("config", path, "must hold a mapping of field: value")
    aliases = {alias: target for cls in groups.values() for alias, target in _aliases(cls).items()}
    sections = yaml_sections(groups)
    flat: dict[str, Any] = {}
    for key, value in data.items():
        key = str(key).replace("-", "_")
        if key in sections and isinstance(value, dict):
            for sub_key, sub_value in value.items():
                written = str(sub_key).replace("-", "_")
                name = aliases.get(written, written)
                if (written if written in PARALLEL_FIELDS else name) not in sections[key]:
                    raise ConfigError("config", path, f"unknown key '{key}.{sub_key}'; the {key} section takes "
                                                      f"{', '.join(sorted(sections[key]))}")
                flat[name] = sub_value
        else:
            flat[aliases.get(key, key)] = value
    for key in flat:
        if key not in owner:
            raise ConfigError("config", path, f"unknown key {key!r}; known keys: {', '.join(sorted(owner))}")
    return flat


def to_dict(config: Any) -> dict[str, Any]:
    """A plain dict of a config (or dict of configs), for YAML and checkpoints."""
    if isinstance(config, dict):
        return {name: to_dict(c) for name, c in config.items()}
    return dataclasses.asdict(config)


def config_yaml(config: Any) -> str:
    import yaml

    return yaml.safe_dump(to_dict(config), sort_keys=False)


def save_config(config: Any, path: str | Path) -> None:
    Path(path).write_text(config_yaml(config))


# Small validators shared by every script, so the messages read the same everywhere.

def require(condition: bool, field: str, value: Any, allowed: str) -> None:
    if not condition:
        raise ConfigError(field, value, allowed)


def require_positive(config: Any, *fields: str) -> None:
    aliases = _aliases(type(config))
    for name in fields:
        name = aliases.get(name, name)  # an alias is checked, and named, as the field it stands for
        value = getattr(config, name)
        if value is not None:
            require(value > 0, name, value, "must be > 0")


# Seed 003 names Procgen. Checked with pip for Python 3.11: procgen and its forks (procgen2, procgen-mirror,
# pufferai-procgen) all require numpy < 2 and gym < 1, and procgen-gym, the Gymnasium port, requires
# Python >= 3.13; this project needs numpy 2 (requirements.txt).
PROCGEN_REFUSAL = (f"Procgen has no package that installs beside numpy 2 on Python {sys.version_info[0]}."
                   f"{sys.version_info[1]} (procgen and its forks need numpy < 2 and gym < 1; procgen-gym, its "
                   "Gymnasium port, needs Python >= 3.13); for pixel games use an Atari id such as ALE/Breakout-v5 "
                   "(pip install -r requirements-extras.txt) or the built-in Catch-v0")


def require_env_id(env_id: str) -> None:
    """Check that an env id is registered (importing common.envs registers the built-ins)."""
    import gymnasium as gym

    from common import envs  # registers the built-in envs

    if "procgen" in env_id.lower() and env_id not in gym.registry:
        raise ConfigError("env_id", env_id, PROCGEN_REFUSAL)
    if envs.atari.is_atari(env_id) and env_id not in gym.registry and not envs.atari.register():
        raise ConfigError("env_id", env_id, "Atari ids need ale-py: pip install -r requirements-extras.txt")
    try:  # "module:name", a user's env class or function (env_factory), is registered on first use
        envs.register_entry_point(env_id)
    except ValueError as err:
        raise ConfigError("env_id", env_id, str(err).split(": ", 1)[1]) from None
    if env_id not in gym.registry:
        close = [k for k in gym.registry if env_id.split("-")[0].lower() in k.lower()][:5]
        hint = f"; did you mean {', '.join(close)}?" if close else "; see gymnasium.registry for ids"
        raise ConfigError("env_id", env_id, f"not a registered Gymnasium id{hint}")


def unusable_directory(path: str | Path) -> str | None:
    """Why ``path`` cannot be (or become) a directory this process writes into; None when it can.

    Checks without creating anything: the path itself, or the nearest part of it that exists, must
    be a directory this process may write to.
    """
    import os

    path = Path(path).absolute()
    if path.exists() and not path.is_dir():
        return "is a file, not a directory"
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        return f"cannot be created: {existing} is a file, not a directory"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"cannot be created or written: no write permission on {existing}"
    return None
