"""train_ppo_multiprocess.py: output layout, leaderboard, learning, crashes, signals, resume, bad input."""

from __future__ import annotations

import csv
import json
import os
import re
import signal
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch
from conftest import kill_tree, run_script, start_script, wait_for_file

import train_ppo_multiprocess as tpm
from common.envs import make_vec_env
from common.envs.market import load_market_data
from common.shm import reclaim_stale_segments, segments_of

SCRIPT = "train_ppo_multiprocess.py"
# A small synthetic market and small rollouts, so each run takes seconds on two cores.
FAST = ["--num-items", "30", "--history-steps", "4000", "--num-workers", "2", "--num-envs-per-worker", "8",
        "--rollout-steps", "512", "--num-minibatches", "4", "--episode-length", "128", "--device", "cpu",
        "--eval-episodes", "16", "--summary-every-s", "1", "--no-tensorboard"]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("market_cache")


def worker_pids(log: Path) -> dict[int, int]:
    text = log.read_text() if log.exists() else ""
    return {int(i): int(pid) for i, pid in re.findall(r"worker (\d+) running \(pid (\d+)\)", text)}


def wait_for(predicate, timeout: float, proc=None) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        if proc is not None and proc.poll() is not None:
            return bool(predicate())
        time.sleep(0.1)
    return False


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.timeout(120)
def test_population_run_writes_layout_leaderboard_and_learns(tmp_path, cache_dir):
    out = tmp_path / "run"
    # Trading is expensive here (2 % fee), so a random policy bleeds money; an agent that learns
    # when not to trade must beat it clearly on the same held-out windows.
    result = run_script(SCRIPT, *FAST, "--cache-dir", cache_dir, "--output-dir", out, "--max-steps-per-worker",
                        "12288", "--checkpoint-every", "4096", "--fee", "0.02", "--top-n-items", "4",
                        "--learning-rate", "2e-3", "--update-epochs", "8", "--gamma", "0.9", "--gae-lambda", "0.5",
                        "--ent-coef", "0.0", "--eval-episodes", "32", "--no-eval-deterministic", timeout=110)
    assert result.returncode == 0, result.stderr[-3000:]
    for name in ("config.yaml", "logs/main.log", "logs/worker_0.log", "logs/worker_1.log", "metrics.csv",
                 "metrics_worker_0.csv", "metrics_worker_1.csv", "leaderboard.csv", "best.pt", "summary.json",
                 "plots/population.png"):
        assert (out / name).is_file(), name
    for i in (0, 1):
        steps = sorted(int(p.stem.split("_")[-1]) for p in (out / "checkpoints").glob(f"worker_{i}_step_*.pt"))
        assert steps == [4096, 8192, 12288]
        assert (out / "checkpoints" / f"worker_{i}_final.pt").is_file()
        rows = read_csv(out / f"metrics_worker_{i}.csv")
        assert int(rows[-1]["global_step"]) == 12288 and rows[0]["episodic_return"] != "" or len(rows) > 1
    main_log = (out / "logs" / "main.log").read_text()
    assert "worker 0: step 1000/12288" in main_log and "worker 1: step 12000/12288" in main_log
    assert "summary after" in main_log and "final statistics" in main_log
    assert "checkpoint worker_0_step_4096.pt" in (out / "logs" / "worker_0.log").read_text()

    board = read_csv(out / "leaderboard.csv")
    agents, baseline = board[:2], board[2]
    assert [r["rank"] for r in agents] == ["1", "2"] and {r["worker"] for r in agents} == {"0", "1"}
    assert baseline["worker"] == "random"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["exit_code"] == 0 and summary["total_steps"] == 2 * 12288
    assert summary["best_worker"] == int(agents[0]["worker"])
    # Both agents sample from their policy on the same 32 held-out windows as the random policy,
    # whose returns have a std of about 5 there: a margin of 5 is over 5 standard errors. (Seeds
    # 1, 2, 3 give margins of 8 to 15.)
    random_mean = float(baseline["eval_mean_return"])
    assert all(float(r["eval_mean_return"]) > random_mean + 5.0 for r in agents), board
    assert all(float(r["eval_mean_trades"]) < float(baseline["eval_mean_trades"]) for r in agents)

    # best.pt loads into a fresh agent that can act in the environment.
    agent, state = tpm.load_agent(out / "best.pt")
    assert state["worker"] == summary["best_worker"] and state["global_step"] == 12288
    data, _ = load_market_data("synthetic", cache_dir, 30, 4000, 0)
    envs = make_vec_env("Market-v0", 2, seed=0, data=data, item_indices=state["item_indices"], top_n_items=4,
                        episode_length=128)
    obs = envs.reset()
    with torch.no_grad():
        actions = agent.get_action_and_value(torch.from_numpy(obs))[0].numpy()
    envs.step(actions)


@pytest.mark.timeout(120)
def test_worker_crash_and_kill9_are_restarted_from_checkpoints(tmp_path, cache_dir):
    out = tmp_path / "run"
    proc = start_script(SCRIPT, *FAST, "--cache-dir", cache_dir, "--output-dir", out, "--max-steps-per-worker",
                        "8192", "--checkpoint-every", "1024", "--inject-crash-worker", "0",
                        "--inject-crash-step", "3000", "--eval-episodes", "8")
    try:
        log = out / "logs" / "main.log"
        assert wait_for_file(out / "checkpoints" / "worker_1_step_2048.pt", 60, proc)
        assert wait_for(lambda: 1 in worker_pids(log), 10, proc)
        pid = worker_pids(log)[1]
        os.kill(pid, signal.SIGKILL)
        output, _ = proc.communicate(timeout=100)
    finally:
        kill_tree(proc)
    assert proc.returncode == 0, output[-3000:]
    main_log = log.read_text()
    assert re.search(r"worker 0 \(pid \d+\) died: raised an exception:.*RuntimeError: injected crash", main_log,
                     re.S)
    assert re.search(rf"worker 1 \(pid {pid}\) died: killed by signal SIGKILL", main_log)
    assert re.search(r"worker 0 restarted from worker_0_step_(2048|3072)\.pt", main_log)
    assert re.search(r"worker 1 restarted from worker_1_step_\d+\.pt", main_log)
    assert re.search(r"worker 0 resumed from .*worker_0_step_\d+\.pt", (out / "logs" / "worker_0.log").read_text())
    summary = json.loads((out / "summary.json").read_text())
    assert [w["restarts"] for w in summary["workers"]] == [1, 1] and summary["restarts"] == 2
    assert "RuntimeError: injected crash" in summary["workers"][0]["failures"][0]
    assert all(w["step"] == 8192 for w in summary["workers"])
    assert len(read_csv(out / "leaderboard.csv")) == 3
    assert "restarts 1" in main_log.split("final statistics")[1]


@pytest.mark.timeout(120)
def test_sigint_saves_every_worker_then_resume_auto_continues(tmp_path, cache_dir):
    out = tmp_path / "run"
    args = [*FAST, "--cache-dir", cache_dir, "--output-dir", out, "--checkpoint-every", "1000000"]
    proc = start_script(SCRIPT, *args, "--max-steps-per-worker", "1000000")
    try:
        log = out / "logs" / "main.log"
        assert wait_for(lambda: log.exists() and "worker 0: step 2000/" in log.read_text()
                        and "worker 1: step 2000/" in log.read_text(), 60, proc)
        pids = worker_pids(log)
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl+C in a terminal reaches the whole process group
        output, _ = proc.communicate(timeout=45)
    finally:
        kill_tree(proc)
    assert proc.returncode == 130, output[-3000:]
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids.values())
    saved = {i: sorted((out / "checkpoints").glob(f"worker_{i}_step_*.pt")) for i in (0, 1)}
    assert all(len(files) == 1 for files in saved.values()), saved
    steps = {i: int(files[0].stem.split("_")[-1]) for i, files in saved.items()}
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stop_reason"] == "signal" and summary["exit_code"] == 130
    assert not (out / "leaderboard.csv").exists()

    target = max(steps.values()) + 1024
    result = run_script(SCRIPT, *args, "--max-steps-per-worker", target, "--resume", "auto", timeout=100)
    assert result.returncode == 0, result.stderr[-3000:]
    main_log = log.read_text()
    for i in (0, 1):
        assert f"worker {i} running (pid" in main_log and f"from step {steps[i]}" in main_log
        rows = read_csv(out / f"metrics_worker_{i}.csv")
        global_steps = [int(r["global_step"]) for r in rows]
        assert global_steps == sorted(global_steps) and global_steps[-1] == target  # one continuing curve
        assert steps[i] in global_steps
    assert len(read_csv(out / "leaderboard.csv")) == 3


@pytest.mark.timeout(60)
def test_a_worker_that_hangs_on_stop_is_terminated(tmp_path, cache_dir):
    out = tmp_path / "run"
    proc = start_script(SCRIPT, *FAST, "--num-workers", "1", "--cache-dir", cache_dir, "--output-dir", out,
                        "--max-steps-per-worker", "1000000", "--stop-timeout-s", "2")
    try:
        log = out / "logs" / "main.log"
        assert wait_for(lambda: len(worker_pids(log)) == 1, 60, proc)
        os.kill(worker_pids(log)[0], signal.SIGSTOP)  # frozen: it can neither finish its rollout nor save
        os.kill(proc.pid, signal.SIGINT)
        output, _ = proc.communicate(timeout=30)
    finally:
        kill_tree(proc)
    assert proc.returncode == 130, output[-3000:]
    assert "worker 0 did not stop within 2 s; terminating it" in log.read_text()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["workers"][0]["gave_up"] and "did not stop in time" in summary["workers"][0]["failures"][0]


@pytest.mark.timeout(60)
def test_coordinator_kill9_workers_exit_and_memory_is_reclaimed(tmp_path, cache_dir):
    out = tmp_path / "run"
    proc = start_script(SCRIPT, *FAST, "--cache-dir", cache_dir, "--output-dir", out,
                        "--max-steps-per-worker", "1000000")
    try:
        log = out / "logs" / "main.log"
        assert wait_for(lambda: len(worker_pids(log)) == 2, 60, proc)
        pids = list(worker_pids(log).values())
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)

        def gone() -> bool:
            return not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids)

        assert wait_for(gone, 10)
    finally:
        kill_tree(proc)
    reclaim_stale_segments()  # what the next run does first
    assert segments_of(proc.pid) == []


@pytest.mark.timeout(60)
def test_bad_csv_exits_2_with_one_line_and_writes_nothing(tmp_path):
    bad = tmp_path / "prices.csv"
    bad.write_text("timestamp,item,price\n1,a,1.0\n")
    out = tmp_path / "run"
    result = run_script(SCRIPT, "--data-source", bad, "--cache-dir", tmp_path / "cache", "--output-dir", out)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "missing column(s) volume" in result.stderr
    assert not out.exists() and not (tmp_path / "cache").exists()


def _main_fails(argv, capsys) -> str:
    """Run main() in this process for inputs rejected before any process starts; returns stderr."""
    with pytest.raises(SystemExit) as exit_info:
        tpm.main([str(a) for a in argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.strip().count("\n") == 0
    return err


def test_impossible_settings_exit_2_before_writing(tmp_path, capsys):
    out = tmp_path / "run"
    small = ["--cache-dir", tmp_path / "cache", "--output-dir", out, "--num-items", "5", "--history-steps", "800",
             "--top-n-items", "3"]
    assert "--top-n-items 6: must be <= num_items" in _main_fails([*small, "--top-n-items", "6"], capsys)
    csv_file = tmp_path / "three.csv"
    rows = "".join(f"{t},{item},1.5,2\n" for t in range(600) for item in "abc")
    csv_file.write_text("timestamp,item,price,volume\n" + rows)
    assert "top_n_items 5: must be between 1 and the 3 items" in _main_fails(
        [*small, "--data-source", csv_file, "--top-n-items", "5"], capsys)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert f"this machine has {gpus} CUDA GPU(s)" in _main_fails([*small, "--num-gpus", gpus + 1], capsys)
    assert "--learning-rate [0.001, 0.002]: needs 1 value or one per worker (3)" in _main_fails(
        [*small, "--num-workers", "3", "--learning-rate", "1e-3", "2e-3"], capsys)
    assert "--rollout-steps 100: must be a multiple of num_envs_per_worker (8)" in _main_fails(
        [*small, "--rollout-steps", "100", "--num-minibatches", "5"], capsys)
    assert not out.exists()
    # A corrupt cache file: one line naming it, and how to recover.
    _, info = load_market_data("synthetic", tmp_path / "cache", 5, 800, 0)
    prices = Path(info["path"]) / "prices.npy"
    prices.write_bytes(prices.read_bytes()[:64])
    assert f"{prices}: corrupt cache file" in _main_fails(small, capsys)
    assert not out.exists()


def test_per_worker_hyperparameters_lists_and_ranges():
    ppo = tpm.PPOKwargs(learning_rate=[1e-4, 1e-2], ent_coef=[0.0, 0.01, 0.02], sample_ranges=["learning_rate"])
    population = tpm.worker_hyperparams(ppo, 3, seed=5)
    assert population == tpm.worker_hyperparams(ppo, 3, seed=5)  # same seed, same population
    lrs = [h["learning_rate"] for h in population]
    assert all(1e-4 <= lr <= 1e-2 for lr in lrs) and len(set(lrs)) == 3
    assert [h["ent_coef"] for h in population] == [0.0, 0.01, 0.02]
    assert all(h["gamma"] == 0.99 for h in population)
    perturbed = tpm.perturb(population[0], 0.2, np.random.default_rng(0))
    assert np.isclose(perturbed["learning_rate"] / lrs[0], 0.8) or np.isclose(perturbed["learning_rate"] / lrs[0], 1.2)
    assert 0.98 < perturbed["gamma"] < 0.9999


def test_pbt_weakest_copies_a_stronger_worker():
    from types import SimpleNamespace

    sent = []
    coordinator = SimpleNamespace(
        status=[tpm.WorkerStatus(hyper={"learning_rate": 1e-3, "gamma": 0.99}) for _ in range(4)],
        train_cfg=tpm.TrainKwargs(num_workers=4, pbt_interval=100, pbt_fraction=0.25, pbt_perturb=0.2),
        rng=np.random.default_rng(0), pbt_events=[], log=tpm.logging.getLogger("test"),
        send=lambda index, command, payload: sent.append((index, command, payload)))
    for index, score in ((1, 5.0), (2, 1.0), (3, 9.0)):
        tpm.Coordinator.pbt(coordinator, index, {"step": 100, "score": score, "path": f"w{index}.pt",
                                                 "hyper": {"learning_rate": 1e-3, "gamma": 0.99}})
    assert [payload for _, _, payload in sent] == [None, None, None]  # not everyone has reported yet
    tpm.Coordinator.pbt(coordinator, 0, {"step": 100, "score": -3.0, "path": "w0.pt",
                                         "hyper": {"learning_rate": 1e-3, "gamma": 0.99}})
    index, command, answer = sent[-1]
    assert (index, command, answer["donor"], answer["path"]) == (0, "pbt", 3, "w3.pt")
    assert answer["hyper"]["learning_rate"] in (pytest.approx(8e-4), pytest.approx(1.2e-3))
    assert coordinator.pbt_events == [{"step": 100, "worker": 0, "copied": 3, "hyper": answer["hyper"]}]
    tpm.Coordinator.pbt(coordinator, 3, {"step": 200, "score": 10.0, "path": "w3b.pt", "hyper": {}})
    assert sent[-1][2] is None  # the strongest keeps its weights
