"""The PPO rollout, without torch: its arrays, the acting of an MLP policy in numpy, the collector.

A rollout lives in a dict of ``[n_steps, envs, ...]`` arrays (:func:`rollout_layout`): shared
memory that several workers fill column by column in ``train_parallel_timed.py``, a worker's
private arrays in ``train_ppo_multiprocess.py``. A :class:`RolloutCollector` fills it with an
*acting* object (``act``, ``value``, ``refresh``): :class:`NumpyActing` for MLP policies, or
``common.ppo.TorchActing`` for the rest (images); ``common.ppo`` turns a filled rollout into a batch
and learns from it.

Nothing here imports torch, so a rollout worker of an MLP policy never does: it starts in a
fraction of the time (torch's import is most of a worker's start-up) and its memory holds no torch.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import gymnasium as gym
import numpy as np

from common.normalize import Normalizer
from common.replay import describe_observations, is_image
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


# --------------------------------------------------------------------------- the policy's description

def space_spec(space: gym.Space) -> dict:
    """A Discrete or Box space as plain values (what a checkpoint can hold under weights_only)."""
    if isinstance(space, gym.spaces.Discrete):
        return {"type": "Discrete", "n": int(space.n)}
    low, high = np.asarray(space.low), np.asarray(space.high)
    uniform = low.size and (low == low.flat[0]).all() and (high == high.flat[0]).all()
    return {"type": "Box", "shape": list(space.shape), "dtype": str(space.dtype),
            "low": float(low.flat[0]) if uniform else low.tolist(),
            "high": float(high.flat[0]) if uniform else high.tolist()}


def space_from_spec(spec: dict) -> gym.Space:
    if spec["type"] == "Discrete":
        return gym.spaces.Discrete(spec["n"])
    dtype = np.dtype(spec["dtype"])
    low = np.broadcast_to(np.asarray(spec["low"], dtype=np.float64), spec["shape"]).astype(dtype)
    high = np.broadcast_to(np.asarray(spec["high"], dtype=np.float64), spec["shape"]).astype(dtype)
    return gym.spaces.Box(low, high, dtype=dtype)


def actor_critic_spec(observation_space, action_space, hidden, activation: str, log_std_init: float) -> dict:
    """What a checkpoint stores under ``policy`` to build ``common.networks.ActorCritic`` again."""
    return {"class": "ActorCritic", "observation_space": space_spec(observation_space),
            "action_space": space_spec(action_space), "hidden_sizes": list(hidden), "activation": activation,
            "log_std_init": log_std_init}


# --------------------------------------------------------------------------- acting in numpy

def acts_in_numpy(observation_space) -> bool:
    """Whether ``common.networks.ActorCritic`` is a pair of MLPs for this observation (anything but a
    picture, which gets a CNN), so that numpy can act for it."""
    return not is_image(observation_space)


def numpy_learner_fits(device: str, observation_space) -> bool:
    """Whether common/numpy_ppo.py can learn this policy on ``device``: an MLP (vector observations) on the CPU."""
    return device == "cpu" and acts_in_numpy(observation_space)


def actor_critic_shapes(observation_space, action_space, hidden) -> list[tuple[int, ...]]:
    """The shapes of ``ActorCritic``'s parameters for a vector observation, in ``parameters()`` order
    (the order of a flat parameter vector): the log-std of Box actions (a parameter of the module itself
    comes before those of its children), then the critic's layers and the actor's, each a weight
    ``(out, in)`` and a bias ``(out,)``."""
    discrete = hasattr(action_space, "n")
    in_dim = int(np.prod(observation_space.shape))
    out_dim = int(action_space.n) if discrete else int(np.prod(action_space.shape))
    shapes: list[tuple[int, ...]] = []
    for head_out in (1, out_dim):
        width = in_dim
        for layer_out in (*hidden, head_out):
            shapes += [(layer_out, width), (layer_out,)]
            width = layer_out
    return shapes if discrete else [(1, out_dim), *shapes]


def parameter_count(shapes) -> int:
    """How many numbers a flat parameter vector of tensors of these ``shapes`` holds."""
    return sum(int(np.prod(shape)) for shape in shapes)


def split_flat(flat: np.ndarray, shapes) -> list[np.ndarray]:
    """Views into a flat parameter vector, one of each of ``shapes``, in order."""
    views, offset = [], 0
    for shape in shapes:
        count = int(np.prod(shape))
        views.append(flat[offset:offset + count].reshape(shape))
        offset += count
    return views


class NumpyActing:
    """The rollout step of an MLP actor-critic in numpy, from a flat copy of its parameters.

    A rollout step runs the network on a handful of observations, where torch's per-call
    overhead dominates: numpy's matmuls took a quarter of the time (16 CartPole envs: 122 vs
    511 us per step, measured). Actions are sampled from the same distributions as
    ``ActorCritic.act`` (categorical by the Gumbel-max trick, or the diagonal Gaussian), with
    this collector's own generator; the learner recomputes log-probabilities (common.ppo, common.numpy_ppo).
    ``params`` returns the current flat parameter vector (``networks.write_flat_params``'s
    layout: shared memory a learner publishes to, or a copy of a local network's).
    """

    def __init__(self, observation_space, action_space, hidden, activation: str,
                 params: Callable[[], np.ndarray], seed: int):
        self.shapes = actor_critic_shapes(observation_space, action_space, tuple(hidden))
        self.size = parameter_count(self.shapes)
        self.discrete = hasattr(action_space, "n")
        self.heads = len(tuple(hidden)) + 1  # layers per head
        self.activation = np.tanh if activation == "tanh" else (lambda x: np.maximum(x, 0.0))
        self.params, self.rng = params, np.random.default_rng(seed)
        self.refresh()

    def refresh(self) -> None:
        """Copy the current parameters (call before every rollout): never alias them, they change under us."""
        flat = np.asarray(self.params(), dtype=np.float32)
        if flat.size != self.size:
            raise ValueError(f"{flat.size} parameters where the MLP policy has {self.size}")
        tensors = split_flat(flat, self.shapes)
        self.log_std = None if self.discrete else tensors.pop(0)[0].copy()
        # what is left: the weight and bias of every layer, the critic's, then the actor's
        layers = [(weight.T.copy(), bias.copy()) for weight, bias in zip(tensors[0::2], tensors[1::2])]
        self.critic, self.actor = layers[:self.heads], layers[self.heads:]

    def _mlp(self, x: np.ndarray, layers) -> np.ndarray:
        for weight, bias in layers[:-1]:
            x = self.activation(x @ weight + bias)
        weight, bias = layers[-1]
        return x @ weight + bias

    def value(self, obs: np.ndarray) -> np.ndarray:
        return self._mlp(_flat(obs), self.critic)[:, 0]

    def act(self, obs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        x = _flat(obs)
        out, value = self._mlp(x, self.actor), self._mlp(x, self.critic)[:, 0]
        if self.log_std is None:
            shifted = out - out.max(axis=1, keepdims=True)
            log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
            action = (log_probs + self.rng.gumbel(size=log_probs.shape)).argmax(axis=1)
            return action, log_probs[np.arange(len(action)), action].astype(np.float32), value
        noise = self.rng.standard_normal(out.shape).astype(np.float32)
        action = out + noise * np.exp(self.log_std)
        logprob = (-0.5 * noise ** 2 - self.log_std - 0.5 * np.log(2 * np.pi)).sum(axis=1)
        return action.astype(np.float32), logprob.astype(np.float32), value


class PublishedParams:
    """The newest flat parameters a learner published under a :class:`common.shm.Seqlock`, as the
    ``params`` source of :class:`NumpyActing` or ``common.ppo.TorchActing``.

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


def _flat(obs: np.ndarray) -> np.ndarray:
    return obs.reshape(len(obs), -1).astype(np.float32, copy=False)


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
        buf, cols, acting, seen, published = self.buf, self.cols, self.acting, self.normalizer.observations, \
            self.published
        acting.refresh()
        self.steps_by_version = Counter()
        episodes = []
        for step in range(n_steps):
            if published is not None:
                if published.newer():
                    acting.refresh()
                self.steps_by_version[published.version] += self.envs.num_envs
            action, logprob, value = acting.act(seen(self.next_obs))
            buf["obs"][step, cols] = self.next_obs
            buf["actions"][step, cols] = action
            buf["logprobs"][step, cols] = logprob
            buf["values"][step, cols] = value
            result = self.envs.step(action if self.low is None else np.clip(action, self.low, self.high))
            self.record(step, result)
            episodes.extend(result.episodes)
        buf["next_values"][cols] = acting.value(seen(self.next_obs))
        return episodes

    def record(self, step: int, result) -> None:
        buf, cols = self.buf, self.cols
        buf["rewards"][step, cols] = result.rewards
        buf["terminations"][step, cols] = result.terminations
        buf["truncations"][step, cols] = result.truncations
        self.returns = self.returns * self.normalizer.gamma + result.rewards
        buf["disc_returns"][step, cols] = self.returns
        done = result.terminations | result.truncations
        self.returns[done] = 0.0
        if result.truncations.any():
            # A time limit is not the end of the task: bootstrap from the final observation.
            final_values = self.acting.value(self.normalizer.observations(result.final_obs))
            buf["final_values"][step, cols] = np.where(result.truncations, final_values, 0.0)
        self.next_obs = result.obs


# --------------------------------------------------------------------------- from a rollout to a batch

@dataclass
class PPOSettings:
    """The hyperparameters of a PPO update, for either learner (common.ppo, common.numpy_ppo)."""

    n_epochs: int
    minibatch_size: int
    clip_coef: float
    clip_vloss: bool
    ent_coef: float
    vf_coef: float
    max_grad_norm: float
    norm_adv: bool = True
    target_kl: float | None = None
    # Decoupled PPO (Hilton et al., 2021), for rollouts collected by a policy older than the learner's
    # (train_parallel_timed.py --async-training): the ratio is clipped around the policy as the update starts
    # (the proximal policy, whose log-probabilities the learner computes first), and each sample's advantage is
    # weighted by proximal / behaviour probability, capped at PROXIMAL_WEIGHT_CAP. The trust region is then
    # centred where the learner is, not one update back, while the gradient stays that of the proximal policy.
    decoupled: bool = False


PROXIMAL_WEIGHT_CAP = 2.0  # bounds a sample whose action the behaviour policy found unlikely (V-trace's rho-bar idea)


def flat_batch(buf: dict[str, np.ndarray], gamma: float, gae_lambda: float,
               normalizer: Normalizer) -> dict[str, np.ndarray]:
    """GAE over a filled rollout, then ``[T, N]`` flattened into one batch of samples.

    Observations are normalized and rewards scaled with the statistics the rollout was collected with.
    ``logprobs`` and ``values`` stay those the rollout stored, the behaviour policy's: the PPO ratio is
    taken against them however far the learner has moved on since (a lagged rollout's is not 1 at first).
    """
    rewards = normalizer.rewards(buf["rewards"])
    advantages, returns = compute_gae(rewards, buf["values"], buf["terminations"], buf["truncations"],
                                      buf["final_values"], buf["next_values"], gamma, gae_lambda)
    samples = rewards.size

    def flat(array: np.ndarray) -> np.ndarray:
        return array.reshape(samples, *array.shape[2:])

    return {"obs": flat(normalizer.observations(buf["obs"])), "actions": flat(buf["actions"]),
            "logprobs": flat(buf["logprobs"]), "values": flat(buf["values"]), "advantages": flat(advantages),
            "returns": flat(returns)}


def compute_gae(rewards: np.ndarray, values: np.ndarray, terminations: np.ndarray,
                truncations: np.ndarray, final_values: np.ndarray, next_values: np.ndarray,
                gamma: float, gae_lambda: float) -> tuple[np.ndarray, np.ndarray]:
    """Generalized advantage estimates and returns for a ``[T, N]`` rollout.

    ``values[t]`` is V(s_t); ``next_values`` is V of the observation after the last
    step. Episodes end with same-step autoreset, so at a done step ``t`` the successor
    state is the episode's final observation, whose value is ``final_values[t]``. A
    termination contributes no bootstrap; a truncation (time limit) bootstraps from
    ``final_values[t]``, because the episode could have gone on.
    """
    terminations = np.asarray(terminations, dtype=np.float32)
    truncations = np.asarray(truncations, dtype=np.float32)
    steps = rewards.shape[0]
    advantages = np.zeros_like(rewards, dtype=np.float32)
    last_gae = np.zeros(rewards.shape[1:], dtype=np.float32)
    for t in reversed(range(steps)):
        following = next_values if t == steps - 1 else values[t + 1]
        successor_value = np.where(truncations[t] > 0, final_values[t], following)
        successor_value = successor_value * (1.0 - terminations[t])
        delta = rewards[t] + gamma * successor_value - values[t]
        episode_continues = (1.0 - terminations[t]) * (1.0 - truncations[t])
        last_gae = delta + gamma * gae_lambda * episode_continues * last_gae
        advantages[t] = last_gae
    return advantages, advantages + values
