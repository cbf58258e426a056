"""Grading by a perfect player (common/grading.py) and Connect Four's, BitBully (common/envs/connect_four_solver.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, script_env

from common import grading
from common.envs import connect_four as c4
from common.envs.connect_four_solver import move_values, solver


def position(moves: str) -> np.ndarray:
    """The ``(1, 2, 6, 7)`` observation of the side to move after ``moves`` (columns, the first player's first)."""
    boards, heights = np.zeros((1, c4.ROWS, c4.COLS), np.int8), np.zeros((1, c4.COLS), np.int64)
    for ply, col in enumerate(moves):
        c4.drop(boards, heights, np.arange(1), np.array([int(col)]), 1 if ply % 2 == 0 else -1)
    return c4.observe(boards, 1 if len(moves) % 2 == 0 else -1)


def test_the_empty_board_is_won_by_the_middle_column_alone():
    values = move_values(position(""))[0]
    assert values.tolist() == [-2, -1, 0, 1, 0, -1, -2]  # the first player wins only in the centre, on its last disc


@pytest.mark.parametrize("moves, winning", [("010101", 0), ("3010106", 0), ("001122", 3)])
def test_an_immediate_win_scores_best_from_either_seat(moves, winning):
    values = move_values(position(moves))[0]
    assert values.argmax() == winning and values[winning] == 22 - (len(moves) // 2 + 1)  # the mover's next disc
    assert (values[np.arange(c4.COLS) != winning] < values[winning]).all()


def test_the_board_encoding_agrees_with_bitbullys_own_move_sequences():
    import bitbully

    rng = np.random.default_rng(0)
    for length in (5, 9, 16, 21, 28, 33):
        while True:  # a random game still going after ``length`` plies
            moves = "".join(str(c) for c in rng.integers(0, c4.COLS, length))
            board = bitbully.Board()
            if all(board.is_legal_move(int(c)) and not board.play_on_copy(int(c)).has_win() and board.play(int(c))
                   for c in moves):
                break
        values = move_values(position(moves))[0]
        expected = np.full(c4.COLS, -np.inf)
        for col, score in solver().score_all_moves(bitbully.Board(moves)).items():
            expected[col] = score
        assert values.tolist() == expected.tolist(), moves


def test_late_positions_agree_with_an_exhaustive_search():
    """Within four plies of a full board the project's own full-width negamax searches to the end, so the
    sign of each of its move values is the game-theoretic value: the solver's must be the same."""
    rng = np.random.default_rng(1)
    checked = 0
    while checked < 12:
        boards, heights = np.zeros((1, c4.ROWS, c4.COLS), np.int8), np.zeros((1, c4.COLS), np.int64)
        for _ in range(38):  # random moves that never complete four, from the side to move (+1) each time
            legal = heights[0] < c4.ROWS
            quiet = np.flatnonzero(legal & ~c4.winning_moves(c4.observe(boards), legal[None], 0)[0])
            if not quiet.size:
                break
            c4.drop(boards, heights, np.arange(1), np.array([rng.choice(quiet)]), 1)
            boards = -boards  # the other side to move
        else:
            exact = c4.move_values(boards, heights, depth=4)
            solved = move_values(c4.observe(boards))
            legal = heights < c4.ROWS
            assert (np.sign(exact[legal]) == np.sign(solved[legal])).all(), (exact, solved)
            checked += 1


def test_a_finished_board_is_refused():
    with pytest.raises(ValueError, match="live boards"):
        move_values(position("0101010"))


@pytest.fixture(scope="module")
def connect_four():
    perfect = grading.perfect_play("ConnectFour-v0")
    positions = grading.random_positions("ConnectFour-v0", {}, grading.graded_plies(perfect), 2, seed=5)
    return perfect, positions


def test_random_positions_are_live_and_at_their_ply(connect_four):
    _, positions = connect_four
    assert sorted(positions) == list(range(31))
    for ply, (obs, masks) in positions.items():
        boards, heights = c4.boards_of(obs)
        assert len(obs) == 2 and (heights.sum(axis=1) == ply).all()
        assert ((boards == 1).sum(axis=(1, 2)) == ply // 2).all()  # the side to move has the fewer discs or as many
        assert not (c4.wins(boards, 1) | c4.wins(boards, -1)).any()
        assert (masks == (heights < c4.ROWS)).all()


def test_a_perfect_player_grades_perfect_and_a_random_one_blunders(connect_four):
    perfect, positions = connect_four
    graded = grading.grade_moves(grading.PerfectPlayer(perfect.move_values, 0).act, perfect, positions)
    assert [graded[band]["positions"] for band in ("0-9", "10-19", "20-30", "all")] == [20, 20, 22, 62]
    assert all(r["optimal"] == 1.0 and r["blunder"] == 0.0 for r in graded.values()), graded
    assert graded["all"]["won"] + graded["all"]["drawn"] + graded["all"]["lost"] == pytest.approx(1.0)
    graded = grading.grade_moves(c4.RandomPlayer(0).act, perfect, positions)
    assert graded["all"]["blunder"] > 0.1 and graded["all"]["optimal"] < 0.8, graded


def test_the_perfect_player_wins_every_game_it_opens_and_ties_at_random(connect_four):
    perfect, _ = connect_four
    results = grading.play_perfect(grading.PerfectPlayer(perfect.move_values, 1).act, perfect, "ConnectFour-v0", {},
                                   2, seed=3)
    assert results["first"]["win"] == 1.0 and results["second"]["loss"] == 1.0  # the first player wins Connect Four
    player = grading.PerfectPlayer(perfect.move_values, 2)
    assert set(player.act(position("").repeat(40, axis=0), np.ones((40, c4.COLS), bool)).tolist()) == {3}
    full_centre = position("333333")  # by symmetry columns 2 and 4 win alike, and nothing better
    values = perfect.move_values(full_centre)[0]
    picked = player.act(full_centre.repeat(60, axis=0), np.isfinite(values)[None].repeat(60, axis=0))
    assert set(np.flatnonzero(values == values.max()).tolist()) == set(picked.tolist()) == {2, 4}, (values, picked)


def test_any_game_with_perfect_move_values_plugs_in():
    """Tic-tac-toe through the PettingZoo adapter, with its minimax values: one line in SOLVED_GAMES."""
    from common.envs import tictactoe_players

    graded = grading.grade(tictactoe_players.MinimaxPlayer(0).act, "pettingzoo/tictactoe-v3", {}, 4, 4, seed=1)
    assert graded["perfect_player"] == "minimax" and graded["positions"]["all"]["positions"] == 36
    assert graded["positions"]["all"]["optimal"] == 1.0 and graded["positions"]["all"]["blunder"] == 0.0
    assert graded["vs_perfect"]["both"]["draw"] == 1.0  # perfect against perfect: tic-tac-toe is a draw
    graded = grading.grade(c4.RandomPlayer(0).act, "pettingzoo/tictactoe-v3", {}, 4, 4, seed=1)
    assert graded["positions"]["all"]["blunder"] > 0 and graded["vs_perfect"]["both"]["win"] == 0.0


def test_a_game_without_a_perfect_player_is_one_line():
    with pytest.raises(ValueError, match="CartPole-v1 has no perfect player to grade by .*ConnectFour-v0"):
        grading.perfect_play("CartPole-v1")


# ---------------------------------------------------------------- never a training opponent; evaluate --grade

def test_no_training_mix_can_name_the_perfect_player():
    from common.envs.selfplay import opponent_mixture

    for name in ("perfect", "bitbully", "solver"):
        with pytest.raises(ValueError, match="unknown player"):
            opponent_mixture({"probs": {name: 1.0}}, None, [], 2, np.random.default_rng(0))


# The Q-network learner's default training mix (latest policy, snapshots, random player), on a budget of seconds.
# (The n-tuple learner, auto's choice on ConnectFour-v0, plays itself only: it has no opponent to mix in.)
TINY_SELF_PLAY = ["--learner", "q_network", "--num-workers", "1", "--episodes-per-batch", "16",
                  "--total-episodes", "96",
                  "--learning-starts", "100", "--batch-size", "32", "--hidden-sizes", "32", "--snapshot-interval", "2",
                  "--eval-interval", "0", "--eval-episodes", "2", "--no-tensorboard", "--seed", "3"]
# A bitbully that leaves a mark where it is imported and then fails, as if it were not installed.
FAKE_BITBULLY = """import os, pathlib
pathlib.Path(os.environ["GRADING_TEST_IMPORT_MARK"]).touch()
raise ImportError("No module named 'bitbully'")
"""


def evaluate(*args, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "common.evaluate", *map(str, args)], cwd=ROOT,
                          env=env or script_env(), capture_output=True, text=True, timeout=200)


@pytest.fixture(scope="module")
def fake_bitbully(tmp_path_factory):
    base = tmp_path_factory.mktemp("no_bitbully")
    (base / "bitbully").mkdir()
    (base / "bitbully" / "__init__.py").write_text(FAKE_BITBULLY)
    return base


def without_bitbully(fake: Path, mark: Path) -> dict:
    """The environment of a process for which ``import bitbully`` fails and touches ``mark``."""
    env = script_env()
    env.update(PYTHONPATH=f"{fake}{os.pathsep}{env['PYTHONPATH']}", GRADING_TEST_IMPORT_MARK=str(mark))
    return env


@pytest.fixture(scope="module")
def self_play_run(tmp_path_factory, fake_bitbully):
    """A tiny self-play run of parallel_train_dqn.py, every process of it unable to import the solver, and
    whether one of them tried."""
    run_dir = tmp_path_factory.mktemp("dqn") / "self_play"
    mark = run_dir.parent / "training_imported_bitbully"
    result = subprocess.run([sys.executable, str(ROOT / "parallel_train_dqn.py"), *TINY_SELF_PLAY, "--output-dir",
                             str(run_dir)], cwd=ROOT, env=without_bitbully(fake_bitbully, mark), capture_output=True,
                            text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir, mark.exists()


def test_self_play_training_never_imports_the_perfect_player(self_play_run):
    run_dir, imported = self_play_run
    assert (run_dir / "checkpoints" / "latest.pt").is_file()
    assert not imported  # no process of the run (learner, workers, plotter) tried to import bitbully


def test_evaluate_grade_without_bitbully_is_one_line_naming_the_extras(self_play_run, fake_bitbully, tmp_path):
    mark = tmp_path / "evaluate_imported_bitbully"
    result = evaluate(self_play_run[0], "--grade", "--episodes", "2", env=without_bitbully(fake_bitbully, mark))
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "requirements-extras.txt" in result.stderr and "bitbully" in result.stderr and mark.exists()
    assert result.stdout == ""  # refused before anything was played


@pytest.mark.timeout(240)
def test_evaluate_grade_reports_rates_by_ply_band_and_games_against_the_perfect_player(self_play_run):
    """Graded is the player of the report: here the 1-ply lookahead over the run's Q-network."""
    result = evaluate(self_play_run[0], "--grade", "1", "--episodes", "2", "--search-depth", "1", "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    graded = report["graded"]
    assert report["search_depth"] == 1
    assert graded["perfect_player"].startswith("bitbully ") and graded["positions_per_ply"] == 1
    assert {band: r["positions"] for band, r in graded["positions"].items()} == {"0-9": 10, "10-19": 10, "20-30": 11,
                                                                                "all": 31}
    for r in graded["positions"].values():
        assert 0 <= r["blunder"] <= 1 - r["optimal"] + 1e-9  # a blunder is never an optimal move
    assert graded["games_per_seat"] == 2
    assert graded["vs_perfect"]["second"]["loss"] == 1.0  # the perfect player moving first always wins
    assert all(sum(r.values()) == pytest.approx(1.0) for r in graded["vs_perfect"].values())
    lines = grading.text(graded)
    assert lines[0].startswith("  graded by a perfect player (bitbully") and "plies 10-19" in lines[2]
    assert "blunder" in lines[4] and lines[-1].strip().startswith("first")


def test_evaluate_grade_flag_and_a_game_without_a_perfect_player(capsys):
    from common.evaluate import EvaluationError, grading_perfect_play, parse_args

    assert [parse_args(["RUN", *flags]).grade for flags in ([], ["--grade"], ["--grade", "5"])] == [0, 30, 5]
    with pytest.raises(SystemExit) as stopped:
        parse_args(["RUN", "--grade", "-1"])
    assert stopped.value.code == 2 and "--grade -1: must be >= 1" in capsys.readouterr().err
    assert grading_perfect_play("CartPole-v1", 0) is None
    with pytest.raises(EvaluationError, match="--grade: CartPole-v1 has no perfect player"):
        grading_perfect_play("CartPole-v1", 30)
