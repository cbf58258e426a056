"""Environment construction for every script: ``make_env`` thunks and ``make_vec_env``.

Importing this package registers the built-in environments with Gymnasium, so they
are ordinary ids. ``make_vec_env`` returns a :class:`VecEnv`: a vector of environments
with *same-step* autoreset (the observation after a finished episode is already the
first observation of the next one; the final observation is handed back separately
for bootstrapping) and per-episode return/length tracking. Where an environment has a
numpy-vectorized form, that form is used instead of a Python loop over copies.

A user's own env needs no registration either: :func:`env_factory_id` names an env class or
a function that returns an env as ``"module:name"``, a Gymnasium entry point, and every
function here registers such an id on first use in each process (:func:`register_entry_point`),
so it travels as a plain string: to spawned workers, into ``config.yaml``, checkpoints and
``--resume``.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.vector import AutoresetMode, SyncVectorEnv

from common.envs import atari
from common.envs.cartpole_vector import CartPoleSameStepVectorEnv
from common.envs.registry import register_builtin_envs

register_builtin_envs()

# Numpy-vectorized forms that step all copies at once, keyed by env id.
FAST_VECTOR_ENVS: dict[str, Callable[..., gym.vector.VectorEnv]] = {
    "CartPole-v1": CartPoleSameStepVectorEnv,
}


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__


def _main_module_name(qualname: str) -> str:
    """The name another process imports the running script by (its ``__main__`` is not theirs).

    ``python -m pkg.mod``: ``pkg.mod``. ``python path/to/script.py``: the dotted path of the file
    under a directory of ``sys.path`` (which spawned workers inherit), the longest one, so that a
    program started from that outermost directory (``python -m common.evaluate`` from the
    repository root) finds it too. An interactive ``__main__`` (a notebook, the REPL, ``python -c``)
    has no file to import: ValueError.
    """
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name:
        return spec.name
    file = getattr(main, "__file__", None)
    if not file:
        raise ValueError(f"env_factory: __main__.{qualname} is defined in an interactive __main__ (a notebook, the "
                         f"REPL, python -c), which another process cannot import; move it into a .py module")
    path = Path(file).resolve()
    names = set()
    for entry in sys.path:
        try:
            parts = path.with_suffix("").relative_to(Path(entry or ".").resolve()).parts
        except ValueError:
            continue
        if parts and all(part.isidentifier() for part in parts):
            names.add(".".join(parts))
    for name in sorted(names, key=lambda n: (-n.count("."), n)):
        try:
            found = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        if found is not None and found.origin and Path(found.origin).resolve() == path:
            return name
    raise ValueError(f"env_factory: __main__.{qualname}: {path} cannot be imported by name from any directory on "
                     f"sys.path; move the env into a module that can")


def env_factory_id(factory: Callable[..., gym.Env]) -> str:
    """The env id of a user's env class or env-making function: ``"module:name"``.

    The id is a Gymnasium entry point, registered in each process that meets it
    (:func:`register_entry_point`): processes start with ``spawn`` and find the factory by
    importing it by name. So a factory another process cannot import by name is refused with a
    one-line ValueError saying why: a lambda, a function defined inside another (a closure), a
    method or nested class, an object without a name (``functools.partial``), a name defined in
    an interactive ``__main__``. A factory defined at the top level of the script being run is
    named by that script's module path (see :func:`_main_module_name`).
    """
    if not callable(factory):
        raise ValueError(f"env_factory: must be an env class or a function that returns an env, not "
                         f"{type(factory).__name__}")
    module, qualname = getattr(factory, "__module__", None), getattr(factory, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qualname, str):
        raise ValueError(f"env_factory: {factory!r} has no name another process could import it by (a "
                         f"functools.partial or a callable object?); pass a module-level function or class")
    where = f"{module}.{qualname}"
    if "<lambda>" in qualname:
        raise ValueError(f"env_factory: {where} is a lambda, which another process cannot import by name (workers "
                         f"start with spawn); define a module-level function or class")
    if "<locals>" in qualname:
        raise ValueError(f"env_factory: {where} is defined inside a function, which another process cannot import by "
                         f"name (workers start with spawn); define it at the top level of a module")
    if "." in qualname:
        raise ValueError(f"env_factory: {where} is not a module-level name (a method or a nested class); "
                         f"pass a module-level function or class")
    env_id = f"{_main_module_name(qualname) if module == '__main__' else module}:{qualname}"
    found = _load_entry_point(env_id, "env_factory")
    if module != "__main__" and found is not factory:
        raise ValueError(f"env_factory: {env_id} names another object than the one given (was it redefined or "
                         f"replaced after its definition?)")
    return env_id


def _load_entry_point(env_id: str, what: str) -> Callable[..., gym.Env]:
    module_name, _, name = env_id.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:
        raise ValueError(f"{what} {env_id!r}: cannot import {module_name} ({_first_line(err)})") from None
    found = getattr(module, name, None)
    if not callable(found):
        raise ValueError(f"{what} {env_id!r}: {module_name} has no env class or function named {name}")
    return found


def is_entry_point_id(env_id: str) -> bool:
    """``"module:name"`` with Python names on both sides (Gymnasium's own ``"module:Env-v0"`` is not one)."""
    module_name, sep, name = env_id.partition(":")
    return bool(sep) and name.isidentifier() and all(part.isidentifier() for part in module_name.split("."))


def register_entry_point(env_id: str) -> None:
    """Register a ``"module:name"`` id (see :func:`env_factory_id`) with Gymnasium in this process,
    once; any other id is left as it is. ValueError, one line, if the module cannot be imported or
    has no such name."""
    if env_id in gym.registry or not is_entry_point_id(env_id):
        return
    _load_entry_point(env_id, "env_id")
    gym.register(id=env_id, entry_point=env_id)


def _make_one(env_id: str, **env_kwargs) -> gym.Env:
    if atari.is_atari(env_id):
        return atari.make_single(env_id, **env_kwargs)
    if is_entry_point_id(env_id):  # gym.make would read "module:name" as "import module, then make the id name"
        register_entry_point(env_id)
        return gym.make(gym.spec(env_id), **env_kwargs)
    return gym.make(env_id, **env_kwargs)


def make_env(env_id: str, seed: int, env_index: int = 0, wrap: Callable[[gym.Env], gym.Env] | None = None,
             **env_kwargs) -> Callable[[], gym.Env]:
    """A thunk creating one environment seeded with ``seed + env_index`` (and wrapped by ``wrap``)."""

    def thunk() -> gym.Env:
        env = _make_one(env_id, **env_kwargs)
        if wrap is not None:
            env = wrap(env)
        env.action_space.seed(seed + env_index)
        env.observation_space.seed(seed + env_index)
        return env

    return thunk


@dataclass
class StepResult:
    obs: np.ndarray
    rewards: np.ndarray
    terminations: np.ndarray
    truncations: np.ndarray
    final_obs: np.ndarray  # rows valid where terminations | truncations
    infos: dict[str, Any]
    episodes: list[dict[str, Any]] = field(default_factory=list)  # one dict per finished episode


class VecEnv:
    """``num_envs`` environments stepped together, with same-step autoreset and episode stats.

    Environment ``i`` is seeded with ``seed + first_index + i``, so workers that own
    different slices of a run's environments never share a seed.
    """

    def __init__(self, env: gym.vector.VectorEnv, seed: int, first_index: int = 0):
        mode = env.metadata.get("autoreset_mode", AutoresetMode.NEXT_STEP)
        if AutoresetMode(mode) is not AutoresetMode.SAME_STEP:
            raise ValueError(f"{env} must autoreset in SAME_STEP mode")
        self.env = env
        self.num_envs = env.num_envs
        self.single_observation_space = env.single_observation_space
        self.single_action_space = env.single_action_space
        self.seed = seed + first_index
        self._returns = np.zeros(self.num_envs, dtype=np.float64)
        self._lengths = np.zeros(self.num_envs, dtype=np.int64)
        self.last_infos: dict[str, Any] = {}

    def reset(self) -> np.ndarray:
        obs, self.last_infos = self.env.reset(seed=self.seed)
        self._returns[:] = 0
        self._lengths[:] = 0
        return np.asarray(obs)

    def step(self, actions: np.ndarray) -> StepResult:
        obs, rewards, terminations, truncations, infos = self.env.step(actions)
        obs = np.asarray(obs)
        rewards = np.asarray(rewards, dtype=np.float32)
        terminations = np.asarray(terminations, dtype=bool)
        truncations = np.asarray(truncations, dtype=bool)
        self._returns += rewards
        self._lengths += 1
        done = terminations | truncations
        final_obs = obs
        episodes: list[dict[str, Any]] = []
        if np.count_nonzero(done):  # .any() takes microseconds more, at every step of every env
            final_obs = _final_observations(obs, infos, done)
            final_info = infos.get("final_info", {})
            for i in np.flatnonzero(done):
                episode = {"env_index": int(i), "return": float(self._returns[i]), "length": int(self._lengths[i])}
                episode.update(_scalars_at(final_info, i))
                episodes.append(episode)
            self._returns[done] = 0
            self._lengths[done] = 0
        self.last_infos = infos
        return StepResult(obs, rewards, terminations, truncations, final_obs, infos, episodes)

    def close(self) -> None:
        self.env.close()


def _final_observations(obs: np.ndarray, infos: dict[str, Any], done: np.ndarray) -> np.ndarray:
    final = obs.copy()
    stored = infos.get("final_obs")
    if stored is None:
        return final
    mask = infos.get("_final_obs", done)
    for i in np.flatnonzero(mask):
        final[i] = stored[i]
    return final


def _scalars_at(info: dict[str, Any], i: int) -> dict[str, float]:
    """Numeric per-env entries of a vector info dict at index ``i`` (e.g. coverage, net worth)."""
    out = {}
    for key, value in info.items():
        if key.startswith("_") or key == "episode":
            continue
        mask = info.get(f"_{key}")
        if mask is not None and not mask[i]:
            continue
        try:
            item = value[i]
        except (TypeError, IndexError, KeyError):
            continue
        if isinstance(item, (bool, int, float, np.number, np.bool_)):
            out[key] = float(item)
    return out


def make_vec_env(env_id: str, num_envs: int, seed: int, first_index: int = 0,
                 vectorize: bool = True, wrap: Callable[[gym.Env], gym.Env] | None = None, **env_kwargs) -> VecEnv:
    """``num_envs`` copies of ``env_id`` behind the :class:`VecEnv` interface.

    Uses the environment's numpy-vectorized form when it has one (and ``vectorize``, and no
    ``wrap`` of each copy is asked for), else a synchronous loop over ``gym.make`` copies in
    this process.
    """
    if atari.is_atari(env_id):
        atari.register()
    register_entry_point(env_id)
    spec = gym.spec(env_id)
    vectorize = vectorize and wrap is None
    if vectorize and atari.is_atari(env_id):
        env = atari.make_vector(env_id, num_envs, **env_kwargs)
    elif vectorize and env_id in FAST_VECTOR_ENVS:
        env = FAST_VECTOR_ENVS[env_id](num_envs=num_envs, **env_kwargs)
    elif vectorize and spec.vector_entry_point is not None and _is_same_step(spec):
        env = gym.make_vec(env_id, num_envs=num_envs, vectorization_mode="vector_entry_point", **env_kwargs)
    else:
        thunks = [make_env(env_id, seed, first_index + i, wrap, **env_kwargs) for i in range(num_envs)]
        env = SyncVectorEnv(thunks, autoreset_mode=AutoresetMode.SAME_STEP)
    return VecEnv(env, seed, first_index)


def _is_same_step(spec) -> bool:
    entry = spec.vector_entry_point
    if isinstance(entry, str):
        module, name = entry.split(":")
        entry = getattr(__import__(module, fromlist=[name]), name)
    mode = getattr(entry, "metadata", {}).get("autoreset_mode")
    return mode is not None and AutoresetMode(mode) is AutoresetMode.SAME_STEP


def play_episodes(vec: VecEnv, act: Callable[[np.ndarray, np.ndarray | None], np.ndarray], num_episodes: int,
                  max_length: int = 0, record: bool = False, seed: int | None = None,
                  stop: Callable[[], bool] | None = None) -> tuple[list[dict[str, Any]], int]:
    """Play exactly ``num_episodes`` whole episodes on ``vec`` with ``act(obs, action_masks) -> actions``.

    Every environment is reset first (with ``seed`` when given, for new games every call); an
    episode counts only if it *starts* while more are needed, so the returned episodes are
    whole and none is cut by the call's end (ties are broken by env index, so the result does
    not depend on timing). ``max_length`` > 0 cuts longer episodes (not terminated). Each
    episode has ``return``, ``length``, ``terminated`` and the env's numeric episode info
    (coverage, net worth ...); with ``record`` also ``obs`` (T+1, the last one final),
    ``actions``, ``rewards`` and, for envs with ``info["action_mask"]``, ``masks`` (T+1).
    ``stop()``, asked before every step, ends the call early with the whole episodes finished so far
    (a deadline). Returns (episodes, environment steps taken).
    """
    if seed is not None:
        vec.seed = seed
    obs = vec.reset()
    masks = vec.last_infos.get("action_mask")
    n = vec.num_envs
    start = np.full(n, -1, dtype=np.int64)  # step where env i's counted episode began, -1 = not counted
    counted = min(n, num_episodes)
    start[:counted] = 0
    obs_hist, mask_hist, act_hist, rew_hist = [], [], [], []
    finished: list[tuple] = []  # (env, first step, last step, final obs, final mask, terminated, info)
    t = 0
    while len(finished) < num_episodes and not (stop is not None and stop()):
        actions = act(obs, masks)
        result = vec.step(actions)
        if record:
            obs_hist.append(obs)
            mask_hist.append(masks)
            act_hist.append(actions)
        rew_hist.append(result.rewards)
        done = result.terminations | result.truncations
        next_masks = result.infos.get("action_mask")
        too_long = (start >= 0) & (t - start + 1 >= max_length) if max_length > 0 else np.zeros(n, dtype=bool)
        infos = {ep["env_index"]: ep for ep in result.episodes}
        for i in np.flatnonzero(done | too_long):
            if start[i] >= 0:
                if done[i]:
                    final_obs, final_mask = result.final_obs[i], None  # terminal: its mask is never used
                else:  # cut here: the episode goes on in the env, so the current obs and mask are the final ones
                    final_obs = result.obs[i]
                    final_mask = next_masks[i] if next_masks is not None else None
                finished.append((i, start[i], t, final_obs, final_mask, bool(result.terminations[i]),
                                 infos.get(i, {})))
                start[i] = -1
            if done[i] and counted < num_episodes:
                start[i] = t + 1
                counted += 1
        obs, masks = result.obs, next_masks
        t += 1
    if not finished:
        return [], t * n
    rewards = np.stack(rew_hist)
    episodes = [_episode(rewards, obs_hist, mask_hist, act_hist, record, *item) for item in finished]
    return episodes, t * n


def _episode(rewards, obs_hist, mask_hist, act_hist, record, i, first, last, final_obs, final_mask,
             terminated, info) -> dict[str, Any]:
    episode_rewards = rewards[first:last + 1, i].astype(np.float32)
    episode: dict[str, Any] = {"return": float(episode_rewards.sum()), "length": int(last - first + 1),
                               "terminated": terminated}
    episode.update({k: v for k, v in info.items() if k not in ("env_index", "return", "length")})
    if record:
        episode["obs"] = np.stack([o[i] for o in obs_hist[first:last + 1]] + [final_obs])
        episode["actions"] = np.array([a[i] for a in act_hist[first:last + 1]], dtype=np.int64)
        episode["rewards"] = episode_rewards
        if mask_hist[first] is not None:
            last_mask = final_mask if final_mask is not None else np.ones_like(mask_hist[first][i])
            episode["masks"] = np.stack([m[i] for m in mask_hist[first:last + 1]] + [last_mask])
    return episode
