"""Connect Four (6 rows x 7 columns) from the learning player's point of view.

The learner plays against a pluggable *opponent*: any object with
``act(obs, action_mask, env_ids) -> actions`` that sees the board from its own point of
view (the same encoding the learner gets, with the planes swapped), so one Q-network
can play both seats. An opponent may also define ``start_games(env_ids)``, called when
games begin, to pick a fresh policy per game (self-play pools do this).

Observation: float32 ``(2, 6, 7)``; plane 0 holds the learner's discs, plane 1 the
opponent's; row 0 is the bottom row. Action: the column to drop a disc in (0-6).
``info["action_mask"]`` (bool, one per column) marks the columns that are not full;
playing a full column raises ``ValueError`` (masked actions must never be chosen).
Reward: +1 win, -1 loss, 0 draw or game going on. One step is the learner's move plus
the opponent's reply, so a game lasts at most 21 steps. ``result`` (1 win, 0 draw,
-1 loss) is in ``info`` (single env) or ``info["final_info"]`` (vector env) when a
game ends.

Render modes of the single env: ``"ansi"`` (X learner, O opponent) and ``"rgb_array"`` (a blue
board with red learner and yellow opponent discs, uint8 ``(288, 336, 3)``).
"""

from __future__ import annotations

from typing import Any, Protocol

import gymnasium as gym
import numpy as np
from gymnasium.vector import AutoresetMode

ROWS, COLS = 6, 7
LEARNER, OPPONENT = 1, -1
CENTRE_WEIGHTS = np.array([1, 2, 3, 4, 3, 2, 1], dtype=np.float64)
CELL_PIXELS = 48  # a cell of the rgb_array picture (a multiple of 16, as video encoders like)
DISC_COLOURS = {0: (235, 235, 235), LEARNER: (220, 40, 40), OPPONENT: (245, 200, 30)}
BOARD_COLOUR = (30, 70, 200)


class Player(Protocol):
    """Anything that picks one legal column per board, seeing the board as the side to move."""

    def act(self, obs: np.ndarray, action_mask: np.ndarray, env_ids: np.ndarray) -> np.ndarray: ...


# ------------------------------------------------------------------ board rules (batched)

def wins(boards: np.ndarray, piece: int) -> np.ndarray:
    """For each board of ``(n, 6, 7)``, whether ``piece`` has four in a row in any direction."""
    b = boards == piece
    horizontal = b[:, :, :-3] & b[:, :, 1:-2] & b[:, :, 2:-1] & b[:, :, 3:]
    vertical = b[:, :-3] & b[:, 1:-2] & b[:, 2:-1] & b[:, 3:]
    rising = b[:, :-3, :-3] & b[:, 1:-2, 1:-2] & b[:, 2:-1, 2:-1] & b[:, 3:, 3:]
    falling = b[:, 3:, :-3] & b[:, 2:-1, 1:-2] & b[:, 1:-2, 2:-1] & b[:, :-3, 3:]
    return (horizontal.any(axis=(1, 2)) | vertical.any(axis=(1, 2))
            | rising.any(axis=(1, 2)) | falling.any(axis=(1, 2)))


def legal_mask(heights: np.ndarray) -> np.ndarray:
    return heights < ROWS


def drop(boards: np.ndarray, heights: np.ndarray, env_ids: np.ndarray, columns: np.ndarray, piece: int) -> None:
    """Drop ``piece`` into ``columns`` of the boards ``env_ids``; raises ValueError for a full column."""
    columns = np.asarray(columns, dtype=np.int64)
    if columns.size == 0:
        return
    if ((columns < 0) | (columns >= COLS)).any():
        raise ValueError(f"illegal move: columns must be 0..{COLS - 1}, got {columns.tolist()}")
    rows = heights[env_ids, columns]
    if (rows >= ROWS).any():
        full = columns[rows >= ROWS].tolist()
        raise ValueError(f"illegal move: column(s) {full} are full (use info['action_mask'])")
    boards[env_ids, rows, columns] = piece
    heights[env_ids, columns] += 1


def observe(boards: np.ndarray, piece: int = LEARNER) -> np.ndarray:
    """The ``(n, 2, 6, 7)`` float32 observation of ``boards`` for the side playing ``piece``."""
    return np.stack([boards == piece, boards == -piece], axis=1).astype(np.float32)


def winning_moves(obs: np.ndarray, action_mask: np.ndarray, plane: int) -> np.ndarray:
    """``(n, 7)`` bool: columns where the player of ``plane`` would complete four at once."""
    n = obs.shape[0]
    boards = (obs[:, 0] - obs[:, 1]).astype(np.int8)  # +1 = side to move, -1 = the other side
    piece = 1 if plane == 0 else -1
    heights = (boards != 0).sum(axis=1)
    out = np.zeros((n, COLS), dtype=bool)
    for col in range(COLS):
        legal = np.flatnonzero(action_mask[:, col])
        if legal.size == 0:
            continue
        trial = boards[legal].copy()
        trial[np.arange(legal.size), heights[legal, col], col] = piece
        out[legal, col] = wins(trial, piece)
    return out


def draw_board(board: np.ndarray, cell: int = CELL_PIXELS) -> np.ndarray:
    """The ``(6, 7)`` board (row 0 at the bottom) as a uint8 ``(6 * cell, 7 * cell, 3)`` picture."""
    palette = np.array([DISC_COLOURS[OPPONENT], DISC_COLOURS[0], DISC_COLOURS[LEARNER]], dtype=np.uint8)
    colours = palette[np.asarray(board, dtype=np.int64)[::-1] + 1]  # top row first, as a picture reads
    centre = (np.arange(cell) - (cell - 1) / 2) ** 2
    disc = centre[:, None] + centre[None, :] <= (0.4 * cell) ** 2
    discs = np.tile(disc, (ROWS, COLS))
    picture = colours.repeat(cell, axis=0).repeat(cell, axis=1)
    return np.where(discs[:, :, None], picture, np.array(BOARD_COLOUR, dtype=np.uint8))


# ------------------------------------------------------------------ fixed players

class RandomPlayer:
    """Uniform over legal columns."""

    def __init__(self, seed: int | None = None):
        self.rng = np.random.default_rng(seed)

    def act(self, obs: np.ndarray, action_mask: np.ndarray, env_ids: np.ndarray | None = None) -> np.ndarray:
        return sample_legal(self.rng, action_mask)


class HeuristicPlayer:
    """Wins when it can, else blocks an immediate loss, else prefers the centre.

    Among columns with no immediate win or block, a column is drawn with weights
    1-2-3-4-3-2-1 from edge to centre, so the player is strong against naive play
    yet not one fixed sequence that a learner could memorise.
    """

    def __init__(self, seed: int | None = None):
        self.rng = np.random.default_rng(seed)

    def act(self, obs: np.ndarray, action_mask: np.ndarray, env_ids: np.ndarray | None = None) -> np.ndarray:
        action_mask = np.asarray(action_mask, dtype=bool)
        win = winning_moves(obs, action_mask, plane=0)
        block = winning_moves(obs, action_mask, plane=1)
        weights = np.where(action_mask, CENTRE_WEIGHTS, 0.0)
        actions = sample_weighted(self.rng, weights)
        has_block = block.any(axis=1)
        actions[has_block] = block[has_block].argmax(axis=1)
        has_win = win.any(axis=1)
        actions[has_win] = win[has_win].argmax(axis=1)
        return actions


def sample_legal(rng: np.random.Generator, action_mask: np.ndarray) -> np.ndarray:
    """One uniformly drawn legal action per row of a boolean mask."""
    return sample_weighted(rng, np.asarray(action_mask, dtype=np.float64))


def sample_weighted(rng: np.random.Generator, weights: np.ndarray) -> np.ndarray:
    cumulative = np.cumsum(weights, axis=1)
    draws = rng.random(len(weights)) * cumulative[:, -1]
    return (cumulative > draws[:, None]).argmax(axis=1)


def make_player(name: str, seed: int | None = None) -> Player:
    players = {"random": RandomPlayer, "heuristic": HeuristicPlayer}
    if name not in players:
        raise ValueError(f"unknown player {name!r}; known: {', '.join(players)}")
    return players[name](seed)


def _as_player(opponent: Player | str | None, seed: int | None) -> Player:
    if opponent is None:
        return RandomPlayer(seed)
    if isinstance(opponent, str):
        return make_player(opponent, seed)
    return opponent


def _seat_draw(rng: np.random.Generator, learner_first: bool | None, n: int) -> np.ndarray:
    if learner_first is None:
        return rng.random(n) < 0.5
    return np.full(n, bool(learner_first))


# ------------------------------------------------------------------ vector env

class ConnectFourVectorEnv(gym.vector.VectorEnv):
    """``num_envs`` games stepped together in numpy, with same-step autoreset.

    ``learner_first``: True/False fixes the learner's seat, None draws it per game.
    The opponent acts once for all games that need a reply, in one batched call.
    """

    metadata = {"autoreset_mode": AutoresetMode.SAME_STEP, "render_modes": []}

    def __init__(self, num_envs: int = 1, opponent: Player | str | None = None,
                 learner_first: bool | None = None, seed: int | None = None,
                 max_episode_steps: int | None = None):  # games end by themselves within 21 steps
        self.num_envs = num_envs
        self.single_observation_space = gym.spaces.Box(0.0, 1.0, (2, ROWS, COLS), np.float32)
        self.single_action_space = gym.spaces.Discrete(COLS)
        self.observation_space = gym.vector.utils.batch_space(self.single_observation_space, num_envs)
        self.action_space = gym.vector.utils.batch_space(self.single_action_space, num_envs)
        self.learner_first = learner_first
        self.np_random = np.random.default_rng(seed)
        self.opponent = _as_player(opponent, seed)
        self.boards = np.zeros((num_envs, ROWS, COLS), dtype=np.int8)
        self.heights = np.zeros((num_envs, COLS), dtype=np.int64)

    def set_opponent(self, opponent: Player | str) -> None:
        """Replace the opponent; takes effect at the next move."""
        self.opponent = _as_player(opponent, int(self.np_random.integers(2**31)))

    def set_learner_first(self, learner_first: bool | None) -> None:
        """Fix the learner's seat for games that start from now on (None = random per game)."""
        self.learner_first = learner_first

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        if seed is not None:
            self.np_random = np.random.default_rng(seed)
            if hasattr(self.opponent, "rng"):
                self.opponent.rng = np.random.default_rng(seed + 1)
        self._start_games(np.arange(self.num_envs))
        return observe(self.boards), {"action_mask": legal_mask(self.heights)}

    def _start_games(self, env_ids: np.ndarray) -> None:
        self.boards[env_ids] = 0
        self.heights[env_ids] = 0
        start_games = getattr(self.opponent, "start_games", None)
        if start_games is not None:
            start_games(env_ids)
        opponent_first = env_ids[~_seat_draw(self.np_random, self.learner_first, len(env_ids))]
        self._opponent_moves(opponent_first)

    def _opponent_moves(self, env_ids: np.ndarray) -> None:
        if env_ids.size == 0:
            return
        obs = observe(self.boards[env_ids], OPPONENT)
        mask = legal_mask(self.heights[env_ids])
        actions = np.asarray(self.opponent.act(obs, mask, env_ids), dtype=np.int64)
        drop(self.boards, self.heights, env_ids, actions, OPPONENT)

    def step(self, actions):
        actions = np.asarray(actions, dtype=np.int64).reshape(self.num_envs)
        every = np.arange(self.num_envs)
        drop(self.boards, self.heights, every, actions, LEARNER)
        result = np.zeros(self.num_envs, dtype=np.float32)
        won = wins(self.boards, LEARNER)
        full = (self.heights >= ROWS).all(axis=1)
        done = won | full
        result[won] = 1.0
        reply = every[~done]
        self._opponent_moves(reply)
        lost = np.zeros(self.num_envs, dtype=bool)
        lost[reply] = wins(self.boards[reply], OPPONENT)
        full = (self.heights >= ROWS).all(axis=1)
        result[lost] = -1.0
        done |= lost | full
        rewards = result.copy()
        terminations = done
        truncations = np.zeros(self.num_envs, dtype=bool)
        obs = observe(self.boards)
        infos: dict[str, Any] = {}
        if done.any():
            infos["final_obs"] = obs.copy()
            infos["_final_obs"] = done.copy()
            infos["final_info"] = {"result": np.where(done, result, 0.0), "_result": done.copy()}
            self._start_games(np.flatnonzero(done))
            obs = observe(self.boards)
        infos["action_mask"] = legal_mask(self.heights)
        return obs, rewards, terminations, truncations, infos

    def render_text(self, index: int = 0) -> str:
        symbols = {LEARNER: "X", OPPONENT: "O", 0: "."}
        rows = ["".join(symbols[int(v)] for v in self.boards[index, r]) for r in reversed(range(ROWS))]
        return "\n".join(rows + ["0123456"])


# ------------------------------------------------------------------ single env

class ConnectFourEnv(gym.Env):
    """One game of Connect Four against ``opponent`` (default: a random player).

    ``reset(options={"learner_first": True/False})`` fixes the seat for that game.
    """

    metadata = {"render_modes": ["ansi", "rgb_array"], "render_fps": 2}

    def __init__(self, opponent: Player | str | None = None, learner_first: bool | None = None,
                 render_mode: str | None = None):
        self.observation_space = gym.spaces.Box(0.0, 1.0, (2, ROWS, COLS), np.float32)
        self.action_space = gym.spaces.Discrete(COLS)
        self.render_mode = render_mode
        self._vec = ConnectFourVectorEnv(1, opponent=opponent, learner_first=learner_first)
        self._done = True

    def set_opponent(self, opponent: Player | str) -> None:
        self._vec.set_opponent(opponent)

    @property
    def board(self) -> np.ndarray:
        """The ``(6, 7)`` board: +1 learner, -1 opponent, 0 empty; row 0 at the bottom."""
        return self._vec.boards[0].copy()

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        if seed is not None:
            self._vec.np_random = np.random.default_rng(seed)
            if hasattr(self._vec.opponent, "rng"):
                self._vec.opponent.rng = np.random.default_rng(seed + 1)
        seat = self._vec.learner_first
        if options and "learner_first" in options:
            self._vec.learner_first = options["learner_first"]
        try:
            self._vec._start_games(np.arange(1))
        finally:
            self._vec.learner_first = seat
        self._done = False
        return observe(self._vec.boards)[0], {"action_mask": legal_mask(self._vec.heights)[0]}

    def set_board(self, board: np.ndarray) -> None:
        """Load a position (rows bottom-up; +1 learner, -1 opponent) with the learner to move."""
        board = np.asarray(board, dtype=np.int8).reshape(ROWS, COLS)
        self._vec.boards[0] = board
        self._vec.heights[0] = (board != 0).sum(axis=0)
        self._done = False

    def step(self, action):
        if self._done:
            raise RuntimeError("step() called on a finished game; call reset()")
        vec = self._vec
        every = np.arange(1)
        drop(vec.boards, vec.heights, every, np.array([int(action)]), LEARNER)
        result, terminated = 0.0, False
        if wins(vec.boards, LEARNER)[0]:
            result, terminated = 1.0, True
        elif (vec.heights[0] >= ROWS).all():
            terminated = True
        else:
            vec._opponent_moves(every)
            if wins(vec.boards, OPPONENT)[0]:
                result, terminated = -1.0, True
            elif (vec.heights[0] >= ROWS).all():
                terminated = True
        self._done = terminated
        info: dict[str, Any] = {"action_mask": legal_mask(vec.heights)[0]}
        if terminated:
            info["result"] = result
        return observe(vec.boards)[0], result, terminated, False, info

    def render(self):
        if self.render_mode == "rgb_array":
            return draw_board(self._vec.boards[0])
        return self._vec.render_text(0)
