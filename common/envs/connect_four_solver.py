"""A perfect Connect Four player for grading: BitBully's solver over ConnectFour-v0's boards.

BitBully (an optional extra, requirements-extras.txt) solves a position exactly: every legal move gets
its game-theoretic score for the side to move, positive for a win, 0 for a draw, negative for a loss,
and the larger the score the quicker the win or the later the loss: a win scores 22 minus the discs the
winner has played when it completes four (its 4th: 18; its 21st, on the last cell: 1), a loss minus the
opponent's win, as in Pascal Pons's solver. Early positions would take minutes to solve by search
alone (the empty board: more than nine minutes here), so the solver is loaded with BitBully's 12-ply
opening book (the bitbully-databases package, installed with it), which gives exact scores, distance
included, for every position up to 12 discs; loading it takes about a second, once per process, and a
position then takes up to 0.4 s on average at 12-14 plies (where the book ends and the search is
longest), a few milliseconds before and after.

:func:`move_values` takes the boards as ConnectFour-v0 shows them to the side to move (common/envs/
connect_four.py: ``(n, 2, 6, 7)``, plane 0 the mover's discs, row 0 the bottom row) and returns ``(n, 7)``
scores, ``-inf`` for a full or masked column, so it plugs into common/grading.py as the game's perfect
move values (:func:`perfect_play`). It is for grading only: no training mix can name it (common/envs/
selfplay.py builds opponents from player names, and it has none), and no training process imports it.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from common.envs.connect_four import COLS, boards_of, wins
from common.grading import PerfectPlay

OPENING_BOOK = "12-ply-dist"  # exact scores, distance to the end included, up to 12 discs
PLY_BANDS = ((0, 9), (10, 19), (20, 30))  # the plies graded, in bands (issue: random positions from plies 0-30)
CACHE_SIZE = 200_000  # positions whose scores are kept: a deterministic agent's games repeat their openings
MISSING = ("grading ConnectFour-v0 needs bitbully, its perfect player, an optional extra: "
           "pip install -r requirements-extras.txt -c constraints.txt")


@lru_cache(maxsize=1)
def solver():
    """The process's BitBully solver with its opening book (loaded once, about a second)."""
    try:
        import bitbully
    except ImportError:
        raise ValueError(MISSING) from None
    return bitbully.BitBully(OPENING_BOOK)


def perfect_play() -> PerfectPlay:
    """Connect Four's perfect move values for common/grading.py; ValueError (one line) without bitbully."""
    from importlib.metadata import version

    solver()
    return PerfectPlay(name=f"bitbully {version('bitbully')}, {OPENING_BOOK} opening book",
                       move_values=move_values, ply_bands=PLY_BANDS)


def to_bitbully(obs: np.ndarray):
    """One ``(2, 6, 7)`` observation of the side to move as a ``bitbully.Board``.

    BitBully marks the first player's discs 1 and the second's 2, column by column from the bottom; the
    side to move moved first exactly when the discs on the board are even in number.
    """
    import bitbully

    mover, other = (np.asarray(obs[k], dtype=bool) for k in (0, 1))
    first, second = (mover, other) if (mover.sum() + other.sum()) % 2 == 0 else (other, mover)
    cells = first.astype(np.int64) + 2 * second.astype(np.int64)  # (6, 7), row 0 at the bottom
    return bitbully.Board(cells.T.tolist())  # 7 columns of 6 cells, bottom first


_scores: dict[bytes, np.ndarray] = {}


def move_values(obs: np.ndarray, action_mask: np.ndarray | None = None) -> np.ndarray:
    """``(n, 7)`` game-theoretic score of each column for the side to move of ``(n, 2, 6, 7)`` live boards:
    > 0 the move wins (higher: sooner), 0 draws, < 0 loses (higher: later); ``-inf`` for a full or masked
    column. ValueError for a board already won (nothing is left to play there)."""
    obs = np.asarray(obs)
    boards, _ = boards_of(obs)
    if len(boards) and (wins(boards, 1) | wins(boards, -1)).any():
        raise ValueError("move values need live boards: a board given already has four in a row")
    out = np.full((len(obs), COLS), -np.inf)
    for row, position in enumerate(obs):
        key = np.asarray(position, dtype=bool).tobytes()
        scores = _scores.get(key)
        if scores is None:
            scores = np.full(COLS, -np.inf)
            for col, score in solver().score_all_moves(to_bitbully(position)).items():
                scores[col] = score
            if len(_scores) >= CACHE_SIZE:
                _scores.clear()
            _scores[key] = scores
        out[row] = scores
    if action_mask is not None:
        out[~np.asarray(action_mask, dtype=bool)] = -np.inf
    return out

