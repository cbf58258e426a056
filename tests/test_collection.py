"""A rollout step's fast forms give the numbers of the plain per-step forms (docs/performance.md, "Collection
against the env's own rate"): the stacked heads, the noise drawn ahead in blocks, the normalization with the
rollout's statistics computed once."""

import gymnasium as gym
import numpy as np
import pytest

from common.normalize import Normalizer
from common.numpy_actor_critic import LOG_SQRT_2PI, NumpyActing, actor_critic_shapes, forward, parameter_count


def plain_act(acting: NumpyActing, rng: np.random.Generator, obs: np.ndarray):
    """A rollout step as it was written before: each head on its own, the noise drawn at every step."""
    x = obs.astype(np.float32)
    out, value = forward(x, acting.actor, acting.tanh)[-1], forward(x, acting.critic, acting.tanh)[-1][:, 0]
    if acting.log_std is None:
        shifted = out - out.max(axis=1, keepdims=True)
        log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
        action = (log_probs + rng.gumbel(size=log_probs.shape)).argmax(axis=1)
        return action, log_probs[np.arange(len(action)), action].astype(np.float32), value
    noise = rng.standard_normal(out.shape).astype(np.float32)
    logprob = (-0.5 * noise * noise - acting.log_std - np.float64(LOG_SQRT_2PI)).sum(axis=1).astype(np.float32)
    return (out + noise * np.exp(acting.log_std)).astype(np.float32), logprob, value


@pytest.mark.parametrize("continuous", [False, True])
@pytest.mark.parametrize("hidden, activation", [((6,), "tanh"), ((16, 16), "tanh"), ((8, 8, 8), "relu")])
def test_acting_gives_the_plain_steps_numbers_across_noise_blocks_and_refreshes(continuous, hidden, activation):
    obs_space = gym.spaces.Box(-1, 1, (5,))
    act_space = gym.spaces.Box(-1, 1, (3,)) if continuous else gym.spaces.Discrete(4)
    rng = np.random.default_rng(0)
    flat = rng.normal(size=parameter_count(actor_critic_shapes(obs_space, act_space, hidden))).astype(np.float32)
    acting = NumpyActing(obs_space, act_space, hidden, activation, lambda: flat, seed=7)
    acting.NOISE_ROWS = 10  # blocks that end inside a step's rows, so that steps straddle two blocks
    reference_rng = np.random.default_rng(7)
    for step in range(40):
        if step % 9 == 8:  # new parameters (a new log-std too) while part of a block is left
            flat += rng.normal(scale=0.1, size=flat.shape).astype(np.float32)
            acting.refresh()
        obs = rng.normal(size=(1 + step % 7, 5)).astype(np.float32)
        for fast, plain in zip(acting.act(obs), plain_act(acting, reference_rng, obs)):
            assert fast.dtype == plain.dtype
            np.testing.assert_array_equal(fast, plain)


def test_observations_with_the_rollouts_statistics_are_the_normalizers_own():
    normalizer = Normalizer((4,), norm_obs=True, norm_reward=False, clip_obs=2.0)
    rng = np.random.default_rng(1)
    normalizer.update(rng.normal(3.0, 2.0, size=(64, 4)), np.zeros(64))
    normalize = normalizer.observations_now()
    obs = rng.normal(3.0, 4.0, size=(32, 4))  # some beyond the clip
    assert (np.abs(normalizer.observations(obs)) == 2.0).any()
    np.testing.assert_array_equal(normalize(obs), normalizer.observations(obs))
    assert normalize(obs).dtype == np.float32
    off = Normalizer((4,), norm_obs=False, norm_reward=False).observations_now()
    assert off(obs) is obs
