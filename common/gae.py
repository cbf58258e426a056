"""From a filled rollout to a PPO batch: generalized advantage estimation, then the ``[T, N]`` arrays
flattened into one batch of samples (``common.rollout`` fills the rollout; a learner of
``common.ppo_learner`` learns from the batch). numpy only: the numpy learner's process never imports torch.
"""

from __future__ import annotations

import numpy as np

from common.normalize import Normalizer


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
