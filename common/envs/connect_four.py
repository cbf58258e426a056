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
game ends; in the vector env also ``opponent``, the label of the game's opponent, when the
opponent has ``game_labels(env_ids)`` (a self-play mixture: common/envs/selfplay.py).

Render modes of the single env: ``"ansi"`` (X learner, O opponent) and ``"rgb_array"`` (a blue
board with red learner and yellow opponent discs, uint8 ``(288, 336, 3)``).

Symmetry: the game mirrored left-right (:data:`MIRROR`, column ``c`` -> ``6 - c``), which both env
classes declare as ``symmetries`` for replay augmentation (common/envs/symmetry.py). Both also
declare :func:`other_seat`, the opponent's side of a recorded game, so that a learner can learn
from the moves of both players, and :func:`plies`, the recorded game as both players' moves in turn,
each from the side to move, so that a learner can learn negamax values.

Fixed players by name (:func:`make_player`): ``random``, ``heuristic``, and the search players
``search1`` .. ``search4`` (:class:`SearchPlayer`), which are held out of every training mix
(:data:`HELD_OUT_PLAYERS`, :func:`check_training_opponents`) so that evaluation against them
(:data:`EVALUATION_OPPONENTS`) measures play the policy never trained against.

Decision-time lookahead over a learned Q-network (:func:`lookahead_values`, :class:`LookaheadPlayer`):
a shallow negamax whose terminal wins and draws come from the rules and whose leaves are the
network's best value for the side to move there (the self-play network sees every board as the
side to move), all children of a ply expanded in one numpy batch and the leaves scored in one
network call; depth 0 is the network's greedy play. ``python -m common.evaluate RUN --search-depth 2``
plays a run's policy through it (common/evaluate.py finds it here by the module's ``LookaheadPlayer``).
"""

from __future__ import annotations

from typing import Any, Protocol

import gymnasium as gym
import numpy as np
from gymnasium.vector import AutoresetMode

from common.envs import placement
from common.envs.one_game import OneGame
from common.envs.placement import Placement, observe
from common.envs.symmetry import Symmetry

ROWS, COLS = 6, 7
LEARNER, OPPONENT = 1, -1
CENTRE_WEIGHTS = np.array([1, 2, 3, 4, 3, 2, 1], dtype=np.float64)
MAX_RANDOM_OPENING = 6  # random plies that may open a game: the first four in a row takes seven
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


def boards_of(obs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The ``(n, 6, 7)`` boards of ``(n, 2, 6, 7)`` observations (+1 = the side whose plane is first, -1 =
    the other; :func:`observe` backwards) and their ``(n, 7)`` column heights."""
    boards = np.asarray(obs[:, 0]).astype(np.int8) - np.asarray(obs[:, 1]).astype(np.int8)
    return boards, (boards != 0).sum(axis=1)


def winning_drops(boards: np.ndarray, heights: np.ndarray, legal: np.ndarray | None = None) -> np.ndarray:
    """``(n, 7)`` bool: the columns (of ``legal``, by default those not full) where the side whose discs are +1
    in ``boards`` completes four by dropping a disc."""
    legal = legal_mask(heights) if legal is None else legal
    parent, col = np.nonzero(legal)
    children = boards[parent].copy()
    children[np.arange(len(parent)), heights[parent, col], col] = 1
    out = np.zeros((len(boards), COLS), dtype=bool)
    out[parent, col] = wins(children, 1)
    return out


def winning_moves(obs: np.ndarray, action_mask: np.ndarray, plane: int) -> np.ndarray:
    """``(n, 7)`` bool: columns where the player of ``plane`` would complete four at once."""
    boards, heights = boards_of(obs)  # +1 = side to move, -1 = the other side
    return winning_drops(boards if plane == 0 else -boards, heights, np.asarray(action_mask, dtype=bool))


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


# ------------------------------------------------------------------ search players (held out of training)

def _windows() -> np.ndarray:
    """``(42, 69)`` 0/1: which cells (row * 7 + column) make up each window of four in a line."""
    lines = []
    for row in range(ROWS):
        for col in range(COLS):
            for d_row, d_col in ((0, 1), (1, 0), (1, 1), (-1, 1)):
                cells = [(row + k * d_row, col + k * d_col) for k in range(4)]
                if all(0 <= r < ROWS and 0 <= c < COLS for r, c in cells):
                    lines.append([r * COLS + c for r, c in cells])
    out = np.zeros((ROWS * COLS, len(lines)), dtype=np.float32)
    for w, cells in enumerate(lines):
        out[cells, w] = 1.0
    return out


WINDOWS = _windows()
# Leaf score of one window by (discs of the side scored, discs of the other side): an open
# three is worth more than two open twos; a window holding both colours is dead.
WINDOW_SCORES = np.zeros((5, 5), dtype=np.float32)
WINDOW_SCORES[2, 0], WINDOW_SCORES[3, 0] = 2.0, 5.0
WINDOW_SCORES[0, 2], WINDOW_SCORES[0, 3] = -2.0, -5.0
CENTRE_SCORES = np.tile(np.array([0, 1, 2, 3, 2, 1, 0], dtype=np.float32), ROWS)  # per disc, by its cell
WIN_SCORE = 1_000_000.0  # above any heuristic score (at most 69 * 5 + 3 * 21 in absolute value)
# Added to a window's gain when one more disc completes four: far above the rest of a cell's gain
# (at most 5 for each of the at most 13 windows through a cell), so a gain above THREAT / 2 is a win.
THREAT = 1024.0
SEARCH_CHUNK = 64  # root boards searched together: bounds memory at depth 4 (64 * 7**3 boards at the last ply)


def _window_tables() -> tuple[np.ndarray, np.ndarray]:
    """Lookups by window code ``5 * mine + theirs``: the window's score, and what one more disc
    of mine adds to it, plus ``THREAT`` when that disc completes four (a live window of three)."""
    score, added = np.zeros(25, dtype=np.float32), np.zeros(25, dtype=np.float32)
    for mine in range(5):
        for theirs in range(5 - mine):
            code = 5 * mine + theirs
            score[code] = WINDOW_SCORES[mine, theirs]
            if mine < 4:
                added[code] = WINDOW_SCORES[mine + 1, theirs] - score[code]
    added[5 * 3] += THREAT
    return score, added


WINDOW_SCORE_BY_CODE, WINDOW_GAIN_BY_CODE = _window_tables()
CELL_CODES = np.array([1, 0, 5], dtype=np.float32)  # by cell + 1: theirs, empty, mine
CELL_WINDOWS = np.ascontiguousarray(WINDOWS.T)  # (69, 42)
CENTRE_BY_CELL = CENTRE_SCORES.astype(np.int16)
MATMUL_BLOCK = 64  # 64 x 42 x 69 multiply-adds: below OpenBLAS's threshold for using threads


def _blocked_matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a @ b`` as a stack of products of ``MATMUL_BLOCK`` rows, each small enough that OpenBLAS
    runs it on one thread: on busy cores (rollout workers) its threads cost more than they give
    (a depth-4 search took 2-4 times as long with them)."""
    n = len(a)
    pad = -n % MATMUL_BLOCK
    if pad:
        a = np.concatenate([a, np.zeros((pad, a.shape[1]), a.dtype)])
    return (a.reshape(-1, MATMUL_BLOCK, a.shape[1]) @ b).reshape(-1, b.shape[1])[:n]


def _one_ply(boards: np.ndarray, heights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For each column of ``(n, 6, 7)`` live boards (+1 = the side to move): whether dropping
    a disc there wins, and the leaf score of the board it makes for that side; ``(n, 7)`` each.

    Computed from the parent board without building the children: a disc changes only the
    windows through its cell, so the gain of every cell comes out of one matrix product.
    """
    n = len(boards)
    flat = boards.reshape(n, ROWS * COLS)
    codes = _blocked_matmul(CELL_CODES[flat + 1], WINDOWS).astype(np.int32)  # (n, 69): 5 * mine + theirs
    score = WINDOW_SCORE_BY_CODE[codes].sum(axis=1) + np.einsum("ij,j->i", flat, CENTRE_BY_CELL)
    gain = _blocked_matmul(WINDOW_GAIN_BY_CODE[codes], CELL_WINDOWS)  # (n, 42): what a disc at each cell adds
    cells = np.minimum(heights, ROWS - 1) * COLS + np.arange(COLS)  # the cell each column's disc lands on
    gain = np.take_along_axis(gain, cells, axis=1)
    won = gain > THREAT / 2
    return won, score[:, None] + gain + CENTRE_SCORES[cells]


def move_values(boards: np.ndarray, heights: np.ndarray, depth: int, root: bool = True) -> np.ndarray:
    """``(n, 7)`` depth-``depth`` negamax value of each column for the side to move (+1 on
    live ``boards``); ``-inf`` for a full column.

    Full width and vectorized: every legal move of every board is expanded at once, one
    numpy batch per ply, and only games that go on are expanded further. A win scores
    ``WIN_SCORE + plies left`` (so a quicker win is worth more, a later loss costs less), a
    full board 0, and a leaf the window score of the side that just moved (:func:`_one_ply`).
    Below the ``root``, a board with a winning move is not searched further: nothing can beat
    that move, so only the row's maximum (all the parent reads) is exact there.
    """
    won, score = _one_ply(boards, heights)
    legal = heights < ROWS
    fills = (heights.sum(axis=1) == ROWS * COLS - 1)[:, None]  # the move fills the board: a draw
    values = np.where(won, WIN_SCORE + depth, np.where(fills, 0.0, score if depth == 1 else np.nan))
    values[~legal] = -np.inf
    if depth > 1:
        search = np.isnan(values) if root else np.isnan(values) & ~(won & legal).any(axis=1, keepdims=True)
        values[np.isnan(values)] = -np.inf
        parent, col = np.nonzero(search)
        if parent.size:  # the reply, seen from the other side: negamax
            children, child_heights = _play(boards, heights, parent, col)
            values[parent, col] = -move_values(-children, child_heights, depth - 1, root=False).max(axis=1)
    return values


def _play(boards: np.ndarray, heights: np.ndarray, parent: np.ndarray,
          col: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The boards (and heights) after the side to move (+1) drops a disc in column ``col[i]`` of board
    ``parent[i]``: new arrays, one per move, the parents untouched."""
    children, child_heights = boards[parent], heights[parent]  # copies (fancy indexing)
    k = np.arange(parent.size)
    children[k, child_heights[k, col], col] = 1
    child_heights[k, col] += 1
    return children, child_heights


class SearchPlayer:
    """Depth-limited negamax with a window heuristic at the leaves; ties broken at random.

    Exactly what negamax with alpha-beta pruning at ``depth`` plies chooses: pruning skips
    moves that cannot change the root's values, and this search is its vectorized
    full-width form (:func:`move_values`), which numpy evaluates far faster than a pruned
    search in pure Python (tests/test_connect_four_search.py checks that the two agree).
    Among equally valued columns one is drawn uniformly with ``seed``'s generator. These
    players are for evaluation only (see :data:`HELD_OUT_PLAYERS`).
    """

    def __init__(self, depth: int, seed: int | None = None):
        if depth < 1:
            raise ValueError(f"search depth must be >= 1, got {depth}")
        self.depth = depth
        self.rng = np.random.default_rng(seed)

    def values(self, obs: np.ndarray, action_mask: np.ndarray | None = None) -> np.ndarray:
        """``(n, 7)`` negamax value of each column (``-inf`` where the mask or the board forbids it)."""
        boards, heights = boards_of(obs)  # +1 = the side to move
        out = np.concatenate([move_values(boards[i:i + SEARCH_CHUNK], heights[i:i + SEARCH_CHUNK], self.depth)
                              for i in range(0, len(boards), SEARCH_CHUNK)]) if len(boards) else np.zeros((0, COLS))
        if action_mask is not None:
            out[~np.asarray(action_mask, dtype=bool)] = -np.inf
        return out

    def act(self, obs: np.ndarray, action_mask: np.ndarray, env_ids: np.ndarray | None = None) -> np.ndarray:
        values = self.values(np.asarray(obs), action_mask)
        best = values == values.max(axis=1, keepdims=True)  # the scores are whole numbers: ties are exact
        return sample_legal(self.rng, best)


SEARCH_DEPTHS = (1, 2, 3, 4)
# Players no training mix may contain: evaluation against them measures what a policy learned
# beyond its own opponents. A script checks its mix with check_training_opponents().
HELD_OUT_PLAYERS = tuple(f"search{depth}" for depth in SEARCH_DEPTHS)
# The opponents evaluation scores a policy against, from both seats.
EVALUATION_OPPONENTS = ("random", "heuristic", *HELD_OUT_PLAYERS)


def check_training_opponents(names) -> None:
    """Raise ValueError when a training opponent mix (names, or a dict of name -> share) names a
    held-out player, whatever its share."""
    held_out = [name for name in names if name in HELD_OUT_PLAYERS]
    if held_out:
        raise ValueError(f"training opponents {held_out} are held out for evaluation: "
                         f"{', '.join(HELD_OUT_PLAYERS)} may never be in a training mix")


def make_player(name: str, seed: int | None = None) -> Player:
    """A fixed player by name: ``random``, ``heuristic``, or ``search1`` .. ``search4``."""
    players = {"random": RandomPlayer, "heuristic": HeuristicPlayer,
               **{f"search{d}": (lambda s, d=d: SearchPlayer(d, s)) for d in SEARCH_DEPTHS}}
    if name not in players:
        raise ValueError(f"unknown player {name!r}; known: {', '.join(players)}")
    return players[name](seed)


def play_match(first: Player, second: Player, games: int) -> np.ndarray:
    """``games`` games of ``first`` (moving first) against ``second``, all in one batch: the
    result of each from ``first``'s side (1 win, 0 draw, -1 loss)."""
    boards = np.zeros((games, ROWS, COLS), dtype=np.int8)
    heights = np.zeros((games, COLS), dtype=np.int64)
    result = np.zeros(games, dtype=np.int64)
    live = np.arange(games)
    for turn in range(ROWS * COLS):
        if live.size == 0:
            break
        player, piece = (first, LEARNER) if turn % 2 == 0 else (second, OPPONENT)
        actions = player.act(observe(boards[live], piece), legal_mask(heights[live]), live)
        drop(boards, heights, live, np.asarray(actions, dtype=np.int64), piece)
        won = wins(boards[live], piece)
        result[live[won]] = piece
        live = live[~won & (heights[live] < ROWS).any(axis=1)]
    return result


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


# ------------------------------------------------------------------ lookahead over a learned Q-network

LOOKAHEAD_LEAVES = 1 << 15  # boards per network call at most: bounds memory at depth 4 and beyond


def lookahead_values(q_values_fn, obs: np.ndarray, depth: int, action_mask: np.ndarray | None = None) -> np.ndarray:
    """``(n, 7)`` depth-``depth`` negamax value of each column for the side to move, with the
    learned ``q_values_fn`` at the leaves; ``-inf`` where the mask or the board forbids a move.

    ``q_values_fn(obs) -> (m, 7)`` maps observations of the side to move (as :func:`observe`
    makes them) to its values, as a self-play Q-network does. Depth 0 is ``q_values_fn`` itself.
    Deeper, the rules decide what they can: a move that completes four scores ``WIN_SCORE`` plus
    the plies left (so a quicker win is worth more and a later loss costs less), one that fills
    the board 0, and the network scores the position after ``depth`` plies by the best value of the
    side to move there, negated back up (negamax). Below the root a board with a winning move is
    not expanded further (nothing beats that move). Every ply is expanded at once in numpy, and the
    leaves of up to ``LOOKAHEAD_LEAVES`` boards go to the network in one call.
    """
    if depth < 0:
        raise ValueError(f"lookahead depth must be >= 0, got {depth}")
    obs = np.asarray(obs, dtype=np.float32)
    boards, heights = boards_of(obs)  # +1 = the side to move
    roots = max(1, LOOKAHEAD_LEAVES // COLS ** depth)  # root boards per chunk
    values = np.concatenate([_lookahead(q_values_fn, boards[i:i + roots], heights[i:i + roots], depth, True)
                             for i in range(0, len(boards), roots)]) if len(boards) else np.zeros((0, COLS))
    if action_mask is not None:
        values[~np.asarray(action_mask, dtype=bool)] = -np.inf
    return values


def _lookahead(q_values_fn, boards: np.ndarray, heights: np.ndarray, depth: int, root: bool) -> np.ndarray:
    legal = heights < ROWS
    if depth == 0:
        values = np.array(q_values_fn(observe(boards, LEARNER)), dtype=np.float64).reshape(len(boards), COLS)
        values[~legal] = -np.inf
        return values
    values = np.full((len(boards), COLS), -np.inf)
    parent, col = np.nonzero(legal)
    children, child_heights = _play(boards, heights, parent, col)
    won = wins(children, 1)
    full = child_heights.sum(axis=1) == ROWS * COLS
    values[parent[won], col[won]] = WIN_SCORE + depth
    values[parent[full & ~won], col[full & ~won]] = 0.0
    go = ~won & ~full
    if not root:  # the side to move wins here: its other moves cannot change the parent's value
        go &= ~np.isin(parent, parent[won])
    if go.any():
        replies = _lookahead(q_values_fn, -children[go], child_heights[go], depth - 1, False)  # the other side's view
        values[parent[go], col[go]] = -replies.max(axis=1)
    return values


class LookaheadPlayer:
    """Plays the column of highest :func:`lookahead_values` (a shallow negamax over a learned
    Q-network, as TD-Gammon searched 2 plies over its network); ties broken at random with
    ``seed``'s generator; masked or full columns never chosen. Depth 0 plays the network greedily."""

    def __init__(self, q_values_fn, depth: int, seed: int | None = None):
        if depth < 0:
            raise ValueError(f"lookahead depth must be >= 0, got {depth}")
        self.q_values_fn, self.depth = q_values_fn, depth
        self.rng = np.random.default_rng(seed)

    def values(self, obs: np.ndarray, action_mask: np.ndarray | None = None) -> np.ndarray:
        return lookahead_values(self.q_values_fn, obs, self.depth, action_mask)

    def act(self, obs: np.ndarray, action_mask: np.ndarray | None = None,
            env_ids: np.ndarray | None = None) -> np.ndarray:
        obs = np.asarray(obs)
        if action_mask is None:
            action_mask = legal_mask(boards_of(obs)[1])
        values = self.values(obs, action_mask)
        return sample_legal(self.rng, values == values.max(axis=1, keepdims=True))


# ------------------------------------------------------------------ symmetry

def mirror_columns(obs: np.ndarray) -> np.ndarray:
    """Boards mirrored left-right: the last observation axis is the column."""
    return obs[..., ::-1]


# The rules and the fixed players' preferences are the same mirrored, so a position mirrored with its
# move mirrored (column c -> 6 - c) is worth what the original is (common/envs/symmetry.py).
MIRROR = Symmetry("mirror", mirror_columns, tuple(range(COLS - 1, -1, -1)))


# ------------------------------------------------------------------ the other seat

def _landing(boards: np.ndarray, columns: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Row 0 is the bottom: a disc lands on its column's first empty cell (a full column's top cell, taken)."""
    return np.minimum((boards[np.arange(len(boards)), :, columns] != 0).sum(axis=1), ROWS - 1), columns


RULES = Placement(landing=_landing, action_at=lambda rows, cols: cols,
                  legal=lambda boards: legal_mask((boards != 0).sum(axis=1)))


def other_seat(episode: dict[str, Any]) -> dict[str, Any] | None:
    """The same game as the opponent played it, rebuilt from the learner's record of it, or None
    (common/envs/placement.py)."""
    return placement.other_seat(RULES, episode)


def plies(episode: dict[str, Any]) -> dict[str, Any]:
    """The learner's record of a game as the alternating moves of both players, one ply at a time, each seen by
    the side to move (common/envs/placement.py)."""
    return placement.plies(RULES, episode)


# ------------------------------------------------------------------ vector env

class ConnectFourVectorEnv(gym.vector.VectorEnv):
    """``num_envs`` games stepped together in numpy, with same-step autoreset.

    ``learner_first``: True/False fixes the learner's seat, None draws it per game.
    ``random_opening``: every game opens with this many uniformly random moves (0-6 plies, the
    first player's first), so that games between deterministic players start from many positions.
    The opponent acts once for all games that need a reply, in one batched call.
    """

    metadata = {"autoreset_mode": AutoresetMode.SAME_STEP, "render_modes": []}
    symmetries = (MIRROR,)
    other_seat = staticmethod(other_seat)  # what learning from both seats uses (common/envs/symmetry.py)
    plies = staticmethod(plies)  # what negamax targets use (common/envs/symmetry.py)

    def __init__(self, num_envs: int = 1, opponent: Player | str | None = None,
                 learner_first: bool | None = None, seed: int | None = None,
                 max_episode_steps: int | None = None,  # games end by themselves within 21 steps
                 random_opening: int = 0):
        if not 0 <= random_opening <= MAX_RANDOM_OPENING:
            raise ValueError(f"random_opening must be 0..{MAX_RANDOM_OPENING} plies (no game is decided that "
                             f"early), got {random_opening}")
        self.num_envs = num_envs
        self.random_opening = random_opening
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
        learner_first = _seat_draw(self.np_random, self.learner_first, len(env_ids))
        for ply in range(self.random_opening):  # uniformly random moves of both sides, the first player's first
            piece = np.where(learner_first == (ply % 2 == 0), LEARNER, OPPONENT)
            columns = sample_legal(self.np_random, legal_mask(self.heights[env_ids]))
            self.boards[env_ids, self.heights[env_ids, columns], columns] = piece
            self.heights[env_ids, columns] += 1
        self._opponent_moves(env_ids[learner_first == (self.random_opening % 2 == 1)])  # where it is its turn

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
            game_labels = getattr(self.opponent, "game_labels", None)
            if game_labels is not None:  # who each game was against (a self-play pool's snapshot id)
                labels = np.zeros(self.num_envs)
                labels[done] = game_labels(np.flatnonzero(done))
                infos["final_info"].update(opponent=labels, _opponent=done.copy())
            self._start_games(np.flatnonzero(done))
            obs = observe(self.boards)
        infos["action_mask"] = legal_mask(self.heights)
        return obs, rewards, terminations, truncations, infos

    def render_text(self, index: int = 0) -> str:
        symbols = {LEARNER: "X", OPPONENT: "O", 0: "."}
        rows = ["".join(symbols[int(v)] for v in self.boards[index, r]) for r in reversed(range(ROWS))]
        return "\n".join(rows + ["0123456"])


# ------------------------------------------------------------------ single env

class ConnectFourEnv(OneGame):
    """One game of Connect Four against ``opponent`` (default: a random player).

    ``reset(options={"learner_first": True/False})`` fixes the seat for that game.
    """

    metadata = {"render_modes": ["ansi", "rgb_array"], "render_fps": 2}
    symmetries = (MIRROR,)  # what replay augmentation may use (common/envs/symmetry.py)
    other_seat = staticmethod(other_seat)  # what learning from both seats uses (common/envs/symmetry.py)
    plies = staticmethod(plies)  # what negamax targets use (common/envs/symmetry.py)

    def __init__(self, opponent: Player | str | None = None, learner_first: bool | None = None,
                 render_mode: str | None = None, random_opening: int = 0):
        self.observation_space = gym.spaces.Box(0.0, 1.0, (2, ROWS, COLS), np.float32)
        self.action_space = gym.spaces.Discrete(COLS)
        self.render_mode = render_mode
        self._vec = ConnectFourVectorEnv(1, opponent=opponent, learner_first=learner_first,
                                         random_opening=random_opening)
        self._done = True

    @property
    def board(self) -> np.ndarray:
        """The ``(6, 7)`` board: +1 learner, -1 opponent, 0 empty; row 0 at the bottom."""
        return self._vec.boards[0].copy()

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        self._start_game(seed, options)
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
