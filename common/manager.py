"""Rollout workers for a central learner: ParallelManager, WorkerCommunicator, ModelSynchronizer.

The learner's process owns the networks and the replay buffer. Each rollout worker is a
process started and watched by :class:`common.supervisor.Supervisor`, with one duplex pipe:
a worker that dies is reported with its id and its traceback (or signal) and restarted with
the current weights, epsilon and opponents; one that cannot run with its configuration
(:class:`~common.supervisor.WorkerConfigError`) is not restarted and ends the run. A worker
plays whole episodes with an :class:`InferencePolicy` (the learner's model, no optimizer) and
sends them on its pipe, a batch of ``games_per_worker`` episodes at a time, at most
``experience_queue_size`` batches ahead of the learner: every batch
:meth:`ParallelManager.collect_experiences` hands out gives its worker one credit back.

Weights go the other way through shared memory (:class:`common.networks.SharedParams`,
versioned under a seqlock): slot 0 holds the learner's current weights, further slots the
past snapshots that self-play opponents play with, so pipes carry small messages only.
Every batch says which weights version played it.

**The model.** Any ``nn.Module`` whose class a worker can import: the module is pickled once,
by reference to its class (and to the classes of its submodules), with every parameter left
out; the pickle goes to the workers through shared memory and each rebuilds the module from it,
then loads the parameters from the weights slot. So the learner's model needs no constructor
arguments or ``spec``, and ``sync_model_to_workers()`` publishes ``manager.model`` with no
arguments. Buffers (BatchNorm statistics ...) travel in that pickle, as they were when the
manager was built; only parameters are synced. A worker turns the model's output into
actions by a convention, or by the user's own ``act_fn`` (see :class:`InferencePolicy`).

Commands (learner -> worker): ``settings``, ``opponents``, ``credit``, ``pause``, ``resume``,
``reset``, ``evaluate``, ``stop`` (an unknown one is an error); messages (worker -> learner):
``episodes``, ``eval``, ``paused``, ``reset_done``. Two-player built-ins get their opponents
from :mod:`common.envs.selfplay`; nothing here knows a particular env.

Seed 004's call works with plain dicts: ``env_config`` names the env and its keyword
arguments, ``model_config`` the Q-network (or ``model=`` any module), ``parallel_config`` the
fields of :class:`ManagerConfig`::

    manager = ParallelManager({"env_id": "ConnectFour-v0"}, {"hidden_dim": 256, "num_layers": 2},
                              {"num_workers": 4, "games_per_worker": 10, "timeout": 30.0})
    manager.start_workers()
    try:
        experiences = manager.collect_experiences()  # ... train manager.model on them ...
        manager.sync_model_to_workers()
    finally:
        manager.stop_workers()

Everything the constructor is given is checked before any process or shared memory exists
(one-line ``ValueError``); the constructor, ``start_workers`` and ``stop_workers`` release all
they made on any failure, and a manager never stopped is stopped when the interpreter exits.
"""

from __future__ import annotations

import copy
import importlib.util
import io
import itertools
import logging
import numbers
import pickle
import sys
import time
import types
import weakref
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from torch import nn

from common.dqn import epsilon_greedy
from common.envs import make_vec_env, play_episodes
from common.networks import QNetwork, SharedParams, flat_size
from common.shm import SharedArrays, attach_all
from common.supervisor import Message, Supervisor, WorkerConfigError, set_torch_threads
from common.system import usable_cores

log = logging.getLogger("prl.manager")
_manager_numbers = itertools.count()  # distinct shared-memory names for several managers in one process

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
    def from_dict(cls, env_config: dict) -> WorkerSpec:
        """``{"env_id": ..., "seed": ...}``; every other key is a keyword argument of the env."""
        if not isinstance(env_config, dict):
            raise ValueError(f"env_config: must be a dict or a WorkerSpec, not {type(env_config).__name__}")
        config = dict(env_config)
        if "env_id" not in config:
            raise ValueError("env_config: needs an env_id (a Gymnasium id, e.g. ConnectFour-v0); the other keys "
                             "are the env's keyword arguments")
        own = {f.name for f in fields(cls)} - {"env_kwargs"}
        return cls(**{k: config.pop(k) for k in list(config) if k in own}, env_kwargs=config)


def build_model(spec: WorkerSpec, model_config: dict | None = None) -> QNetwork:
    """The Q-network ``model_config`` describes for ``spec``'s env: ``hidden_sizes``, or seed 004's
    ``hidden_dim`` and ``num_layers``; ``input_dim`` and ``action_dim``, if given, must match the env."""
    from common import envs  # noqa: F401  (registers the built-in envs)

    if model_config is not None and not isinstance(model_config, dict):
        raise ValueError(f"model_config: must be a dict, not {type(model_config).__name__}")
    config = dict(model_config or {})
    for key in ("hidden_dim", "num_layers", "input_dim", "action_dim"):
        check_value("model_config", key, config.get(key, 1), "int", 1)
    sizes = config.get("hidden_sizes", [1])
    if not isinstance(sizes, (list, tuple)) or not all(_is_int(w) and w >= 1 for w in sizes):
        raise ValueError(f"model_config: hidden_sizes {sizes!r} must be a list of ints >= 1")
    try:
        env = gym.make(spec.env_id, **spec.env_kwargs)
    except Exception as err:
        raise ValueError(f"env_config: cannot create {spec.env_id} with {spec.env_kwargs}: {err}") from None
    obs_space, action_space = env.observation_space, env.action_space
    env.close()
    hidden = config.pop("hidden_sizes", None)
    width, layers = config.pop("hidden_dim", None), config.pop("num_layers", 2)
    hidden = list(hidden) if hidden is not None else [width] * layers if width else list(spec.hidden_sizes)
    actual = {"input_dim": int(np.prod(obs_space.shape)), "action_dim": int(getattr(action_space, "n", -1))}
    for key, value in actual.items():
        if key in config and int(config.pop(key)) != value:
            raise ValueError(f"model_config: {key} {model_config[key]} does not match {spec.env_id} ({value})")
    if config:
        raise ValueError(f"model_config: unknown key(s) {', '.join(sorted(config))}")
    return QNetwork(obs_space, action_space, tuple(hidden))


@dataclass
class ExperienceBatch:
    """Whole episodes from one worker, played with one model version and epsilon."""

    worker: int
    model_version: int
    epsilon: float
    episodes: list[dict[str, Any]]
    steps: int
    collect_seconds: float
    last: bool = True  # the final message of the batch (a big batch travels in several messages)
    env_resets: int = 0  # times this worker made fresh envs before playing the batch (worker_reset_interval, reset)


# ------------------------------------------------------------------ the model, sent to the workers

def _unknown_global(obj: Any, main_file: bool) -> str | None:
    """Why a worker could not import the class or function ``obj`` (pickled by reference), or None."""
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", "?")
    where = f"{module}.{qualname}"
    if "<locals>" in qualname or "<lambda>" in qualname:
        return f"{where} is defined inside a function (or is a lambda); a worker can import only module-level names"
    if module == "__main__":
        return None if main_file else (f"{where} is defined in an interactive __main__ (a notebook, the REPL, "
                                        f"python -c), which a worker cannot import; move it into a .py module")
    if module is None or module == "builtins":
        return None
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    return None if found else f"{where}: module {module!r} is not importable (no file a worker could import)"


def _rebuild_parameter(shape: tuple[int, ...], dtype: str, requires_grad: bool, is_parameter: bool) -> torch.Tensor:
    """A parameter's stand-in in a worker's copy of the model; the weights slot fills it before first use."""
    tensor = torch.zeros(shape, dtype=getattr(torch, dtype.removeprefix("torch.")))
    return nn.Parameter(tensor, requires_grad=requires_grad) if is_parameter else tensor


class _ModelPickler(pickle.Pickler):
    """Pickles a model by reference to its classes, its parameters left out (shape and dtype only) and
    its buffers copied to the CPU; notes every class or function a worker could not import."""

    def __init__(self, file, model: nn.Module):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.parameters = {id(p) for p in model.parameters()}
        self.buffers = {id(b) for b in model.buffers()}
        self.main_file = any(getattr(sys.modules.get("__main__"), attr, None) for attr in ("__file__", "__spec__"))
        self.problems: list[str] = []
        self._checked: set[int] = set()

    def reducer_override(self, obj: Any):
        if isinstance(obj, torch.Tensor):
            if id(obj) in self.parameters:
                return _rebuild_parameter, (tuple(obj.shape), str(obj.dtype), obj.requires_grad,
                                            isinstance(obj, nn.Parameter))
            if id(obj) in self.buffers and obj.device.type != "cpu":
                return copy.copy, (obj.detach().cpu(),)
        elif isinstance(obj, (type, types.FunctionType)) and id(obj) not in self._checked:
            self._checked.add(id(obj))
            problem = _unknown_global(obj, self.main_file)
            if problem:
                self.problems.append(problem)
        return NotImplemented


def _checked_pickle(obj: Any, model: nn.Module, what: str) -> bytes:
    buffer = io.BytesIO()
    pickler = _ModelPickler(buffer, model)
    try:
        pickler.dump(obj)
    except Exception as err:  # pickling runs the model's own code: any error means "cannot be sent"
        if not pickler.problems:
            pickler.problems.append(str(err).splitlines()[0] if str(err) else type(err).__name__)
    if pickler.problems:
        raise ValueError(f"{what} cannot be sent to a worker: {pickler.problems[0]}")
    return buffer.getvalue()


def pack_model(model: nn.Module, act_fn: Callable | None = None) -> bytes:
    """``(model, act_fn)`` as bytes a worker unpickles (:func:`unpack_model`), parameters left out.

    Raises a one-line ValueError if a worker could not rebuild them: a class or function defined
    in an interactive ``__main__`` or inside a function, or something that cannot be pickled."""
    if act_fn is not None:
        _checked_pickle(act_fn, model, f"act_fn: {getattr(act_fn, '__qualname__', type(act_fn).__name__)}")
    return _checked_pickle((model, act_fn), model, f"model: {type(model).__name__}")


def unpack_model(data: bytes | np.ndarray) -> tuple[nn.Module, Callable | None]:
    """The worker's side of :func:`pack_model`: a fresh copy of the model (zero weights) and the act_fn."""
    model, act_fn = pickle.loads(bytes(data))
    return model.eval(), act_fn


def parameter_shapes(model: nn.Module) -> list[tuple[int, ...]]:
    return [tuple(p.shape) for p in model.parameters()]


# ------------------------------------------------------------------ model synchronization

class ModelSynchronizer:
    """Publishes the learner's weights to the workers as numbered versions (shared memory, slot 0).

    ``should_sync(learner_step)`` is true once ``model_sync_interval`` learner steps have passed
    since the last publication, or when there was none. A publication made without a
    ``learner_step`` counts as one at the last step this synchronizer knows (the latest given to
    ``should_sync`` or ``publish``); before any step is known it counts as none.
    """

    def __init__(self, params: SharedParams, model_sync_interval: int = 1):
        self.params = params
        self.model_sync_interval = max(1, model_sync_interval)
        self.last_sync_step: int | None = None
        self.known_step: int | None = None  # the latest learner step seen

    @property
    def version(self) -> int:
        return self.params.version(0)

    def _see(self, learner_step: int) -> None:
        self.known_step = learner_step if self.known_step is None else max(self.known_step, learner_step)

    def should_sync(self, learner_step: int) -> bool:
        self._see(learner_step)
        return self.last_sync_step is None or learner_step - self.last_sync_step >= self.model_sync_interval

    def publish(self, model: nn.Module, learner_step: int | None = None) -> int:
        """Write ``model``'s weights as a new version; returns it."""
        if learner_step is not None:
            self._see(learner_step)
            self.last_sync_step = learner_step
        elif self.known_step is not None:
            self.last_sync_step = self.known_step
        return self.params.publish(model, 0)


# ------------------------------------------------------------------ worker side

def action_scores(output: Any) -> np.ndarray:
    """The convention that turns a model's output into per-action scores: a tensor ``[n, actions]``
    is the scores; a tuple or list stands for its first element (``(logits, value)``)."""
    if isinstance(output, (tuple, list)) and output:
        output = output[0]
    if not isinstance(output, torch.Tensor) or output.dim() != 2:
        shape = f" of shape {tuple(output.shape)}" if isinstance(output, torch.Tensor) else ""
        raise TypeError(f"the model returned a {type(output).__name__}{shape}; the convention takes a tensor "
                        f"[n, actions] of per-action scores, or a tuple whose first element is one; else pass act_fn")
    return output.detach().float().cpu().numpy()


def sample_actions(model: nn.Module, obs: np.ndarray, action_mask: np.ndarray | None, epsilon: float,
                   rng: np.random.Generator) -> np.ndarray:
    """An ``act_fn`` for a policy model: sample from the softmax of its (legal) logits, the first
    output by the :func:`action_scores` convention; with probability ``epsilon``, a uniform legal action."""
    with torch.no_grad():
        logits = action_scores(model(torch.as_tensor(obs, dtype=torch.float32))).astype(np.float64)
    if action_mask is not None:
        logits = np.where(action_mask, logits, -np.inf)
    probs = np.exp(logits - logits.max(axis=1, keepdims=True))
    cumulative = np.cumsum(probs, axis=1)
    actions = (cumulative > rng.random(len(obs))[:, None] * cumulative[:, -1:]).argmax(axis=1)
    explore = rng.random(len(actions)) < epsilon
    if explore.any():
        actions[explore] = epsilon_greedy(np.zeros_like(logits[explore]), 1.0, rng,
                                          None if action_mask is None else action_mask[explore])
    return actions


class InferencePolicy:
    """The learner's model, for acting only (no gradients).

    Actions come from ``act_fn(model, obs, action_mask, epsilon, rng) -> actions`` when one is
    given (a module-level function, so workers can import it; ``obs`` is the numpy batch
    ``[n, *obs_shape]``, ``action_mask`` ``[n, actions]`` bool or None; :func:`sample_actions` is
    one). Otherwise by convention: the model's output on the float32 observations (its first
    element if a tuple, as ``(logits, value)``) is ``[n, actions]`` scores, and the action is
    epsilon-greedy over them, the argmax among legal actions (Q-values and logits alike).
    """

    def __init__(self, net: nn.Module, act_fn: Callable | None = None):
        self.net = net.eval()
        self.act_fn = act_fn
        self.version = 0

    def fetch(self, params: SharedParams, slot: int, alive=lambda: True) -> None:
        self.version = params.wait_fetch(self.net, slot, alive)

    def act(self, obs: np.ndarray, action_mask: np.ndarray | None, epsilon: float,
            rng: np.random.Generator) -> np.ndarray:
        if self.act_fn is not None:
            return np.asarray(self.act_fn(self.net, obs, action_mask, epsilon, rng))
        with torch.no_grad():
            output = self.net(torch.as_tensor(obs, dtype=torch.float32))
        return epsilon_greedy(action_scores(output), epsilon, rng, action_mask)


def check_actions(actions: np.ndarray, num_envs: int, action_space: gym.Space, mask: np.ndarray | None) -> None:
    """The act path's first answer must be one valid action per env (else no game can be played)."""
    actions = np.asarray(actions)
    if not isinstance(action_space, gym.spaces.Discrete):  # e.g. an act_fn for a Box space: one action per env
        if actions.shape != (num_envs, *action_space.shape):
            raise TypeError(f"got actions of shape {actions.shape}; need {(num_envs, *action_space.shape)}")
        return
    if actions.shape != (num_envs,) or not np.issubdtype(actions.dtype, np.integer):
        raise TypeError(f"got actions of shape {actions.shape} and dtype {actions.dtype} for {num_envs} envs; "
                        f"need {num_envs} integers")
    if ((actions < 0) | (actions >= action_space.n)).any():
        raise ValueError(f"actions {actions.tolist()} are outside 0..{action_space.n - 1}")
    if mask is not None and not mask[np.arange(num_envs), actions].all():
        raise ValueError(f"actions {actions.tolist()} include an illegal one under the action mask")


def split_by_transitions(episodes: list[dict[str, Any]], limit: int) -> list[list[dict[str, Any]]]:
    """Group whole episodes into chunks of at most ``limit`` transitions (an episode is never split)."""
    chunks, current, size = [], [], 0
    for episode in episodes:
        if current and size + episode["length"] > limit:
            chunks.append(current)
            current, size = [], 0
        current.append(episode)
        size += episode["length"]
    if current or not chunks:
        chunks.append(current)
    return chunks


class RolloutWorker:
    """The loop inside a worker process: apply commands; play a batch while it has credit; repeat."""

    def __init__(self, link, spec: WorkerSpec, config: ManagerConfig, param_specs: dict, state: dict[str, Any]):
        self.link, self.spec, self.config = link, spec, config
        arrays, self._handles = attach_all(param_specs)
        self.model_bytes = arrays.pop("model")
        self.params = SharedParams(arrays)
        self.seed = state["seed"]
        self.rng = np.random.default_rng(self.seed)
        self.epsilon, self.credits, self.opponents = state["epsilon"], state["credits"], state["opponents"]
        self.paused, self.paused_acked, self.reset_requested = state["paused"], False, False
        self.env_resets, self.games_since_reset = 0, 0
        self.evals: list[dict[str, Any]] = []
        self.policy = self._rebuild()
        self.policy.fetch(self.params, 0, link.parent_alive)
        self.vec = self._make_env(config.games_per_worker)
        self._check_act()
        self._install_opponents()

    def _rebuild(self) -> InferencePolicy:
        """A fresh copy of the learner's model (weights not loaded yet) with its act path."""
        try:
            return InferencePolicy(*unpack_model(self.model_bytes))
        except Exception as err:  # the same bytes fail the same way at every restart
            detail = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise WorkerConfigError(f"worker {self.link.index} cannot rebuild the model: {type(err).__name__}: "
                                    f"{detail} (its classes must be importable from a .py module)") from err

    def _check_act(self) -> None:
        obs = self.vec.reset()
        mask = self.vec.last_infos.get("action_mask")
        try:
            check_actions(self.policy.act(obs, mask, 0.0, self.rng), self.vec.num_envs,
                          self.vec.single_action_space, mask)
        except Exception as err:
            detail = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise WorkerConfigError(f"worker {self.link.index} cannot turn the model's output into actions for "
                                    f"{self.spec.env_id}: {type(err).__name__}: {detail}") from err

    def _make_env(self, games: int, **overrides):
        width = self.config.envs_per_worker or games
        kwargs = {**self.spec.env_kwargs, **overrides}
        try:
            return make_vec_env(self.spec.env_id, max(1, min(width, games)), self.seed, **kwargs)
        except Exception as err:  # a bad env id or keyword: no restart can fix it
            raise WorkerConfigError(f"cannot create {self.spec.env_id} with {kwargs}: {err}") from err

    def _install_opponents(self) -> None:
        """Two-player envs: the per-game opponent mixture of the latest policy, snapshots and fixed players."""
        if self.opponents is None or not hasattr(self.vec.env, "set_opponent"):
            return
        from common.envs.selfplay import opponent_mixture

        snapshots = []
        for slot in self.opponents["slots"]:
            snapshots.append(self._rebuild())
            snapshots[-1].fetch(self.params, slot, self.link.parent_alive)
        player = opponent_mixture(self.opponents, self.policy, snapshots, self.vec.num_envs, self.rng)
        if player is not None:
            self.vec.env.set_opponent(player)

    def apply(self, command: str, payload: Any) -> None:
        if command == "settings":
            self.epsilon = float(payload["epsilon"])
        elif command == "opponents":
            self.opponents = payload
            self._install_opponents()
        elif command == "credit":
            self.credits += int(payload)
        elif command in ("pause", "resume"):
            self.paused, self.paused_acked = command == "pause", False
        elif command == "reset":
            self.reset_requested = True
        elif command == "evaluate":
            self.evals.append(payload)
        elif command != "stop":
            raise ValueError(f"worker {self.link.index}: unknown command {command!r}")

    def run(self) -> None:
        link = self.link
        while not link.stop_requested:
            for command, payload in link.commands():
                self.apply(command, payload)
            if link.stop_requested:
                return
            if self.reset_requested:
                self.reset()
            elif self.evals:
                self.evaluate(self.evals.pop(0))
            elif self.paused or self.credits <= 0:
                if self.paused and not self.paused_acked:
                    link.send("paused")
                    self.paused_acked = True
                message = link.receive()  # idle until the learner says something (heartbeats meanwhile)
                if message is not None:
                    self.apply(*message)
            else:
                self.collect()

    def _act(self, epsilon: float):
        return lambda obs, masks: self.policy.act(obs, masks, epsilon, self.rng)

    def collect(self) -> None:
        if self.params.version(0) != self.policy.version:
            self.policy.fetch(self.params, 0, self.link.parent_alive)
        started = time.perf_counter()
        version, epsilon = self.policy.version, self.epsilon
        episodes, steps = play_episodes(self.vec, self._act(epsilon), self.config.games_per_worker,
                                        self.config.max_game_length, record=True,
                                        seed=int(self.rng.integers(2**31 - 1)))
        seconds = time.perf_counter() - started
        chunks = split_by_transitions(episodes, self.config.experience_batch_size)
        for k, chunk in enumerate(chunks):
            self.link.send("episodes", ExperienceBatch(self.link.index, version, epsilon, chunk,
                                                       steps if k == 0 else 0, seconds, last=k == len(chunks) - 1,
                                                       env_resets=self.env_resets))
        self.credits -= 1
        self.games_since_reset += len(episodes)
        interval = self.config.worker_reset_interval
        if interval and self.games_since_reset >= interval:  # episodes are whole: the reset waits for a batch's end
            self.new_envs()

    def evaluate(self, request: dict[str, Any]) -> None:
        vec = self._make_env(request["episodes"], **request["env_kwargs"])
        try:
            if request["opponent"] is not None:
                vec.env.set_opponent(request["opponent"])
            episodes, steps = play_episodes(vec, self._act(request["epsilon"]), request["episodes"],
                                            self.config.max_game_length, seed=int(self.rng.integers(2**31 - 1)))
        finally:
            vec.close()
        self.link.send("eval", {"request": request["request"], "episodes": episodes, "steps": steps})

    def new_envs(self) -> None:
        """Fresh environments with a new seed (weights and settings stay)."""
        self.vec.close()
        self.seed = int(self.rng.integers(2**31 - 1))
        self.vec = self._make_env(self.config.games_per_worker)
        self._install_opponents()
        self.env_resets += 1
        self.games_since_reset = 0

    def reset(self) -> None:
        self.reset_requested = False
        self.new_envs()
        self.link.send("reset_done")

    def close(self) -> None:
        self.vec.close()
        self.params = self.model_bytes = None
        for handle in self._handles:
            handle.close()


def rollout_worker(link, spec: WorkerSpec, config: ManagerConfig, param_specs: dict, state: dict[str, Any]) -> None:
    """Entry point of a rollout worker process (run by the supervisor, which reports a crash)."""
    set_torch_threads(spec.torch_threads)
    if spec.log_dir is not None:
        from common.runlog import setup_logging

        setup_logging(Path(spec.log_dir) / f"worker_{link.index}.log", "prl.manager")
    worker = RolloutWorker(link, spec, config, param_specs, state)
    try:
        link.ready()
        worker.run()
    finally:
        worker.close()


# ------------------------------------------------------------------ learner side

class WorkerCommunicator:
    """The learner's end of the workers' pipes, over the supervisor: commands out, messages in,
    and how many complete batches of each worker wait to be collected."""

    def __init__(self, supervisor: Supervisor, experience_queue_size: int):
        self.supervisor = supervisor
        self.experience_queue_size = experience_queue_size
        self.waiting: Counter[int] = Counter()  # complete batches received per worker, not yet collected

    def send(self, index: int, command: str, payload: Any = None) -> bool:
        """False if the worker is gone (the supervisor restarts it with the current state)."""
        return self.supervisor.send(index, command, payload)

    def broadcast(self, command: str, payload: Any = None) -> None:
        self.supervisor.broadcast(command, payload)

    def receive(self, timeout: float) -> list[Message]:
        """What the workers sent within ``timeout`` s (deaths and restarts handled and reported too)."""
        return self.supervisor.poll(timeout)

    def get_queue_info(self) -> dict[str, Any]:
        """Complete batches waiting per worker, and how many a worker may play ahead."""
        return {"experience": {i: self.waiting[i] for i in self.supervisor.workers},
                "experience_max": self.experience_queue_size}


@dataclass
class WorkerState:
    index: int
    paused: bool = False
    paused_acked: bool = False
    reset_acked: bool = True
    lives: int = 0
    model_version: int = 0  # the weights version of the worker's newest batch
    episodes: int = 0  # episodes received from this worker (all its lives)
    batches: int = 0
    last_seen: float = field(default_factory=time.monotonic)
    pending_evals: list[dict[str, Any]] = field(default_factory=list)
    env_resets: int = 0  # fresh envs the worker made in its current life (as its newest batch says)


def _release(supervisor: Supervisor, arrays: SharedArrays) -> None:
    """Stop the workers and unlink the segments of a manager that was never stopped (at exit)."""
    try:
        supervisor.stop(5.0)
    finally:
        arrays.unlink_all()


class ParallelManager:
    """Runs rollout workers for a training loop (see the module docstring).

    ``env_config``: a :class:`WorkerSpec` or seed 004's dict; ``model_config``: the Q-network
    (ignored when ``model`` is given); ``parallel_config``: a :class:`ManagerConfig` or a dict of
    its fields; ``model``: any ``nn.Module`` whose classes a worker can import (the network is
    then ``manager.model``); ``act_fn``: how workers act with it (see :class:`InferencePolicy`;
    None = the convention). Every argument is checked before any process or shared memory exists:
    a one-line ValueError names the first that cannot work. Also a context manager (stops on exit).
    """

    def __init__(self, env_config: WorkerSpec | dict, model_config: dict | None = None,
                 parallel_config: ManagerConfig | dict | None = None, *, model: nn.Module | None = None,
                 epsilon: float = 1.0, logger: logging.Logger | None = None, act_fn: Callable | None = None):
        self.log = logger or log
        self._stopped, self._started = True, False  # nothing to stop until the shared memory exists
        self.spec = env_config if isinstance(env_config, WorkerSpec) else WorkerSpec.from_dict(env_config)
        self.spec.validate()
        self.config = (parallel_config if isinstance(parallel_config, ManagerConfig)
                       else ManagerConfig.from_dict({} if parallel_config is None else parallel_config))
        self.config.validate()
        if model is not None and not isinstance(model, nn.Module):
            raise ValueError(f"model: must be a torch.nn.Module, not {type(model).__name__}")
        if act_fn is not None and not callable(act_fn):
            raise ValueError(f"act_fn: must be a module-level function, not {type(act_fn).__name__}")
        check_value("ParallelManager", "epsilon", epsilon, "float", 0)
        if epsilon > 1:
            raise ValueError(f"ParallelManager: epsilon {epsilon!r}: must be in [0, 1]")
        self.model = model if model is not None else build_model(self.spec, model_config)
        if flat_size(self.model) == 0:
            raise ValueError(f"model: {type(self.model).__name__} has no parameters to send to the workers")
        self._shapes = parameter_shapes(self.model)
        model_bytes = pack_model(self.model, act_fn)  # the workers' copy; refuses what they could not rebuild
        self.act_fn = act_fn
        self._arrays = SharedArrays()
        try:
            self._allocate(model_bytes)
            self.workers = {i: WorkerState(i) for i in range(self.config.num_workers)}
            self.supervisor = Supervisor(rollout_worker, self.config.num_workers, self._args_for, name="worker",
                                         max_restarts=self.config.max_restarts,
                                         start_timeout_s=self.config.start_timeout,
                                         hang_timeout_s=self.config.hang_timeout or None, logger=self.log)
        except BaseException:
            self._arrays.unlink_all()
            raise
        self._stopped = False
        # A manager nobody stopped (an exception before the caller's try) is stopped at interpreter exit.
        self._finalizer = weakref.finalize(self, _release, self.supervisor, self._arrays)
        self.communicator = WorkerCommunicator(self.supervisor, self.config.experience_queue_size)
        self._epsilon = float(epsilon)
        self._opponents: dict[str, Any] | None = None
        self._batches: list[ExperienceBatch] = []  # received, not yet handed out
        self._evals: dict[int, dict[str, Any]] = {}
        self._request_ids = itertools.count()

    def _allocate(self, model_bytes: bytes) -> None:
        """The shared weights slots, their versions and the model's pickle (the only segments this makes)."""
        tag, slots = next(_manager_numbers), 1 + self.config.opponent_slots
        names = {"params": f"manager{tag}_params", "versions": f"manager{tag}_versions",
                 "model": f"manager{tag}_model"}
        self._arrays.create(names["params"], (slots, flat_size(self.model)), np.float32)
        self._arrays.create(names["versions"], (slots, 2), np.int64)
        self._arrays.create(names["model"], (len(model_bytes),), np.uint8, fill=None)[:] = np.frombuffer(
            model_bytes, dtype=np.uint8)
        self._param_specs = {key: self._arrays.specs()[name] for key, name in names.items()}
        self.params = SharedParams({key: self._arrays[names[key]] for key in ("params", "versions")})
        self.synchronizer = ModelSynchronizer(self.params, self.config.model_sync_interval)

    def _args_for(self, index: int) -> tuple:
        """What worker ``index`` starts with; called again at every restart, so it gets the current state."""
        state = self.workers[index]
        state.lives += 1
        start = {"seed": self.spec.seed + 7919 * index + 104729 * state.lives, "epsilon": self._epsilon,
                 "opponents": self._opponents, "paused": state.paused,
                 "credits": max(0, self.config.experience_queue_size - self.communicator.waiting[index])}
        return self.spec, self.config, self._param_specs, start

    # -- lifecycle
    def start_workers(self, wait: bool = False, stop: Callable[[], bool] | None = None) -> None:
        """Start every worker; they play with the weights published last (``manager.model``'s, if none).

        ``wait``: return only once every worker is set up (its env made, its model rebuilt and
        answering with legal actions) or ``stop()`` is true, so that a worker that cannot run
        raises here (:class:`WorkerConfigError`). Whatever fails in here stops the workers and
        releases the shared memory before the error propagates."""
        if self._stopped or self._started:
            raise RuntimeError(f"start_workers: this manager was already {'stopped' if self._stopped else 'started'}"
                               f"; make a new ParallelManager")
        self._started = True
        try:
            if self.model_version == 0:
                self.synchronizer.publish(self.model)
            self.supervisor.start()
            if wait:
                self.wait_ready(stop or (lambda: False))
        except BaseException:
            self.stop_workers()
            raise

    def wait_ready(self, stop=lambda: False) -> None:
        """Wait until every worker is set up (or ``stop()`` is true)."""
        for message in self.supervisor.wait_ready(stop):
            self._handle(message)

    def stop_workers(self, timeout: float = 10.0) -> None:
        """Stop every worker (killing those that do not stop within ``timeout`` s) and release the
        shared memory. Safe to call twice."""
        if self._stopped:
            return
        self._stopped = True
        self._finalizer.detach()
        try:
            self.supervisor.stop(timeout)
        finally:
            # Reading an unmapped segment would crash the process: model_version, get_status() and
            # a late sync go to private copies from now on (np.empty_like commits no memory until written).
            self.params = SharedParams({"params": np.empty_like(self.params.params),
                                        "versions": self.params.versions.copy()})
            self.synchronizer.params = self.params
            self._arrays.unlink_all()

    def __enter__(self) -> ParallelManager:
        return self

    def __exit__(self, *exc) -> None:
        self.stop_workers()

    # -- weights and settings
    def sync_model_to_workers(self, model: nn.Module | dict[str, torch.Tensor] | None = None,
                              epsilon: float | None = None, learner_step: int | None = None) -> int:
        """Publish ``manager.model``'s weights as a new version, the workers' from their next batch on.

        ``model`` (optional): a network of the same parameter shapes, which becomes
        ``manager.model``, or a state dict loaded into it; ``epsilon``: a new exploration rate;
        ``learner_step``: the step this sync counts at for ``synchronizer.should_sync``.
        Returns the version."""
        if isinstance(model, dict):
            self.model.load_state_dict(model)
        elif model is not None:
            self._check_shapes(model, "sync_model_to_workers")
            self.model = model
        version = self.synchronizer.publish(self.model, learner_step)
        if epsilon is not None:
            self.set_epsilon(epsilon)
        return version

    def _check_shapes(self, model: nn.Module, what: str) -> None:
        if not isinstance(model, nn.Module) or parameter_shapes(model) != self._shapes:
            raise ValueError(f"{what}: {type(model).__name__} does not have the parameter shapes of the workers' "
                             f"{type(self.model).__name__}; a new architecture needs a new ParallelManager")

    def set_epsilon(self, epsilon: float) -> None:
        """The exploration rate workers play with from their next batch on."""
        if epsilon != self._epsilon:
            self._epsilon = epsilon
            self.communicator.broadcast("settings", {"epsilon": epsilon})

    @property
    def model_version(self) -> int:
        return self.synchronizer.version

    def set_opponents(self, snapshots: list[nn.Module | dict[str, torch.Tensor]], probs: dict[str, float],
                      epsilon: float = 0.0, snapshot_weights: list[float] | None = None,
                      snapshot_ids: list[int] | None = None) -> None:
        """Opponent mixture for two-player envs: ``probs`` over latest / snapshot / random / heuristic
        (see :mod:`common.envs.selfplay`); ``snapshots`` are past weights of the learner, drawn in
        proportion to ``snapshot_weights`` (evenly without) and named in episodes by ``snapshot_ids``."""
        if len(snapshots) > self.config.opponent_slots:
            raise ValueError(f"{len(snapshots)} snapshots, but opponent_slots is {self.config.opponent_slots}")
        scratch = copy.deepcopy(self.model) if any(isinstance(s, dict) for s in snapshots) else None
        for slot, snapshot in enumerate(snapshots, start=1):
            if isinstance(snapshot, dict):
                scratch.load_state_dict(snapshot)
            else:
                self._check_shapes(snapshot, "set_opponents")
            self.params.publish(scratch if isinstance(snapshot, dict) else snapshot, slot)
        self._opponents = {"slots": list(range(1, len(snapshots) + 1)), "probs": dict(probs), "epsilon": epsilon,
                           "snapshot_weights": snapshot_weights, "snapshot_ids": snapshot_ids}
        self.communicator.broadcast("opponents", self._opponents)

    # -- experience
    def collect_experiences(self, timeout: float | None = None, min_batches: int | None = None,
                            stop=None) -> list[ExperienceBatch]:
        """Batches that arrived, waiting until ``min_batches`` complete batches (default: one from
        each active worker) are in, ``timeout`` seconds pass or ``stop()`` is true; never longer."""
        timeout = self.config.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while True:
            done = Counter(b.worker for b in self._batches if b.last)
            active = self._active()
            if min_batches is None:
                waiting_for = [i for i in active if done[i] == 0]
            else:
                waiting_for = active if sum(done.values()) < min_batches else []
            remaining = deadline - time.monotonic()
            if not waiting_for or remaining <= 0 or (stop is not None and stop()):
                break
            self._pump(min(remaining, 0.25))
        self._pump(0.0)
        batches, self._batches = self._batches, []
        for index, count in Counter(b.worker for b in batches if b.last).items():
            self.communicator.waiting[index] -= count
            self.communicator.send(index, "credit", count)  # it may play as many batches more
        return batches

    def _pump(self, timeout: float) -> None:
        for message in self.communicator.receive(timeout):
            self._handle(message)

    def _handle(self, message: Message) -> None:
        state, payload = self.workers[message.index], message.payload
        state.last_seen = time.monotonic()
        if message.kind == "episodes":
            self._batches.append(payload)
            state.episodes += len(payload.episodes)
            state.model_version, state.env_resets = payload.model_version, payload.env_resets
            if payload.last:
                state.batches += 1
                self.communicator.waiting[message.index] += 1
        elif message.kind == "paused":
            state.paused_acked = True
        elif message.kind == "reset_done":
            state.reset_acked = True
        elif message.kind == "eval":
            self._evals[payload["request"]] = payload
            state.pending_evals = [r for r in state.pending_evals if r["request"] != payload["request"]]
        elif message.kind == "restarted":  # what the dead worker was asked to do and did not, it does now
            state.paused_acked, state.reset_acked = False, True
            for request in state.pending_evals:
                self.communicator.send(message.index, "evaluate", request)
        elif message.kind != "ready":
            self.log.warning("worker %d sent an unknown message %r", message.index, message.kind)

    # -- control
    def pause_workers(self, ids: list[int], timeout: float | None = None) -> None:
        """Pause workers; on return they send nothing more until resumed (batches they sent
        before pausing are kept for the next collect)."""
        for index in ids:
            self.workers[index].paused, self.workers[index].paused_acked = True, False
            self.communicator.send(index, "pause")
        self._wait(lambda: all(self.workers[i].paused_acked for i in ids), timeout, "pause", ids)

    def resume_workers(self, ids: list[int]) -> None:
        for index in ids:
            self.workers[index].paused = False
            self.communicator.send(index, "resume")

    def reset_workers(self, ids: list[int] | None = None, timeout: float | None = None) -> None:
        """Give workers fresh environments and seeds (their weights and settings stay)."""
        ids = list(self.workers) if ids is None else ids
        for index in ids:
            self.workers[index].reset_acked = False
            self.communicator.send(index, "reset")
        self._wait(lambda: all(self.workers[i].reset_acked for i in ids), timeout, "reset", ids)

    def evaluate(self, episodes: int, opponent: str | None = None, learner_first: bool | None = None,
                 epsilon: float = 0.0, timeout: float | None = None,
                 env_kwargs: dict | None = None) -> list[dict[str, Any]]:
        """Play ``episodes`` episodes at ``epsilon`` (greedy by default) spread over the active workers.

        ``opponent`` (a player name) and ``learner_first`` (the seat) are for two-player envs;
        ``env_kwargs`` go to the evaluation envs. Returns each episode's statistics.
        """
        ids = self._active() or self.supervisor.live()
        kwargs = {**(env_kwargs or {}), **({} if learner_first is None else {"learner_first": learner_first})}
        requests = []
        for k, index in enumerate(ids):
            share = episodes // len(ids) + (k < episodes % len(ids))
            if share:
                request = {"request": next(self._request_ids), "episodes": share, "opponent": opponent,
                           "env_kwargs": kwargs, "epsilon": epsilon}
                self.workers[index].pending_evals.append(request)
                self.communicator.send(index, "evaluate", request)
                requests.append(request["request"])
        self._wait(lambda: all(r in self._evals for r in requests), timeout, "evaluate", ids)
        return [episode for r in requests for episode in self._evals.pop(r)["episodes"]]

    def _wait(self, done, timeout: float | None, what: str, ids: list[int]) -> None:
        timeout = self.config.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while not done():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"workers {ids} did not finish '{what}' within {timeout:.0f} s")
            self._pump(min(remaining, 0.25))

    # -- status
    def _active(self) -> list[int]:
        return [i for i in self.supervisor.live() if not self.workers[i].paused]

    def get_status(self) -> dict[str, Any]:
        """Active, paused and restarted workers, each worker's model version and episodes, queue sizes."""
        now, procs = time.monotonic(), self.supervisor.workers
        return {
            "active_workers": self._active(),
            "paused_workers": [i for i, s in self.workers.items() if s.paused],
            "restarted_workers": {i: w.restarts for i, w in procs.items() if w.restarts},
            "total_restarts": self.supervisor.total_restarts,
            "model_version": self.model_version,
            "workers": {i: {"pid": procs[i].process.pid if procs[i].process else None, "alive": procs[i].alive,
                            "paused": s.paused, "model_version": s.model_version, "episodes": s.episodes,
                            "batches": s.batches, "restarts": procs[i].restarts, "env_resets": s.env_resets,
                            "seconds_since_message": round(now - s.last_seen, 2)}
                        for i, s in self.workers.items()},
            "queue_info": self.communicator.get_queue_info(),
            "batches_waiting": len(self._batches),
        }

    def pids(self) -> list[int]:
        return self.supervisor.pids()
