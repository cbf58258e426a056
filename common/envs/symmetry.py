"""Symmetries an environment declares, for replay augmentation.

A symmetry maps the environment onto itself: in the observation transformed by ``observe``,
action ``action_map[a]`` is worth exactly what action ``a`` is worth in the original (same
reward, and the next observation is the original next observation, transformed). A learner
may then store every transition once more under each symmetry, for free experience
(``parallel_train_dqn.py --mirror-augment``).

An environment declares its symmetries as a class attribute ``symmetries`` (a tuple of
:class:`Symmetry`) of the class its Gymnasium id is registered with; ConnectFour-v0 declares
its left-right mirror. :func:`declared_symmetries` reads them without making an env, so any
user's env can declare its own the same way; an env that declares none has none.

A two-player game has one more: the same game seen from the other seat. An env may declare
``other_seat``, a function that turns the learner's record of an episode (``obs`` T+1, ``actions``,
``rewards``, ``terminated``) into the opponent's record of the same game, or None where it cannot;
a learner may then store the opponent's moves as experience too (``parallel_train_dqn.py
--learn-both-seats``). :func:`declared_other_seat` reads it the same way.

A zero-sum game with alternating moves may also declare ``plies``: the learner's record as the moves
of both players in turn (``obs`` P+1, each seen by the side to move there; ``actions``; ``rewards``,
each what the move earned its mover; ``terminated``; ``masks``). A move is then worth minus the best
value of the position it leads to, and a learner can learn negamax values from every move of a game
(``parallel_train_dqn.py --negamax``). :func:`declared_plies` reads it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import gymnasium as gym
import numpy as np


@dataclass(frozen=True)
class Symmetry:
    """One symmetry: ``observe`` transforms observations (any leading batch axes), ``action_map[a]``
    is the action that plays the role of ``a`` in the transformed observation (a permutation)."""

    name: str
    observe: Callable[[np.ndarray], np.ndarray]  # [..., *obs_shape] -> the same shape, transformed
    action_map: tuple[int, ...]  # action a becomes action_map[a]

    def __post_init__(self):
        if sorted(self.action_map) != list(range(len(self.action_map))):
            raise ValueError(f"symmetry {self.name!r}: action_map {self.action_map} is not a permutation of "
                             f"0..{len(self.action_map) - 1}")

    def observations(self, obs: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(self.observe(obs))

    def actions(self, actions: np.ndarray) -> np.ndarray:
        return np.asarray(self.action_map, dtype=np.int64)[actions]

    def masks(self, masks: np.ndarray) -> np.ndarray:
        """Legal-action masks ``[..., n]`` of the transformed observations: ``action_map[a]`` is legal there
        exactly where ``a`` is legal here."""
        out = np.empty_like(masks)
        out[..., list(self.action_map)] = masks
        return out

    def mismatch(self, observation_space: gym.spaces.Box, action_space: gym.spaces.Discrete) -> str | None:
        """Why this symmetry cannot apply to these spaces, or None."""
        if len(self.action_map) != action_space.n:
            return f"symmetry {self.name!r} maps {len(self.action_map)} actions, the env has {action_space.n}"
        sample = np.zeros((1, *observation_space.shape), dtype=observation_space.dtype)
        shape = np.shape(self.observe(sample))
        if shape != sample.shape:
            return f"symmetry {self.name!r} turns observations of shape {sample.shape[1:]} into {shape[1:]}"
        return None


def _registered(env_id: str):
    """The class (or function) ``env_id`` is registered with, or None."""
    try:
        entry = gym.spec(env_id).entry_point
        return gym.envs.registration.load_env_creator(entry) if isinstance(entry, str) else entry
    except (gym.error.Error, ImportError, AttributeError):  # ids made elsewhere (ALE) declare nothing here
        return None


def declared_symmetries(env_id: str) -> tuple[Symmetry, ...]:
    """The symmetries ``env_id``'s registered class declares (``symmetries``), or none."""
    return tuple(getattr(_registered(env_id), "symmetries", ()))


def declared_other_seat(env_id: str) -> Callable[[dict], dict | None] | None:
    """The ``other_seat`` function ``env_id``'s registered class declares, or None."""
    return getattr(_registered(env_id), "other_seat", None)


def declared_plies(env_id: str) -> Callable[[dict], dict] | None:
    """The ``plies`` function ``env_id``'s registered class declares, or None."""
    return getattr(_registered(env_id), "plies", None)
