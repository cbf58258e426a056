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

from common.envs import atari
from common.envs.cartpole_vector import CartPoleSameStepVectorEnv
from common.envs.registry import register_builtin_envs

register_builtin_envs()

# Numpy-vectorized forms that step all copies at once, keyed by env id.
FAST_VECTOR_ENVS: dict[str, Callable[..., gym.vector.VectorEnv]] = {
    "CartPole-v1": CartPoleSameStepVectorEnv,
}


def make_env(env_id: str, seed: int, env_index: int = 0, wrap: Callable[[gym.Env], gym.Env] | None = None,
             **env_kwargs) -> Callable[[], gym.Env]:
    """A thunk creating one environment seeded with ``seed + env_index`` (and wrapped by ``wrap``)."""

    def thunk() -> gym.Env:
        env = atari.make_single(env_id, **env_kwargs) if atari.is_atari(env_id) else gym.make(env_id, **env_kwargs)
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
                 vectorize: bool = True, wrap: Callable[[gym.Env], gym.Env] | None = None, **env_kwargs) -> VecEnv:
    """``num_envs`` copies of ``env_id`` behind the :class:`VecEnv` interface.

    Uses the environment's numpy-vectorized form when it has one (and ``vectorize``, and no
    ``wrap`` of each copy is asked for), else a synchronous loop over ``gym.make`` copies in
    this process.
    """
    if atari.is_atari(env_id):
        atari.register()
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
