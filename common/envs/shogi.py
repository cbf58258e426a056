"""Shogi (9x9) on cshogi, from the learning player's point of view: ``Shogi-v0``.

The rules are cshogi's (a C++ move generator: drops, promotion, no pawn-drop mate, no move into
check), and the learner plays against a pluggable *opponent*, as in ConnectFour-v0: any object
with ``act(obs, action_mask, env_ids) -> actions`` that sees the board from its own side (the
same encoding the learner gets), so one Q-network can play both seats; an opponent may also
define ``start_games(env_ids)`` (self-play pools do: common/envs/selfplay.py). One step is the
learner's move plus the opponent's reply.

The sizes are seed 004's ``model_config``: observations of ``81 * 14`` values and ``2187`` actions.

**Observation**: float32 ``(14, 9, 9)``, from the side of the player who is shown it (rotated 180
degrees when that player moves second). Squares are cshogi's numbering, ``9 * file + rank``, with
file 0 the mover's file 1 and rank 0 the rank farthest from the mover; ``obs[p].flat[s]`` is
square ``s``, the square the actions name too.

- planes 0-7: pawn, lance, knight, silver, bishop, rook, gold, king: +1 where the mover has that
  piece (promoted or not), -1 where the opponent has it;
- plane 8: promoted pieces, +1 the mover's, -1 the opponent's (with planes 0-7: every piece exactly);
- planes 9 and 10: the mover's and the opponent's pieces in hand, counted in the first 38 entries
  of the plane: 18 for pawns, then 4 each for lances, knights, silvers and golds, 2 each for bishops
  and rooks; entry ``j`` of a piece's run is 1 when the hand holds more than ``j`` of them;
- plane 11: 1 everywhere when the mover's king is in check;
- plane 12: how often this position occurred before in the game, over 3 (a fourth time ends it);
- plane 13: 1 everywhere (where the board is, for convolutions that pad with zeros).

**Action**: ``81 * move_type + to``, ``to`` the destination square as above, ``move_type`` one of 27
(dlshogi's move labels, which cshogi.dlshogi.make_move_label computes and a test holds equal):
0-9 a board move by its direction as the mover sees it, up (towards the opponent), up-left,
up-right, left, right, down, down-left, down-right, and the knight's two jumps up-left and
up-right; 10-19 the same moves promoting; 20-26 a drop of a pawn, lance, knight, silver, gold,
bishop or rook. Every legal move has its own id (a board move's origin is the first piece on the
line back from ``to``), so ``info["action_mask"]`` (bool, 2187) marks exactly the legal moves;
an action outside the mask raises ``ValueError``.

**Game end and reward**: +1 win, -1 loss, 0 otherwise. A player with no legal move has lost
(checkmate). A position on the board for the fourth time ends the game as a draw, unless one side
gave check with every move of the last cycle: that side loses (cshogi's repetition rule). After
``max_moves`` moves of both players (default 200, seed 004's) a game still going is cut: a draw,
``truncated`` rather than ``terminated``, since the position itself is not decided (a learner
bootstraps from it). King-entry declarations are not part of these rules. ``result`` (1, 0, -1)
and ``plies`` (moves of both players) are in ``info`` (single env) or ``info["final_info"]``
(vector env) when a game ends; in the vector env also ``opponent``, the label of the game's
opponent, when the opponent has ``game_labels(env_ids)`` (a self-play mixture).

``board_size`` is accepted for seed 004's ``env_config`` and must be 9; ``random_opening`` opens
every game with that many uniformly random moves (at most :data:`MAX_RANDOM_OPENING`), so that
deterministic players meet in many positions. Fixed players by name (:func:`make_player`):
``random`` and ``heuristic`` (:class:`HeuristicPlayer`: takes the most valuable piece it can, else
promotes, else plays at random); both are scored against (:data:`EVALUATION_OPPONENTS`).

cshogi is an optional extra: without it, making the env raises one line naming
``requirements-extras.txt``.
"""

from __future__ import annotations

import itertools
from collections import Counter
from typing import Any, Protocol

import gymnasium as gym
import numpy as np
from gymnasium.vector import AutoresetMode

from common.envs.one_game import OneGame

try:
    import cshogi
except ImportError:  # an optional extra: making the env says how to install it
    cshogi = None

NEEDS_CSHOGI = "Shogi-v0 needs the cshogi package: pip install -r requirements-extras.txt"
BOARD_SIZE = 9
SQUARES = BOARD_SIZE * BOARD_SIZE
PLANES = 14
MOVE_TYPES = 27
ACTIONS = SQUARES * MOVE_TYPES  # 2187
DEFAULT_MAX_MOVES = 200  # seed 004's env_config
MAX_RANDOM_OPENING = 16  # random plies that may open a game
BLACK, WHITE = 0, 1  # cshogi's colours: black (sente) moves first
HAND_SIZES = (18, 4, 4, 4, 4, 2, 2)  # pawns, lances, knights, silvers, golds, bishops, rooks: cshogi's hand order
PROMOTED_PLANE, HAND_PLANE, CHECK_PLANE, REPEAT_PLANE, ONES_PLANE = 8, 9, 11, 12, 13
DROP_TYPE = 20  # move types 20-26 drop a piece of cshogi's hand order
PROMOTING = 10  # move types 10-19 are 0-9 promoting
REPETITIONS = 4  # the fourth occurrence of a position ends the game


class Player(Protocol):
    """Anything that picks one legal action per board, seeing the board as the side to move."""

    def act(self, obs: np.ndarray, action_mask: np.ndarray, env_ids: np.ndarray) -> np.ndarray: ...


def require_cshogi() -> None:
    if cshogi is None:
        raise ImportError(NEEDS_CSHOGI)


# ------------------------------------------------------------------ the encoding

def _direction_table() -> np.ndarray:
    """``(81, 81)`` move type (0-9) of a board move from square ``f`` to ``t`` for black, -1 where no
    piece moves so. A square is ``9 * file + rank``; black moves up, towards rank 0, and its left is
    the higher file."""
    table = np.full((SQUARES, SQUARES), -1, dtype=np.int64)
    for f in range(SQUARES):
        for t in range(SQUARES):
            d_file, d_rank = t // 9 - f // 9, t % 9 - f % 9
            if (d_file, d_rank) == (1, -2):
                table[f, t] = 8
            elif (d_file, d_rank) == (-1, -2):
                table[f, t] = 9
            elif d_file == 0 and d_rank != 0:
                table[f, t] = 0 if d_rank < 0 else 5
            elif d_rank == 0 and d_file != 0:
                table[f, t] = 3 if d_file > 0 else 4
            elif abs(d_file) == abs(d_rank) and d_file != 0:
                table[f, t] = {(True, True): 1, (True, False): 2, (False, True): 6, (False, False): 7}[
                    (d_rank < 0, d_file > 0)]
    return table


DIRECTIONS = _direction_table()


def encode_moves(moves: np.ndarray, turns: np.ndarray | int) -> np.ndarray:
    """The action ids of cshogi moves (ints), each for the side to move ``turns`` (0 black, 1 white)."""
    moves = np.asarray(moves, dtype=np.int64)
    white = np.asarray(turns) == WHITE
    to = moves & 0x7F
    origin = (moves >> 7) & 0x7F  # a square, or 81 + the hand piece for a drop
    promote = (moves >> 14) & 1
    drop = origin >= SQUARES
    to = np.where(white, SQUARES - 1 - to, to)
    origin = np.where(white & ~drop, SQUARES - 1 - origin, origin)
    board_type = DIRECTIONS[np.where(drop, 0, origin), to] + PROMOTING * promote
    move_type = np.where(drop, DROP_TYPE + origin - SQUARES, board_type)
    return move_type * SQUARES + to


FEATURE_PLANES = 104  # cshogi's Board.piece_planes: 14 piece kinds x 2 colours, then 38 x 2 hand planes (unused)
PIECE_KINDS = 14  # pawn, lance, knight, silver, bishop, rook, gold, king, then the six promoted kinds, in that order


def _kind_planes() -> np.ndarray:
    """``(9, 14)``: cshogi's piece kinds -> board planes 0-8 (a promoted piece counts on its piece's plane
    and on the promoted plane)."""
    table = np.zeros((PROMOTED_PLANE + 1, PIECE_KINDS), dtype=np.float32)
    for kind in range(PIECE_KINDS):
        table[kind % 8 if kind < 8 else kind - 8, kind] = 1.0
        if kind >= 8:
            table[PROMOTED_PLANE, kind] = 1.0
    return table


KIND_PLANES = _kind_planes()
HAND_RUNS = np.repeat(np.arange(len(HAND_SIZES)), HAND_SIZES)  # the hand piece of each of the 38 entries
HAND_ENTRIES = np.concatenate([np.arange(n) for n in HAND_SIZES])  # entry j of its piece's run


def observe(boards: list, viewers: np.ndarray, repeats: np.ndarray | None = None) -> np.ndarray:
    """The ``(n, 14, 9, 9)`` float32 observations of cshogi ``boards``, each seen by ``viewers[i]``
    (0 black, 1 white); ``repeats``: earlier occurrences of each position (plane 12).

    The pieces come from cshogi's ``piece_planes`` (filled in C, black's side: its 14 kinds, then
    white's), turned round for a white viewer; reading ``Board.pieces`` (a list of 81 Python ints)
    into numpy took longer than everything else here together."""
    n = len(boards)
    viewers = np.asarray(viewers, dtype=np.int64)
    out = np.zeros((n, PLANES, SQUARES), dtype=np.float32)
    if n == 0:
        return out.reshape(n, PLANES, BOARD_SIZE, BOARD_SIZE)
    features = np.zeros((n, FEATURE_PLANES, BOARD_SIZE, BOARD_SIZE), dtype=np.float32)
    for board, planes in zip(boards, features):
        board.piece_planes(planes)
    features = features.reshape(n, FEATURE_PLANES, SQUARES)
    pieces = features[:, :PIECE_KINDS] - features[:, PIECE_KINDS:2 * PIECE_KINDS]  # black's +1, white's -1
    white = viewers == WHITE
    pieces[white] = -pieces[white][:, :, ::-1]  # the board turned round, the colours swapped
    out[:, :HAND_PLANE] = KIND_PLANES @ pieces
    hands = np.array([b.pieces_in_hand for b in boards], dtype=np.int64)  # (n, colour, 7)
    mine, theirs = hands[np.arange(n), viewers], hands[np.arange(n), 1 - viewers]
    out[:, HAND_PLANE, :len(HAND_RUNS)] = mine[:, HAND_RUNS] > HAND_ENTRIES
    out[:, HAND_PLANE + 1, :len(HAND_RUNS)] = theirs[:, HAND_RUNS] > HAND_ENTRIES
    checked = np.array([b.is_check() and b.turn == v for b, v in zip(boards, viewers)], dtype=np.float32)
    out[:, CHECK_PLANE] = checked[:, None]
    if repeats is not None:
        out[:, REPEAT_PLANE] = np.asarray(repeats, dtype=np.float32)[:, None] / (REPETITIONS - 1)
    out[:, ONES_PLANE] = 1.0
    return out.reshape(n, PLANES, BOARD_SIZE, BOARD_SIZE)


def legal_actions(board) -> tuple[np.ndarray, np.ndarray]:
    """The legal moves of a cshogi ``board`` (ints) and their action ids, in cshogi's order."""
    moves = np.array(list(board.legal_moves), dtype=np.int64)
    return moves, encode_moves(moves, board.turn)


def action_from_usi(board, usi: str) -> int:
    """The action id of a legal move in USI notation (``7g7f``, ``G*5b``) for the side to move on ``board``."""
    move = board.move_from_usi(usi)
    if not move or not board.is_legal(move):
        raise ValueError(f"{usi!r} is not a legal move in {board.sfen()}")
    return int(encode_moves(np.array([move]), board.turn)[0])


def usi_from_action(board, action: int) -> str:
    """The USI notation of the legal move an action id stands for on ``board`` (ValueError if none)."""
    moves, actions = legal_actions(board)
    found = moves[actions == action]
    if not found.size:
        raise ValueError(f"action {action} is no legal move in {board.sfen()}")
    return cshogi.move_to_usi(int(found[0]))


# ------------------------------------------------------------------ fixed players

def sample_weighted(rng: np.random.Generator, weights: np.ndarray) -> np.ndarray:
    cumulative = np.cumsum(weights, axis=1)
    draws = rng.random(len(weights)) * cumulative[:, -1]
    return (cumulative > draws[:, None]).argmax(axis=1)


def sample_legal(rng: np.random.Generator, action_mask: np.ndarray) -> np.ndarray:
    """One uniformly drawn legal action per row of a boolean mask (0 for a row with none).

    Drawn among each row's legal ids rather than over all 2187 columns: a cumulative sum over
    every column cost half of a random game's time."""
    rows, columns = np.nonzero(action_mask)
    counts = np.bincount(rows, minlength=len(action_mask))
    picks = np.cumsum(counts) - counts + (rng.random(len(action_mask)) * counts).astype(np.int64)
    if not len(columns):
        return np.zeros(len(action_mask), dtype=np.int64)
    return np.where(counts > 0, columns[np.minimum(picks, len(columns) - 1)], 0)


class RandomPlayer:
    """Uniform over legal moves."""

    def __init__(self, seed: int | None = None):
        self.rng = np.random.default_rng(seed)

    def act(self, obs: np.ndarray, action_mask: np.ndarray, env_ids: np.ndarray | None = None) -> np.ndarray:
        return sample_legal(self.rng, action_mask)


# Material values by board plane (pawn, lance, knight, silver, bishop, rook, gold, king) and what
# promotion adds to each: the usual rough scale (a promoted minor piece moves as a gold).
PIECE_VALUES = np.array([1, 3, 4, 5, 8, 10, 6, 0], dtype=np.float64)
PROMOTED_EXTRA = np.array([5, 3, 2, 1, 2, 2, 0, 0], dtype=np.float64)
PROMOTION_BONUS = 0.5  # a promoting move that takes nothing still beats a quiet one


class HeuristicPlayer:
    """Material-greedy, one ply, from the observation alone: takes the most valuable piece it can
    (by :data:`PIECE_VALUES`), else promotes, else plays a random legal move; ties drawn at random.
    It never looks at the reply, so it loses pieces to recaptures: cheap, and far from strong."""

    def __init__(self, seed: int | None = None):
        self.rng = np.random.default_rng(seed)

    def act(self, obs: np.ndarray, action_mask: np.ndarray, env_ids: np.ndarray | None = None) -> np.ndarray:
        scores = move_scores(obs)
        scores = np.where(action_mask, scores, -np.inf)
        best = scores == scores.max(axis=1, keepdims=True)
        return sample_legal(self.rng, best & action_mask)


def move_scores(obs: np.ndarray) -> np.ndarray:
    """``(n, 2187)``: the material each action takes (drops take nothing) plus the promotion bonus."""
    n = len(obs)
    planes = np.asarray(obs, dtype=np.float32).reshape(n, PLANES, SQUARES)
    theirs = planes[:, :PROMOTED_PLANE] < 0  # (n, 8, 81): the opponent's piece kinds
    taken = np.einsum("nks,k->ns", theirs, PIECE_VALUES)
    taken += np.einsum("nks,k->ns", theirs, PROMOTED_EXTRA) * (planes[:, PROMOTED_PLANE] < 0)
    scores = np.zeros((n, MOVE_TYPES, SQUARES))
    scores[:, :DROP_TYPE] = taken[:, None, :]
    scores[:, PROMOTING:DROP_TYPE] += PROMOTION_BONUS
    return scores.reshape(n, ACTIONS)


# The opponents evaluation scores a policy against, from both seats (common/evaluate.py and
# parallel_train_dqn.py read it); both may be training opponents too: nothing is held out.
EVALUATION_OPPONENTS = ("random", "heuristic")


def make_player(name: str, seed: int | None = None) -> Player:
    """A fixed player by name: ``random`` or ``heuristic``."""
    players = {"random": RandomPlayer, "heuristic": HeuristicPlayer}
    if name not in players:
        raise ValueError(f"unknown Shogi player {name!r}; known: {', '.join(players)}")
    return players[name](seed)


def _as_player(opponent: Player | str | None, seed: int | None) -> Player:
    if opponent is None:
        return RandomPlayer(seed)
    if isinstance(opponent, str):
        return make_player(opponent, seed)
    remake = getattr(opponent, "remake_fixed_players", None)
    if remake is not None:  # a self-play mixture (common/envs/selfplay.py): its fixed players are Shogi's
        remake(make_player)
    return opponent


def check_settings(board_size: Any, max_moves: Any, random_opening: Any) -> None:
    """One-line ValueError for settings this env cannot play (seed 004's ``env_config`` keys among them)."""
    require_cshogi()
    if board_size != BOARD_SIZE:
        raise ValueError(f"board_size {board_size!r}: Shogi-v0 plays the standard 9x9 board only (board_size 9)")
    if isinstance(max_moves, bool) or not isinstance(max_moves, (int, np.integer)) or max_moves < 1:
        raise ValueError(f"max_moves {max_moves!r}: must be an int >= 1 (moves of both players before a draw)")
    if not 0 <= random_opening <= MAX_RANDOM_OPENING:
        raise ValueError(f"random_opening must be 0..{MAX_RANDOM_OPENING} plies, got {random_opening}")
    if max_moves < random_opening + 2:
        raise ValueError(f"max_moves {max_moves}: must be >= random_opening + 2 = {random_opening + 2}, so that the "
                         "learner moves in every game")


# ------------------------------------------------------------------ vector env

class ShogiVectorEnv(gym.vector.VectorEnv):
    """``num_envs`` games of Shogi stepped together, with same-step autoreset.

    ``learner_first``: True/False fixes the learner's seat (first = black), None draws it per game.
    The opponent acts once for all games that need a reply, in one batched call; cshogi plays
    each board's move, and the observations and masks of all boards are built in numpy at once.
    """

    metadata = {"autoreset_mode": AutoresetMode.SAME_STEP, "render_modes": []}

    def __init__(self, num_envs: int = 1, opponent: Player | str | None = None, learner_first: bool | None = None,
                 seed: int | None = None, max_moves: int = DEFAULT_MAX_MOVES, board_size: int = BOARD_SIZE,
                 random_opening: int = 0):
        check_settings(board_size, max_moves, random_opening)
        self.num_envs, self.max_moves, self.random_opening = num_envs, int(max_moves), random_opening
        self.single_observation_space = gym.spaces.Box(-1.0, 1.0, (PLANES, BOARD_SIZE, BOARD_SIZE), np.float32)
        self.single_action_space = gym.spaces.Discrete(ACTIONS)
        self.observation_space = gym.vector.utils.batch_space(self.single_observation_space, num_envs)
        self.action_space = gym.vector.utils.batch_space(self.single_action_space, num_envs)
        self.learner_first = learner_first
        self.np_random = np.random.default_rng(seed)
        self.opponent = _as_player(opponent, seed)
        self.boards = [cshogi.Board() for _ in range(num_envs)]
        self.learner_colour = np.zeros(num_envs, dtype=np.int64)
        self.plies = np.zeros(num_envs, dtype=np.int64)  # moves of both players in each game
        self.seen: list[Counter] = [Counter() for _ in range(num_envs)]  # position key -> occurrences
        self.masks = np.zeros((num_envs, ACTIONS), dtype=bool)
        self.moves = np.zeros((num_envs, ACTIONS), dtype=np.int64)  # action id -> cshogi move, where legal

    def set_opponent(self, opponent: Player | str) -> None:
        """Replace the opponent; takes effect at the next move."""
        self.opponent = _as_player(opponent, int(self.np_random.integers(2**31)))

    def set_learner_first(self, learner_first: bool | None) -> None:
        """Fix the learner's seat for games that start from now on (None = random per game)."""
        self.learner_first = learner_first

    # -- one board
    def _legal(self, env_ids: np.ndarray) -> None:
        """The masks and the action -> move tables of the boards ``env_ids``, from cshogi's move lists."""
        lists = [list(self.boards[i].legal_moves) for i in env_ids]
        counts = np.array([len(m) for m in lists], dtype=np.int64)
        self.masks[env_ids] = False
        if counts.sum() == 0:
            return
        moves = np.fromiter(itertools.chain.from_iterable(lists), dtype=np.int64, count=int(counts.sum()))
        rows = np.repeat(np.asarray(env_ids, dtype=np.int64), counts)
        turns = np.repeat(np.array([self.boards[i].turn for i in env_ids], dtype=np.int64), counts)
        actions = encode_moves(moves, turns)
        self.masks[rows, actions] = True
        self.moves[rows, actions] = moves

    def _play(self, env_ids: np.ndarray, actions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Play ``actions`` on the boards ``env_ids`` (checked legal first): per board the result for
        the side that moved (1, 0, -1), whether the game ended by the rules, and whether it was cut."""
        actions = np.asarray(actions, dtype=np.int64).reshape(len(env_ids))
        if ((actions < 0) | (actions >= ACTIONS)).any():
            raise ValueError(f"illegal move: actions must be 0..{ACTIONS - 1}, got {actions.tolist()}")
        legal = self.masks[env_ids, actions]
        if not legal.all():
            raise ValueError(f"illegal move(s) {actions[~legal].tolist()} (use info['action_mask'])")
        result = np.zeros(len(env_ids), dtype=np.float32)
        over = np.zeros(len(env_ids), dtype=bool)
        for k, (i, action) in enumerate(zip(env_ids, actions)):
            board = self.boards[i]
            board.push(int(self.moves[i, action]))
            self.plies[i] += 1
            key = board.zobrist_hash()
            self.seen[i][key] += 1
            if self.seen[i][key] >= REPETITIONS:  # the side to move now is the mover's opponent
                over[k] = True
                verdict = board.is_draw()
                result[k] = {cshogi.REPETITION_WIN: -1.0, cshogi.REPETITION_LOSE: 1.0}.get(verdict, 0.0)
        self._legal(env_ids)
        mated = ~self.masks[env_ids].any(axis=1) & ~over
        result[mated], over[mated] = 1.0, True
        cut = ~over & (self.plies[env_ids] >= self.max_moves)
        return result, over, cut

    def _observe(self, env_ids: np.ndarray, viewers: np.ndarray) -> np.ndarray:
        repeats = [self.seen[i][self.boards[i].zobrist_hash()] - 1 for i in env_ids]
        return observe([self.boards[i] for i in env_ids], viewers, repeats)

    # -- games
    def reset(self, *, seed: int | None = None, options: dict | None = None):
        if seed is not None:
            self.np_random = np.random.default_rng(seed)
            if hasattr(self.opponent, "rng"):
                self.opponent.rng = np.random.default_rng(seed + 1)
        every = np.arange(self.num_envs)
        self._start_games(every)
        return self._observe(every, self.learner_colour), {"action_mask": self.masks.copy()}

    def _start_games(self, env_ids: np.ndarray) -> None:
        env_ids = np.asarray(env_ids, dtype=np.int64)
        start_games = getattr(self.opponent, "start_games", None)
        if start_games is not None:
            start_games(env_ids)
        first = self.np_random.random(len(env_ids)) < 0.5 if self.learner_first is None else np.full(
            len(env_ids), bool(self.learner_first))
        self.learner_colour[env_ids] = np.where(first, BLACK, WHITE)
        pending = env_ids
        while pending.size:  # a game that the opening or the opponent's first move ends (hardly ever) starts again
            for i in pending:
                self.boards[i].reset()
                self.plies[i] = 0
                self.seen[i] = Counter([self.boards[i].zobrist_hash()])
            self._legal(pending)
            ended = np.zeros(len(pending), dtype=bool)
            for _ in range(self.random_opening):
                live = np.flatnonzero(~ended)
                _, over, cut = self._play(pending[live], sample_legal(self.np_random, self.masks[pending[live]]))
                ended[live[over | cut]] = True
            turns = np.array([self.boards[i].turn for i in pending], dtype=np.int64)
            replies = np.flatnonzero(~ended & (turns != self.learner_colour[pending]))  # the opponent's turn
            _, over, cut = self._opponent_moves(pending[replies])
            ended[replies[over | cut]] = True
            pending = pending[ended]

    def _opponent_moves(self, env_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if env_ids.size == 0:
            empty = np.zeros(0, dtype=bool)
            return np.zeros(0, dtype=np.float32), empty, empty
        obs = self._observe(env_ids, 1 - self.learner_colour[env_ids])
        actions = np.asarray(self.opponent.act(obs, self.masks[env_ids].copy(), env_ids), dtype=np.int64)
        return self._play(env_ids, actions)

    def step(self, actions):
        every = np.arange(self.num_envs)
        result, over, cut = self._play(every, actions)
        reply = every[~(over | cut)]
        reply_result, reply_over, reply_cut = self._opponent_moves(reply)
        result[reply], over[reply], cut[reply] = 0.0 - reply_result, reply_over, reply_cut  # 0.0 -: no -0.0 draws
        done = over | cut
        obs = self._observe(every, self.learner_colour)
        infos: dict[str, Any] = {}
        if done.any():
            infos["final_obs"] = obs.copy()
            infos["_final_obs"] = done.copy()
            infos["final_info"] = {"result": np.where(done, result, 0.0), "_result": done.copy(),
                                   "plies": np.where(done, self.plies, 0), "_plies": done.copy()}
            game_labels = getattr(self.opponent, "game_labels", None)
            if game_labels is not None:  # who each game was against (a self-play pool's snapshot id)
                labels = np.zeros(self.num_envs)
                labels[done] = game_labels(np.flatnonzero(done))
                infos["final_info"].update(opponent=labels, _opponent=done.copy())
            finished = np.flatnonzero(done)
            self._start_games(finished)
            obs[finished] = self._observe(finished, self.learner_colour[finished])
        infos["action_mask"] = self.masks.copy()
        return obs, result.copy(), over.copy(), cut.copy(), infos

    def render_text(self, index: int = 0) -> str:
        """The board as cshogi writes it (CSA-like: + black, - white), the learner's colour under it."""
        seat = "black (first)" if self.learner_colour[index] == BLACK else "white (second)"
        return f"{self.boards[index]}\nlearner: {seat}, move {self.plies[index]}"


# ------------------------------------------------------------------ single env

class ShogiEnv(OneGame):
    """One game of Shogi against ``opponent`` (default: a random player).

    ``reset(options={"learner_first": True/False})`` fixes the seat for that game.
    """

    metadata = {"render_modes": ["ansi"], "render_fps": 1}

    def __init__(self, opponent: Player | str | None = None, learner_first: bool | None = None,
                 render_mode: str | None = None, max_moves: int = DEFAULT_MAX_MOVES, board_size: int = BOARD_SIZE,
                 random_opening: int = 0):
        self._vec = ShogiVectorEnv(1, opponent=opponent, learner_first=learner_first, max_moves=max_moves,
                                   board_size=board_size, random_opening=random_opening)
        self.observation_space = self._vec.single_observation_space
        self.action_space = self._vec.single_action_space
        self.render_mode = render_mode
        self._done = True

    @property
    def board(self):
        """A copy of the cshogi Board of the game."""
        return self._vec.boards[0].copy()

    @property
    def learner_colour(self) -> int:
        """0 when the learner plays black (moves first), 1 when white."""
        return int(self._vec.learner_colour[0])

    def _obs(self) -> np.ndarray:
        return self._vec._observe(np.arange(1), self._vec.learner_colour)[0]

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        self._start_game(seed, options)
        self._done = False
        return self._obs(), {"action_mask": self._vec.masks[0].copy()}

    def set_position(self, sfen: str, plies: int = 0) -> dict:
        """Load a position (SFEN) with the learner as the side to move there, ``plies`` moves already
        played; returns the info (``action_mask``) of the learner's move."""
        vec = self._vec
        board = vec.boards[0]
        board.set_sfen(sfen)
        vec.learner_colour[0], vec.plies[0] = board.turn, plies
        vec.seen[0] = Counter([board.zobrist_hash()])
        vec._legal(np.arange(1))
        self._done = False
        return {"action_mask": vec.masks[0].copy()}

    def step(self, action):
        if self._done:
            raise RuntimeError("step() called on a finished game; call reset()")
        vec, one = self._vec, np.arange(1)
        result, over, cut = vec._play(one, np.array([int(action)]))
        if not (over[0] or cut[0]):
            reply_result, over, cut = vec._opponent_moves(one)
            result = 0.0 - reply_result
        self._done = bool(over[0] or cut[0])
        info: dict[str, Any] = {"action_mask": vec.masks[0].copy()}
        if self._done:
            info["result"], info["plies"] = float(result[0]), int(vec.plies[0])
        return self._obs(), float(result[0]), bool(over[0]), bool(cut[0]), info

    def render(self):
        return self._vec.render_text(0)
