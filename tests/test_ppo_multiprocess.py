"""train_ppo_multiprocess.py: the population learns, ranks and keeps its agents; a worker continues from
its own newest checkpoint after a crash, a stop or a resume; Box actions train; bad input is refused.

What every script shares (signals, worker deaths and hangs, kill -9, NaN, locks, bad input) is in
tests/test_faults.py.
"""

from __future__ import annotations

import csv
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ROOT, kill_tree, run_script, script_env, start_script
from test_faults import log_text, rows, wait_until

import train_ppo_multiprocess as tpm
from common.checkpoint import load_checkpoint
from common.envs import make_vec_env
from common.envs.market import load_market_data
from common.networks import ActorCritic, build_network
from common.normalize import Normalizer

SCRIPT = "train_ppo_multiprocess.py"
# A small synthetic market and small rollouts, so each run takes seconds on two cores.
FAST = ["--num-items", "30", "--history-steps", "4000", "--num-workers", "2", "--num-envs-per-worker", "8",
        "--n-steps", "64", "--batch-size", "128", "--episode-length", "128", "--device", "cpu",
        "--eval-episodes", "16", "--log-interval-s", "1", "--no-tensorboard"]
CARTPOLE = ["--env-id", "CartPole-v1", "--num-workers", "2", "--num-envs-per-worker", "4", "--n-steps", "64",
            "--batch-size", "64", "--device", "cpu", "--target-return", "none", "--eval-episodes", "8",
            "--no-tensorboard"]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("market_cache")


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def worker_steps(run_dir: Path) -> dict[int, int]:
    """Each worker's newest step in metrics.csv."""
    return {int(r["worker"]): int(r["worker_step"]) for r in rows(run_dir)}


@pytest.mark.timeout(150)
def test_population_learns_ranks_and_keeps_its_agents(tmp_path, cache_dir):
    out = tmp_path / "run"
    # Trading is expensive here (2 % fee), so a random policy bleeds money; an agent that learns
    # when not to trade must beat it clearly on the same held-out windows. PBT runs at 4096 and 8192.
    result = run_script(SCRIPT, *FAST, "--cache-dir", cache_dir, "--output-dir", out, "--max-steps-per-worker",
                        "12288", "--checkpoint-every", "4096", "--fee", "0.02", "--top-n-items", "4",
                        "--learning-rate", "2e-3", "--n-epochs", "8", "--gamma", "0.9", "--gae-lambda", "0.5",
                        "--ent-coef", "0.0", "--eval-episodes", "32", "--no-eval-deterministic",
                        "--pbt-interval", "4096", "--pbt-fraction", "0.5", timeout=140)
    assert result.returncode == 0, result.stderr[-3000:]
    for name in ("config.yaml", "logs/main.log", "logs/worker_0.log", "logs/worker_1.log", "metrics.csv",
                 "leaderboard.csv", "best.pt", "summary.json", "plots/population.png",
                 "plots/training_curve.png", "checkpoints/population.pt"):
        assert (out / name).is_file(), name
    for i in (0, 1):
        steps = sorted(int(p.stem.split("_")[-1]) for p in (out / "checkpoints").glob(f"worker_{i}_step_*.pt"))
        assert steps == [4096, 8192, 12288]
        assert (out / "checkpoints" / f"worker_{i}_final.pt").is_file()
    metrics = rows(out)
    assert [int(r["global_step"]) for r in metrics] == [512 * k for k in range(1, 49)]  # a row per worker update
    assert {r["worker"] for r in metrics} == {"0", "1"} and worker_steps(out) == {0: 12288, 1: 12288}
    main_log = (out / "logs" / "main.log").read_text()
    assert "worker 0 running (pid" in main_log and re.search(r"  worker 1: step \d+/12288", main_log)
    assert "checkpoint worker_0_step_4096.pt" in (out / "logs" / "worker_0.log").read_text()

    summary = json.loads((out / "summary.json").read_text())
    assert summary["exit_code"] == 0 and summary["global_step"] == 2 * 12288
    assert summary["stop_reason"].startswith("every worker is done")
    assert [w["step"] for w in summary["workers"]] == [12288, 12288]
    assert summary["pbt_events"] and summary["pbt_events"][0]["step"] in (4096, 8192)
    copier = summary["pbt_events"][0]["worker"]
    assert "PBT: copied worker" in (out / "logs" / f"worker_{copier}.log").read_text()

    board = read_csv(out / "leaderboard.csv")
    agents, baseline = board[:2], board[2]
    assert [r["rank"] for r in agents] == ["1", "2"] and {r["worker"] for r in agents} == {"0", "1"}
    assert baseline["worker"] == "random" and summary["best_worker"] == int(agents[0]["worker"])
    # Both agents sample from their policy on the same 32 held-out windows as the random policy,
    # whose returns have a std of about 5 there: a margin of 5 is over 5 standard errors.
    random_mean = float(baseline["eval_mean_return"])
    assert all(float(r["eval_mean_return"]) > random_mean + 5.0 for r in agents), board
    assert all(float(r["eval_mean_trades"]) < float(baseline["eval_mean_trades"]) for r in agents)

    # best.pt stands alone: its "policy" rebuilds the network, which acts in the env it names.
    state = load_checkpoint(out / "best.pt", required=("model", "policy", "env", "config", "counters"))
    assert state["worker"] == summary["best_worker"] and state["counters"]["global_step"] == 12288
    agent = build_network(state["policy"])
    agent.load_state_dict(state["model"])
    data, _ = load_market_data("synthetic", cache_dir, 30, 4000, 0)
    kwargs = {k: v for k, v in state["env"]["kwargs"].items() if k not in ("data_source", "cache_dir")}
    envs = make_vec_env(state["env"]["id"], 2, seed=0, data=data, **kwargs)
    actions = agent.get_action_and_value(torch.from_numpy(envs.reset()))[0].numpy()
    envs.step(actions)


@pytest.mark.timeout(200)
def test_crash_restarts_from_the_newest_checkpoint_then_stop_and_resume_continue_each_worker(tmp_path):
    out = tmp_path / "run"
    args = [*CARTPOLE, "--output-dir", out, "--checkpoint-every", "512"]
    # Worker 0's 6th message is the report of its 5th update (step 1280): it raises there, after
    # its checkpoint at step 1024.
    proc = start_script(SCRIPT, *args, "--max-steps-per-worker", "1000000", env={"PRL_INJECT_FAULT": "raise:0:6"})
    try:
        assert wait_until(lambda: min(worker_steps(out).values(), default=0) >= 2048, 90, proc), log_text(out)[-3000:]
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl+C in a terminal reaches the whole process group
        output, _ = proc.communicate(timeout=45)
    finally:
        kill_tree(proc)
    assert proc.returncode == 130, output[-3000:]
    main_log = (out / "logs" / "main.log").read_text()
    assert re.search(r"worker 0 died: raised an exception:\nTraceback.*fault injected", main_log, re.S)
    assert "worker 0 continues from worker_0_step_1024.pt" in main_log
    assert re.search(r"worker 0 resumed from \S+worker_0_step_1024\.pt at step 1024",
                     (out / "logs" / "worker_0.log").read_text())
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stop_reason"] == "interrupted" and summary["worker_restarts"] == 1
    assert not (out / "leaderboard.csv").exists()  # nobody finished: nothing to rank
    saved = {i: summary["workers"][i]["step"] for i in (0, 1)}
    for i, step in saved.items():  # every worker saved where it stopped
        assert (out / "checkpoints" / f"worker_{i}_step_{step}.pt").is_file()
    before = rows(out)

    target = max(saved.values()) + 512
    result = run_script(SCRIPT, *args, "--max-steps-per-worker", target, "--resume", "auto", timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    main_log = (out / "logs" / "main.log").read_text()
    for i, step in saved.items():
        assert re.search(rf"worker {i} running \(pid \d+\) from step {step}\b", main_log)
    new = rows(out)[len(before):]
    assert new and int(new[0]["global_step"]) > int(before[-1]["global_step"])  # the count goes on
    assert float(new[0]["wall_time"]) > float(before[-1]["wall_time"])  # and so does the clock
    assert worker_steps(out) == {0: target, 1: target}
    assert len(read_csv(out / "leaderboard.csv")) == 3


@pytest.mark.timeout(90)
def test_a_worker_that_does_not_stop_is_killed_after_stop_timeout(tmp_path):
    out = tmp_path / "run"
    proc = start_script(SCRIPT, *CARTPOLE, "--num-workers", "1", "--output-dir", out, "--max-steps-per-worker",
                        "1000000000", "--stop-timeout-s", "2")
    try:
        log = out / "logs" / "main.log"
        assert wait_until(lambda: "worker 0 running (pid" in log_text(out), 60, proc), log_text(out)
        pid = int(re.search(r"worker 0 running \(pid (\d+)\)", log.read_text()).group(1))
        os.kill(pid, signal.SIGSTOP)  # frozen: it can neither finish its rollout nor save
        os.kill(proc.pid, signal.SIGINT)
        output, _ = proc.communicate(timeout=30)
    finally:
        kill_tree(proc)
    assert proc.returncode == 130, output[-3000:]
    assert "worker 0 did not stop within 2 s; killing it" in log.read_text()
    summary = json.loads((out / "summary.json").read_text())
    assert "before it reported" in summary["workers"][0]["failures"][-1]


@pytest.mark.timeout(90)
def test_each_worker_is_done_at_its_own_target_return(tmp_path):
    out = tmp_path / "run"
    # A random CartPole policy averages about 22; 30 takes a few thousand steps of learning.
    result = run_script(SCRIPT, *CARTPOLE, "--target-return", "30", "--max-steps-per-worker", "1000000",
                        "--output-dir", out, timeout=80)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["target_return"] == 30 and summary["stop_reason"].startswith("every worker is done")
    assert all(w["finished"] and w["recent_return"] >= 30 and w["step"] < 100_000 for w in summary["workers"])
    assert len(read_csv(out / "leaderboard.csv")) == 3


@pytest.mark.timeout(90)
def test_box_actions_train_and_act_with_their_mean(tmp_path):
    out = tmp_path / "run"
    result = run_script(SCRIPT, *CARTPOLE, "--env-id", "Pendulum-v1", "--max-steps-per-worker", "1024",
                        "--eval-episodes", "2", "--output-dir", out, timeout=80)
    assert result.returncode == 0, result.stderr[-3000:]
    board = read_csv(out / "leaderboard.csv")
    assert [r["worker"] for r in board] in (["0", "1", "random"], ["1", "0", "random"])
    state = load_checkpoint(out / "best.pt", required=("model", "policy"))
    assert state["policy"]["action_space"]["type"] == "Box"
    assert state["obs_norm"]["count"] > 1000 and state["reward_norm"]["count"] > 1000  # on by default for Box
    # Greedy evaluation acts with the mean of the Gaussian, clipped to the bounds.
    import gymnasium as gym

    space = gym.spaces.Box(-2.0, 2.0, (1,), np.float32)
    agent = ActorCritic(gym.spaces.Box(-np.inf, np.inf, (3,), np.float32), space)
    with torch.no_grad():
        agent.actor[-1].bias.fill_(5.0)  # a mean beyond the upper bound
    obs = np.random.default_rng(0).normal(size=(4, 3)).astype(np.float32)
    normalizer = Normalizer((3,), norm_obs=True, norm_reward=True)
    act = tpm.policy_actions(agent, space, True, normalizer)
    assert np.array_equal(act(obs, None), act(obs, None)) and np.all(act(obs, None) == 2.0)


# --------------------------------------------------------------------------- before anything runs

def fails(argv, capsys) -> str:
    """main() in this process for input refused before anything is written: exit 2 and one line."""
    try:
        status = tpm.main([str(a) for a in argv])
    except SystemExit as err:
        status = err.code
    err = capsys.readouterr().err
    assert status == 2 and err.startswith("error: ") and err.strip().count("\n") == 0, err
    return err


def test_what_cannot_run_is_refused_before_writing(tmp_path, capsys):
    out = tmp_path / "run"
    small = ["--cache-dir", tmp_path / "cache", "--output-dir", out, "--num-items", "5", "--history-steps", "800",
             "--top-n-items", "3"]
    bad = tmp_path / "prices.csv"
    bad.write_text("timestamp,item,price\n1,a,1.0\n")
    assert "missing column(s) volume" in fails(["--data-source", bad, *small], capsys)
    assert not (tmp_path / "cache").exists()
    assert "--top-n-items 6: must be <= num_items" in fails([*small, "--top-n-items", "6"], capsys)
    csv_file = tmp_path / "three.csv"
    lines = "".join(f"{t},{item},1.5,2\n" for t in range(600) for item in "abc")
    csv_file.write_text("timestamp,item,price,volume\n" + lines)
    assert "top_n_items 5: must be between 1 and the 3 items" in fails(
        [*small, "--data-source", csv_file, "--top-n-items", "5"], capsys)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert f"this machine has {gpus} CUDA GPU(s)" in fails([*small, "--num-gpus", gpus + 1], capsys)
    assert "--learning-rate [0.001, 0.002]: needs 1 value or one per worker (3)" in fails(
        [*small, "--num-workers", "3", "--learning-rate", "1e-3", "2e-3"], capsys)
    assert "--rollout-steps 100: must be a multiple of num_envs_per_worker (8)" in fails(
        [*small, "--rollout-steps", "100"], capsys)
    assert "--batch-size 100: must divide the rollout" in fails([*small, "--batch-size", "100"], capsys)
    assert "observation space Discrete(16) is not a Box" in fails([*small, "--env-id", "FrozenLake-v1"], capsys)
    _, info = load_market_data("synthetic", tmp_path / "cache", 5, 800, 0)  # a corrupt cache file: how to recover
    prices = Path(info["path"]) / "prices.npy"
    prices.write_bytes(prices.read_bytes()[:64])
    assert f"{prices}: corrupt cache file" in fails(small, capsys)
    assert not out.exists()


def test_seed_names_and_help_need_no_torch(tmp_path):
    """--rollout-steps (the seed's name: a worker's whole rollout) sets n_steps; --help loads no torch."""
    yaml_file = tmp_path / "seed.yaml"
    yaml_file.write_text("PPO_KWARGS:\n  rollout_steps: 1024\nTRAIN_KWARGS:\n  num_workers: 3\n"
                         "ENV_KWARGS:\n  top_n_items: 7\n")
    code = ("import sys, train_ppo_multiprocess as t\n"
            "try:\n    t.main(['--help'])\nexcept SystemExit:\n    pass\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n"
            f"assert t.main(['--config', {str(yaml_file)!r}, '--env-id', 'CartPole-v1', '--validate-only']) == 0\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=script_env(), capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "n_steps: 128\n" in result.stdout and "num_workers: 3\n" in result.stdout
    assert "--max-steps-per-worker" in result.stdout and "--rollout-steps" in result.stdout


def test_per_worker_hyperparameters_lists_and_ranges():
    cfg = tpm.PPOKwargs(learning_rate=[1e-4, 1e-2], ent_coef=[0.0, 0.01, 0.02], sample_ranges=["learning_rate"])
    population = tpm.worker_hyperparams(cfg, 3, seed=5)
    assert population == tpm.worker_hyperparams(cfg, 3, seed=5)  # same seed, same population
    lrs = [h["learning_rate"] for h in population]
    assert all(1e-4 <= lr <= 1e-2 for lr in lrs) and len(set(lrs)) == 3
    assert [h["ent_coef"] for h in population] == [0.0, 0.01, 0.02]
    assert all(h["gamma"] == 0.99 for h in population)
    perturbed = tpm.perturb(population[0], 0.2, np.random.default_rng(0))
    assert np.isclose(perturbed["learning_rate"] / lrs[0], 0.8) or np.isclose(perturbed["learning_rate"] / lrs[0], 1.2)
    assert 0.98 < perturbed["gamma"] < 0.9999 and all(type(v) is float for v in perturbed.values())


def test_pbt_the_weakest_copies_a_stronger_worker():
    rng = np.random.default_rng(0)
    assert tpm.pbt_donor([5.0, None, 1.0, 9.0], 2, 0.25, rng) is None  # not everyone has reported yet
    assert tpm.pbt_donor([-3.0, 5.0, 1.0, 9.0], 0, 0.25, rng) == 3  # the weakest copies the strongest
    assert tpm.pbt_donor([-3.0, 5.0, 1.0, 9.0], 3, 0.25, rng) is None  # the strongest keeps its weights
    assert tpm.pbt_donor([-3.0, 5.0, 1.0, 9.0], 1, 0.25, rng) is None  # the middle too
    assert tpm.pbt_donor([2.0, 2.0], 0, 0.5, rng) is None  # a copy must be better, not equal


def test_a_pbt_copy_trains_with_its_own_perturbed_learning_rate(tmp_path):
    """The donor's optimizer state carries the donor's rate; without annealing nothing else would reset it."""
    out = tmp_path / "run"
    proc = run_script(SCRIPT, "--env-id", "CartPole-v1", "--num-workers", "2", "--num-envs-per-worker", "4",
                      "--n-steps", "64", "--batch-size", "64", "--no-tensorboard", "--max-steps-per-worker", "4096",
                      "--pbt-interval", "1024", "--pbt-fraction", "0.5", "--no-anneal-lr",
                      "--learning-rate", "1e-3", "5e-4", "--eval-episodes", "2", "--output-dir", out, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = json.loads((out / "summary.json").read_text())["pbt_events"]
    assert events, "no PBT copy happened"
    metrics = read_csv(out / "metrics.csv")
    checked = 0
    for event in events:
        after = [r for r in metrics if int(r["worker"]) == event["worker"] and int(r["worker_step"]) > event["step"]]
        if after:  # the copier's next update uses the rate it was given (a copy at the last step has none)
            assert float(after[0]["learning_rate"]) == pytest.approx(event["hyper"]["learning_rate"]), event
            checked += 1
    assert checked, f"no update followed a PBT copy: {events}"
