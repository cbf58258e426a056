"""Observation normalization and reward scaling with one set of statistics for the whole run.

The statistics are those of Stable-Baselines3's ``VecNormalize`` and CleanRL's
``ppo_continuous_action.py``: a running mean and variance of the observations, and a running
variance of the discounted return, by which rewards are divided. What differs is who owns them.
Here the learner alone updates them, from every rollout of every worker (and, under torchrun,
of every rank: their moments are summed first), and publishes them together with the parameters;
workers act on observations normalized with the published statistics, and store what they saw
*raw*. The learner then normalizes a rollout with exactly the statistics it was collected with,
and only then takes the rollout into the statistics. With ``--num-workers 0`` the same code runs
in one process. Checkpoints hold the statistics (``obs_norm``, ``reward_norm``), so a resumed run
goes on with them and a saved policy acts on raw observations (``common.policy``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

EPSILON = 1e-8


@dataclass
class NormalizationSettings:
    """The normalization fields every PPO script's config has (its config class derives from this one)."""

    norm_obs: bool | None = None  # normalize observations by running statistics (None: on for Box actions)
    norm_reward: bool | None = None  # divide rewards by the discounted return's std (None: on for Box actions)
    clip_obs: float = 10.0  # normalized observations are clipped to +-this
    clip_reward: float = 10.0  # scaled rewards are clipped to +-this


class RunningMeanStd:
    """Mean and variance of everything seen so far, updated a batch at a time (Chan et al.)."""

    def __init__(self, shape: tuple[int, ...] = ()):
        self.mean = np.zeros(shape, dtype=np.float64)
        self.var = np.ones(shape, dtype=np.float64)
        self.count = 1e-4  # as SB3: the first batch all but replaces the initial unit variance

    def update(self, batch: np.ndarray, total: Callable[[np.ndarray], np.ndarray] = lambda x: x) -> None:
        """Take in ``batch`` (samples along axis 0); ``total`` sums moments over ranks (identity alone)."""
        batch = np.asarray(batch, dtype=np.float64).reshape(-1, *self.mean.shape)
        moments = total(np.concatenate([[len(batch)], batch.sum(0).ravel(), (batch ** 2).sum(0).ravel()]))
        count = moments[0]
        if count == 0:
            return
        size = self.mean.size
        mean = (moments[1:1 + size] / count).reshape(self.mean.shape)
        var = np.maximum((moments[1 + size:] / count).reshape(self.mean.shape) - mean ** 2, 0.0)
        delta, total_count = mean - self.mean, self.count + count
        self.mean = self.mean + delta * count / total_count
        m2 = self.var * self.count + var * count + delta ** 2 * self.count * count / total_count
        self.var, self.count = m2 / total_count, total_count

    def state(self) -> dict:
        """Plain lists and floats: what a checkpoint may hold under ``torch.load(weights_only=True)``."""
        return {"mean": self.mean.tolist(), "var": self.var.tolist(), "count": float(self.count)}

    def load(self, state: dict) -> None:
        self.mean = np.asarray(state["mean"], dtype=np.float64).reshape(self.mean.shape)
        self.var = np.asarray(state["var"], dtype=np.float64).reshape(self.var.shape)
        self.count = float(state["count"])


class Normalizer:
    """What the policy sees and what the learner learns from, for one run (see the module docstring)."""

    def __init__(self, obs_shape: tuple[int, ...], norm_obs: bool, norm_reward: bool, clip_obs: float = 10.0,
                 clip_reward: float = 10.0, gamma: float = 0.99):
        self.norm_obs, self.norm_reward = norm_obs, norm_reward
        self.clip_obs, self.clip_reward, self.gamma = clip_obs, clip_reward, gamma
        self.obs = RunningMeanStd(obs_shape)
        self.ret = RunningMeanStd(())

    @property
    def active(self) -> bool:
        return self.norm_obs or self.norm_reward

    def observations(self, obs: np.ndarray) -> np.ndarray:
        """Observations as the policy sees them (raw when observation normalization is off)."""
        if not self.norm_obs:
            return obs
        normalized = (obs - self.obs.mean) / np.sqrt(self.obs.var + EPSILON)
        return np.clip(normalized, -self.clip_obs, self.clip_obs).astype(np.float32)

    def observations_now(self) -> Callable[[np.ndarray], np.ndarray]:
        """:meth:`observations` with the statistics as they are now, for a rollout, during which they hold
        still: the same numbers with half the numpy calls (the scale is computed once, the rest in place)."""
        if not self.norm_obs:
            return lambda obs: obs
        mean, scale, clip = self.obs.mean, np.sqrt(self.obs.var + EPSILON), self.clip_obs

        def normalized(obs: np.ndarray) -> np.ndarray:
            out = np.subtract(obs, mean)
            np.divide(out, scale, out=out)
            return np.minimum(np.maximum(out, -clip, out=out), clip, out=out).astype(np.float32)  # np.clip, sooner

        return normalized

    def rewards(self, rewards: np.ndarray) -> np.ndarray:
        """Rewards as the learner learns from them: divided by the discounted return's standard deviation."""
        if not self.norm_reward:
            return rewards
        scaled = rewards / np.sqrt(self.ret.var + EPSILON)
        return np.clip(scaled, -self.clip_reward, self.clip_reward).astype(np.float32)

    def update(self, raw_obs: np.ndarray, discounted_returns: np.ndarray,
               total: Callable[[np.ndarray], np.ndarray] = lambda x: x) -> None:
        """Take a collected rollout into the statistics (after the learner has used it)."""
        if self.norm_obs:
            self.obs.update(raw_obs.reshape(-1, *self.obs.mean.shape), total)
        if self.norm_reward:
            self.ret.update(discounted_returns.ravel(), total)

    # -- publishing to workers: a flat float64 array [obs mean, obs var, return var]
    def size(self) -> int:
        return 2 * self.obs.mean.size + 1

    def publish(self, out: np.ndarray) -> None:
        n = self.obs.mean.size
        out[:n], out[n:2 * n], out[2 * n] = self.obs.mean.ravel(), self.obs.var.ravel(), self.ret.var

    def read(self, published: np.ndarray) -> None:
        n = self.obs.mean.size
        self.obs.mean = published[:n].reshape(self.obs.mean.shape).copy()
        self.obs.var = published[n:2 * n].reshape(self.obs.var.shape).copy()
        self.ret.var = np.float64(published[2 * n])

    def digest(self) -> str:
        """A short hash of the statistics as published: equal in two processes iff they use the same."""
        import hashlib

        published = np.zeros(self.size(), dtype=np.float64)
        self.publish(published)
        return hashlib.sha1(published.tobytes()).hexdigest()[:16]

    # -- checkpoints
    def state_dict(self) -> dict:
        """``obs_norm`` (what common.policy applies to raw observations) and ``reward_norm``."""
        out = {}
        if self.norm_obs:
            out["obs_norm"] = {**self.obs.state(), "clip": self.clip_obs}
        if self.norm_reward:
            out["reward_norm"] = {**self.ret.state(), "clip": self.clip_reward}
        return out

    def load_state_dict(self, state: dict) -> None:
        if self.norm_obs and "obs_norm" in state:
            self.obs.load(state["obs_norm"])
        if self.norm_reward and "reward_norm" in state:
            self.ret.load(state["reward_norm"])
