"""Catch-v0, the built-in image task: rules, pixels, and the vector form against the single env."""

from __future__ import annotations

import gymnasium as gym
import numpy as np

import common.envs  # noqa: F401  (registers the built-in envs)
from common.envs import make_vec_env, play_episodes


def test_registered_pixels_and_spaces():
    env = gym.make("Catch-v0")
    obs, _ = env.reset(seed=0)
    assert env.observation_space.shape == (1, 40, 40) and obs.dtype == np.uint8
    assert env.action_space.n == 3 and env.spec.reward_threshold == 0.9
    assert (obs[0, :4] == 255).sum() == 16  # the ball: one 4 x 4 block in the top row
    assert (obs[0, -4:] == 255).sum() == 16  # the paddle: one block in the bottom row


def test_vectorized_equals_single_through_autoresets():
    n, seed = 6, 11
    vec = make_vec_env("Catch-v0", n, seed)
    singles = [gym.make("Catch-v0") for _ in range(n)]
    assert (vec.reset() == np.stack([e.reset(seed=seed + i)[0] for i, e in enumerate(singles)])).all()
    rng = np.random.default_rng(0)
    for _ in range(40):
        actions = rng.integers(0, 3, n)
        result = vec.step(actions)
        for i, (env, action) in enumerate(zip(singles, actions)):
            obs, reward, terminated, truncated, _ = env.step(int(action))
            assert reward == result.rewards[i] and terminated == result.terminations[i] and not truncated
            if terminated:
                assert (result.final_obs[i] == obs).all()
                obs, _ = env.reset()
            assert (result.obs[i] == obs).all()


def test_following_the_ball_always_catches_it_and_random_mostly_misses():
    vec = make_vec_env("Catch-v0", 8, 0)

    def follow(obs, masks):
        board = obs[:, 0, ::4, ::4]  # back to one pixel per cell
        ball = board[:, :-1].max(axis=1).argmax(axis=1)
        paddle = board[:, -1].argmax(axis=1)
        return np.sign(ball - paddle) + 1

    episodes, _ = play_episodes(vec, follow, 40)
    assert all(e["caught"] == 1.0 and e["return"] == 1.0 and e["length"] == 9 for e in episodes)
    rng = np.random.default_rng(0)
    episodes, _ = play_episodes(vec, lambda obs, masks: rng.integers(0, 3, len(obs)), 200)
    assert np.mean([e["caught"] for e in episodes]) < 0.4
