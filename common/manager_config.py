"""What a :class:`~common.parallel_manager.ParallelManager` is given, checked: seed 004's
``parallel_config`` (:class:`ManagerConfig`), ``env_config`` (:class:`WorkerSpec`, with the
user's ``env_factory``), ``model_config`` (:func:`build_model`), and the user's model against
the env's spaces (:func:`probe_env_spaces`, :func:`check_model_fits`).

Every check raises a one-line ``ValueError`` naming the dict, the key, the value and what is
allowed, before any process or shared memory exists.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

import gymnasium as gym
import numpy as np
from torch import nn

from common.networks import QNetwork
from common.system import usable_cores

# What compression_enabled=True would buy, measured (benchmarks/bench_manager_compression.py: CPU time of worker
# + learner per batch of 16 games, medians of 50, zlib level 1): experience crosses a local pipe, where zlib
# costs more CPU than the bytes it saves; weights never cross a pipe at all.
NO_COMPRESSION = ("compression_enabled=True is not supported: batches cross a local pipe, where zlib costs more CPU "
                  "than the bytes it saves (worker + learner per batch: ConnectFour 66.9 kB -> 5.5 kB but 0.54 -> "
                  "1.09 ms, CartPole of 8000 steps 226 kB -> 126 kB but 0.48 -> 5.81 ms; "
                  "benchmarks/bench_manager_compression.py); weights go through shared memory")


def default_num_workers() -> int:
    """All cores but two (one for the learner, one for the system), at least one."""
    return max(1, usable_cores() - 2)


def _from_dict(cls: type, values: Any, what: str):
    if not isinstance(values, dict):
        raise ValueError(f"{what}: must be a dict or a {cls.__name__}, not {type(values).__name__}")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"{what}: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    return cls(**values)


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_value(what: str, name: str, value: Any, kind: str, low: float | None = None, strict: bool = False,
                optional: bool = False) -> None:
    """One-line ValueError unless ``value`` is an ``int``/``float``/``bool`` (``kind``) at least (above) ``low``."""
    if optional and value is None:
        return
    fits = {"int": _is_int, "float": _is_number, "bool": lambda v: isinstance(v, bool)}[kind](value)
    bound = "" if low is None else f" {'>' if strict else '>='} {low:g}"
    allowed = f"must be {'an' if kind == 'int' else 'a'} {'number' if kind == 'float' else kind}{bound}"
    allowed += " or None" if optional else ""
    if not fits:
        raise ValueError(f"{what}: {name} {value!r} is a {type(value).__name__}; {allowed}")
    if low is not None and (value <= low if strict else value < low):
        raise ValueError(f"{what}: {name} {value!r}: {allowed}")


@dataclass
class ManagerConfig:
    """Seed 004's ``parallel_config``: checked when made (and again by ParallelManager), one line per error."""

    num_workers: int = field(default_factory=default_num_workers)  # rollout processes
    games_per_worker: int = 8  # episodes a worker plays per batch it sends
    max_game_length: int = 0  # cut an episode after this many steps (0 = the env's own limit)
    experience_batch_size: int = 8192  # most transitions per message; bigger batches are split by episode
    model_sync_interval: int = 1  # learner steps between weight publications (see ModelSynchronizer.should_sync)
    worker_reset_interval: int = 0  # games after which a worker makes fresh envs (at a batch's end; 0 = never)
    timeout: float = 30.0  # seconds collect_experiences, pause, reset and evaluate wait at most
    compression_enabled: bool = False  # seed 004's setting: only False (see NO_COMPRESSION for why)
    max_restarts: int | None = 3  # restarts per worker before the manager gives up (WorkerFailed); None = no limit
    experience_queue_size: int = 2  # batches a worker may play ahead of the learner
    envs_per_worker: int = 0  # environments a worker steps together; 0 = games_per_worker
    hang_timeout: float = 300.0  # a worker silent this long is killed and restarted (0 = never)
    start_timeout: float = 120.0  # a worker not ready this long after its start is killed and restarted
    opponent_slots: int = 10  # past snapshots set_opponents can hand the workers for self-play

    # (kind, lowest value, lowest excluded, None allowed) of every field
    RULES = {"num_workers": ("int", 1, False, False), "games_per_worker": ("int", 1, False, False),
             "max_game_length": ("int", 0, False, False), "experience_batch_size": ("int", 1, False, False),
             "model_sync_interval": ("int", 1, False, False), "worker_reset_interval": ("int", 0, False, False),
             "timeout": ("float", 0, True, False), "compression_enabled": ("bool", None, False, False),
             "max_restarts": ("int", 0, False, True), "experience_queue_size": ("int", 1, False, False),
             "envs_per_worker": ("int", 0, False, False), "hang_timeout": ("float", 0, False, False),
             "start_timeout": ("float", 0, True, False), "opponent_slots": ("int", 0, False, False)}

    def __post_init__(self) -> None:
        self.validate()

    def validate(self, what: str = "parallel_config") -> None:
        """Raise a one-line ValueError naming the first field of the wrong type or out of range."""
        for name, (kind, low, strict, optional) in self.RULES.items():
            check_value(what, name, getattr(self, name), kind, low, strict, optional)
        if self.compression_enabled:
            raise ValueError(f"{what}: {NO_COMPRESSION}")

    @classmethod
    def from_dict(cls, values: dict) -> ManagerConfig:
        return _from_dict(cls, values, "parallel_config")


@dataclass
class WorkerSpec:
    """The env a rollout worker plays (picklable): seed 004's ``env_config``."""

    env_id: str
    seed: int = 0
    hidden_sizes: tuple[int, ...] = (128, 128)  # used when no model_config or model says otherwise
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    torch_threads: int = 1
    log_dir: str | None = None  # where worker_<i>.log goes (None = no worker log file)

    def validate(self, what: str = "env_config") -> None:
        if not isinstance(self.env_id, str) or not self.env_id:
            raise ValueError(f"{what}: env_id {self.env_id!r} must be a Gymnasium id (a str, e.g. ConnectFour-v0)")
        check_value(what, "seed", self.seed, "int")
        check_value(what, "torch_threads", self.torch_threads, "int", 1)
        if not isinstance(self.env_kwargs, dict):
            raise ValueError(f"{what}: env_kwargs {self.env_kwargs!r} must be a dict")

    def __post_init__(self) -> None:
        self.validate()

    @classmethod
    def from_dict(cls, env_config: dict, env_factory: Callable[..., gym.Env] | None = None) -> WorkerSpec:
        """``{"env_id": ..., "seed": ...}``; every other key is a keyword argument of the env.

        With ``env_factory`` (the user's env class or a function returning an env) instead of an
        ``env_id``, the env is the factory's (its id is ``"module:name"``, see
        :func:`common.envs.env_factory_id`), so seed 004's ``{"board_size": 9, "max_moves": 200}``
        reaches ``env_factory(board_size=9, max_moves=200)`` unchanged."""
        if not isinstance(env_config, dict):
            raise ValueError(f"env_config: must be a dict or a WorkerSpec, not {type(env_config).__name__}")
        config = dict(env_config)
        if env_factory is not None:
            if "env_id" in config:
                raise ValueError(f"env_config: env_id {config['env_id']!r} and env_factory both name the env; "
                                 f"give one")
            from common.envs import env_factory_id

            config["env_id"] = env_factory_id(env_factory)
        if "env_id" not in config:
            raise ValueError("env_config: needs an env_id (a Gymnasium id, e.g. ConnectFour-v0) or env_factory= "
                             "(your env's class or function); the other keys are the env's keyword arguments")
        own = {f.name for f in fields(cls)} - {"env_kwargs"}
        return cls(**{k: config.pop(k) for k in list(config) if k in own}, env_kwargs=config)


@dataclass
class EnvSpaces:
    """What the learner's process reads from one env of a spec: its spaces, a first observation
    and whether it marks legal actions (``info["action_mask"]``, one bool per action)."""

    env_id: str
    observation_space: gym.Space
    action_space: gym.Space
    first_obs: np.ndarray
    action_mask: bool


def probe_env_spaces(spec: WorkerSpec) -> EnvSpaces:
    """Make and reset one env as the workers will; one-line ValueError if it cannot be made or its
    action mask does not fit its action space."""
    from common.envs import make_env  # registers the built-ins and "module:name" ids

    try:
        env = make_env(spec.env_id, spec.seed, **spec.env_kwargs)()
        obs, info = env.reset(seed=spec.seed)
    except Exception as err:
        detail = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"env_config: cannot create {spec.env_id} with {spec.env_kwargs}: {detail}") from None
    obs_space, action_space = env.observation_space, env.action_space
    env.close()
    mask = info.get("action_mask") if isinstance(info, dict) else None
    if mask is not None:
        need = (int(action_space.n),) if isinstance(action_space, gym.spaces.Discrete) else None
        if need is None or np.shape(mask) != need:
            raise ValueError(f"env_config: {spec.env_id}'s info['action_mask'] has shape {np.shape(mask)}; its action "
                             f"space {action_space} needs {need or 'a Discrete space'}, one bool per action")
    return EnvSpaces(spec.env_id, obs_space, action_space, np.asarray(obs), mask is not None)


def _first_linear_inputs(model: nn.Module) -> int | None:
    first = next((m for m in model.modules() if any(True for _ in m.parameters(recurse=False))), None)
    return first.in_features if isinstance(first, nn.Linear) else None


def check_model_fits(model: nn.Module, spaces: EnvSpaces) -> None:
    """One-line ValueError, naming both shapes, unless ``model`` takes the env's observations and
    (by the convention of :func:`common.rollout_worker.action_scores`) gives one score per action.

    The model runs once, in eval mode and without gradients, on the env's first observation as a
    float32 batch of one; an output the convention does not read is left to the workers' own
    first check, which an ``act_fn`` also passes through."""
    import torch

    from common.rollout_worker import action_scores

    obs_shape = tuple(spaces.first_obs.shape)
    name = type(model).__name__
    parameter = next(model.parameters(), None)
    device = parameter.device if parameter is not None else "cpu"
    batch = torch.as_tensor(spaces.first_obs[None], dtype=torch.float32, device=device)
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            output = model(batch)
    except Exception as err:
        inputs = _first_linear_inputs(model)
        takes = f" (its first layer takes {inputs} inputs)" if inputs is not None else ""
        detail = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise ValueError(f"model: {name}{takes} cannot take {spaces.env_id}'s observations of shape {obs_shape} "
                         f"({int(np.prod(obs_shape))} values): {type(err).__name__}: {detail}") from None
    finally:
        model.train(training)
    try:
        scores = action_scores(output)
    except TypeError:
        return
    n = getattr(spaces.action_space, "n", None)
    if n is not None and scores.shape[1] != int(n):
        raise ValueError(f"model: {name} gives {scores.shape[1]} scores per observation (output shape "
                         f"{tuple(scores.shape)} for a batch of 1), but {spaces.env_id} has {int(n)} actions "
                         f"({spaces.action_space})")


def build_model(spec: WorkerSpec, model_config: dict | None = None, spaces: EnvSpaces | None = None) -> QNetwork:
    """The Q-network ``model_config`` describes for ``spec``'s env (``spaces``: as read from it):
    ``hidden_sizes``, or seed 004's ``hidden_dim`` and ``num_layers``; ``input_dim`` and
    ``action_dim``, if given, must match the env."""
    if model_config is not None and not isinstance(model_config, dict):
        raise ValueError(f"model_config: must be a dict, not {type(model_config).__name__}")
    config = dict(model_config or {})
    for key in ("hidden_dim", "num_layers", "input_dim", "action_dim"):
        check_value("model_config", key, config.get(key, 1), "int", 1)
    sizes = config.get("hidden_sizes", [1])
    if not isinstance(sizes, (list, tuple)) or not all(_is_int(w) and w >= 1 for w in sizes):
        raise ValueError(f"model_config: hidden_sizes {sizes!r} must be a list of ints >= 1")
    spaces = spaces or probe_env_spaces(spec)
    obs_space, action_space = spaces.observation_space, spaces.action_space
    hidden = config.pop("hidden_sizes", None)
    width, layers = config.pop("hidden_dim", None), config.pop("num_layers", 2)
    hidden = list(hidden) if hidden is not None else [width] * layers if width else list(spec.hidden_sizes)
    actual = {"input_dim": int(np.prod(obs_space.shape)), "action_dim": int(getattr(action_space, "n", -1))}
    for key, value in actual.items():
        if key in config and int(config.pop(key)) != value:
            raise ValueError(f"model_config: {key} {model_config[key]} does not match {spec.env_id} ({value}: "
                             f"observations of shape {obs_space.shape}, action space {action_space})")
    if config:
        raise ValueError(f"model_config: unknown key(s) {', '.join(sorted(config))}")
    return QNetwork(obs_space, action_space, tuple(hidden))

