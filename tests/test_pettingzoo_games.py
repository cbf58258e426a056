"""PettingZoo's two-player classic games through one adapter (common/envs/pettingzoo_games.py): turn order,
masks, results from both seats, seeding, what each game declares; the perfect tic-tac-toe player; self-play in
parallel_train_dqn.py, ParallelManager and python -m common.evaluate on them."""

from __future__ import annotations

import json
import sys

import gymnasium as gym
import numpy as np
import pytest
from conftest import ROOT

import parallel_train_dqn
from common.envs import make_vec_env, play_episodes
from common.envs.connect_four import RandomPlayer
from common.envs.pettingzoo_games import GAMES, TicTacToeEnv
from common.envs.symmetry import declared_other_seat, declared_plies, declared_symmetries
from common.envs.tictactoe_players import (
    HeuristicPlayer,
    MinimaxPlayer,
    boards_of,
    completing_lines,
    lines_lost,
    move_values,
    value,
)
from common.evaluate import declared, evaluation_opponents

TICTACTOE, CONNECT_FOUR, GO = "pettingzoo/tictactoe-v3", "pettingzoo/connect_four-v3", "pettingzoo/go-v5"


class Scripted:
    """An opponent that plays a fixed list of moves."""

    def __init__(self, moves):
        self.moves = list(moves)

    def act(self, obs, action_mask, env_ids):
        return np.array([self.moves.pop(0) for _ in range(len(obs))])


class Recording:
    """A random opponent that keeps every board it was shown, its mask and the move it made (one game at a time)."""

    def __init__(self):
        self.rng, self.calls = np.random.default_rng(5), []

    def act(self, obs, action_mask, env_ids):
        action = int(self.rng.choice(np.flatnonzero(action_mask[0])))
        self.calls.append((obs[0].copy(), action_mask[0].copy(), action))
        return np.array([action])


def random_moves(seed: int):
    rng = np.random.default_rng(seed)
    return lambda obs, masks: np.array([rng.choice(np.flatnonzero(m)) for m in masks])


# ----------------------------------------------------------------- the adapter

@pytest.mark.parametrize("env_id, shape, actions", [(TICTACTOE, (2, 3, 3), 9), (CONNECT_FOUR, (2, 6, 7), 7)])
def test_registered_with_the_movers_planes_channels_first_and_bool_masks(env_id, shape, actions):
    env = gym.make(env_id)
    obs, info = env.reset(seed=0, options={"learner_first": True})
    assert obs.shape == shape and obs.dtype == np.float32 and env.observation_space.contains(obs)
    assert env.action_space.n == actions and info["action_mask"].dtype == bool and info["action_mask"].all()
    assert not obs.any()  # the empty board: the learner opens
    assert hasattr(env.unwrapped, "set_opponent") and env.unwrapped.learner_agent == env.unwrapped.aec_env.agents[0]
    env.close()


def test_turn_order_masks_and_results_from_both_seats():
    """The learner's move and the opponent's reply are one step, each side sees its own marks in plane 0, the
    mask is the empty cells, a taken cell is refused, and a win, a loss and a draw end the game with their
    rewards, from either seat."""
    env = TicTacToeEnv(opponent=Scripted([3, 4]))
    obs, info = env.reset(seed=0, options={"learner_first": True})
    obs, reward, terminated, _, info = env.step(0)
    assert obs[0].ravel().tolist() == [1, 0, 0, 0, 0, 0, 0, 0, 0] and obs[1].ravel()[3] == 1
    assert info["action_mask"].tolist() == [False, True, True, False, True, True, True, True, True]
    with pytest.raises(ValueError, match="illegal move: action 3"):
        env.step(3)
    env.step(1)
    obs, reward, terminated, truncated, info = env.step(2)  # 0, 1, 2: the top row
    assert (reward, terminated, truncated, info["result"]) == (1.0, True, False, 1.0)
    assert env.aec_env.board.squares[:3] == [1, 1, 1]  # PettingZoo's own board: the opener's marks are 1
    with pytest.raises(RuntimeError, match="finished game"):
        env.step(5)

    env = TicTacToeEnv(opponent=Scripted([4, 0, 8, 2]))  # the opponent opens in the centre and takes a diagonal
    obs, info = env.reset(seed=0, options={"learner_first": False})
    assert obs[1].ravel()[4] == 1 and obs[0].sum() == 0 and not info["action_mask"][4]
    assert env.learner_agent == "player_2" and env.aec_env.board.squares[4] == 1
    env.step(1)
    obs, reward, terminated, _, info = env.step(3)
    assert (reward, terminated, info["result"]) == (-1.0, True, -1.0)

    draw = TicTacToeEnv(opponent=Scripted([4, 1, 5, 6]))  # X O X / X O O / O X X: no line of three
    draw.reset(seed=0, options={"learner_first": True})
    for move in (0, 2, 7, 3):
        assert draw.step(move)[2] is False
    obs, reward, terminated, _, info = draw.step(8)
    assert (reward, terminated, info["result"]) == (0.0, True, 0.0) and obs.sum() == 9


def test_results_agree_with_the_final_board_from_both_seats_and_seeds_repeat_games():
    """Thousands of random games in the vector form: every finished game's result is what its final board says
    (a line of the learner's, of the opponent's, or a full board), both seats are played, same-step autoreset
    starts a fresh board, and the same seed plays the same games."""
    def play(seed):
        vec = make_vec_env(TICTACTOE, 16, seed=seed)
        episodes, _ = play_episodes(vec, random_moves(seed), 200, record=True)
        vec.close()
        return episodes

    episodes = play(4)
    first_moves = {int(e["obs"][0].sum()) for e in episodes}
    assert first_moves == {0, 1}  # the learner opened some games (empty board) and replied in others
    for e in episodes:
        final = boards_of(e["obs"][-1:])
        expected = 1.0 if completing_lines(final, 1)[0] else -1.0 if completing_lines(final, -1)[0] else 0.0
        assert e["result"] == expected == e["return"] and e["terminated"]
        assert expected != 0.0 or (final != 0).all()
        assert (e["masks"][:-1] == (boards_of(e["obs"][:-1]) == 0)).all()
    assert {e["result"] for e in episodes} == {-1.0, 0.0, 1.0}
    again, other = play(4), play(5)
    assert all((a["obs"] == b["obs"]).all() for a, b in zip(episodes, again))
    assert any(a["obs"].shape != b["obs"].shape or (a["obs"] != b["obs"]).any() for a, b in zip(episodes, other))


def test_a_random_opening_plays_both_sides_then_hands_over_in_turn():
    env = TicTacToeEnv(opponent=Scripted([]), random_opening=4)  # no reply needed: 4 plies leave the opener to move
    obs, _ = env.reset(seed=1, options={"learner_first": True})
    assert obs[0].sum() == obs[1].sum() == 2
    with pytest.raises(ValueError, match="random_opening must be 0..4"):
        TicTacToeEnv(random_opening=5)


def test_the_opponent_moves_in_every_waiting_game_at_once():
    calls = []

    class Counting(RandomPlayer):
        def act(self, obs, action_mask, env_ids=None):
            calls.append(sorted(env_ids.tolist()))
            return super().act(obs, action_mask, env_ids)

    vec = make_vec_env(TICTACTOE, 16, seed=0, opponent=Counting(0), learner_first=False)
    vec.reset()
    vec.step(np.argmax(vec.last_infos["action_mask"], axis=1))
    assert calls == [list(range(16))] * 2  # the 16 openings in one call, then the 16 replies in one call
    vec.close()


def test_render_mode_goes_to_the_game():
    env = gym.make(TICTACTOE, render_mode="rgb_array")
    env.reset(seed=0)
    frame = env.render()
    assert frame.dtype == np.uint8 and frame.ndim == 3 and frame.shape[2] == 3 and frame.std() > 0
    env.close()


def test_go_through_the_same_adapter_with_the_games_own_kwargs():
    """go-v5 on a 5 x 5 board (``board_size`` goes to PettingZoo): 17 planes channels first, 26 moves (the last
    one passes), games end with PettingZoo's score from either seat."""
    vec = make_vec_env(GO, 4, seed=0, board_size=5)
    assert vec.single_observation_space.shape == (17, 5, 5) and vec.single_action_space.n == 26
    episodes, _ = play_episodes(vec, random_moves(0), 4)
    vec.close()
    assert len(episodes) == 4 and all(e["result"] == np.sign(e["return"]) != 0 for e in episodes)
    assert evaluation_opponents(GO) == ("random",) and declared_plies(GO) is None


def test_a_missing_pettingzoo_is_one_line_naming_the_extras(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "pettingzoo", None)  # import pettingzoo now fails as if it were not installed
    run = tmp_path / "run"
    assert parallel_train_dqn.main(["--env-id", TICTACTOE, "--output-dir", str(run)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "needs PettingZoo" in lines[0] and "requirements-extras.txt" in lines[0], lines
    assert not run.exists()


# ----------------------------------------------------------------- what the games declare

def test_each_game_declares_its_players_symmetries_and_seat_rebuilds():
    assert evaluation_opponents(TICTACTOE) == ("random", "heuristic", "minimax")
    assert declared(TICTACTOE, "HELD_OUT_PLAYERS") == ("minimax",) and declared(TICTACTOE, "MAX_RANDOM_OPENING") == 4
    assert evaluation_opponents(CONNECT_FOUR) == evaluation_opponents("ConnectFour-v0")
    assert declared(CONNECT_FOUR, "LookaheadPlayer") is not None and declared(TICTACTOE, "LookaheadPlayer") is None
    assert len(declared_symmetries(TICTACTOE)) == 7
    assert [s.name for s in declared_symmetries(CONNECT_FOUR)] == ["mirror"]
    assert declared_symmetries(GO) == () and declared_other_seat(GO) is None
    held_out = {name for game in GAMES.values() for name in game.held_out}
    columns = set(parallel_train_dqn.EVAL_COLUMNS)
    assert held_out <= set(parallel_train_dqn.EVALUATION_OPPONENTS + parallel_train_dqn.PETTINGZOO_OPPONENTS)
    assert {f"eval_loss_{name}" for game in GAMES.values() for name in game.evaluation_opponents} <= columns


def test_the_square_symmetries_keep_every_moves_perfect_value():
    """Each of tic-tac-toe's 7 declared symmetries maps a position and a move to one of the same minimax value,
    and the legal moves with them, on 200 random positions."""
    vec = make_vec_env(TICTACTOE, 8, seed=2)
    episodes, _ = play_episodes(vec, random_moves(2), 60, record=True)
    vec.close()
    obs = np.concatenate([e["obs"][:-1] for e in episodes])[:200]
    masks = np.concatenate([e["masks"][:-1] for e in episodes])[:200]
    values = move_values(obs, masks)
    for symmetry in declared_symmetries(TICTACTOE):
        moved = move_values(symmetry.observations(obs), symmetry.masks(masks))
        assert (moved[:, list(symmetry.action_map)] == values).all(), symmetry.name


@pytest.mark.parametrize("env_id", [TICTACTOE, CONNECT_FOUR])
def test_other_seat_and_plies_rebuild_what_the_opponent_saw_and_played(env_id):
    """From the learner's record alone: the opponent's boards (its side), masks and moves exactly as a recording
    opponent was given and made them; and the plies alternate, each next board the move played on the board
    before seen from the other side, only the winner's last move rewarded."""
    rebuild, plies = declared_other_seat(env_id), declared_plies(env_id)
    opponent = Recording()
    vec = make_vec_env(env_id, 1, 0)
    vec.env.set_opponent(opponent)
    episodes, _ = play_episodes(vec, random_moves(6), 30, record=True, seed=3)
    vec.close()
    games, opened = [], 0
    for board, mask, action in opponent.calls:  # a board with at most one mark starts a new game
        marks = int(board.sum())
        if marks <= 1:
            games.append([])
        if marks == 0:
            opened += 1  # the opponent's first move: not in the learner's record
            continue
        games[-1].append((board, mask, action))
    assert 3 <= opened <= 27
    for episode, game in zip(episodes, games):
        other = rebuild(episode)
        assert other["actions"].tolist() == [action for _, _, action in game]
        assert (other["obs"][:-1] == np.stack([board for board, _, _ in game])).all()
        assert (other["masks"][:-1] == np.stack([mask for _, mask, _ in game])).all()
        assert other["rewards"][-1] == -episode["rewards"][-1] and other["terminated"]
        ply = plies(episode)
        boards = ply["obs"][:, 0] - ply["obs"][:, 1]
        for t, action in enumerate(ply["actions"]):
            assert ply["masks"][t, action]
            after = boards[t + 1]
            changed = np.argwhere(boards[t] != -after)  # one new mark, the mover's (now -1 for the next side)
            assert len(changed) == 1 and after[tuple(changed[0])] == -1
        assert ply["rewards"].tolist() == [0.0] * (len(ply["actions"]) - 1) + [float(episode["rewards"][-1] != 0)]


def test_connect_four_players_and_lookahead_read_pettingzoos_rows():
    """PettingZoo's Connect Four has row 0 at the top: the built-in's players, made for row 0 at the bottom, take
    an open win there, and so does a depth-1 lookahead over a network that knows nothing."""
    env = gym.make(CONNECT_FOUR, opponent=Scripted([0, 0, 0]))
    obs, info = env.reset(seed=0, options={"learner_first": True})
    for column in (3, 3, 3):
        obs, *_, info = env.step(column)
    assert obs[0, 3:, 3].all() and obs[1, 3:, 0].all()  # three discs each, stacked from the bottom (row 5)
    game = GAMES[CONNECT_FOUR]
    for name in ("heuristic", "search2"):
        assert game.make_player(name, 0).act(obs[None], info["action_mask"][None], np.zeros(1, int))[0] == 3
    lookahead = declared(CONNECT_FOUR, "LookaheadPlayer")(lambda o: np.zeros((len(o), 7)), 1, 0)
    assert lookahead.act(obs[None], info["action_mask"][None])[0] == 3
    env.close()


# ----------------------------------------------------------------- the tic-tac-toe players

def test_minimax_is_perfect():
    """The empty board is a draw; minimax against minimax always draws, from both seats; it never loses to the
    random player and loses no line of play against any opponent; the heuristic and random players lose some."""
    assert value((0,) * 9) == 0
    player = MinimaxPlayer(2)

    def minimax(obs, masks):
        return player.act(obs, masks)

    for seat in (True, False):
        vec = make_vec_env(TICTACTOE, 20, seed=1, opponent="minimax", learner_first=seat)
        selfplay, _ = play_episodes(vec, minimax, 40)
        vec.close()
        assert {e["result"] for e in selfplay} == {0.0}
        vec = make_vec_env(TICTACTOE, 50, seed=1, opponent="random", learner_first=seat)
        against_random, _ = play_episodes(vec, minimax, 200)
        vec.close()
        results = np.array([e["result"] for e in against_random])
        assert (results >= 0).all() and (results == 1).mean() > (0.9 if seat else 0.6)
        assert lines_lost(minimax, seat)[0] == 0
    heuristic, random = HeuristicPlayer(0), RandomPlayer(0)
    assert lines_lost(lambda obs, masks: heuristic.act(obs, masks), False)[0] > 0
    assert lines_lost(lambda obs, masks: random.act(obs, masks), True)[0] > 0


def test_the_heuristic_completes_a_line_else_blocks_one():
    boards = np.array([[1, 1, 0, -1, -1, 0, 0, 0, 0],  # a win at 2 beats the block at 5
                       [1, 0, 0, -1, -1, 0, 1, 0, 0]])  # no win: block at 5
    obs = np.stack([boards == 1, boards == -1], axis=1).reshape(2, 2, 3, 3).astype(np.float32)
    assert HeuristicPlayer(0).act(obs, boards == 0).tolist() == [2, 5]


# ----------------------------------------------------------------- self-play, ParallelManager, evaluation

@pytest.mark.timeout(150)
@pytest.mark.parametrize("env_id, held_out", [(TICTACTOE, "minimax"), (CONNECT_FOUR, "search1")])
def test_self_play_runs_and_common_evaluate_scores_the_run(env_id, held_out, tmp_path, capsys):
    """A tiny self-play run: the opponent pool fills with snapshots whose games are labelled (PFSP), evaluation
    plays the game's own players from both seats (its held-out one too), and python -m common.evaluate reports
    them for the run."""
    from common.checkpoint import load_checkpoint
    from common.evaluate import main as evaluate
    from common.runlog import read_metrics

    run = tmp_path / "run"
    summary = parallel_train_dqn.train(
        env_id=env_id, num_workers=1, episodes_per_batch=8, total_episodes=24, duration=None, eval_interval=0,
        eval_episodes=2, hidden_sizes=[16], learning_starts=0, batch_size=16, snapshot_interval=1,
        opponent_snapshot=0.6, opponent_heuristic=0.2, tensorboard=False, output_dir=str(run))
    assert summary["exit_code"] == 0 and summary["episodes"] >= 24, summary
    final = summary["final_eval"]
    assert {f"eval_{what}_{held_out}{seat}" for what, seat in (("win", "_first"), ("win", "_second"), ("draw", ""),
                                                               ("loss", ""))} <= set(final)
    assert set(read_metrics(run / "metrics.csv")[0]) >= {f"eval_loss_{held_out}", "train_win_rate"}
    checkpoint = load_checkpoint(run / "checkpoints" / "latest.pt")
    assert len(checkpoint["snapshot_ids"]) >= 2 and checkpoint["env"]["id"] == env_id
    capsys.readouterr()
    assert evaluate([str(run), "--episodes", "3", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert list(report["opponents"]) == list(evaluation_opponents(env_id))
    assert report["env_id"] == env_id and "win_rate_vs_heuristic" in report
    if held_out == "minimax":
        assert report["opponents"]["minimax"]["both"]["win"] == 0.0  # nobody beats perfect play


def test_the_training_mix_and_the_targets_name_only_the_games_players(tmp_path, capsys):
    for flags, message in (([GO, "--opponent-heuristic", "0.2"], "--opponent-heuristic 0.2: pettingzoo/go-v5 has no "
                                                                 "heuristic player (its players: random)"),
                           ([TICTACTOE, "--target-unbeaten", "search4"], "--target-unbeaten 'search4': must be a "
                                                                         "player pettingzoo/tictactoe-v3 is evaluated"),
                           (["CartPole-v1", "--target-unbeaten", "random"], "--target-unbeaten 'random': must be a "
                                                                            "player CartPole-v1")):
        run = tmp_path / "run"
        assert parallel_train_dqn.main(["--env-id", *flags, "--output-dir", str(run)]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"error: {message}"), lines
        assert not run.exists()
    config = ROOT / "configs" / "tictactoe_selfplay.yaml"
    assert parallel_train_dqn.main(["--config", str(config), "--validate-only"]) == 0
    assert "target_unbeaten: minimax" in capsys.readouterr().out
    unbeaten = parallel_train_dqn.unbeaten
    assert unbeaten("minimax", {"eval_loss_minimax": 0.0}) and not unbeaten("minimax", {"eval_loss_minimax": 0.01})
    assert not unbeaten(None, {"eval_loss_minimax": 0.0}) and not unbeaten("minimax", {"eval_return": 1.0})
    with pytest.raises(ValueError, match="held out for evaluation"):
        GAMES[TICTACTOE].check_training_opponents({"latest": 0.5, "minimax": 0.5})


def test_a_self_play_mixture_plays_the_games_own_fixed_players():
    """The mixture's fixed players are made again by the game's own players when it becomes the opponent
    (tic-tac-toe's heuristic, not ConnectFour-v0's), and a mixture that names a held-out player is refused."""
    from common.envs.pettingzoo_games import TicTacToeVectorEnv
    from common.envs.selfplay import MixturePlayer, opponent_mixture

    rng = np.random.default_rng(0)
    mixture = opponent_mixture({"probs": {"heuristic": 0.5, "random": 0.5}}, None, [], 8, rng)
    vec = TicTacToeVectorEnv(8, seed=0)
    vec.set_opponent(mixture)
    assert {type(p).__module__ for p in mixture.players} == {"common.envs.tictactoe_players",
                                                             "common.envs.connect_four"}  # its heuristic, the random
    obs, info = vec.reset(seed=0)
    for _ in range(20):  # ConnectFour-v0's heuristic would fail on these boards
        obs, _, _, _, info = vec.step(RandomPlayer(1).act(obs, info["action_mask"]))
    with pytest.raises(ValueError, match="held out for evaluation"):
        vec.set_opponent(MixturePlayer([RandomPlayer(0)], [1.0], 8, rng, names=["minimax"]))


@pytest.mark.timeout(90)
def test_parallel_manager_collects_self_play_games_of_a_pettingzoo_game():
    """ParallelManager's rollout workers play pettingzoo/tictactoe-v3 as they play ConnectFour-v0: whole games
    with masks, a self-play mixture whose heuristic is tic-tac-toe's, and evaluation against minimax by name."""
    from common.parallel_manager import ParallelManager

    manager = ParallelManager({"env_id": TICTACTOE, "seed": 3}, {"hidden_dim": 16, "num_layers": 1},
                              {"num_workers": 1, "games_per_worker": 8, "timeout": 60.0})
    manager.start_workers()
    try:
        episodes = [e for batch in manager.collect_experiences() for e in batch.episodes]
        assert len(episodes) >= 8 and all(e["obs"].shape[1:] == (2, 3, 3) and "masks" in e for e in episodes)
        manager.set_opponents([manager.model.state_dict()], {"snapshot": 0.5, "heuristic": 0.5}, 0.1, [1.0], [7])
        mixed = []
        while len(mixed) < 16:  # a batch may still be the one played before the new opponents
            mixed += [e for batch in manager.collect_experiences() for e in batch.episodes]
        assert {e["opponent"] for e in mixed[-8:]} <= {7.0, -1.0}
        results = [e["result"] for e in manager.evaluate(10, "minimax", learner_first=True)]
        assert len(results) == 10 and max(results) <= 0.0  # minimax never loses
    finally:
        manager.stop_workers()
