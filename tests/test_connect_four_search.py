"""ConnectFour search players (held out of training): legal, tactical, stronger with depth, seeded,
refused in a training mix, and scored by python -m common.evaluate."""

from __future__ import annotations

import numpy as np
import pytest

from common.envs.connect_four import (
    COLS,
    EVALUATION_OPPONENTS,
    HELD_OUT_PLAYERS,
    ROWS,
    WIN_SCORE,
    WINDOW_SCORES,
    HeuristicPlayer,
    RandomPlayer,
    SearchPlayer,
    check_training_opponents,
    drop,
    legal_mask,
    make_player,
    observe,
    play_match,
)


def positions(count: int, plies: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``count`` boards after ``plies`` random moves (no game over), seen by the side to move."""
    rng = np.random.default_rng(seed)
    random = RandomPlayer(seed)
    boards, heights = np.zeros((0, ROWS, COLS), np.int8), np.zeros((0, COLS), np.int64)
    while len(boards) < count:
        b, h = np.zeros((64, ROWS, COLS), np.int8), np.zeros((64, COLS), np.int64)
        for ply in range(plies):
            piece = 1 if ply % 2 == 0 else -1
            drop(b, h, np.arange(64), random.act(observe(b, piece), legal_mask(h)), piece)
        side = 1 if plies % 2 == 0 else -1
        alive = ~np.array([_four(board, 1) or _four(board, -1) for board in b])
        boards = np.concatenate([boards, side * b[alive]])
        heights = np.concatenate([heights, h[alive]])
    keep = rng.permutation(len(boards))[:count]
    return boards[keep], heights[keep]


def board_from_rows(rows: list[str]) -> np.ndarray:
    """A board from text, top row first: X = the side to move, O = the other side."""
    board = np.zeros((ROWS, COLS), np.int8)
    for r, line in enumerate(reversed(rows)):
        for c, ch in enumerate(line):
            board[r, c] = {"X": 1, "O": -1, ".": 0}[ch]
    return board


def act_on(player, board: np.ndarray) -> int:
    board = board[None]
    return int(player.act(observe(board), legal_mask((board != 0).sum(axis=1)), np.arange(1))[0])


# ----------------------------------------------------------------- a plain alpha-beta negamax, for reference

LINES = [[(r + k * dr, c + k * dc) for k in range(4)] for r in range(ROWS) for c in range(COLS)
         for dr, dc in ((0, 1), (1, 0), (1, 1), (-1, 1))
         if all(0 <= r + k * dr < ROWS and 0 <= c + k * dc < COLS for k in range(4))]
CENTRE = [0, 1, 2, 3, 2, 1, 0]


def _four(board, piece) -> bool:
    return any(all(board[r][c] == piece for r, c in line) for line in LINES)


def _leaf(board) -> float:
    """The window heuristic, written out cell by cell: for the side that has +1 on ``board``."""
    total = 0.0
    for line in LINES:
        cells = [board[r][c] for r, c in line]
        total += WINDOW_SCORES[cells.count(1), cells.count(-1)]
    return total + sum(CENTRE[c] * board[r][c] for r in range(ROWS) for c in range(COLS))


def alphabeta(board, depth, alpha=-np.inf, beta=np.inf) -> float:
    """Negamax with alpha-beta pruning: the value for the side to move (+1) of the best column."""
    best = -np.inf
    for col in range(COLS):
        row = next((r for r in range(ROWS) if board[r][col] == 0), None)
        if row is None:
            continue
        board[row][col] = 1
        if _four(board, 1):
            value = WIN_SCORE + depth
        elif all(board[ROWS - 1][c] != 0 for c in range(COLS)):
            value = 0.0
        elif depth == 1:
            value = _leaf(board)
        else:
            value = -alphabeta(-board, depth - 1, -beta, -max(alpha, best))
        board[row][col] = 0
        best = max(best, value)
        if best >= beta:
            break
    return best


def test_vectorized_search_values_are_alpha_beta_negamax_exactly():
    boards, heights = positions(8, 8, seed=3)
    for depth in (1, 2, 3):
        player = SearchPlayer(depth, seed=0)
        values = player.values(observe(boards))
        for board, height, row in zip(boards, heights, values):
            for col in range(COLS):  # every root move's exact value: a full window at the root
                if height[col] == ROWS:
                    assert row[col] == -np.inf
                    continue
                child = board.astype(np.int64).copy()
                child[height[col], col] = 1
                if _four(child, 1):
                    want = WIN_SCORE + depth
                elif (child != 0).all():
                    want = 0.0
                else:
                    want = _leaf(child) if depth == 1 else -alphabeta(-child, depth - 1)
                assert row[col] == want, (depth, board, col)
            assert row.max() == alphabeta(board.astype(np.int64).copy(), depth)  # pruned at the root too


# ----------------------------------------------------------------- legal and tactical

def test_search_players_never_play_a_full_column():
    boards, heights = positions(40, 30, seed=5)  # late positions: several full columns
    assert (heights == ROWS).any(axis=1).sum() >= 10
    for name in HELD_OUT_PLAYERS:
        actions = make_player(name, seed=1).act(observe(boards), legal_mask(heights), np.arange(len(boards)))
        assert legal_mask(heights)[np.arange(len(boards)), actions].all(), name


def test_whole_games_stay_legal_to_the_end():
    for name in HELD_OUT_PLAYERS[:3]:  # drop() raises on a full column; every game ends with a result
        results = play_match(make_player(name, 2), RandomPlayer(3), 10)
        assert set(results.tolist()) <= {-1, 0, 1}


def test_take_an_immediate_win():
    board = board_from_rows([".......",
                             ".......",
                             ".......",
                             ".......",
                             "O.O....",
                             "OXXX..O"])  # X wins in column 4
    for name in HELD_OUT_PLAYERS:
        assert act_on(make_player(name, seed=0), board) == 4, name


def test_take_the_quicker_win():
    board = board_from_rows([".......",
                             ".......",
                             ".......",
                             "...O..X",
                             "O.OO..X",
                             "O.XX..X"])  # X wins now in column 6, or in two moves after column 4 (two threats)
    for name in HELD_OUT_PLAYERS:
        depth = int(name[-1])
        values = make_player(name, 0).values(observe(board[None]))[0]
        assert values[6] == WIN_SCORE + depth and values.argmax() == 6, (name, values)
        if depth >= 3:
            assert values[4] == WIN_SCORE + depth - 2, (name, values)  # a win too, but a later one
        assert all(act_on(make_player(name, seed), board) == 6 for seed in range(3)), name


def test_block_an_immediate_loss_from_depth_2():
    board = board_from_rows([".......",
                             ".......",
                             ".......",
                             ".......",
                             "......X",
                             "OOO.X.X"])  # O wins in column 3 unless X plays there
    for name in HELD_OUT_PLAYERS[1:]:
        assert all(act_on(make_player(name, seed), board) == 3 for seed in range(5)), name


# ----------------------------------------------------------------- strength and seeds

def score(a, b, games: int) -> float:
    """``a``'s points (win 1, draw 1/2) per game against ``b``, ``games`` games from each seat."""
    results = np.concatenate([play_match(a, b, games), -play_match(b, a, games)])
    return float(np.mean((results + 1) / 2))


def test_deeper_search_beats_shallower_and_every_depth_beats_the_fixed_players():
    # Measured with these seeds: 0.975, 1.0, 0.85 (search1 vs heuristic), 1.0, 0.85, 0.76; 0.5 is an even match.
    assert score(SearchPlayer(1, 10), RandomPlayer(11), 20) >= 0.95
    assert score(SearchPlayer(2, 12), HeuristicPlayer(13), 20) >= 0.95
    assert score(SearchPlayer(1, 20), HeuristicPlayer(21), 20) >= 0.6
    assert score(SearchPlayer(2, 14), SearchPlayer(1, 15), 20) >= 0.9
    assert score(SearchPlayer(3, 16), SearchPlayer(2, 17), 20) >= 0.75
    assert score(SearchPlayer(4, 18), SearchPlayer(3, 19), 20) >= 0.65


def test_ties_are_broken_at_random_with_the_seed():
    boards, heights = positions(40, 4, seed=7)
    values = SearchPlayer(2).values(observe(boards))
    tied = (values == values.max(axis=1, keepdims=True)).sum(axis=1) >= 2
    assert tied.sum() >= 3  # positions where two or more columns are equally good
    board = np.repeat(boards[tied][:1], 200, axis=0)
    best = set(np.flatnonzero(values[tied][0] == values[tied][0].max()).tolist())
    mask = legal_mask((board != 0).sum(axis=1))
    picks = {seed: SearchPlayer(2, seed).act(observe(board), mask) for seed in (0, 1)}
    assert set(picks[0].tolist()) == best  # every best column drawn, nothing else
    assert (picks[0] != picks[1]).any()  # another seed, other draws
    assert (SearchPlayer(2, 0).act(observe(board), mask) == picks[0]).all()  # the same seed, the same draws


# ----------------------------------------------------------------- held out of training

def test_held_out_players_are_refused_in_a_training_mix():
    check_training_opponents({"latest": 0.5, "snapshot": 0.3, "random": 0.2, "heuristic": 0.0})
    for name in HELD_OUT_PLAYERS:
        with pytest.raises(ValueError, match="held out for evaluation"):
            check_training_opponents({"latest": 0.5, name: 0.5})
        with pytest.raises(ValueError, match=name):
            check_training_opponents(["random", name])
    assert set(HELD_OUT_PLAYERS) == {"search1", "search2", "search3", "search4"}
    assert EVALUATION_OPPONENTS == ("random", "heuristic", *HELD_OUT_PLAYERS)
    with pytest.raises(ValueError, match="unknown player"):
        make_player("search5")


# ----------------------------------------------------------------- python -m common.evaluate

class Greedy:
    """A stand-in policy: the heuristic player's moves, as ``act(obs, masks)``."""

    def __init__(self):
        self.player = HeuristicPlayer(0)

    def act(self, obs, masks=None):
        return self.player.act(np.asarray(obs), np.asarray(masks), None)


def test_evaluate_reports_win_draw_loss_against_every_opponent_from_both_seats():
    from common.evaluate import _text, report

    episodes = [{"return": 1.0, "length": 10, "result": 1.0}] * 4
    result = report(episodes, "ConnectFour-v0", {}, Greedy(), seed=1_000_000)
    table = result["opponents"]
    assert list(table) == list(EVALUATION_OPPONENTS)
    for name, seats in table.items():
        assert list(seats) == ["first", "second", "both"]
        for seat, rates in seats.items():
            games = 8 if seat == "both" else 4  # as many games from each seat as --episodes
            assert set(rates) == {"win", "draw", "loss"} and sum(rates.values()) == pytest.approx(1.0)
            assert all(games * v == round(games * v) for v in rates.values()), (name, seat, rates)
    assert table["random"]["both"]["win"] >= 0.75  # the heuristic player beats random play
    assert table["search4"]["both"]["loss"] >= 0.75  # and loses to a depth-4 search
    assert {"win_rate_vs_random", "win_rate_vs_heuristic"} <= set(result)  # the scores it reported before
    text = _text({"checkpoint": "x.pt", **result})
    for name in EVALUATION_OPPONENTS:
        assert f"\n  vs {name:<10}" in text, text


def test_the_self_play_script_evaluates_against_every_opponent_and_trains_with_none_held_out():
    import parallel_train_dqn
    from common.envs import connect_four
    from common.envs.selfplay import opponent_mixture

    assert parallel_train_dqn.EVALUATION_OPPONENTS == connect_four.EVALUATION_OPPONENTS
    assert {f"eval_win_{name}" for name in connect_four.HELD_OUT_PLAYERS} <= set(parallel_train_dqn.EVAL_COLUMNS)
    rng = np.random.default_rng(0)
    assert opponent_mixture({"probs": {"random": 0.5, "heuristic": 0.5}}, None, [], 4, rng) is not None
    with pytest.raises(ValueError, match="held out for evaluation"):
        opponent_mixture({"probs": {"random": 0.9, "search2": 0.1}}, None, [], 4, rng)
