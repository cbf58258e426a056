"""The PPO rollout, without torch: its arrays, and the collector that fills them.

A rollout lives in a dict of ``[n_steps, envs, ...]`` arrays (:func:`rollout_layout`): shared
memory that several workers fill column by column in ``train_parallel_timed.py``, a worker's
private arrays in ``train_ppo_multiprocess.py``. A :class:`RolloutCollector` fills it with an
*acting* object (``act``, ``value``, ``refresh``): ``common.numpy_actor_critic.NumpyActing`` for MLP
policies, or ``common.ppo.TorchActing`` for the rest (images); ``common.gae.flat_batch`` turns a filled
rollout into a batch, and a ``common.ppo_learner`` learner learns from it.

Nothing here imports torch, so a rollout worker of an MLP policy never does: it starts in a
fraction of the time (torch's import is most of a worker's start-up) and its memory holds no torch.
"""

from __future__ import annotations

import time
from collections import Counter

import numpy as np

from common.normalize import Normalizer
from common.replay import describe_observations
from common.shm import Seqlock


def rollout_layout(n_steps: int, num_envs: int, observation_space, action_space) -> dict[str, tuple]:
    """``{name: (shape, dtype)}`` of the arrays a :class:`RolloutCollector` fills for ``num_envs`` envs.

    Observations are stored as the env gives them (uint8 frames stay uint8: a quarter of float32).
    """
    continuous = not hasattr(action_space, "n")
    obs_dtype = np.uint8 if observation_space.dtype == np.uint8 else np.float32
    layout = {"obs": ((n_steps, num_envs, *observation_space.shape), obs_dtype),
              "actions": ((n_steps, num_envs, *action_space.shape), np.float32 if continuous else np.int64)}
    for key in ("logprobs", "values", "rewards", "final_values", "terminations", "truncations", "disc_returns"):
        layout[key] = ((n_steps, num_envs), np.float32)
    layout["next_values"] = ((num_envs,), np.float32)
    return layout


def describe_rollout(buf: dict[str, np.ndarray], observation_space) -> str:
    """How a rollout holds its observations (``rollout: 128 x 8 x (4, 84, 84) uint8 observations, 28.9 MB``)."""
    return describe_observations("rollout", [buf["obs"]], observation_space.shape)


def make_normalizer(cfg, observation_space, action_space, gamma: float | None = None) -> Normalizer:
    """The run's normalizer from ``norm_obs``/``norm_reward`` (None = on for Box actions, off for Discrete)."""
    continuous = not hasattr(action_space, "n")
    norm_obs = continuous if cfg.norm_obs is None else cfg.norm_obs
    norm_reward = continuous if cfg.norm_reward is None else cfg.norm_reward
    return Normalizer(observation_space.shape, norm_obs, norm_reward, cfg.clip_obs, cfg.clip_reward,
                      cfg.gamma if gamma is None else gamma)


def action_bounds(space):
    """Box actions are clipped to the bounds when stepping the env (the log-prob is of the raw sample)."""
    return (space.low, space.high) if hasattr(space, "low") else (None, None)


class PublishedParams:
    """The newest flat parameters a learner published under a :class:`common.shm.Seqlock`, as the
    ``params`` source of ``common.numpy_actor_critic.NumpyActing`` or ``common.ppo.TorchActing``.

    Calling it copies them and returns the copy; ``version`` is that copy's version, and ``newer()``
    says whether the learner has published since (one read of shared memory: cheap enough for every step).
    """

    def __init__(self, lock: Seqlock, slot: int = 0, attempts: int = 2000):
        self.lock, self.slot, self.attempts = lock, slot, attempts
        self.copy = np.empty(lock.rows.shape[1], dtype=lock.rows.dtype)
        self.version = 0

    def __call__(self) -> np.ndarray:
        for _ in range(self.attempts):  # a write holds the row for microseconds
            version = self.lock.read(self.copy, self.slot)
            if version is not None:
                self.version = version
                return self.copy
            time.sleep(0.0005)
        raise RuntimeError(f"no consistent copy of the published parameters in {self.attempts} attempts "
                           f"(version {self.lock.version(self.slot)}): was the learner killed while writing them?")

    def newer(self) -> bool:
        return self.lock.version(self.slot) != self.version


# --------------------------------------------------------------------------- the collector

class RolloutCollector:
    """Steps ``envs`` with ``acting`` (on the CPU), filling columns ``cols`` of a rollout ``buf``.

    It keeps what outlives one rollout: the observation to continue from and each env's
    discounted return so far (reward scaling learns its variance). The policy acts on
    observations normalized by ``normalizer``; the rollout stores them raw (common/normalize.py).
    ``buf`` may be another rollout of the same layout from one rollout to the next
    (train_parallel_timed.py alternates two when it collects while it learns).

    With ``published`` (the :class:`PublishedParams` that ``acting`` reads), the collector takes
    up parameters the learner publishes during a rollout at the next step, and counts the steps
    acted with each version in ``steps_by_version``. Every step stores the log-probability and
    value of the policy that acted, so the learner's ratio stays exact whichever version that was.
    """

    def __init__(self, acting, envs, buf: dict[str, np.ndarray], cols: slice, normalizer: Normalizer,
                 published: PublishedParams | None = None):
        self.acting, self.envs, self.buf, self.cols, self.normalizer = acting, envs, buf, cols, normalizer
        self.published = published
        self.low, self.high = action_bounds(envs.single_action_space)
        self.next_obs = envs.reset()
        self.returns = np.zeros(envs.num_envs, dtype=np.float64)
        self.steps_by_version: Counter[int] = Counter()

    def collect(self, n_steps: int) -> list[dict]:
        """One rollout of ``n_steps`` steps per env with the policy's current parameters; the episodes that finished."""
        acting, published, num_envs = self.acting, self.published, self.envs.num_envs
        # The statistics hold still for a rollout (the learner publishes new ones between rollouts), and so
        # do this collector's columns of the rollout: both are looked up once, not at every step.
        self.seen = seen = self.normalizer.observations_now()
        self.columns = columns = {key: array[:, self.cols] for key, array in self.buf.items() if key != "next_values"}
        obs, actions, logprobs, values = columns["obs"], columns["actions"], columns["logprobs"], columns["values"]
        acting.refresh()
        self.steps_by_version = Counter()
        acted_since = 0  # the first step acted with the parameters of published.version (counted when they change)
        episodes = []
        for step in range(n_steps):
            if published is not None and published.newer():
                if step > acted_since:
                    self.steps_by_version[published.version] += (step - acted_since) * num_envs
                acting.refresh()
                acted_since = step
            action, logprob, value = acting.act(seen(self.next_obs))
            obs[step] = self.next_obs
            actions[step] = action
            logprobs[step] = logprob
            values[step] = value
            result = self.envs.step(action if self.low is None else np.clip(action, self.low, self.high))
            self.record(step, result)
            if result.episodes:
                episodes.extend(result.episodes)
        if published is not None and n_steps > acted_since:
            self.steps_by_version[published.version] += (n_steps - acted_since) * num_envs
        self.buf["next_values"][self.cols] = acting.value(seen(self.next_obs))
        return episodes

    def record(self, step: int, result) -> None:
        columns, returns = self.columns, self.returns
        columns["rewards"][step] = result.rewards
        columns["terminations"][step] = result.terminations
        columns["truncations"][step] = result.truncations
        np.multiply(returns, self.normalizer.gamma, out=returns)
        returns += result.rewards
        columns["disc_returns"][step] = returns
        if result.episodes:  # an episode ended (the mask alone costs a microsecond at every step)
            returns[result.terminations | result.truncations] = 0.0
        if np.count_nonzero(result.truncations):  # .any() costs microseconds more, at every step
            # A time limit is not the end of the task: bootstrap from the final observation.
            final_values = self.acting.value(self.seen(result.final_obs))
            columns["final_values"][step] = np.where(result.truncations, final_values, 0.0)
        self.next_obs = result.obs
