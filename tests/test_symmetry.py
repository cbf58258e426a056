"""A symmetry a user's env declares (common/envs/symmetry.py) is checked before it is used."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest

import parallel_train_dqn
from common.config import ConfigError
from common.envs.symmetry import Symmetry, declared_symmetries
from common.run import probe_env

FLIP = Symmetry("flip", lambda obs: obs[..., ::-1], (1, 0))  # fits CartPole's two actions only by its count
WIDENING = Symmetry("widen", lambda obs: np.concatenate([obs, obs], axis=-1), (1, 0))


class DeclaringCartPole(gym.Wrapper):
    """CartPole whose class declares whatever symmetries a test sets (as a user's own env would)."""

    symmetries: tuple = ()

    def __init__(self):
        super().__init__(gym.make("CartPole-v1"))


@pytest.fixture
def user_env():
    gym.register("DeclaringCartPole-v0", entry_point=DeclaringCartPole)
    yield "DeclaringCartPole-v0", probe_env("DeclaringCartPole-v0", actions=("Discrete",))
    DeclaringCartPole.symmetries = ()
    del gym.registry["DeclaringCartPole-v0"]


def test_a_symmetry_must_map_actions_by_a_permutation():
    with pytest.raises(ValueError, match=r"action_map \(0, 0\) is not a permutation of 0..1"):
        Symmetry("broken", lambda obs: obs, (0, 0))


def test_a_declared_symmetry_that_does_not_fit_the_env_is_refused_in_one_line(user_env):
    env_id, env = user_env
    DeclaringCartPole.symmetries = (FLIP,)
    assert declared_symmetries(env_id) == (FLIP,)
    used = parallel_train_dqn.augmenting_symmetries(parallel_train_dqn.Config(env_id=env_id), env)
    assert used == (FLIP,)  # fits: two actions, observations keep their shape
    DeclaringCartPole.symmetries = (WIDENING,)
    with pytest.raises(ConfigError, match=r"symmetry 'widen' turns observations of shape \(4,\) into \(8,\)"):
        parallel_train_dqn.augmenting_symmetries(parallel_train_dqn.Config(env_id=env_id), env)
    DeclaringCartPole.symmetries = (Symmetry("three", lambda obs: obs, (2, 0, 1)),)
    with pytest.raises(ConfigError, match="symmetry 'three' maps 3 actions, the env has 2"):
        parallel_train_dqn.augmenting_symmetries(parallel_train_dqn.Config(env_id=env_id), env)
