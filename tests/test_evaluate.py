"""python -m common.evaluate and common.policy.load_policy on real runs, as a user runs them."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from conftest import ROOT, run_script, script_env

TIMED_CARTPOLE = ["--config", str(ROOT / "configs" / "cartpole_fast.yaml"), "--seed", "1", "--no-tensorboard"]


def evaluate(*args, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "common.evaluate", *map(str, args)], cwd=cwd or ROOT,
                          env=script_env(), capture_output=True, text=True, timeout=180)


@pytest.fixture(scope="module")
def solved_cartpole(tmp_path_factory):
    """A CartPole-v1 policy trained by train_parallel_timed.py until the training mean reached 475."""
    run_dir = tmp_path_factory.mktemp("timed") / "cartpole"
    result = run_script("train_parallel_timed.py", *TIMED_CARTPOLE, "--output-dir", run_dir, timeout=240)
    assert result.returncode == 0, result.stderr
    return run_dir


@pytest.mark.timeout(300)
def test_a_solved_cartpole_policy_scores_475_under_evaluation(solved_cartpole):
    result = evaluate(solved_cartpole, "--episodes", "20", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["episodes"] == 20 and report["env_id"] == "CartPole-v1"
    assert report["mean_return"] >= 475, report


def test_video_and_onnx_export_agree_with_the_policy(solved_cartpole, tmp_path):
    result = evaluate(solved_cartpole, "--episodes", "2", "--video", tmp_path / "videos",
                      "--export", tmp_path / "policy.onnx", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    videos = sorted((tmp_path / "videos").glob("*.mp4"))
    assert len(videos) == 2 and all(v.stat().st_size > 1000 for v in videos), videos
    assert report["export"]["max_abs_error"] <= 1e-5 and report["export"]["checked_observations"] >= 32
    assert (tmp_path / "policy.onnx").stat().st_size > 1000


def test_load_policy_needs_no_training_script(solved_cartpole, tmp_path):
    code = f"""
import sys, gymnasium as gym, numpy as np
from common.policy import load_policy
policy = load_policy({str(solved_cartpole / "checkpoints" / "latest.pt")!r})
assert not any(name.startswith(("train_", "parallel_train", "ultra_")) for name in sys.modules)
env = gym.make("CartPole-v1")
obs, _ = env.reset(seed=123)
total, done = 0.0, False
while not done:
    obs, reward, terminated, truncated, _ = env.step(int(policy.act(obs[None])[0]))
    total += reward
    done = terminated or truncated
print(total)
"""
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=script_env(), capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert float(result.stdout) >= 400


def test_a_path_without_a_checkpoint_is_one_line_and_exit_2(tmp_path):
    result = evaluate(tmp_path)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "not a run directory with a checkpoint" in result.stderr


# ---------------------------------------------------------------- the other three scripts, tiny real runs

def evaluate_json(*args) -> dict:
    result = evaluate(*args, "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


# A DQN learner that plays ConnectFour (the script's default env) against a random player only. The
# learner updates while the worker plays, so how many updates fit between two batches varies from run to
# run: 800 games put its score against random at 0.73-0.89 in 100 games on a quiet machine, but at 0.53-0.58
# in 40 games with the whole suite on both cores; 1200 keep a margin there (400 games gave 0.67-0.81).
CONNECT_FOUR = ["--learner", "q_network", "--seed", "1", "--num-workers", "1", "--episodes-per-batch", "16",
                "--total-episodes", "1200",
                "--learning-starts", "200", "--batch-size", "64", "--hidden-sizes", "64", "--learning-rate", "1e-3",
                "--epsilon-decay-steps", "1500", "--opponent-random", "1", "--opponent-latest", "0",
                "--opponent-snapshot", "0", "--opponent-heuristic", "0", "--eval-interval", "0",
                "--eval-episodes", "4", "--no-tensorboard"]
GRID = ["--env-id", "GridCoverage-v0", "--grid-size", "4", "--num-workers", "1", "--num-envs-per-worker", "8",
        "--learning-starts", "300", "--batch-size", "32", "--buffer-size", "2000", "--total-timesteps", "1500",
        "--total-episodes", "none", "--no-tensorboard"]
MARKET = ["--num-items", "30", "--history-steps", "4000", "--top-n-items", "4", "--episode-length", "128",
          "--num-workers", "2", "--num-envs-per-worker", "8", "--n-steps", "64", "--batch-size", "128",
          "--max-steps-per-worker", "1024", "--checkpoint-every", "512", "--eval-episodes", "8", "--device", "cpu",
          "--log-interval-s", "1", "--no-tensorboard"]


@pytest.fixture(scope="module")
def connect_four_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("dqn") / "connect_four"
    result = run_script("parallel_train_dqn.py", *CONNECT_FOUR, "--output-dir", run_dir, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


@pytest.fixture(scope="module")
def grid_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("ultra") / "grid"
    result = run_script("ultra_parallel_train_dqn.py", *GRID, "--output-dir", run_dir, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


@pytest.fixture(scope="module")
def market_run(tmp_path_factory):
    base = tmp_path_factory.mktemp("population")
    result = run_script("train_ppo_multiprocess.py", *MARKET, "--cache-dir", base / "cache", "--output-dir",
                        base / "market", timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    return base / "market"


def test_connect_four_dqn_run_scores_win_rates_against_both_players(connect_four_run):
    report = evaluate_json(connect_four_run, "--episodes", "100")
    assert report["checkpoint"] == str(connect_four_run / "checkpoints" / "latest.pt")
    assert report["env_id"] == "ConnectFour-v0" and report["script"] == "parallel_train_dqn"
    assert report["episodes"] == 100 and 5 <= report["mean_length"] <= 21  # a step is a move and the reply
    # Scored on games of their own: trained against random play it wins most of those (chance is about
    # one half), and the heuristic player, which blocks every open three, beats it.
    assert report["win_rate_vs_random"] >= 0.6, report
    assert report["win_rate_vs_heuristic"] <= report["win_rate_vs_random"] - 0.4, report
    assert all(100 * report[k] == round(100 * report[k]) for k in ("win_rate_vs_random", "win_rate_vs_heuristic"))


def test_connect_four_episodes_are_recorded_through_rgb_array(connect_four_run, tmp_path):
    import imageio_ffmpeg

    report = evaluate_json(connect_four_run, "--episodes", "2", "--video", tmp_path / "videos")
    videos = sorted((tmp_path / "videos").glob("*.mp4"))
    assert [str(v) for v in videos] == report["videos"] and len(videos) == 2, report
    lengths = []
    for video in videos:
        reader = imageio_ffmpeg.read_frames(str(video))
        meta = next(reader)
        assert meta["size"] == (7 * 48, 6 * 48), meta  # the board picture, width x height
        pictures = [np.frombuffer(f, np.uint8).reshape(6 * 48, 7 * 48, 3) for f in reader]
        lengths.append(len(pictures) - 1)  # the first position, then a frame a step
        discs = pictures[-1][24::48, 24::48].astype(int)  # the centre of every cell of the final position
        red = ((discs[..., 0] > 180) & (discs[..., 1] < 90) & (discs[..., 2] < 90)).sum()
        yellow = ((discs[..., 0] > 200) & (discs[..., 1] > 150) & (discs[..., 2] < 90)).sum()
        assert red == lengths[-1] and abs(int(yellow) - int(red)) <= 1  # a learner's disc a step, and the replies
    assert sum(lengths) == 2 * report["mean_length"]


def test_load_policy_plays_connect_four_without_the_training_script(connect_four_run, tmp_path):
    code = f"""
import sys, gymnasium as gym
import common.envs
from common.policy import load_policy
policy = load_policy({str(connect_four_run / "checkpoints" / "latest.pt")!r})
assert not any(name.startswith(("train_", "parallel_train", "ultra_")) for name in sys.modules)
env = gym.make("ConnectFour-v0", opponent="random")
wins = 0
for game in range(40):
    obs, info = env.reset(seed=500 + game)
    done = False
    while not done:  # a masked action would raise: the policy must honour the legal-move mask
        obs, reward, done, _, info = env.step(int(policy.act(obs[None], info["action_mask"][None])[0]))
    wins += reward == 1
print(wins / 40)
"""
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=script_env(), capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert float(result.stdout) >= 0.6


def test_ultra_run_is_found_by_directory_or_file_and_exports_its_q_network(grid_run, tmp_path):
    import onnxruntime

    from common.envs.grid_coverage import GridCoverageVectorEnv

    final = grid_run / "ultra_final_model.pth"
    assert list((grid_run / "checkpoints").glob("ultra_model_ep*.pt"))  # there is another checkpoint to pick
    by_dir = evaluate_json(grid_run, "--episodes", "4", "--export", tmp_path / "q.onnx")
    assert by_dir["checkpoint"] == str(final) and by_dir["env_id"] == "GridCoverage-v0"
    assert by_dir["mean_length"] <= 4 * 4 * 4 and 0 < by_dir["mean_coverage"] <= 1  # the run's 4 x 4 grid
    assert by_dir["export"]["max_abs_error"] <= 1e-5 and by_dir["export"]["checked_observations"] >= 32
    by_file = evaluate_json(final, "--episodes", "4")
    assert by_file["checkpoint"] == str(final)
    assert (by_file["mean_return"], by_file["mean_coverage"]) == (by_dir["mean_return"], by_dir["mean_coverage"])
    env = GridCoverageVectorEnv(5, size=4, view="egocentric")
    obs, _ = env.reset(seed=0)
    session = onnxruntime.InferenceSession(str(tmp_path / "q.onnx"), providers=["CPUExecutionProvider"])
    q_values = session.run(None, {"obs": obs})[0]
    assert q_values.shape == (5, 4) and np.isfinite(q_values).all()  # a Q-value per move, for any batch


def test_population_run_evaluates_its_best_agent_or_the_member_asked_for(market_run):
    leaderboard = (market_run / "leaderboard.csv").read_text().splitlines()
    best_worker = int(leaderboard[1].split(",")[1])
    best = evaluate_json(market_run, "--episodes", "4")
    assert best["checkpoint"] == str(market_run / "best.pt") and best["member"] == best_worker
    assert best["env_id"] == "Market-v0" and best["script"] == "train_ppo_multiprocess"
    assert best["mean_length"] == 128 and best["profit_percent"] == best["mean_return"]
    # the reward is the change of net worth in % of the initial cash: the scores must agree
    assert best["mean_net_worth"] == pytest.approx(10_000 * (1 + best["mean_return"] / 100), abs=0.05)
    member = evaluate_json(market_run, "--episodes", "4", "--member", "1")
    assert member["checkpoint"] == str(market_run / "checkpoints" / "worker_1_final.pt")
    assert member["member"] == 1 and member["global_step"] == 1024


def test_misused_flags_are_one_line_and_exit_2(tmp_path, capsys):
    from common.evaluate import main

    checkpoint = tmp_path / "some.pt"
    checkpoint.write_bytes(b"not used")
    for args, message in (([checkpoint, "--member", "1"], "is a checkpoint file"),
                          ([tmp_path, "--render", "--video", tmp_path / "v"], "exclude each other")):
        with pytest.raises(SystemExit) as stopped:
            main([str(a) for a in args])
        stderr = capsys.readouterr().err
        assert stopped.value.code == 2 and len(stderr.strip().splitlines()) == 1, stderr
        assert message in stderr
