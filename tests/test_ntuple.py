"""The n-tuple value function and its self-play TD learner (common/ntuple.py)."""

from __future__ import annotations

import numpy as np
import pytest

from common.envs.connect_four import COLS, ROWS, RandomPlayer, drop, legal_mask, observe, play_match
from common.ntuple import NTupleValue, TrainConfig, random_walk_tuples, train


def random_boards(count: int, seed: int) -> np.ndarray:
    """Boards of random games, each stopped after a random number of plies, +1 = the side that just moved."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        board = np.zeros((1, ROWS, COLS), dtype=np.int8)
        heights = np.zeros((1, COLS), dtype=np.int64)
        for _ in range(rng.integers(1, 30)):
            drop(board, heights, np.array([0]), np.array([rng.choice(np.flatnonzero(legal_mask(heights[0])))]), 1)
            board *= -1
        out.append(-board[0])  # the side that just moved is +1
    return np.stack(out)


def naive_index(board: np.ndarray, cells: list[int]) -> int:
    """One tuple's index read cell by cell: 1 the first player's disc, 2 the second's, 3 empty and playable."""
    first_just_moved = (board != 0).sum() % 2 == 1
    first_piece = 1 if first_just_moved else -1
    index = 0
    for k, cell in enumerate(cells):
        row, col = divmod(cell, COLS)
        if board[row, col] == first_piece:
            state = 1
        elif board[row, col] == -first_piece:
            state = 2
        else:
            state = 3 if row == 0 or board[row - 1, col] != 0 else 0
        index += state * 4 ** k
    return index


def trained_weights(value: NTupleValue, seed: int) -> None:
    value.weights[:] = np.random.default_rng(seed).normal(0, 0.1, value.weights.size).astype(np.float32)


def test_tuples_are_walks_over_adjacent_distinct_cells():
    tuples = random_walk_tuples(20, 8, seed=3)
    assert tuples.shape == (20, 8)
    assert np.array_equal(tuples, random_walk_tuples(20, 8, seed=3))
    for walk in tuples:
        assert len(set(walk.tolist())) == 8
        rows, cols = np.divmod(walk, COLS)
        assert (np.maximum(abs(np.diff(rows)), abs(np.diff(cols))) == 1).all()


def test_indices_equal_a_naive_per_cell_computation():
    value = NTupleValue.random(count=12, length=6, seed=1)
    boards = random_boards(40, seed=2)
    indices = value.indices(boards)
    mirror_cells = [[(c // COLS) * COLS + COLS - 1 - c % COLS for c in cells] for cells in value.tuples.tolist()]
    for board, row in zip(boards, indices, strict=True):
        seat = 0 if (board != 0).sum() % 2 == 1 else 1
        for t, cells in enumerate(value.tuples.tolist()):
            lut = (seat * len(value.tuples) + t) * value.lut_size
            assert row[t] == lut + naive_index(board, cells)
            assert row[len(value.tuples) + t] == lut + naive_index(board, mirror_cells[t])


def test_move_values_follow_the_rules_and_the_table():
    """Each move's afterstate: the learned value of the board it makes (kept up to date by adding what the
    disc changes), 1 where it completes four."""
    value = NTupleValue.random(count=10, length=6, seed=4)
    trained_weights(value, 5)
    parents = -random_boards(30, seed=6)  # +1 = the side to move
    heights = (parents != 0).sum(axis=1)
    values, children, terminal = value.move_values(parents, heights)
    for i in range(len(parents)):
        for col in np.flatnonzero(legal_mask(heights[i])):
            child, child_heights = parents[i:i + 1].copy(), heights[i:i + 1].copy()
            drop(child, child_heights, np.array([0]), np.array([col]), 1)
            seat = heights[i].sum() % 2
            assert np.array_equal(children[i, col] + seat * value.seat_size, value.indices(child)[0])
            if not terminal[i, col]:
                assert values[i, col] == pytest.approx(value.values(child)[0], abs=1e-6)
        assert np.isneginf(values[i][~legal_mask(heights[i])]).all()
    lines = np.zeros((1, ROWS, COLS), dtype=np.int8)
    lines[0, 0, :3], lines[0, 1, :3] = 1, -1  # three in the bottom row, the side to move's
    values, _, terminal = value.move_values(lines, (lines != 0).sum(axis=1))
    assert values[0, 3] == 1.0 and terminal[0, 3] and not terminal[0, 4]


def test_mirrored_boards_are_worth_the_same():
    value = NTupleValue.random(count=30, length=8, seed=7)
    trained_weights(value, 8)
    boards = random_boards(50, seed=9)
    values = value.values(boards)
    np.testing.assert_allclose(value.values(boards[:, :, ::-1]), values, rtol=1e-5, atol=1e-6)
    assert np.std(values) > 0.05  # the weights do tell the boards apart


def test_save_and_load_round_trip(tmp_path):
    value = NTupleValue.random(count=8, length=5, seed=10)
    trained_weights(value, 11)
    value.save(tmp_path / "ntuple.npz")
    loaded = NTupleValue.load(tmp_path / "ntuple.npz")
    assert np.array_equal(loaded.tuples, value.tuples)
    assert loaded.weights.dtype == np.float32 and np.array_equal(loaded.weights, value.weights)
    boards = random_boards(10, seed=12)
    assert np.array_equal(loaded.values(boards), value.values(boards))


def test_wrong_weights_are_refused():
    with pytest.raises(ValueError, match="float32 values"):
        NTupleValue(random_walk_tuples(2, 4, 0), np.zeros(10, dtype=np.float32))


def win_rate_against_random(value: NTupleValue, games: int, seed: int) -> float:
    """Share of games won against uniformly random play, half of them moving first."""
    class Greedy:
        def act(self, obs, action_mask, env_ids):
            return value.act(obs, action_mask)

    as_first = play_match(Greedy(), RandomPlayer(seed), games // 2)
    as_second = play_match(RandomPlayer(seed + 1), Greedy(), games // 2)
    return float(np.concatenate([as_first == 1, as_second == -1]).mean())


def test_short_self_play_beats_the_random_player():
    value = NTupleValue.random(count=40, length=6, seed=13)
    untrained = win_rate_against_random(value, 400, seed=14)
    calls = []
    progress = train(value, games=4000, seed=15, config=TrainConfig(games_in_lockstep=256),
                     callback=calls.append, callback_every_s=0.5)
    trained = win_rate_against_random(value, 400, seed=14)
    assert progress.games >= 4000 and calls and calls[0].games <= progress.games
    assert untrained < 0.9 <= trained, (untrained, trained)


def test_act_plays_observations_of_the_env():
    value = NTupleValue.random(count=10, length=6, seed=16)
    boards = np.zeros((2, ROWS, COLS), dtype=np.int8)
    boards[:, 0, :3] = 1  # the side to move has three in the bottom row: column 3 wins
    boards[:, 1, :3] = -1
    mask = np.ones((2, COLS), dtype=bool)
    assert value.act(observe(boards), mask).tolist() == [3, 3]
    mask[1, 3] = False
    assert value.act(observe(boards), mask)[1] != 3
