"""Environment construction for every script: ``make_env`` thunks and ``make_vec_env``.

Importing this package registers the built-in environments with Gymnasium, so they
are ordinary ids. ``make_vec_env`` returns a :class:`VecEnv`: a vector of environments
with *same-step* autoreset (the observation after a finished episode is already the
first observation of the next one; the final observation is handed back separately
for bootstrapping) and per-episode return/length tracking. Where an environment has a
numpy-vectorized form, that form is used instead of a Python loop over copies.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.vector import AutoresetMode, SyncVectorEnv

from common.envs.cartpole_vector import CartPoleSameStepVectorEnv
from common.envs.registry import register_builtin_envs

register_builtin_envs()

# Numpy-vectorized forms that step all copies at once, keyed by env id.
FAST_VECTOR_ENVS: dict[str, Callable[..., gym.vector.VectorEnv]] = {
    "CartPole-v1": CartPoleSameStepVectorEnv,
}


def make_env(env_id: str, seed: int, env_index: int = 0, **env_kwargs) -> Callable[[], gym.Env]:
    """A thunk creating one environment seeded with ``seed + env_index``."""

    def thunk() -> gym.Env:
        env = gym.make(env_id, **env_kwargs)
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
        if done.any():
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
                 vectorize: bool = True, **env_kwargs) -> VecEnv:
    """``num_envs`` copies of ``env_id`` behind the :class:`VecEnv` interface.

    Uses the environment's numpy-vectorized form when it has one (and ``vectorize``),
    else a synchronous loop over ``gym.make`` copies in this process.
    """
    spec = gym.spec(env_id)
    if vectorize and env_id in FAST_VECTOR_ENVS:
        env = FAST_VECTOR_ENVS[env_id](num_envs=num_envs, **env_kwargs)
    elif vectorize and spec.vector_entry_point is not None and _is_same_step(spec):
        env = gym.make_vec(env_id, num_envs=num_envs, vectorization_mode="vector_entry_point", **env_kwargs)
    else:
        thunks = [make_env(env_id, seed, first_index + i, **env_kwargs) for i in range(num_envs)]
        env = SyncVectorEnv(thunks, autoreset_mode=AutoresetMode.SAME_STEP)
    return VecEnv(env, seed, first_index)


def _is_same_step(spec) -> bool:
    entry = spec.vector_entry_point
    if isinstance(entry, str):
        module, name = entry.split(":")
        entry = getattr(__import__(module, fromlist=[name]), name)
    mode = getattr(entry, "metadata", {}).get("autoreset_mode")
    return mode is not None and AutoresetMode(mode) is AutoresetMode.SAME_STEP
