"""Tic-tac-toe players that see the board from the side to move: a perfect player by plain minimax, a
heuristic one, and :func:`lines_lost`, which checks a policy against every reply an opponent could make.

A board is what ``pettingzoo/tictactoe_v3`` shows the side to move (common/envs/pettingzoo_games.py):
float32 ``(2, 3, 3)``, plane 0 its own marks, plane 1 the other side's; action ``3 * row + column``.
Players act on batches: ``act(obs (n, 2, 3, 3), action_mask (n, 9), env_ids) -> (n,) actions``.

The minimax values are exact: a position is searched to the end of every line (memoized, about 4,000
positions from the empty board, in some 30 ms), a win worth 1, a draw 0, a loss -1 for the side to move,
both sides playing their best. :class:`MinimaxPlayer` plays a move of the highest value, ties drawn at
random, so it never loses a game it can draw and never draws one it can win, and its games vary.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

import numpy as np

from common.envs import connect_four
from common.envs.connect_four import sample_legal

CELLS = 9
LINES = ((0, 1, 2), (3, 4, 5), (6, 7, 8), (0, 3, 6), (1, 4, 7), (2, 5, 8), (0, 4, 8), (2, 4, 6))
LINE_MATRIX = np.zeros((CELLS, len(LINES)), dtype=np.int64)  # which cells make up each line
for _line, _cells in enumerate(LINES):
    LINE_MATRIX[list(_cells), _line] = 1


def boards_of(obs: np.ndarray) -> np.ndarray:
    """``(n, 9)`` int8 boards of ``(n, 2, 3, 3)`` observations: +1 the side to move, -1 the other, 0 empty."""
    obs = np.asarray(obs)
    return (obs[:, 0] - obs[:, 1]).reshape(len(obs), CELLS).astype(np.int8)


def has_line(cells: tuple[int, ...], piece: int) -> bool:
    return any(cells[a] == cells[b] == cells[c] == piece for a, b, c in LINES)


@cache
def value(cells: tuple[int, ...]) -> int:
    """Minimax value of a live board (9 cells, +1 the side to move) for the side to move: 1 win, 0 draw,
    -1 loss, with both sides playing perfectly from here."""
    best = -1
    for cell in range(CELLS):
        if cells[cell] == 0:
            best = max(best, move_value(cells, cell))
            if best == 1:
                break
    return best


def move_value(cells: tuple[int, ...], cell: int) -> int:
    """Minimax value, for the side to move, of marking ``cell``: 1 if it completes a line, 0 if it fills the
    board, else minus the value of the position it leaves for the other side (negamax)."""
    child = cells[:cell] + (1,) + cells[cell + 1:]
    if has_line(child, 1):
        return 1
    if 0 not in child:
        return 0
    return -value(tuple(-c for c in child))


def move_values(obs: np.ndarray, action_mask: np.ndarray | None = None) -> np.ndarray:
    """``(n, 9)`` minimax value of every move for the side to move; ``-inf`` for a taken or masked cell."""
    boards = boards_of(obs)
    out = np.full(boards.shape, -np.inf)
    for row, board in enumerate(boards):
        cells = tuple(int(c) for c in board)
        for cell in np.flatnonzero(board == 0):
            out[row, cell] = move_value(cells, int(cell))
    if action_mask is not None:
        out[~np.asarray(action_mask, dtype=bool)] = -np.inf
    return out


class MinimaxPlayer:
    """Perfect play: a move of the highest minimax value, ties drawn uniformly with ``seed``'s generator."""

    def __init__(self, seed: int | None = None):
        self.rng = np.random.default_rng(seed)

    def act(self, obs: np.ndarray, action_mask: np.ndarray, env_ids: np.ndarray | None = None) -> np.ndarray:
        values = move_values(obs, action_mask)
        return sample_legal(self.rng, values == values.max(axis=1, keepdims=True))


def completing_moves(boards: np.ndarray, piece: int) -> np.ndarray:
    """``(n, 9)`` bool: the empty cells where ``piece`` would complete a line of three at once."""
    mine = (boards == piece).astype(np.int64) @ LINE_MATRIX  # (n, 8): marks of ``piece`` in each line
    empty = (boards == 0).astype(np.int64) @ LINE_MATRIX
    open_two = (mine == 2) & (empty == 1)  # lines one mark short of three
    return (boards == 0) & ((open_two.astype(np.int64) @ LINE_MATRIX.T) > 0)


class HeuristicPlayer:
    """Completes a line when it can, else blocks the other side's, else plays a uniformly random cell;
    strong against random play, beaten by forks (two threats at once), which it never sees coming."""

    def __init__(self, seed: int | None = None):
        self.rng = np.random.default_rng(seed)

    def act(self, obs: np.ndarray, action_mask: np.ndarray, env_ids: np.ndarray | None = None) -> np.ndarray:
        boards = boards_of(obs)
        legal = np.asarray(action_mask, dtype=bool)
        win, block = completing_moves(boards, 1) & legal, completing_moves(boards, -1) & legal
        choice = np.where(win.any(axis=1, keepdims=True), win, np.where(block.any(axis=1, keepdims=True), block, legal))
        return sample_legal(self.rng, choice)


def observe(boards: np.ndarray) -> np.ndarray:
    """``(n, 2, 3, 3)`` float32 observations of ``(n, 9)`` boards for the side playing +1."""
    return connect_four.observe(np.asarray(boards).reshape(-1, 3, 3))


def lines_lost(act: Callable[[np.ndarray, np.ndarray], np.ndarray], moves_first: bool) -> tuple[int, int]:
    """Plays ``act(obs (n, 2, 3, 3), masks (n, 9)) -> actions`` (a deterministic policy, e.g. a network's greedy
    moves) against every reply an opponent could make, from one seat, to the end of every line of play.

    Returns (lines lost, lines played): a policy that loses no line loses to no opponent from that seat,
    which is what perfect play is. A policy that draws at random explores one draw of its moves.
    """
    boards = np.zeros((1, CELLS), dtype=np.int8)  # +1 the policy's marks, -1 the opponent's
    if not moves_first:
        boards = -np.eye(CELLS, dtype=np.int8)  # every opening of the opponent
    lost = played = 0
    while len(boards):
        actions = np.asarray(act(observe(boards), boards == 0), dtype=np.int64)
        if not (boards[np.arange(len(boards)), actions] == 0).all():
            raise ValueError("the policy marked a cell that is taken")
        boards = boards.copy()
        boards[np.arange(len(boards)), actions] = 1
        over = completing_lines(boards, 1) | (boards != 0).all(axis=1)
        played += int(over.sum())
        boards = boards[~over]
        if not len(boards):
            break
        parent, cell = np.nonzero(boards == 0)  # every reply of the opponent
        children = boards[parent]
        children[np.arange(len(parent)), cell] = -1
        opponent_won = completing_lines(children, -1)
        lost += int(opponent_won.sum())
        full = (children != 0).all(axis=1) & ~opponent_won
        played += int(opponent_won.sum() + full.sum())
        boards = children[~opponent_won & ~full]
    return lost, played


def completing_lines(boards: np.ndarray, piece: int) -> np.ndarray:
    """``(n,)`` bool: whether ``piece`` has three in a line on each of ``(n, 9)`` boards."""
    return (((boards == piece).astype(np.int64) @ LINE_MATRIX) == 3).any(axis=1)


def perfect_play():
    """Tic-tac-toe's perfect player for :mod:`common.grading`: minimax's exact move values."""
    from common.grading import PerfectPlay

    return PerfectPlay("minimax", move_values, ((0, 2), (3, 5), (6, 8)))
