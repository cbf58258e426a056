"""Shogi-v0 on cshogi: the encoding against cshogi's own move generator and labels, the rules' game
ends from both seats, the players, and the game in ParallelManager and parallel_train_dqn's self-play."""

from __future__ import annotations

import json
import subprocess
import sys

import gymnasium as gym
import numpy as np
import pytest

cshogi = pytest.importorskip("cshogi", reason="Shogi-v0 needs cshogi (requirements-extras.txt)")

from cshogi.dlshogi import make_move_label  # noqa: E402

from common.envs import make_vec_env, play_episodes, shogi  # noqa: E402
from common.envs.selfplay import opponent_mixture  # noqa: E402
from common.envs.shogi import (  # noqa: E402
    ACTIONS,
    HeuristicPlayer,
    RandomPlayer,
    ShogiEnv,
    ShogiVectorEnv,
    action_from_usi,
    encode_moves,
    usi_from_action,
)
from tests.conftest import ROOT, run_script, script_env  # noqa: E402

SEED_004_MODEL = {"input_dim": 81 * 14, "hidden_dim": 512, "action_dim": 2187}


def rotated(usi: str) -> str:
    """A USI move on the board turned round (file f -> 10 - f, rank a <-> i): the same move for the other seat."""
    def square(text: str) -> str:
        return f"{10 - int(text[0])}{chr(ord('a') + ord('i') - ord(text[1]))}"

    if "*" in usi:
        return usi[:2] + square(usi[2:4])
    return square(usi[:2]) + square(usi[2:4]) + usi[4:]


class Scripted:
    """An opponent that plays a fixed list of USI moves on the boards of ``env`` (a ShogiVectorEnv)."""

    def __init__(self, env: ShogiVectorEnv, moves: list[str]):
        self.env, self.moves = env, list(moves)

    def act(self, obs, action_mask, env_ids):
        return np.array([action_from_usi(self.env.boards[i], self.moves.pop(0)) for i in env_ids])


def game(sfen: str, learner: list[str], opponent: list[str], seat_black: bool, **kwargs):
    """Play ``learner``'s moves from ``sfen`` (written for black to move) against the scripted ``opponent``,
    as black or, on the board turned round, as white; returns the last step's output."""
    env = ShogiEnv(**kwargs)
    if not seat_black:
        sfen = cshogi.rotate_sfen(sfen)
        learner, opponent = [rotated(m) for m in learner], [rotated(m) for m in opponent]
    env.set_opponent(Scripted(env._vec, opponent))
    env.set_position(sfen)
    assert env.learner_colour == (0 if seat_black else 1)
    out = None
    for move in learner:
        assert out is None or not (out[2] or out[3]), "the game ended before the learner's last move"
        out = env.step(action_from_usi(env._vec.boards[0], move))
    return out


def random_positions(count: int, seed: int):
    """cshogi boards after random games of random length, both sides to move."""
    rng = np.random.default_rng(seed)
    board = cshogi.Board()
    for _ in range(count):
        board.reset()
        for _ in range(int(rng.integers(0, 160))):
            moves = list(board.legal_moves)
            if not moves:
                break
            board.push(int(rng.choice(moves)))
        yield board


def test_registered_with_the_seeds_sizes():
    env = gym.make("Shogi-v0", board_size=9, max_moves=200)  # seed 004's env_config
    obs, info = env.reset(seed=0)
    assert obs.shape == (14, 9, 9) and obs.size == SEED_004_MODEL["input_dim"] and obs.dtype == np.float32
    assert env.action_space.n == ACTIONS == SEED_004_MODEL["action_dim"]
    assert info["action_mask"].dtype == bool and info["action_mask"].shape == (ACTIONS,)
    assert info["action_mask"].sum() == 30  # the opening position's legal moves (after a reply: 30 too)
    env.close()


def test_mask_is_cshogis_legal_moves_and_every_move_round_trips():
    """From 60 random positions (both colours to move): the mask marks one id per legal move and nothing else,
    the id is dlshogi's move label, and the id leads back to the same move."""
    env = ShogiVectorEnv(1)
    colours = set()
    for board in random_positions(60, seed=1):
        env.boards[0].set_sfen(board.sfen())
        env._legal(np.arange(1))
        moves = list(board.legal_moves)
        colours.add(board.turn)
        ids = encode_moves(np.array(moves, dtype=np.int64), board.turn)
        assert sorted(ids.tolist()) == sorted(np.flatnonzero(env.masks[0]).tolist())
        assert len(set(ids.tolist())) == len(moves)
        assert ids.tolist() == [make_move_label(m, board.turn) for m in moves]
        assert [int(env.moves[0, a]) for a in ids] == moves
        assert [usi_from_action(board, int(a)) for a in ids] == [cshogi.move_to_usi(m) for m in moves]
    assert colours == {0, 1}


def test_observation_from_the_movers_side():
    """The opening looks the same to both seats (the board turned round for white); hands are counted in
    their runs, the opponent's pieces are -1, a check fills its plane."""
    env = ShogiEnv(opponent="random")
    black, _ = env.reset(seed=0, options={"learner_first": True})
    assert black[0].reshape(81).tolist().count(1) == 9 and (black[0].reshape(9, 9)[:, 6] == 1).all()  # my pawns
    assert (black[0].reshape(9, 9)[:, 2] == -1).all()  # theirs, on the far side
    start = shogi.observe([cshogi.Board()], np.array([1]))[0]
    assert np.array_equal(start, shogi.observe([cshogi.Board()], np.array([0]))[0])
    board = cshogi.Board("4k4/9/9/9/9/9/9/4r4/4K4 b 2PLr3p 1")  # black in check, with 2 pawns and a lance in hand
    obs = shogi.observe([board], np.array([0]), np.array([2]))[0].reshape(14, 81)
    assert obs[9, :18].tolist() == [1, 1] + [0] * 16 and obs[9, 18:22].tolist() == [1, 0, 0, 0]
    assert obs[10, :3].tolist() == [1, 1, 1] and obs[10, 36:38].tolist() == [1, 0]  # their pawns and their rook
    assert (obs[11] == 1).all() and np.allclose(obs[12], 2 / 3) and (obs[13] == 1).all()
    assert obs[5, 4 * 9 + 7] == -1  # their rook on 5h (file 5 -> 4, rank h -> 7)
    seen_by_white = shogi.observe([board], np.array([1]))[0].reshape(14, 81)
    assert seen_by_white[5, 80 - (4 * 9 + 7)] == 1 and (seen_by_white[11] == 0).all()  # white is not in check


def test_observation_matches_every_piece_and_hand_of_random_positions():
    """Planes 0-10 read back into the board and the hands, square by square, for both viewers."""
    for board in random_positions(30, seed=2):
        for viewer in (0, 1):
            obs = shogi.observe([board], np.array([viewer]))[0].reshape(14, 81)
            for square, code in enumerate(board.pieces):
                seen = obs[:9, square if viewer == 0 else 80 - square]
                kind, colour = code & 15, code >> 4
                expected = np.zeros(9)
                if code:
                    expected[(kind - 1) % 8] = expected[8] = 1.0 if colour == viewer else -1.0
                    expected[8] *= kind > 8
                assert seen.tolist() == expected.tolist(), (board.sfen(), viewer, square)
            for plane, colour in ((9, viewer), (10, 1 - viewer)):
                runs = np.split(obs[plane, :38], np.cumsum(shogi.HAND_SIZES)[:-1])
                assert [int(run.sum()) for run in runs] == list(board.pieces_in_hand[colour])
                assert all((np.diff(run) <= 0).all() for run in runs)  # counted from the start of each run


@pytest.mark.parametrize("seat_black", [True, False], ids=["first", "second"])
def test_checkmate_wins_and_loses_from_both_seats(seat_black):
    _, reward, terminated, truncated, info = game("4k4/9/4P4/9/9/9/9/9/4K4 b G 1", ["G*5b"], [], seat_black)
    assert (reward, terminated, truncated, info["result"]) == (1.0, True, False, 1.0)
    _, reward, terminated, truncated, info = game("4k4/9/9/9/9/P8/4p4/9/4K4 b g 1", ["9f9e"], ["G*5h"], seat_black)
    assert (reward, terminated, truncated, info["result"], info["plies"]) == (-1.0, True, False, -1.0, 2)
    assert not info["action_mask"].any()  # mated: no legal move


@pytest.mark.parametrize("seat_black", [True, False], ids=["first", "second"])
def test_fourfold_repetition_draws_and_perpetual_check_loses(seat_black):
    shuffle = ["5i4i", "4i5i"] * 3, ["5a4a", "4a5a"] * 3  # no checks: the opening position's 4th time is a draw
    _, reward, terminated, truncated, info = game("4k4/9/9/9/9/9/9/9/4K4 b - 1", *shuffle, seat_black)
    assert (reward, terminated, truncated, info["result"]) == (0.0, True, False, 0.0)
    checks = ["6i5i"] + ["5i4i", "4i5i"] * 3, ["5a4a", "4a5a"] * 3  # the learner checks with every move
    _, reward, terminated, truncated, info = game("4k4/9/9/9/9/9/9/9/K2R5 b - 1", *checks, seat_black)
    assert (reward, terminated, truncated, info["result"]) == (-1.0, True, False, -1.0)


@pytest.mark.parametrize("learner_first", [True, False], ids=["first", "second"])
def test_max_moves_cuts_a_game_as_a_draw(learner_first):
    env = ShogiEnv(opponent="random", max_moves=7)
    _, info = env.reset(seed=3, options={"learner_first": learner_first})
    rng = np.random.default_rng(0)
    steps = []
    while not steps or not (steps[-1][2] or steps[-1][3]):
        steps.append(env.step(int(rng.choice(np.flatnonzero(info["action_mask"])))))
        info = steps[-1][4]
    _, reward, terminated, truncated, info = steps[-1]
    assert (reward, terminated, truncated, info["result"], info["plies"]) == (0.0, False, True, 0.0, 7)
    assert len(steps) == (4 if learner_first else 3)  # the learner moves on plies 1, 3, 5, 7 or 2, 4, 6


@pytest.mark.parametrize("learner_first", [True, False], ids=["first", "second"])
def test_random_openings_play_both_sides_then_hand_over_in_turn(learner_first):
    env = ShogiEnv(opponent="random", random_opening=4, learner_first=learner_first)
    _, info = env.reset(seed=1)
    assert env._vec.plies[0] == (4 if learner_first else 5)  # the second player's opponent replies to the opening
    assert env.board.turn == env.learner_colour and info["action_mask"].any()
    with pytest.raises(ValueError, match="random_opening must be 0..16"):
        ShogiEnv(random_opening=17)


def test_illegal_moves_and_bad_settings_are_one_line_refusals(monkeypatch):
    env = ShogiEnv()
    _, info = env.reset(seed=0)
    with pytest.raises(ValueError, match="illegal move"):
        env.step(int(np.flatnonzero(~info["action_mask"])[0]))
    with pytest.raises(ValueError, match="board_size 19: Shogi-v0 plays the standard 9x9 board only"):
        gym.make("Shogi-v0", board_size=19)
    with pytest.raises(ValueError, match="max_moves 0"):
        ShogiVectorEnv(2, max_moves=0)
    with pytest.raises(ValueError, match="unknown Shogi player 'search1'; known: random, heuristic"):
        ShogiEnv(opponent="search1")
    monkeypatch.setattr(shogi, "cshogi", None)
    refusal = r"^Shogi-v0 needs the cshogi package: pip install -r requirements-extras\.txt$"
    with pytest.raises(ImportError, match=refusal):
        gym.make("Shogi-v0")


def test_heuristic_takes_the_most_valuable_piece_and_beats_random():
    board = cshogi.Board("4k4/9/9/3b5/4r4/4P4/3G5/9/4K4 b - 1")  # the pawn may take the rook, the gold nothing
    obs = shogi.observe([board], np.array([0]))
    env = ShogiVectorEnv(1)
    env.boards[0].set_sfen(board.sfen())
    env._legal(np.arange(1))
    assert usi_from_action(board, int(HeuristicPlayer(0).act(obs, env.masks[:1])[0])) == "5f5e"
    vec = ShogiVectorEnv(16, opponent="random", seed=5, max_moves=200)
    obs, info = vec.reset(seed=5)
    player, results = HeuristicPlayer(6), []
    while len(results) < 16:
        obs, _, _, _, info = vec.step(player.act(obs, info["action_mask"]))
        if "final_info" in info:
            results += info["final_info"]["result"][info["final_info"]["_result"]].tolist()
    assert np.mean(np.array(results) == 1) > 0.5 and -1 not in results  # most won, none lost (bench_shogi.py speed)


def test_vector_env_autoresets_and_seeds_repeat_games():
    def games(seed):
        vec = make_vec_env("Shogi-v0", 4, seed=seed, max_moves=30, opponent="heuristic")
        player = RandomPlayer(seed)
        episodes, _ = play_episodes(vec, lambda obs, masks: player.act(obs, masks), 8, record=True, seed=seed)
        return episodes

    first, again = games(11), games(11)
    assert [e["return"] for e in first] == [e["return"] for e in again]
    assert all(np.array_equal(a["actions"], b["actions"]) for a, b in zip(first, again))
    for episode in first:  # every recorded move was legal where it was played
        assert episode["masks"][np.arange(len(episode["actions"])), episode["actions"]].all()
        assert episode["plies"] <= 30 and episode["result"] in (-1.0, 0.0, 1.0)


def test_self_play_mixture_plays_shogis_own_fixed_players():
    class Latest:
        def act(self, obs, action_mask, epsilon, rng):
            return RandomPlayer(0).act(obs, action_mask)

    rng = np.random.default_rng(0)
    mixture = opponent_mixture({"probs": {"latest": 0.5, "random": 0.25, "heuristic": 0.25}}, Latest(), [], 4, rng)
    vec = ShogiVectorEnv(4)
    vec.set_opponent(mixture)
    fixed = [type(p) for p, name in zip(mixture.players, mixture.names) if name is not None]
    assert fixed == [RandomPlayer, HeuristicPlayer]
    obs, info = vec.reset(seed=0)
    for _ in range(5):
        obs, _, _, _, info = vec.step(RandomPlayer(1).act(obs, info["action_mask"]))


@pytest.mark.timeout(180)
def test_parallel_manager_plays_shogi_with_the_seed_004_model():
    """Seed 004's three dicts with the Shogi env id: its model fits the env exactly, and the workers' games
    come back legal under their masks."""
    from common.parallel_manager import ParallelManager

    with pytest.raises(ValueError, match="action_dim 2186 does not match"):
        ParallelManager({"env_id": "Shogi-v0"}, {**SEED_004_MODEL, "action_dim": 2186}, {"num_workers": 1})
    manager = ParallelManager({"env_id": "Shogi-v0", "board_size": 9, "max_moves": 40, "opponent": "heuristic"},
                              SEED_004_MODEL, {"num_workers": 1, "games_per_worker": 2, "timeout": 120.0})
    assert manager.spec.env_kwargs == {"board_size": 9, "max_moves": 40, "opponent": "heuristic"}
    assert sum(p.numel() for p in manager.model.parameters()) == (1134 * 512 + 512) + (512 * 512 + 512) + (
        512 * 2187 + 2187)
    with manager:
        manager.start_workers(wait=True)
        batches = manager.collect_experiences(timeout=120.0)
        episodes = [e for b in batches for e in b.episodes]
        assert len(episodes) == 2
        for episode in episodes:
            assert episode["obs"].shape[1:] == (14, 9, 9) and episode["masks"].shape[1] == 2187
            assert episode["masks"][np.arange(len(episode["actions"])), episode["actions"]].all()
            assert episode["plies"] <= 40
        assert manager.sync_model_to_workers() == 2
        results = manager.evaluate(2, opponent="heuristic", learner_first=False)
        assert len(results) == 2 and all(r["result"] in (-1.0, 0.0, 1.0) for r in results)


@pytest.mark.timeout(240)
def test_parallel_train_dqn_self_play_on_shogi(tmp_path):
    """A tiny self-play run: the pool, Shogi's heuristic in the training mix, evaluation against its players."""
    out = tmp_path / "run"
    proc = run_script("parallel_train_dqn.py", "--env-id", "Shogi-v0", "--env-kwargs", "max_moves=20",
                      "--num-workers", "1", "--episodes-per-batch", "4", "--total-episodes", "24",
                      "--eval-episodes", "2", "--learning-starts", "32", "--batch-size", "32", "--buffer-size", "2000",
                      "--hidden-sizes", "64", "--snapshot-interval", "2", "--opponent-heuristic", "0.2",
                      "--output-dir", str(out), timeout=220)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["episodes"] == 24 and summary["updates"] > 0 and summary["worker_restarts"] == 0
    evaluation = summary["final_eval"]
    for opponent in ("random", "heuristic"):
        assert evaluation[f"eval_win_{opponent}"] + evaluation[f"eval_draw_{opponent}"] + evaluation[
            f"eval_loss_{opponent}"] == pytest.approx(1.0)
    assert "opponent pool" in (out / "logs" / "main.log").read_text()
    proc = subprocess.run([sys.executable, "-m", "common.evaluate", str(out), "--episodes", "2", "--json"], cwd=ROOT,
                          env=script_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout[proc.stdout.index("{"):])
    assert {"win_rate_vs_random", "win_rate_vs_heuristic"} <= set(report) and set(report["opponents"]) == {
        "random", "heuristic"}
