"""The n-tuple value function and its self-play TD learner (common/ntuple.py), and the learner as
parallel_train_dqn.py's ``--learner ntuple``."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from conftest import ROOT, kill_tree, run_script, script_env, start_script

import parallel_train_dqn
from common import system
from common.checkpoint import load_checkpoint
from common.config import ConfigError
from common.envs.connect_four import COLS, ROWS, RandomPlayer, drop, legal_mask, observe, play_match
from common.ntuple import NTupleValue, SelfPlay, TrainConfig, random_walk_tuples, train
from common.ntuple_trainer import ntuple_train_config
from common.policy import load_policy
from common.runlog import read_metrics


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
    values, terminal = value.move_values(parents, heights)
    base = value.base_indices(-parents, 1 - heights.sum(axis=1) % 2)  # the boards' own, as the trainer keeps them
    for i in range(len(parents)):
        for col in np.flatnonzero(legal_mask(heights[i])):
            child, child_heights = parents[i:i + 1].copy(), heights[i:i + 1].copy()
            drop(child, child_heights, np.array([0]), np.array([col]), 1)
            positions = value.afterstate_indices(base[i:i + 1], heights[i:i + 1], np.array([col]))[0]
            assert np.array_equal(positions, value.indices(child)[0])  # the mover's seat's LUTs
            if not terminal[i, col]:  # read through the board's own entries and the changed ones
                assert values[i, col] == pytest.approx(value.values(child)[0], abs=1e-6)
        assert np.isneginf(values[i][~legal_mask(heights[i])]).all()
    lines = np.zeros((1, ROWS, COLS), dtype=np.int8)
    lines[0, 0, :3], lines[0, 1, :3] = 1, -1  # three in the bottom row, the side to move's
    values, terminal = value.move_values(lines, (lines != 0).sum(axis=1))
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


def test_td_lambda_moves_each_afterstate_once_by_its_lambda_return(monkeypatch):
    """Against the textbook form, game by game: the afterstate a game's ply i left moves once, by the sum over
    k < horizon of (-lambda) ** k times the TD error of ply i + 1 + k (negamax: each error is of the afterstate
    before it, the other side's, so its sign alternates), up to the game's end, and only while the moves in
    between were worth the best (an exploring move ends the sum)."""
    import common.ntuple as ntuple

    td_lambda, learning_rate = 0.5, 0.7
    value = NTupleValue.random(count=8, length=4, seed=22)
    config = TrainConfig(games_in_lockstep=6, td_lambda=td_lambda, epsilon=0.3, random_opening=(0, 2),
                         tanh_gradient=False)
    play = SelfPlay(value, config, seed=23)
    plies, applied = [], {}
    move_values, afterstate_indices = value.move_values, value.afterstate_indices
    real_drop, real_apply = ntuple.drop, ntuple.apply_mean_updates

    def recorded_move_values(*args):
        values, terminal = move_values(*args)
        plies.append({"values": values.copy(), "terminal": terminal.copy()})
        return values, terminal

    def recorded_afterstate_indices(*args):
        plies[-1]["afterstates"] = afterstate_indices(*args).copy()
        return plies[-1]["afterstates"]

    def recorded_drop(boards, heights, ids, actions, piece):
        plies[-1]["actions"] = np.asarray(actions).copy()
        return real_drop(boards, heights, ids, actions, piece)

    def recorded_apply(weights, hits, indices, steps):
        for row, step in zip(np.asarray(indices), steps.tolist()):
            applied.setdefault(row.tobytes(), []).append(step)
        return real_apply(weights, hits, indices, steps)

    monkeypatch.setattr(value, "move_values", recorded_move_values)
    monkeypatch.setattr(value, "afterstate_indices", recorded_afterstate_indices)
    monkeypatch.setattr(ntuple, "drop", recorded_drop)
    monkeypatch.setattr(ntuple, "apply_mean_updates", recorded_apply)
    for _ in range(300):
        play.ply(learning_rate, config.epsilon)

    horizon, checked, cut = config.horizon, 0, 0
    assert horizon == 5  # the first k with 0.5 ** k < 1/32
    for game in range(config.games_in_lockstep):
        line = []  # the plies of this game so far: (best value, chosen value, the afterstate's positions, ended)
        for ply in plies:
            values, action = ply["values"][game], ply["actions"][game]
            line.append((values.max(), values[action], ply["afterstates"][game].tobytes(),
                         ply["terminal"][game, action]))
            if not line[-1][3]:
                continue
            end = len(line) - 1  # the ply that ended the game: its afterstate is worth what the rules say
            for i in range(end):
                error, factor = 0.0, 1.0
                for k in range(min(horizon, end - i)):
                    best, previous_value = line[i + 1 + k][0], line[i + k][1]
                    error += factor * (-best - previous_value)
                    chosen, best_then = line[i + 1 + k][1], line[i + 1 + k][0]
                    factor *= -td_lambda if chosen == best_then else 0.0
                cut += factor == 0.0
                steps = applied.get(line[i][2], [])
                match = [s for s in steps if s == pytest.approx(learning_rate / value.active * error, abs=1e-6)]
                assert match, (game, i, error, steps)
                steps.remove(match[0])
                checked += 1
            line = []
    assert checked > 200 and cut > 20  # many afterstates, and many sums an exploring move ended


# ------------------------------------------------------------------ parallel_train_dqn.py --learner ntuple

NTUPLE_RUN = ["--learner", "ntuple", "--ntuple-tuples", "40", "--ntuple-length", "6", "--ntuple-games-in-lockstep",
              "256", "--num-workers", "1", "--duration", "none", "--eval-interval", "0", "--eval-episodes", "20",
              "--no-tensorboard", "--checkpoint-interval-s", "2"]


def test_self_play_counts_every_game_once_and_by_its_result():
    value = NTupleValue.random(count=8, length=4, seed=20)
    play = SelfPlay(value, TrainConfig(games_in_lockstep=64), seed=21)
    ended = sum(play.ply(0.5, 0.2) for _ in range(400))
    assert ended == play.games == play.results.sum() > 0 and play.plies == 400 * 64
    assert play.results[0] > 0 and play.results[2] > 0  # both seats win games


def test_the_ntuple_learner_trains_on_two_processes_survives_a_worker_death_stops_and_resumes(tmp_path):
    """Self-play in the main process and a worker over one shared table: a worker that dies is reported and
    restarted, Ctrl+C saves and exits 130, --resume continues the counts, the games and the learning, and
    the checkpoint plays and is graded through common.evaluate."""
    run_dir = tmp_path / "run"
    proc = start_script("parallel_train_dqn.py", *NTUPLE_RUN, "--total-timesteps", str(10**9), "--output-dir",
                        run_dir, env={"PRL_INJECT_FAULT": "raise:0:4"})  # worker 0 raises at its 4th message
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            rows = read_metrics(run_dir / "metrics.csv") if (run_dir / "metrics.csv").exists() else []
            if rows and float(rows[-1]["worker_restarts"]) >= 1 and (run_dir / "checkpoints" / "latest.pt").exists():
                break
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        kill_tree(proc)
    assert proc.returncode == 130, out[-2000:]
    assert "fault injected into worker 0" in out
    first = json.loads((run_dir / "summary.json").read_text())
    assert first["learner"] == "ntuple" and first["worker_restarts"] == 1 and first["global_step"] > 0
    # an update: one lockstep ply of one process, its 256 games' TD updates applied at once
    assert first["updates"] == first["global_step"] // 256 and f"stopping after update {first['updates']}:" in out
    assert sum(first["self_play_results"].values()) == first["episodes"] > 0

    more = first["global_step"] + 150_000
    done = run_script("parallel_train_dqn.py", *NTUPLE_RUN, "--total-timesteps", more, "--output-dir", run_dir,
                      "--resume", "auto", timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed_from"] and more <= summary["global_step"] < more + 200_000
    assert summary["updates"] == first["updates"] + (summary["global_step"] - first["global_step"]) // 256
    assert summary["episodes"] > first["episodes"]
    assert sum(summary["self_play_results"].values()) == summary["episodes"]
    assert summary["final_eval"]["eval_win_random"] >= 0.9, summary["final_eval"]
    rows = read_metrics(run_dir / "metrics.csv")
    steps = [int(r["global_step"]) for r in rows]
    assert steps == sorted(steps) and steps[0] < first["global_step"] < steps[-1]  # one run, continued

    state = load_checkpoint(run_dir / "checkpoints" / "latest.pt")
    assert state["learner"] == "ntuple" and state["counters"]["global_step"] == summary["global_step"]
    graded = subprocess.run([sys.executable, "-m", "common.evaluate", str(run_dir), "--episodes", "10", "--grade",
                             "2", "--json"], cwd=ROOT, env=script_env(), capture_output=True, text=True, timeout=300)
    assert graded.returncode == 0, graded.stderr[-2000:]
    report = json.loads(graded.stdout)
    assert report["opponents"]["random"]["both"]["win"] >= 0.9
    assert 0 < report["graded"]["positions"]["all"]["optimal"] <= 1


def test_auto_is_the_ntuple_learner_on_connect_four_on_one_machine(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    chosen = {}
    for env_id in ("ConnectFour-v0", "CartPole-v1", "pettingzoo/tictactoe-v3"):
        cfg = parallel_train_dqn.Config(env_id=env_id)
        cfg.validate()
        chosen[env_id] = cfg.learner  # resolved: config.yaml and the checkpoints name the learner that ran
    assert chosen == {"ConnectFour-v0": "ntuple", "CartPole-v1": "q_network", "pettingzoo/tictactoe-v3": "q_network"}
    seed_002 = parallel_train_dqn.Config(episodes_per_batch=4, batch_size=256)  # a setting of the Q-network given
    seed_002.validate()
    assert seed_002.learner == "q_network"
    monkeypatch.setenv("WORLD_SIZE", "2")  # under torchrun the Q-network learns, its rollouts come from every node
    cfg = parallel_train_dqn.Config()
    cfg.validate()
    assert cfg.learner == "q_network"
    assert parallel_train_dqn.chosen_learner("auto", "ConnectFour-v0", world_size=1) == "ntuple"


def test_the_step_and_lambda_reach_the_self_play_as_set():
    alone = parallel_train_dqn.Config(ntuple_learning_rate=0.5)
    alone.validate()
    steps = [ntuple_train_config(alone).learning_rate_at(fraction) for fraction in (0.0, 0.5, 1.0)]
    assert steps == [0.5, 0.5, 0.5]  # not a step rising towards the default's 1.0
    decaying = parallel_train_dqn.Config(ntuple_learning_rate=1.0, ntuple_final_learning_rate=0.25)
    decaying.validate()
    steps = [ntuple_train_config(decaying).learning_rate_at(fraction) for fraction in (0.0, 0.5, 1.0)]
    assert steps == pytest.approx([1.0, 0.5, 0.25])  # exponential: halfway is the geometric mean
    traced = parallel_train_dqn.Config(ntuple_td_lambda=0.7)
    traced.validate()
    assert ntuple_train_config(traced).horizon == 10  # 0.7 ** 10 < 1/32 < 0.7 ** 9
    with pytest.raises(ConfigError, match="--ntuple-td-lambda 1.0: must be in"):
        parallel_train_dqn.Config(ntuple_td_lambda=1.0).validate()


@pytest.mark.parametrize("argv, message", [
    (["--learner", "ntuple", "--batch-size", "64"], "--batch-size 64: is a setting of --learner q_network; this "
                                                    "run's learner is ntuple\n"),
    (["--learner", "q_network", "--ntuple-tuples", "70"], "--ntuple-tuples 70: is a setting of --learner ntuple"),
    (["--batch-size", "64", "--ntuple-tuples", "70"], "--ntuple-tuples 70: is a setting of --learner ntuple; this "
                                                      "run's learner is q_network, auto's choice since --batch-size "
                                                      "is set"),
    (["--env-id", "CartPole-v1", "--ntuple-epsilon", "0.1"], "this run's learner is q_network, auto's choice on "
                                                             "CartPole-v1"),
])
def test_a_setting_of_the_other_learner_is_refused_not_ignored(tmp_path, capsys, monkeypatch, argv, message):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit) as refused:  # the settings are checked as they are read
        parallel_train_dqn.main([*argv, "--validate-only", "--output-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert refused.value.code == 2
    assert err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "run").exists()


def test_an_ntuple_table_beyond_dev_shm_is_refused_in_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with system.assumed_machine({"shm_free": 64 * 2**20}):  # docker's default /dev/shm; the default table is 294 MB
        assert parallel_train_dqn.main(["--validate-only", "--output-dir", str(tmp_path / "run")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "the n-tuple table (140 tuples of 9 cells) needs 280.0 MiB of shared " \
            "memory, but /dev/shm has 64.0 MiB free" in err and "--shm-size" in err, err
        assert parallel_train_dqn.main(["--validate-only", "--ntuple-tuples", "100", "--ntuple-length", "7",
                            "--output-dir", str(tmp_path / "small")]) == 0  # 12.5 MiB fits


def test_the_ntuple_learner_is_refused_where_it_cannot_run(tmp_path):
    wrong_env = run_script("parallel_train_dqn.py", "--learner", "ntuple", "--env-id", "CartPole-v1",
                           "--validate-only")
    assert wrong_env.returncode == 2 and "learns ConnectFour-v0 only" in wrong_env.stderr
    q_run = tmp_path / "q"
    (q_run / "checkpoints").mkdir(parents=True)
    torch.save({"script": "parallel_train_dqn", "config": {"env_id": "ConnectFour-v0", "learner": "q_network"},
                "model": {}}, q_run / "checkpoints" / "latest.pt")
    other = run_script("parallel_train_dqn.py", *NTUPLE_RUN, "--resume", q_run / "checkpoints" / "latest.pt",
                       "--validate-only")
    assert other.returncode == 2 and "was trained with learner 'q_network'" in other.stderr
    value = NTupleValue.random(count=4, length=4, seed=0)
    state = {"model": {"tuples": torch.from_numpy(value.tuples), "weights": torch.from_numpy(value.weights)},
             "policy": value.spec, "env": {"id": "ConnectFour-v0", "kwargs": {}}, "script": "parallel_train_dqn"}
    torch.save(state, tmp_path / "ntuple.pt")
    assert isinstance(load_policy(tmp_path / "ntuple.pt"), NTupleValue)
    export = subprocess.run([sys.executable, "-m", "common.evaluate", str(tmp_path / "ntuple.pt"), "--export",
                             str(tmp_path / "x.onnx")], cwd=ROOT, env=script_env(), capture_output=True, text=True)
    assert export.returncode == 2 and "n-tuple value function" in export.stderr
