"""A preallocated numpy replay buffer living in one process.

Layout (one row per transition, a ring over ``capacity`` rows): ``obs``, ``next_obs``,
``actions``, ``rewards``, ``dones`` (terminal, i.e. no bootstrap; a time-limit
truncation is not terminal), ``discounts`` (the factor of the bootstrapped value:
gamma, or gamma**k for a k-step return) and, for environments with legal-action masks,
``next_masks`` so that the target's max runs over legal next actions only. Whole
episodes are added in one call (``add_episode``) from a compact form: T+1
observations and T actions/rewards; as the whole episode is at hand, n-step returns
cost nothing extra there. Memory is checked before allocation: a buffer
that does not fit in the available RAM is refused with a one-line reason.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from common.system import ram_shortfall


class ReplayMemoryError(MemoryError):
    """The buffer would not fit in RAM; the message says how much it needs and what is free."""


@dataclass
class ReplaySample:
    obs: np.ndarray
    actions: np.ndarray
    rewards: np.ndarray
    next_obs: np.ndarray
    dones: np.ndarray
    discounts: np.ndarray
    next_masks: np.ndarray | None
    indices: np.ndarray


def replay_bytes(capacity: int, obs_shape: tuple[int, ...], obs_dtype, num_actions: int | None) -> int:
    """Bytes a :class:`ReplayBuffer` of ``capacity`` transitions allocates."""
    obs_bytes = int(np.prod(obs_shape)) * np.dtype(obs_dtype).itemsize
    per_row = 2 * obs_bytes + 8 + 4 + 1 + 4 + (num_actions or 0)
    return capacity * per_row


def check_replay_memory(capacity: int, obs_shape: tuple[int, ...], obs_dtype, num_actions: int | None) -> int:
    """Raise ReplayMemoryError if the buffer would not fit in the RAM available now; returns its size."""
    needed = replay_bytes(capacity, obs_shape, obs_dtype, num_actions)
    shortfall = ram_shortfall(needed, f"a replay buffer of {capacity} transitions")
    if shortfall:
        raise ReplayMemoryError(shortfall)
    return needed


class ReplayBuffer:
    """Uniform-sampling ring buffer of transitions, preallocated after a RAM check.

    ``num_actions`` enables next-state action masks (pass None for unmasked envs).
    """

    def __init__(self, capacity: int, obs_shape: tuple[int, ...], obs_dtype=np.float32,
                 num_actions: int | None = None, seed: int | None = None):
        check_replay_memory(capacity, obs_shape, obs_dtype, num_actions)
        self.capacity = capacity
        self.obs = np.zeros((capacity, *obs_shape), dtype=obs_dtype)
        self.next_obs = np.zeros((capacity, *obs_shape), dtype=obs_dtype)
        self.actions = np.zeros(capacity, dtype=np.int64)
        self.rewards = np.zeros(capacity, dtype=np.float32)
        self.dones = np.zeros(capacity, dtype=bool)
        self.discounts = np.zeros(capacity, dtype=np.float32)
        self.next_masks = np.ones((capacity, num_actions), dtype=bool) if num_actions else None
        self.pos = 0  # next row to write
        self.size = 0
        self.added = 0  # transitions ever added (for logging)
        self.rng = np.random.default_rng(seed)

    def __len__(self) -> int:
        return self.size

    def add_batch(self, obs: np.ndarray, actions: np.ndarray, rewards: np.ndarray, next_obs: np.ndarray,
                  dones: np.ndarray, next_masks: np.ndarray | None = None,
                  discounts: np.ndarray | float = 0.99) -> None:
        """Append ``n`` transitions (wrapping around, overwriting the oldest when full)."""
        n = len(actions)
        if n == 0:
            return
        discounts = np.broadcast_to(np.asarray(discounts, dtype=np.float32), (n,))
        if n > self.capacity:  # only the newest capacity rows can survive anyway
            cut = n - self.capacity
            obs, actions, rewards = obs[cut:], actions[cut:], rewards[cut:]
            next_obs, dones, discounts = next_obs[cut:], dones[cut:], discounts[cut:]
            next_masks = next_masks[cut:] if next_masks is not None else None
            n = self.capacity
        rows = (self.pos + np.arange(n)) % self.capacity
        self.obs[rows] = obs
        self.next_obs[rows] = next_obs
        self.actions[rows] = actions
        self.rewards[rows] = rewards
        self.dones[rows] = dones
        self.discounts[rows] = discounts
        if self.next_masks is not None:
            self.next_masks[rows] = True if next_masks is None else next_masks
        self.pos = int((self.pos + n) % self.capacity)
        self.size = min(self.capacity, self.size + n)
        self.added += n

    def add_episode(self, obs: np.ndarray, actions: np.ndarray, rewards: np.ndarray, terminated: bool,
                    masks: np.ndarray | None = None, gamma: float = 0.99, n_step: int = 1) -> None:
        """Add one episode given T+1 observations (the last is the final one), T actions and rewards.

        ``terminated`` is False for an episode cut by a time limit: its last transitions
        then bootstrap. ``masks`` are the T+1 legal-action masks of the observations.
        With ``n_step`` > 1 the row of step t holds the discounted sum of rewards t..t+n-1
        (fewer at the episode's end), the observation n steps later and gamma**k.
        """
        steps = len(actions)
        t = np.arange(steps)
        ahead = np.minimum(t + n_step, steps)  # index of the bootstrap observation
        k = ahead - t
        rewards = np.asarray(rewards, dtype=np.float64)
        if n_step > 1:
            padded = np.concatenate([rewards, np.zeros(n_step)])
            returns = sum(gamma**i * padded[t + i] * (i < k) for i in range(n_step))
        else:
            returns = rewards
        dones = (ahead == steps) & bool(terminated)
        next_masks = masks[ahead] if masks is not None else None
        self.add_batch(obs[:-1], actions, returns.astype(np.float32), obs[ahead], dones, next_masks,
                       (gamma**k).astype(np.float32))

    def sample(self, batch_size: int) -> ReplaySample:
        indices = self.rng.integers(0, self.size, size=batch_size)
        return ReplaySample(self.obs[indices], self.actions[indices], self.rewards[indices],
                            self.next_obs[indices], self.dones[indices], self.discounts[indices],
                            self.next_masks[indices] if self.next_masks is not None else None, indices)
