"""Replay pieces both DQN scripts share: the sample, n-step returns, the memory plan, a local buffer.

:class:`ReplaySample` is what every replay buffer hands the learner (this module's
:class:`LocalReplay`, living in one process, and :class:`common.replay_shm.SharedReplay`,
written by many actors). :func:`nstep_returns` is the one n-step computation, used on whole
episodes here (:func:`episode_transitions`) and on the actors' rolling windows
(:class:`NStepAccumulator`). :func:`fit_buffer_size` decides a buffer's capacity against the
RAM (and ``/dev/shm``) at hand before anything is allocated, from the bytes per transition
the buffer allocates (:func:`replay_bytes` here, ``ReplayLayout.nbytes`` for the shared one).

The local buffer's layout (one row per transition, a ring over ``capacity`` rows): ``obs``,
``next_obs``, ``actions``, ``rewards``, ``dones`` (terminal, i.e. no bootstrap; a time-limit
truncation is not terminal), ``discounts`` (the factor of the bootstrapped value: gamma, or
gamma**k for a k-step return) and, for environments with legal-action masks, ``next_masks``
so that the target's max runs over legal next actions only. Whole episodes are added in one
call (``add_episode``) from a compact form: T+1 observations and T actions/rewards.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from common.config import ConfigError
from common.system import format_bytes, ram_shortfall, shm_shortfall


class ReplayMemoryError(MemoryError):
    """The buffer would not fit in RAM; the message says how much it needs and what is free."""


@dataclass
class ReplaySample:
    """A batch of transitions and where they came from (the one sample type of every buffer)."""

    obs: np.ndarray
    actions: np.ndarray
    rewards: np.ndarray
    next_obs: np.ndarray
    dones: np.ndarray
    discounts: np.ndarray
    indices: np.ndarray
    next_masks: np.ndarray | None = None  # legal next actions (envs with action masks)
    weights: np.ndarray | None = None  # importance-sampling weights (prioritized replay)
    seq: np.ndarray | None = None  # the slots' sequence numbers when drawn (shared-memory buffer)
    rejected: int = 0  # draws thrown away because their slot was being written


def nstep_returns(rewards: np.ndarray, gamma: float, n: int) -> tuple[np.ndarray, np.ndarray]:
    """n-step returns of a segment of rewards that ends with its last row (an episode's end).

    ``rewards`` is ``[T]`` or ``[T, envs]``. Row t of the result is
    ``sum_{i<k} gamma**i * rewards[t + i]`` with ``k = min(n, T - t)`` rewards, fewer at the end;
    the second array is that ``k`` per row (the bootstrap value is discounted by ``gamma**k``).
    """
    rewards = np.asarray(rewards, dtype=np.float64)
    steps = len(rewards)
    k = np.minimum(n, steps - np.arange(steps))
    padded = np.concatenate([rewards, np.zeros((n, *rewards.shape[1:]))])
    returns = np.zeros_like(rewards)
    for i in range(n):
        returns += gamma**i * padded[i:i + steps]
    return returns, k


def episode_transitions(obs: np.ndarray, actions: np.ndarray, rewards: np.ndarray, terminated: bool,
                        masks: np.ndarray | None = None, gamma: float = 0.99, n_step: int = 1) -> dict:
    """One whole episode (T+1 observations, the last the final one; T actions and rewards; T+1 legal-action
    masks or None) as the T rows a buffer stores, keyed as :meth:`LocalReplay.add_batch` takes them: row t
    holds the n-step return from step t (fewer rewards at the end), the observation it bootstraps from and
    its mask, ``gamma**k`` for the ``k`` rewards summed, and ``dones`` where the episode terminated within
    them (a time-limit cut is not terminal, so its last rows bootstrap)."""
    returns, k = nstep_returns(rewards, gamma, n_step)
    ahead = np.arange(len(actions)) + k  # index of the bootstrap observation
    return {"obs": obs[:-1], "actions": np.asarray(actions), "rewards": returns.astype(np.float32),
            "next_obs": obs[ahead], "dones": (ahead == len(actions)) & bool(terminated),
            "next_masks": masks[ahead] if masks is not None else None, "discounts": (gamma**k).astype(np.float32)}


class NStepAccumulator:
    """Turns per-step transitions of ``num_envs`` environments into n-step transitions.

    A transition leaves once it has ``n`` rewards, or when its episode ends (then with
    fewer rewards and the final observation); ``discounts`` holds gamma ** rewards used.
    """

    def __init__(self, n: int, gamma: float, num_envs: int, obs_shape: tuple[int, ...], obs_dtype):
        self.n, self.gamma = n, gamma
        self.obs = np.zeros((n, num_envs, *obs_shape), dtype=obs_dtype)
        self.actions = np.zeros((n, num_envs), dtype=np.int64)
        self.rewards = np.zeros((n, num_envs), dtype=np.float32)
        self.count = np.zeros(num_envs, dtype=np.int64)  # steps stored since the episode began
        self.pos = 0

    def push(self, obs, actions, rewards, final_obs, terminations, truncations) -> dict[str, np.ndarray] | None:
        n, pos = self.n, self.pos
        self.obs[pos], self.actions[pos], self.rewards[pos] = obs, actions, rewards
        self.pos = (pos + 1) % n
        self.count += 1
        order = (pos + 1 + np.arange(n)) % n  # oldest first
        done = terminations | truncations
        out: list[dict[str, np.ndarray]] = []
        full = np.flatnonzero((self.count >= n) & ~done)
        if len(full):
            returns = nstep_returns(self.rewards[order][:, full], self.gamma, n)[0][0]
            out.append({"obs": self.obs[order[0], full], "actions": self.actions[order[0], full], "rewards": returns,
                        "next_obs": final_obs[full], "dones": np.zeros(len(full)),
                        "discounts": np.full(len(full), self.gamma ** n)})
        for env in np.flatnonzero(done):  # flush every pending transition of a finished episode
            steps = order[n - min(int(self.count[env]), n):]
            returns, counts = nstep_returns(self.rewards[steps, env], self.gamma, n)
            out.append({"obs": self.obs[steps, env], "actions": self.actions[steps, env], "rewards": returns,
                        "next_obs": np.repeat(final_obs[env][None], len(steps), axis=0),
                        "dones": np.full(len(steps), float(terminations[env])), "discounts": self.gamma ** counts})
            self.count[env] = 0
        if not out:
            return None
        batch = {key: np.concatenate([part[key] for part in out]) for key in out[0]}
        for key in ("rewards", "dones", "discounts"):
            batch[key] = batch[key].astype(np.float32)
        return batch


# ---------------------------------------------------------------------------- memory plan

def fit_buffer_size(requested: int | None, default: int, bytes_per_transition: int, shared: bool = False,
                    minimum: int = 1) -> tuple[int, str | None]:
    """The capacity to allocate, checked against the RAM available now (and ``/dev/shm`` if ``shared``).

    A size the user set (``requested``) that does not fit is refused (ConfigError: one line,
    exit 2). Left unset, the capacity is ``default``, or as much as fits; the second value is
    then a note to log. ``minimum`` is the least capacity the run can work with.
    """
    def shortfall(capacity: int) -> str | None:
        nbytes = capacity * bytes_per_transition
        what = f"a replay buffer of {capacity} transitions"
        return ram_shortfall(nbytes, what) or (shm_shortfall(nbytes, what) if shared else None)

    if requested is not None:
        problem = shortfall(requested)
        if problem:
            raise ConfigError("buffer_size", requested, f"{problem}; lower it (or leave it unset to fit)")
        return requested, None
    capacity = default
    while capacity > minimum and shortfall(capacity):
        capacity = max(minimum, capacity // 2)
    problem = shortfall(capacity)
    if problem:
        raise ConfigError("buffer_size", capacity, f"{problem}; the run needs at least this much")
    if capacity == default:
        return capacity, None
    return capacity, (f"replay buffer: {capacity} transitions ({format_bytes(capacity * bytes_per_transition)}), "
                      f"the most of the default {default} that fits this machine's "
                      f"{'RAM and /dev/shm' if shared else 'RAM'}")


def is_image(space) -> bool:
    """An observation that is a picture (frames, channels first): uint8 of rank 3."""
    return hasattr(space, "shape") and len(space.shape) == 3 and space.dtype == np.uint8


def storage_dtype(observation_space) -> np.dtype:
    """How a buffer stores observations: frames as the uint8 they are (4x less memory), the rest as float32."""
    return np.dtype(np.uint8) if observation_space.dtype == np.uint8 else np.dtype(np.float32)


def describe_observations(what: str, arrays: list[np.ndarray], obs_shape: tuple[int, ...]) -> str:
    """One log line on how a buffer really holds its observations, read from the arrays themselves:
    ``replay: 20000 x (4, 84, 84) uint8 observations x 2 (obs, next_obs), 1129.0 MB`` (bytes of these arrays)."""
    first = arrays[0]
    rows = " x ".join(str(n) for n in first.shape[:first.ndim - len(obs_shape)])
    copies = f" x {len(arrays)} (obs, next_obs)" if len(arrays) == 2 else ""
    nbytes = sum(array.nbytes for array in arrays)
    return f"{what}: {rows} x {tuple(obs_shape)} {first.dtype} observations{copies}, {nbytes / 1e6:.1f} MB"


def replay_bytes(capacity: int, obs_shape: tuple[int, ...], obs_dtype, num_actions: int | None) -> int:
    """Bytes a :class:`LocalReplay` of ``capacity`` transitions allocates."""
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


# ---------------------------------------------------------------------------- the local buffer

class LocalReplay:
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
        self.add_batch(**episode_transitions(obs, actions, rewards, terminated, masks, gamma, n_step))

    def sample(self, batch_size: int, beta: float | None = None) -> ReplaySample:
        """``batch_size`` uniformly drawn transitions (``beta`` is for the prioritized buffer's interface)."""
        indices = self.rng.integers(0, self.size, size=batch_size)
        return ReplaySample(self.obs[indices], self.actions[indices], self.rewards[indices], self.next_obs[indices],
                            self.dones[indices], self.discounts[indices], indices,
                            next_masks=self.next_masks[indices] if self.next_masks is not None else None)

    def update_priorities(self, sample: ReplaySample, td_abs: np.ndarray) -> None:
        """Uniform sampling keeps no priorities (the learner calls this on every buffer)."""

    def describe(self) -> str:
        """How the observations are stored (dtype, shape, bytes): one line for the run's log."""
        return describe_observations("replay", [self.obs, self.next_obs], self.obs.shape[1:])
