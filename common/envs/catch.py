"""Catch-v0: catch a falling ball with a paddle, seen as pixels (the small image task of bsuite).

A ball starts in a random column of the top row of a ``rows x columns`` board and falls one row
per step; the paddle, on the bottom row, moves left, stays or moves right. When the ball reaches
the bottom row the episode ends with reward +1 if the paddle is under it, -1 otherwise
(``info["caught"]``). The observation is a picture: uint8 ``(1, rows * scale, columns * scale)``,
255 where the ball and the paddle are, so an agent must learn from pixels with a convolutional
encoder (the Nature CNN needs 36 pixels or more a side: the default board 10 x 10 at scale 4 is
40 x 40). It learns in seconds, which makes it the test of every script's image path.

:class:`CatchVectorEnv` steps many boards in numpy with same-step autoreset; board ``i`` reset
with seed ``s`` plays the episodes of :class:`CatchEnv` reset with ``s + i``.
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np
from gymnasium.utils import seeding
from gymnasium.vector import AutoresetMode, VectorEnv


class _Boards:
    """Ball and paddle positions of ``n`` boards, and their pictures."""

    def __init__(self, n: int, rows: int, columns: int, scale: int):
        self.rows, self.columns, self.scale = rows, columns, scale
        self.ball_row = np.zeros(n, dtype=np.int64)
        self.ball_col = np.zeros(n, dtype=np.int64)
        self.paddle = np.zeros(n, dtype=np.int64)

    def reset(self, idx: np.ndarray, rngs: list[np.random.Generator]) -> None:
        self.ball_row[idx] = 0
        self.ball_col[idx] = [int(rng.integers(self.columns)) for rng in rngs]
        self.paddle[idx] = self.columns // 2

    def step(self, actions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Move paddles (0 left, 1 stay, 2 right) and balls; rewards and which episodes ended."""
        self.paddle = np.clip(self.paddle + np.asarray(actions, dtype=np.int64) - 1, 0, self.columns - 1)
        self.ball_row += 1
        done = self.ball_row == self.rows - 1
        rewards = np.where(done, np.where(self.ball_col == self.paddle, 1.0, -1.0), 0.0).astype(np.float32)
        return rewards, done

    def pictures(self) -> np.ndarray:
        n = len(self.paddle)
        board = np.zeros((n, self.rows, self.columns), dtype=np.uint8)
        board[np.arange(n), self.ball_row, self.ball_col] = 255
        board[np.arange(n), self.rows - 1, self.paddle] = 255
        return board.repeat(self.scale, axis=1).repeat(self.scale, axis=2)[:, None]


def _spaces(rows: int, columns: int, scale: int) -> tuple[gym.spaces.Box, gym.spaces.Discrete]:
    if rows < 2 or columns < 1 or scale < 1:
        raise ValueError(f"Catch needs rows >= 2, columns >= 1, scale >= 1; got {rows}, {columns}, {scale}")
    return gym.spaces.Box(0, 255, (1, rows * scale, columns * scale), np.uint8), gym.spaces.Discrete(3)


class CatchEnv(gym.Env):
    """One board; see the module docstring."""

    metadata = {"render_modes": ["rgb_array"], "render_fps": 10}

    def __init__(self, rows: int = 10, columns: int = 10, scale: int = 4, render_mode: str | None = None):
        self.observation_space, self.action_space = _spaces(rows, columns, scale)
        self.render_mode = render_mode
        self._boards = _Boards(1, rows, columns, scale)

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self._boards.reset(np.array([0]), [self.np_random])
        return self._boards.pictures()[0], {}

    def step(self, action):
        rewards, done = self._boards.step(np.array([int(action)]))
        info = {"caught": float(rewards[0] > 0)} if done[0] else {}
        return self._boards.pictures()[0], float(rewards[0]), bool(done[0]), False, info

    def render(self):
        return np.repeat(self._boards.pictures()[0, 0][:, :, None], 3, axis=2).repeat(4, axis=0).repeat(4, axis=1)


class CatchVectorEnv(VectorEnv):
    """``num_envs`` boards stepped in numpy, with same-step autoreset."""

    metadata = {"autoreset_mode": AutoresetMode.SAME_STEP}

    def __init__(self, num_envs: int = 1, rows: int = 10, columns: int = 10, scale: int = 4, **_ignored):
        self.num_envs = int(num_envs)
        self.single_observation_space, self.single_action_space = _spaces(rows, columns, scale)
        self.observation_space = gym.vector.utils.batch_space(self.single_observation_space, self.num_envs)
        self.action_space = gym.vector.utils.batch_space(self.single_action_space, self.num_envs)
        self._boards = _Boards(self.num_envs, rows, columns, scale)
        self._rngs: list[np.random.Generator] = []

    def reset(self, *, seed: int | list[int] | None = None, options: dict | None = None):
        seeds = [seed + i for i in range(self.num_envs)] if isinstance(seed, int) else \
            list(seed) if seed is not None else [None] * self.num_envs
        self._rngs = [seeding.np_random(s)[0] for s in seeds]
        self._boards.reset(np.arange(self.num_envs), self._rngs)
        return self._boards.pictures(), {}

    def step(self, actions):
        if not self._rngs:
            raise RuntimeError("call reset() before step()")
        rewards, done = self._boards.step(actions)
        info: dict = {}
        if done.any():
            info = {"final_obs": self._boards.pictures(), "_final_obs": done,
                    "final_info": {"caught": (rewards > 0).astype(np.float64), "_caught": done}}
            idx = np.flatnonzero(done)
            self._boards.reset(idx, [self._rngs[i] for i in idx])
        return self._boards.pictures(), rewards, done, np.zeros(self.num_envs, dtype=bool), info
