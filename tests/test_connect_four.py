"""ConnectFour-v0 rules, masks, players and the vectorized form."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest

from common.envs import make_vec_env
from common.envs.connect_four import (
    COLS,
    ROWS,
    ConnectFourEnv,
    HeuristicPlayer,
    RandomPlayer,
    observe,
    sample_legal,
    wins,
)


class Scripted:
    """An opponent that plays a fixed list of columns."""

    def __init__(self, moves):
        self.moves = list(moves)

    def act(self, obs, action_mask, env_ids):
        return np.array([self.moves.pop(0) for _ in range(len(obs))])


def play(learner_moves, opponent_moves, learner_first=True):
    env = ConnectFourEnv(opponent=Scripted(opponent_moves))
    obs, info = env.reset(seed=0, options={"learner_first": learner_first})
    out = None
    for move in learner_moves:
        out = env.step(move)
    return env, out


def test_registered_and_spaces():
    env = gym.make("ConnectFour-v0")
    obs, info = env.reset(seed=3)
    assert obs.shape == (2, ROWS, COLS) and obs.dtype == np.float32
    assert env.action_space.n == COLS
    assert info["action_mask"].dtype == bool and info["action_mask"].all()
    env.close()


def test_row_win():
    env, (obs, reward, terminated, truncated, info) = play([0, 1, 2, 3], [0, 1, 2])
    assert reward == 1.0 and terminated and not truncated and info["result"] == 1.0
    assert obs[0, 0, :4].all()  # the learner's four discs in the bottom row


def test_column_win():
    _, (_, reward, terminated, _, info) = play([3, 3, 3, 3], [0, 1, 2])
    assert reward == 1.0 and terminated


def test_rising_diagonal_win():
    # learner: (0,0) (1,1) (2,2) (3,3) with opponent discs filling underneath
    learner = [0, 1, 2, 3, 3, 2, 3]
    opponent = [1, 2, 6, 3, 6, 6]
    env, (_, reward, terminated, _, _) = play(learner[:3], opponent[:3])
    assert not terminated
    env, out = play(learner, opponent)
    board = env.board
    assert board[0, 0] == board[1, 1] == board[2, 2] == board[3, 3] == 1
    assert out[1] == 1.0 and out[2]


def test_falling_diagonal_win_for_opponent():
    # opponent: (3,0) (2,1) (1,2) (0,3)
    opponent = [3, 2, 2, 1, 1, 0, 1, 0, 0]
    learner = [0, 0, 1, 6, 1, 6, 6, 6, 0]
    env = ConnectFourEnv(opponent=Scripted(opponent))
    env.reset(seed=0, options={"learner_first": False})  # opponent opens in column 3
    reward, terminated = 0.0, False
    for move in learner:
        _, reward, terminated, _, info = env.step(move)
        if terminated:
            break
    board = env.board
    assert board[0, 3] == board[1, 2] == board[2, 1] == board[3, 0] == -1
    assert reward == -1.0 and terminated and info["result"] == -1.0


def test_win_detection_all_directions_batched():
    boards = np.zeros((5, ROWS, COLS), dtype=np.int8)
    boards[0, 2, 1:5] = 1                       # row
    boards[1, 1:5, 6] = 1                       # column
    for k in range(4):
        boards[2, k, k + 2] = 1                 # rising diagonal
        boards[3, 5 - k, k] = 1                 # falling diagonal
    boards[4, 0, :3] = 1                        # only three
    assert wins(boards, 1).tolist() == [True, True, True, True, False]
    assert not wins(boards, -1).any()


def test_draw_on_full_board():
    # A full board with no four in a row: pairs of columns, rows alternating.
    row = np.array([1, 1, -1, -1, 1, 1, -1], dtype=np.int8)
    board = np.stack([row, -row] * 3)
    assert not wins(board[None], 1)[0] and not wins(board[None], -1)[0]
    assert board[5, 6] == 1
    board[5, 6] = 0  # leave one empty cell for the learner's last move
    env = ConnectFourEnv(opponent=RandomPlayer(0))
    env.reset(seed=0)
    env.set_board(board)
    obs, reward, terminated, _, info = env.step(6)
    assert terminated and reward == 0.0 and info["result"] == 0.0
    assert not info["action_mask"].any()


def test_illegal_move_refused():
    env = ConnectFourEnv(opponent=Scripted([0, 0, 0]))
    env.reset(seed=0, options={"learner_first": True})
    for _ in range(3):
        _, _, _, _, info = env.step(0)
    assert not info["action_mask"][0]
    with pytest.raises(ValueError, match="full"):
        env.step(0)
    with pytest.raises(ValueError):
        env.step(COLS)


def test_action_mask_marks_full_columns():
    env = ConnectFourEnv(opponent=Scripted([0, 0, 0]))
    env.reset(seed=0, options={"learner_first": True})
    for _ in range(2):
        env.step(0)
    _, _, _, _, info = env.step(0)
    assert info["action_mask"].tolist() == [False] + [True] * 6


def test_heuristic_wins_and_blocks():
    board = np.zeros((1, ROWS, COLS), dtype=np.int8)
    board[0, 0, 0:3] = 1     # side to move can win at column 3
    board[0, 0:3, 6] = -1    # and must otherwise block column 6
    mask = np.ones((1, COLS), dtype=bool)
    player = HeuristicPlayer(0)
    assert player.act(observe(board, 1), mask, None)[0] == 3
    board[0, 0, 0:3] = 0
    assert player.act(observe(board, 1), mask, None)[0] == 6


def test_heuristic_beats_random_and_players_respect_masks():
    env = make_vec_env("ConnectFour-v0", 64, seed=0, opponent="random")
    env.reset()
    heuristic, results = HeuristicPlayer(1), []
    while len(results) < 300:
        actions = heuristic.act(observe(env.env.boards), env.last_infos["action_mask"], None)
        results += [ep["result"] for ep in env.step(actions).episodes]
    assert np.mean(np.array(results) == 1.0) > 0.9
    mask = np.zeros((200, COLS), dtype=bool)
    mask[np.arange(200), np.arange(200) % COLS] = True
    assert (sample_legal(np.random.default_rng(0), mask) == np.arange(200) % COLS).all()


def test_vector_env_same_step_autoreset_and_results():
    env = make_vec_env("ConnectFour-v0", 16, seed=5, opponent="random")
    obs = env.reset()
    rng = np.random.default_rng(0)
    finished = 0
    for _ in range(60):
        mask = env.last_infos["action_mask"]
        result = env.step(sample_legal(rng, mask))
        for ep in result.episodes:
            i = ep["env_index"]
            assert ep["result"] in (-1.0, 0.0, 1.0) and ep["return"] == ep["result"]
            assert result.terminations[i]
            # the new game's board holds at most the opponent's opening disc
            assert result.obs[i].sum() <= 1
            assert result.final_obs[i].sum() >= 7
            finished += 1
        obs = result.obs
    assert finished > 16 and obs.shape == (16, 2, ROWS, COLS)


def test_vector_env_seats_and_determinism():
    def run(seed):
        env = make_vec_env("ConnectFour-v0", 8, seed=seed, opponent="heuristic")
        obs = env.reset()
        return obs.copy()

    first = run(7)
    assert (first == run(7)).all()
    env = make_vec_env("ConnectFour-v0", 8, seed=1, opponent="random", learner_first=True)
    assert env.reset().sum() == 0  # learner moves first: empty boards
    env = make_vec_env("ConnectFour-v0", 8, seed=1, opponent="random", learner_first=False)
    assert (env.reset()[:, 1].sum(axis=(1, 2)) == 1).all()  # one opponent disc each


def test_random_openings_play_both_sides_then_hand_over_in_turn():
    """random_opening=N: N random plies of both sides, the first player's first, then the learner is shown the
    board where it is its turn (after the opponent's reply where the opponent is to move); games differ; 7 and
    more are refused (a game could be decided)."""
    for plies in range(7):
        for learner_first in (True, False):
            env = make_vec_env("ConnectFour-v0", 32, seed=plies, opponent="random", learner_first=learner_first,
                               random_opening=plies)
            obs = env.reset()
            mine, theirs = obs[:, 0].sum(axis=(1, 2)), obs[:, 1].sum(axis=(1, 2))
            # the learner to move: as the first player it has as many discs as the opponent, else one fewer
            assert (mine == theirs - (0 if learner_first else 1)).all() and (mine + theirs >= plies).all()
            assert (mine + theirs <= plies + 1).all()
            if plies >= 2:
                assert len({o.tobytes() for o in obs}) > 8  # many different openings
            env.close()
    with pytest.raises(ValueError, match="random_opening must be 0..6"):
        make_vec_env("ConnectFour-v0", 1, seed=0, random_opening=7)
    single = gym.make("ConnectFour-v0", random_opening=3, learner_first=True)
    obs, _ = single.reset(seed=4)
    assert obs[0].sum() == obs[1].sum() == 2  # 3 random plies and the opponent's reply


def test_rgb_array_frame_shows_the_discs_where_they_lie():
    env = gym.make("ConnectFour-v0", render_mode="rgb_array", opponent=Scripted([0]))
    assert "rgb_array" in env.metadata["render_modes"] and env.metadata["render_fps"] > 0
    env.reset(seed=0, options={"learner_first": True})
    empty = env.render()
    assert empty.dtype == np.uint8 and empty.shape == (ROWS * 48, COLS * 48, 3)
    env.step(3)  # learner (red) in column 3, opponent (yellow) replies in column 0, both on the bottom row
    frame = env.render()
    assert frame.shape == empty.shape and (frame != empty).any()

    def centre(row_from_top, col):
        return frame[row_from_top * 48 + 24, col * 48 + 24].tolist()

    assert centre(ROWS - 1, 3) == [220, 40, 40] and centre(ROWS - 1, 0) == [245, 200, 30]
    assert centre(ROWS - 2, 3) == centre(0, 0) == empty[24, 24].tolist()  # still empty cells
    text = ConnectFourEnv(opponent=Scripted([0]), render_mode="ansi")
    text.reset(seed=0, options={"learner_first": True})
    text.step(3)
    assert text.render().splitlines()[-2:] == ["O..X...", "0123456"]  # the text mode is still there
