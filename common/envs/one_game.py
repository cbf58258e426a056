"""The single-env form of a two-player vector env with the opponent inside (ConnectFour-v0, Shogi-v0, PettingZoo's
games): one game, played through the vector env's own code, so that both forms play the same rules."""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np


class OneGame(gym.Env):
    """One game of ``self._vec``, a vector env of one game that the subclass makes in ``__init__``.

    ``reset(seed=s)`` seeds the seat draws and openings (``s``) and the opponent (``s + 1``);
    ``reset(options={"learner_first": True/False})`` fixes the seat for that game only.
    """

    _vec: Any

    def set_opponent(self, opponent: Any) -> None:
        self._vec.set_opponent(opponent)

    def _start_game(self, seed: int | None, options: dict | None) -> None:
        super().reset(seed=seed)
        vec = self._vec
        if seed is not None:
            vec.np_random = np.random.default_rng(seed)
            if hasattr(vec.opponent, "rng"):
                vec.opponent.rng = np.random.default_rng(seed + 1)
        seat = vec.learner_first
        if options and "learner_first" in options:
            vec.learner_first = options["learner_first"]
        try:
            vec._start_games(np.arange(1))
        finally:
            vec.learner_first = seat
