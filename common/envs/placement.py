"""Games where every move puts one mark of the mover on an empty cell and nothing else changes (Connect Four,
tic-tac-toe): the opponent's side of a game rebuilt from the learner's record of it.

A two-player env with the opponent inside records only the learner's moves: ``obs`` T+1 (every board the learner
moved on and the final one, two planes, the learner's marks first), ``actions`` T, ``rewards`` T and
``terminated``. In a placement game each reply is the one mark that differs between the board just after the
learner's move and the next board, so the whole game can be rebuilt: :func:`other_seat` is the game as the
opponent played it, :func:`plies` both players' moves in turn (common/envs/symmetry.py, ``parallel_train_dqn.py
--learn-both-seats`` and ``--negamax``). A game's :class:`Placement` holds what the rebuilding needs of its rules.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Placement:
    """The rules of a placement game on a ``(rows, cols)`` board, as far as rebuilding a recorded game needs them."""

    landing: Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]  # (boards, actions) -> (rows, cols)
    action_at: Callable[[np.ndarray, np.ndarray], np.ndarray]  # (rows, cols) of a new mark -> the move
    legal: Callable[[np.ndarray], np.ndarray]  # (n, rows, cols) boards -> (n, actions) bool


def observe(boards: np.ndarray, piece: int = 1) -> np.ndarray:
    """The ``(n, 2, rows, cols)`` float32 observation of ``boards`` (+1/-1 marks) for the side playing ``piece``."""
    return np.stack([boards == piece, boards == -piece], axis=1).astype(np.float32)


def _replies(rules: Placement, episode: dict[str, Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """What the learner's record implies about its opponent: the boards the learner moved on (+1 = learner),
    each board just after the learner's move (the one the opponent was shown), whether the opponent replied to
    it, and each reply's move."""
    obs = np.asarray(episode["obs"])
    actions = np.asarray(episode["actions"], dtype=np.int64)
    boards = (obs[:, 0] - obs[:, 1]).astype(np.int8)
    steps = len(actions)
    after = boards[:-1].copy()
    rows, cols = rules.landing(after, actions)
    if (after[np.arange(steps), rows, cols] != 0).any():
        raise ValueError("the record holds a move onto a taken cell")
    after[np.arange(steps), rows, cols] = 1
    replied = np.ones(steps, dtype=bool)
    replied[-1] = (boards[-1] != after[-1]).any()  # no reply when the learner's move ended the game
    new_mark = boards[1:][replied] != after[replied]
    if (new_mark.reshape(len(new_mark), -1).sum(axis=1) != 1).any():
        raise ValueError("the boards of this record do not follow from its moves one reply apart")
    cells = new_mark.reshape(len(new_mark), -1).argmax(axis=1)
    reply_rows, reply_cols = np.divmod(cells, boards.shape[2])
    return boards, after, replied, rules.action_at(reply_rows, reply_cols).astype(np.int64)


def other_seat(rules: Placement, episode: dict[str, Any]) -> dict[str, Any] | None:
    """The same game as the opponent played it, rebuilt from the learner's record of it, or None.

    Returns the opponent's episode in the record's form: the boards it moved on seen from its side, its moves,
    its rewards (all 0 but the last, which is minus the learner's) and its legal-move masks. None for a game cut
    before its end (the opponent's next position is not in the record) or one where the opponent made no
    recorded move. A game the opponent opened loses that first move: the record starts after it.
    """
    if not episode["terminated"]:
        return None
    boards, after, replied, replies = _replies(rules, episode)
    if not replied.any():
        return None
    seen = np.concatenate([after[replied], boards[-1:]])
    rewards = np.zeros(int(replied.sum()), dtype=np.float32)
    rewards[-1] = -float(episode["rewards"][-1])
    return {"obs": observe(seen, -1), "actions": replies, "rewards": rewards, "terminated": True,
            "masks": rules.legal(-seen)}


def plies(rules: Placement, episode: dict[str, Any]) -> dict[str, Any]:
    """The learner's record of a game as the alternating moves of both players, one ply at a time.

    Every observation is the board seen by the side to move there (as the self-play network sees every board),
    every action that side's move, and every reward what the move earned the side that made it: 1 for the move
    that wins, 0 otherwise (a loss shows as the winner's 1 on the next ply). The value of a ply is then minus the
    value of the next one, so a learner bootstraps each ply with ``-gamma`` times the best value of the position
    it leads to (negamax), and learns from every move of both players whoever made them. Same form as the record
    (``obs`` P+1, ``actions``, ``rewards``, ``terminated``, ``masks``); a game cut before its end ends on the
    learner's next board, to bootstrap from. A game the opponent opened loses that first move.
    """
    boards, after, replied, replies = _replies(rules, episode)
    steps = len(after)
    both = np.empty((2 * steps, *boards.shape[1:]), dtype=np.int8)  # each step: the learner's board, then the reply's
    both[0::2], both[1::2] = boards[:-1], -after  # the opponent's side: its own marks +1
    moves = np.zeros(2 * steps, dtype=np.int64)
    moves[0::2] = episode["actions"]
    moves[1::2][replied] = replies
    if replied[-1]:  # the reply ended the game (or the record was cut): the last board follows it
        seen = np.concatenate([both, boards[-1:]])
    else:  # the learner's move ended the game: the board after it is the last
        seen, moves = both, moves[:-1]
    rewards = np.zeros(len(moves), dtype=np.float32)
    rewards[-1] = float(bool(episode["terminated"]) and float(episode["rewards"][-1]) != 0)  # the winner moved last
    return {"obs": observe(seen, 1), "actions": moves, "rewards": rewards,
            "terminated": bool(episode["terminated"]), "masks": rules.legal(seen)}
