"""An n-tuple value function for Connect Four learned by TD self-play, in numpy.

After Thill, Bagheri and Konen's n-tuple agents for Connect-4: the value of a board is ``tanh`` of a sum
of look-up table (LUT) entries, one per *tuple* (a fixed list of cells, here random walks of adjacent
cells drawn from a seed), each indexed by the states of its cells. A cell is in one of four states:
0 empty and not yet playable, 1 the first player's disc, 2 the second player's, 3 empty and playable
(the next disc of its column lands there); telling the two kinds of empty apart is what the published
agents found worth it. Each tuple is also read on the board mirrored left-right into the same LUT, so
mirrored boards are worth the same and share what is learned. There are two sets of LUTs, one for
boards the first player has just moved on and one for the second player's, so a tuple can learn that
the same pattern is worth differently to the two seats (Connect Four's odd and even threats). Colours
by seat rather than by side to move keep a board's indices valid from one ply to the next: a move
changes two cells, so the trainer updates each game's indices by adding what the disc changes instead
of reading all 42 cells again.

**Afterstate values.** :meth:`NTupleValue.values` scores a board for the side that *just moved* (whose
discs are +1 in the boards passed to it): +1 a win, -1 a loss. The side to move picks the move whose
afterstate is worth most to itself: four in a row is worth 1 and a full board 0 by the rules, every
other afterstate the learned value. The weights are one flat float32 array, so they can live in shared
memory.

**Self-play TD** (:func:`train`): thousands of games are played in lockstep, both sides greedy over
afterstate values with epsilon-greedy exploration and a few uniformly random opening plies. After every
ply the afterstate the previous mover left is moved toward minus the best afterstate value the side now
to move found (negamax TD(0) with a max target, so exploring moves do not bias the targets; an immediate
win there is worth 1 to the mover, hence -1 as the target). With ``td_lambda`` above 0 the update is
TD(lambda) in its forward view: each afterstate waits ``horizon`` plies (or to the game's end), gathering
the TD errors after it, the k-th weighted by (-lambda) ** k (the sign alternates: every other afterstate is
the opponent's), and stops gathering at a move worth less than the best, whose consequences the greedy
player would not have met (Watkins' cut); it then moves once by the sum. All the games' updates of a ply
are applied at once (torch's ``index_add_`` on the numpy weights), each LUT entry moving by the mean of the
updates that hit it in that ply, so the thousands of games that share an entry move it like one game would.

Boards are those of common/envs/connect_four.py: ``(n, 6, 7)`` int8, +1/-1/0, row 0 the bottom.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from common.envs.connect_four import COLS, ROWS, boards_of, drop, legal_mask, winning_drops

CELLS = ROWS * COLS
CELL_STATES = 4  # empty not playable, the side that just moved, the other side, empty playable
MIRROR_CELL = np.array([r * COLS + (COLS - 1 - c) for r in range(ROWS) for c in range(COLS)])


def random_walk_tuples(count: int, length: int, seed: int) -> np.ndarray:
    """``(count, length)`` cell indices (``row * 7 + column``): each row a random walk over cells adjacent
    in any of the 8 directions, never visiting a cell twice (a walk that gets stuck starts over)."""
    rng = np.random.default_rng(seed)
    out = np.zeros((count, length), dtype=np.int64)
    for t in range(count):
        while True:
            walk = [int(rng.integers(CELLS))]
            while len(walk) < length:
                r, c = divmod(walk[-1], COLS)
                nxt = [(r + dr) * COLS + c + dc for dr in (-1, 0, 1) for dc in (-1, 0, 1)
                       if (dr or dc) and 0 <= r + dr < ROWS and 0 <= c + dc < COLS]
                nxt = [cell for cell in nxt if cell not in walk]
                if not nxt:
                    break
                walk.append(int(rng.choice(nxt)))
            if len(walk) == length:
                out[t] = walk
                break
    return out


def cell_states(boards: np.ndarray, seats: np.ndarray) -> np.ndarray:
    """``(n, 42)`` uint8 state of each cell of ``(n, 6, 7)`` boards (+1 = the side that just moved, whose seat
    is ``seats``: 0 first player, 1 second): 1 the first player's disc, 2 the second's, 3 empty and
    playable, 0 empty above that."""
    heights = (boards != 0).sum(axis=1)  # (n, 7)
    playable = np.arange(ROWS)[None, :, None] == heights[:, None, :]
    first = np.where(np.asarray(seats)[:, None, None] == 0, 1, -1).astype(np.int8)  # the first player's piece
    states = np.where(boards == first, 1, np.where(boards == -first, 2, np.where(playable, 3, 0)))
    return states.astype(np.uint8).reshape(len(boards), CELLS)


def seats_of(boards: np.ndarray) -> np.ndarray:
    """The seat of the side that just moved on each board: an odd disc count means the first player (0)."""
    return (1 - (np.asarray(boards) != 0).sum(axis=(1, 2)) % 2).astype(np.int64)


class NTupleValue:
    """LUT weights of ``tuples`` (``(T, length)`` cells) for two seats, and the afterstate values they give.

    ``weights`` is flat float32: seat of the side that just moved (0 first player, 1 second), tuple, then
    the tuple's index ``sum(state[cell_k] * 4 ** k)`` (:func:`cell_states`); each tuple is read twice, on
    the board and on its mirror image, into the same LUT.
    """

    def __init__(self, tuples: np.ndarray, weights: np.ndarray | None = None):
        self.tuples = np.asarray(tuples, dtype=np.int64)
        count, length = self.tuples.shape
        self.lut_size = CELL_STATES ** length
        self.seat_size = count * self.lut_size
        self.weights = np.zeros(2 * self.seat_size, dtype=np.float32) if weights is None else weights
        if self.weights.shape != (2 * self.seat_size,) or self.weights.dtype != np.float32:
            raise ValueError(f"weights must be {2 * self.seat_size} float32 values, got {self.weights.shape} "
                             f"{self.weights.dtype}")
        # Every tuple's index and its mirror image's as one matrix product, (n, 42) states @ (42, 2T) place
        # values (4 ** k at the tuple's k-th cell): exact in float32, the largest index is 4 ** 8 - 1.
        place = np.zeros((CELLS, 2 * count), dtype=np.int64)
        for t, cells in enumerate(self.tuples):
            for k, cell in enumerate(cells):
                place[cell, t] += CELL_STATES ** k
                place[MIRROR_CELL[cell], count + t] += CELL_STATES ** k
        self.place = place.astype(np.float32)
        self.offsets = np.tile(np.arange(count, dtype=np.int64) * self.lut_size, 2)  # (2T,): each tuple's LUT
        self.active = 2 * count  # LUT entries read per board
        # Indices are int32 where the weights allow (half the memory traffic of int64 in the hot loop).
        self.index_dtype = np.int32 if 2 * self.seat_size < 2 ** 31 else np.int64
        # What a disc adds to a board's base indices: DROP[seat, row, column] for the mover's disc landing at
        # (row, column), turning that cell from playable (3) to its seat's state and the cell above from 0 to
        # 3, plus the offset of that seat's LUTs: base indices + DROP are the afterstate's positions in weights.
        # Row ROWS, a full column's, changes no cell: its "afterstate" is read in range and then ruled out.
        drop_delta = np.zeros((2, ROWS + 1, COLS, 2 * count), dtype=np.int64)
        for seat in (0, 1):
            drop_delta[seat] = seat * self.seat_size
            for row in range(ROWS):
                for col in range(COLS):
                    drop_delta[seat, row, col] += place[row * COLS + col] * (1 + seat - 3)
                    if row + 1 < ROWS:
                        drop_delta[seat, row, col] += place[(row + 1) * COLS + col] * 3
        self.drop_delta = drop_delta.astype(self.index_dtype)
        # A move changes the entries of only the tuples over the two cells it changes (85 of 280 on average for
        # 140 tuples of 9): CHANGED[seat, row, column] lists those slots, padded to one length with slot 0 and a
        # change of 0, and CHANGE what the disc adds there. The 7 afterstates of a board then read the board's
        # own entries once and only their changed ones each (benchmarks/bench_ntuple_ply.py).
        change = drop_delta - (np.arange(2) * self.seat_size)[:, None, None, None]
        width = max(1, int((change != 0).sum(axis=-1).max()))
        self.changed = np.zeros((2, ROWS + 1, COLS, width), dtype=np.int64)
        self.change = np.zeros((2, ROWS + 1, COLS, width), dtype=self.index_dtype)
        for seat in (0, 1):
            for row in range(ROWS + 1):
                for col in range(COLS):
                    slots = np.flatnonzero(change[seat, row, col])
                    self.changed[seat, row, col, :len(slots)] = slots
                    self.change[seat, row, col, :len(slots)] = change[seat, row, col, slots]
        self.empty_index = self.base_indices(np.zeros((1, ROWS, COLS), dtype=np.int8), np.ones(1, np.int64))[0]

    @property
    def spec(self) -> dict:
        """What a checkpoint records under ``policy`` (common/policy.py rebuilds the player from it)."""
        count, length = self.tuples.shape
        return {"class": "NTupleValue", "tuples": int(count), "length": int(length)}

    @classmethod
    def random(cls, count: int = 70, length: int = 8, seed: int = 0) -> NTupleValue:
        return cls(random_walk_tuples(count, length, seed))

    def base_indices(self, boards: np.ndarray, seats: np.ndarray) -> np.ndarray:
        """``(n, 2T)`` positions in the LUTs of the first seat read for ``boards`` (+1 = the side that just
        moved, from ``seats``); add ``seat * seat_size`` for the LUTs of the second."""
        index = (cell_states(boards, seats).astype(np.float32) @ self.place).astype(np.int64)
        return (index + self.offsets).astype(self.index_dtype)

    def indices(self, boards: np.ndarray, seats: np.ndarray | None = None) -> np.ndarray:
        """``(n, 2T)`` positions in ``weights`` read for ``boards`` (+1 = the side that just moved; its seat
        from the disc count unless ``seats`` says)."""
        seats = seats_of(boards) if seats is None else np.asarray(seats, dtype=np.int64)
        return self.base_indices(boards, seats) + (seats * self.seat_size)[:, None]

    def values_at(self, indices: np.ndarray) -> np.ndarray:
        """``tanh`` of the sum of the entries at ``indices`` over the last axis. torch gathers (it takes int32
        indices as they are: benchmarks/bench_ntuple_ply.py times the ply this is part of); numpy sums, in
        the order it always did."""
        flat = torch.from_numpy(np.ascontiguousarray(indices).reshape(-1))
        picked = torch.from_numpy(self.weights).index_select(0, flat).numpy()
        return np.tanh(picked.reshape(indices.shape).sum(axis=-1))

    def values(self, boards: np.ndarray, seats: np.ndarray | None = None) -> np.ndarray:
        """``(n,)`` learned value for the side that just moved (its discs +1) of each board, in (-1, 1)."""
        return self.values_at(self.indices(np.asarray(boards, dtype=np.int8), seats))

    def move_values(self, boards: np.ndarray, heights: np.ndarray,
                    base: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """For boards of the side to move (+1) with column ``heights``: ``(n, 7)`` value of each move's
        afterstate for the mover (-inf for a full column; 1 four in a row, 0 a full board, else learned), and
        ``(n, 7)`` whether the move ends the game.
        ``base``: the boards' own base indices when known (the trainer keeps them up to date).

        An afterstate's sum is the board's own entries' (read once, in the mover's seat's LUTs) plus, for the
        tuples the disc changes, the new entry less the old; equal to reading all of the afterstate's entries
        up to float32 rounding, with a third of the reads (the ply is bound by reads from a table far larger
        than the caches)."""
        n = len(boards)
        discs = heights.sum(axis=1)
        mover_seat = discs % 2  # the side to move moves first when the discs are even in number
        if base is None:
            base = (self.base_indices(-boards, 1 - mover_seat) if n else
                    np.zeros((0, self.active), self.index_dtype))
        own = torch.from_numpy(base + (mover_seat * self.seat_size).astype(self.index_dtype)[:, None])
        weights = torch.from_numpy(self.weights)
        own_entries = weights.index_select(0, own.reshape(-1)).reshape(n, self.active)
        slots = torch.from_numpy(self.changed[mover_seat[:, None], heights, np.arange(COLS)].reshape(n, -1))
        changed = torch.gather(own, 1, slots) + torch.from_numpy(
            self.change[mover_seat[:, None], heights, np.arange(COLS)].reshape(n, -1))
        moved = weights.index_select(0, changed.reshape(-1)).reshape(n, -1) - torch.gather(own_entries, 1, slots)
        learned = np.tanh((own_entries.sum(dim=1)[:, None] + moved.reshape(n, COLS, -1).sum(dim=2)).numpy())
        legal = legal_mask(heights)
        won = winning_drops(boards, heights)
        full = (discs + 1 == CELLS)[:, None]
        values = np.where(won, 1.0, np.where(full, 0.0, learned)).astype(np.float32)
        values[~legal] = -np.inf
        return values, (won | full) & legal

    def afterstate_indices(self, base: np.ndarray, heights: np.ndarray, columns: np.ndarray) -> np.ndarray:
        """``(n, 2T)`` positions in ``weights`` the afterstates of dropping the side to move's disc in ``columns``
        read (boards with base indices ``base`` and column ``heights``; the mover's seat from the disc count)."""
        mover_seat = heights.sum(axis=1) % 2
        rows = np.arange(len(base))
        return base + self.drop_delta[mover_seat, heights[rows, columns], columns]

    def act(self, obs: np.ndarray, action_mask: np.ndarray | None = None,
            env_ids: np.ndarray | None = None) -> np.ndarray:
        """Greedy column for each ``(n, 2, 6, 7)`` observation of ConnectFour-v0 (plane 0 the side to move):
        the legal move whose afterstate is worth most to the mover (the lowest column among equals)."""
        boards, heights = boards_of(np.asarray(obs))
        values = self.move_values(boards, heights)[0]
        if action_mask is not None:
            values[~np.asarray(action_mask, dtype=bool)] = -np.inf
        return values.argmax(axis=1)

    def save(self, path: str | Path, **extra) -> None:
        np.savez(path, tuples=self.tuples, weights=self.weights, **extra)

    @classmethod
    def load(cls, path: str | Path) -> NTupleValue:
        with np.load(path) as saved:
            return cls(saved["tuples"], saved["weights"].astype(np.float32))


# ------------------------------------------------------------------ self-play TD


@dataclass
class TrainConfig:
    games_in_lockstep: int = 1024  # games played together: numpy's overhead is paid once per ply for all
    # The defaults won short comparisons graded by the perfect player (what was tried: docs/parallel_train_dqn.md).
    learning_rate: float = 1.0  # step of the tanh's input per unit of TD error (shared by the active entries)
    final_learning_rate: float | None = None  # reached at the end of the budget, decaying exponentially (None:
    # the step stays learning_rate, so a learning_rate given alone neither rises nor falls)
    epsilon: float = 0.2  # share of moves played uniformly at random (after the random opening)
    final_epsilon: float = 0.2
    random_opening: tuple[int, int] = (0, 8)  # each game opens with this many random plies (drawn uniformly)
    tanh_gradient: bool = True  # scale the TD error by tanh's slope (False: the error alone, as for a logistic loss)
    td_lambda: float = 0.0  # TD(lambda): each afterstate learns the lambda-return of the TD errors after it (0: TD(0))

    @property
    def horizon(self) -> int:
        """Plies of TD errors an afterstate's lambda-return sums before it is applied: until lambda ** k < 1/32
        (at most a whole game); 1 for TD(0)."""
        if self.td_lambda <= 0.0:
            return 1
        return min(CELLS, max(1, math.ceil(math.log(1 / 32) / math.log(self.td_lambda))))

    def learning_rate_at(self, fraction: float) -> float:
        """The step size ``fraction`` of the way through the budget (exponential decay)."""
        if self.final_learning_rate is None:
            return self.learning_rate
        return schedule(self.learning_rate, self.final_learning_rate, fraction)

    def epsilon_at(self, fraction: float) -> float:
        return self.epsilon + (self.final_epsilon - self.epsilon) * fraction


@dataclass
class Progress:
    games: int
    plies: int
    seconds: float
    learning_rate: float
    epsilon: float


class SelfPlay:
    """``config.games_in_lockstep`` self-play games of ``value`` played together, one ply of all at a time,
    each ply's TD updates applied to ``value.weights`` at once. Several processes can each run one over the
    same weights in shared memory (lock-free: two processes adding to one entry at the same instant may
    lose one of the adds, a rounding error to TD learning)."""

    def __init__(self, value: NTupleValue, config: TrainConfig, seed: int):
        self.value, self.config = value, config
        self.rng = np.random.default_rng(seed)
        n = self.n = config.games_in_lockstep
        self.boards = np.zeros((n, ROWS, COLS), dtype=np.int8)  # +1 = the side to move
        self.heights = np.zeros((n, COLS), dtype=np.int64)
        self.base = np.tile(value.empty_index, (n, 1))  # the boards' base indices, kept up to date move by move
        self.opening = self._openings(n)
        # Each game's last ``horizon`` afterstates, in a ring: their LUT positions, their values when they were
        # left, the lambda-return error gathered for them so far, the factor the next TD error joins it with,
        # and whether they still wait for their update. ``head`` is the slot of the afterstate the last mover left.
        k = self.horizon = config.horizon
        self.ring_idx = np.zeros((k, n, value.active), dtype=value.index_dtype)
        self.ring_value = np.zeros((k, n), dtype=np.float32)
        self.ring_error = np.zeros((k, n), dtype=np.float32)
        self.ring_factor = np.zeros((k, n), dtype=np.float32)
        self.pending = np.zeros((k, n), dtype=bool)
        self.head = 0
        self.hits = np.zeros(value.weights.size, dtype=np.float32)
        self.all_ids = np.arange(n)
        self.games = self.plies = 0
        self.results = np.zeros(3, dtype=np.int64)  # finished games: first player won, drawn, second won

    def _openings(self, count: int) -> np.ndarray:
        low, high = self.config.random_opening
        return self.rng.integers(low, high + 1, size=count)

    def ply(self, learning_rate: float, epsilon: float) -> int:
        """One move in every game, and the TD update of the afterstates the previous movers left; returns
        how many games ended."""
        value, n, rng = self.value, self.n, self.rng
        boards, heights = self.boards, self.heights
        mover_seat = heights.sum(axis=1) % 2
        values, terminal = value.move_values(boards, heights, self.base)
        best = values.max(axis=1)
        # The TD error: the afterstate the previous mover left is worth minus the best the side to move can do.
        # Every afterstate waiting in the ring takes it in, times its factor ((-lambda) ** plies since, by
        # negamax, while the moves since were worth the best); the oldest is then updated by what it gathered
        # (with horizon 1, TD(0): the previous afterstate, at once).
        head, oldest = self.head, (self.head + 1) % self.horizon
        if self.horizon == 1:
            update = np.flatnonzero(self.pending[head])
            self.ring_error[head, update] = -best[update] - self.ring_value[head, update]
        else:
            delta = np.where(self.pending[head], -best - self.ring_value[head], 0.0).astype(np.float32)
            self.ring_error += self.ring_factor * delta
            update = np.flatnonzero(self.pending[oldest])
        self._learn([(oldest, update)], learning_rate)
        self.pending[oldest] = False
        legal = np.isfinite(values)
        greedy = (values + rng.random(values.shape, dtype=np.float32) * 1e-6).argmax(axis=1)  # random ties
        random_move = (heights.sum(axis=1) < self.opening) | (rng.random(n) < epsilon)
        cumulative = np.cumsum(legal, axis=1)
        draws = (rng.random(n) * cumulative[:, -1]).astype(np.int64)
        random_cols = (cumulative > draws[:, None]).argmax(axis=1)
        actions = np.where(random_move, random_cols, greedy)
        ended = terminal[self.all_ids, actions]
        finished = np.flatnonzero(ended)
        chosen = values[self.all_ids, actions]
        won = chosen[finished] == 1.0  # a finishing move wins (1) or fills the board (0)
        if self.horizon > 1:
            # A move worth less than the best (an exploring one) ends what the earlier afterstates learn from
            # later errors: those come from a line the greedy player would not have taken.
            self.ring_factor *= np.where(chosen == best, np.float32(-self.config.td_lambda), np.float32(0.0))
            if finished.size:  # the game is over: its waiting afterstates learn what they gathered
                self._learn([(slot, finished[self.pending[slot, finished]]) for slot in range(self.horizon)],
                            learning_rate)
                self.pending[:, finished] = False
        self.head = head = oldest
        self.ring_idx[head] = value.afterstate_indices(self.base, heights, actions)
        self.base = self.ring_idx[head] - (mover_seat * value.seat_size).astype(value.index_dtype)[:, None]
        self.ring_value[head] = chosen
        self.ring_error[head] = 0.0
        self.ring_factor[head] = 1.0
        self.pending[head] = ~ended  # a finished game's last afterstate is worth what the rules say
        drop(boards, heights, self.all_ids, actions, 1)
        boards *= -1  # the other side moves next: it is +1 now
        self.plies += n
        if finished.size:  # four in a row, or a full board (a draw)
            first_moved = mover_seat[finished] == 0
            self.results += [np.sum(won & first_moved), np.sum(~won), np.sum(won & ~first_moved)]
            boards[finished] = 0
            heights[finished] = 0
            self.base[finished] = value.empty_index
            self.opening[finished] = self._openings(finished.size)
            self.games += finished.size
        return int(finished.size)

    def _learn(self, rows: list[tuple[int, np.ndarray]], learning_rate: float) -> None:
        """Move the afterstates of the games ``games`` of ring slot ``slot`` (each ``(slot, games)`` of
        ``rows``) by their gathered errors, in one update (each LUT entry by the mean of its rows' steps)."""
        rows = [(slot, games) for slot, games in rows if games.size]
        if not rows:
            return
        v = np.concatenate([self.ring_value[slot, games] for slot, games in rows])
        steps = (learning_rate / self.value.active) * np.concatenate([self.ring_error[slot, games]
                                                                     for slot, games in rows])
        if self.config.tanh_gradient:
            steps *= 1.0 - v * v
        indices = (self.ring_idx[rows[0][0], rows[0][1]] if len(rows) == 1 else
                   np.concatenate([self.ring_idx[slot, games] for slot, games in rows]))
        apply_mean_updates(self.value.weights, self.hits, indices, steps)


def train(value: NTupleValue, minutes: float | None = None, games: int | None = None, seed: int = 0,
          config: TrainConfig | None = None, callback: Callable[[Progress], None] | None = None,
          callback_every_s: float = 60.0) -> Progress:
    """Self-play TD(0) on ``value`` in this process for ``minutes`` of wall time or ``games`` finished games
    (the first reached); ``callback(progress)`` every ``callback_every_s`` seconds of training before the end
    (its own time is not counted). Returns the final progress."""
    if minutes is None and games is None:
        raise ValueError("train needs minutes or games")
    config = config or TrainConfig()
    play = SelfPlay(value, config, seed)
    trained_s = 0.0
    budget_s = None if minutes is None else minutes * 60.0
    next_callback = callback_every_s
    started = time.monotonic()

    def fraction() -> float:
        parts = [trained_s / budget_s if budget_s else 0.0, play.games / games if games else 0.0]
        return min(1.0, max(parts))

    def progress() -> Progress:
        f = fraction()
        return Progress(play.games, play.plies, trained_s, config.learning_rate_at(f), config.epsilon_at(f))

    while fraction() < 1.0:
        play.ply(config.learning_rate_at(fraction()), config.epsilon_at(fraction()))
        now = time.monotonic()
        trained_s += now - started
        started = now
        if callback is not None and trained_s >= next_callback and fraction() < 1.0:  # the end is the caller's
            callback(progress())
            next_callback += callback_every_s
            started = time.monotonic()
    return progress()


def schedule(start: float, end: float, fraction: float) -> float:
    """Exponential decay from ``start`` to ``end`` as ``fraction`` goes from 0 to 1."""
    return float(start * (end / start) ** fraction) if start > 0 and end > 0 else start + (end - start) * fraction


def apply_mean_updates(weights: np.ndarray, hits: np.ndarray, indices: np.ndarray, steps: np.ndarray) -> None:
    """Add to each entry of ``weights`` hit by ``indices`` (``(m, k)``) the mean of the ``steps`` (``(m,)``) of
    the rows that hit it. Summed, the thousands of boards of a ply that share an entry (a tuple over cells
    still empty, an opening position) would move it thousands of times as far as one board does.
    ``hits``: float32 zeros of the weights' size, left zero. torch's ``index_add_`` does the scatter-adds:
    on one core it is about ten times as fast as ``np.add.at``."""
    flat = torch.from_numpy(np.ascontiguousarray(indices).ravel())
    hits_t = torch.from_numpy(hits)
    hits_t.index_add_(0, flat, torch.ones(1, dtype=torch.float32).expand(flat.numel()))
    rows = torch.from_numpy(steps.astype(np.float32))[:, None].expand(-1, indices.shape[1]).reshape(-1)
    share = rows / hits_t.index_select(0, flat)
    torch.from_numpy(weights).index_add_(0, flat, share)  # the shares of an entry's rows add up to their mean
    hits_t[flat] = 0.0


# ------------------------------------------------------------------ self-play processes over shared weights

# The shared arrays of a run's self-play processes (parallel_train_dqn.py --learner ntuple): ``weights``
# (the LUTs, float32), ``control`` (float64: the learning rate and epsilon the coordinator sets as the budget
# goes) and ``counts`` (int64, one row per process, the coordinator's first: games, plies, and the games
# the first player won, drew and lost).
LEARNING_RATE, EPSILON = 0, 1
GAMES, PLIES, FIRST_WON, DRAWN, FIRST_LOST = range(5)


def count_row(play: SelfPlay) -> np.ndarray:
    return np.array([play.games, play.plies, *play.results], dtype=np.int64)


def selfplay_worker(link, shared_specs: dict, tuples: np.ndarray, config: TrainConfig, seed: int) -> None:
    """A self-play process (run by common.supervisor, which reports a death and restarts it): lockstep
    games over the shared weights until told to stop. It adds what it played to its row of ``counts``, so
    a restarted worker's games still count."""
    from common.shm import attach_all
    from common.supervisor import set_torch_threads

    set_torch_threads(1)
    shared, handles = attach_all(shared_specs)
    try:
        play = SelfPlay(NTupleValue(tuples, shared["weights"]), config, seed)
        row, control = shared["counts"][link.index + 1], shared["control"]
        reported = count_row(play)
        link.ready()
        while not link.stop_requested:
            for command, _ in link.commands():
                if command != "stop":
                    raise ValueError(f"self-play worker {link.index}: unknown command {command!r}")
            if link.stop_requested:
                break
            play.ply(float(control[LEARNING_RATE]), float(control[EPSILON]))
            now = count_row(play)
            row += now - reported
            reported = now
    finally:
        shared.clear()
        for handle in handles:
            handle.close()
