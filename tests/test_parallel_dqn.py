"""parallel_train_dqn.py: masking in the target, replay layout, learning runs, faults and bad input."""

from __future__ import annotations

import json
import os
import re
import signal
import time

import numpy as np
import psutil
import pytest
import torch
from conftest import kill_tree, run_script, start_script, wait_for_file
from torch import nn

import parallel_train_dqn
from common.dqn import double_dqn_loss
from common.replay import ReplayBuffer, ReplayMemoryError, check_replay_memory
from common.runlog import read_metrics

SCRIPT = "parallel_train_dqn.py"
CARTPOLE = ["--env-id", "CartPole-v1", "--hidden-sizes", "64", "64", "--episodes-per-batch", "8",
            "--replay-ratio", "0.25", "--batch-size", "64", "--learning-rate", "1e-3", "--target-update-interval",
            "100", "--epsilon-decay-batches", "10", "--epsilon-end", "0.04", "--eval-interval", "0",
            "--eval-episodes", "20", "--num-workers", "1", "--no-tensorboard"]


class TableQ(nn.Module):
    """Q-values that ignore the observation: a fixed row per call, for exact target checks."""

    def __init__(self, values):
        super().__init__()
        self.values = nn.Parameter(torch.tensor(values, dtype=torch.float32))

    def forward(self, obs):
        return self.values.expand(len(obs), -1)


def test_masked_actions_never_win_the_target_max():
    q_net = TableQ([0.0, 10.0, 1.0])      # action 1 looks best but is illegal in the next state
    target_net = TableQ([5.0, 100.0, 2.0])
    obs = torch.zeros(2, 3)
    actions = torch.tensor([0, 0])
    rewards = torch.tensor([1.0, 1.0])
    dones = torch.tensor([0.0, 1.0])
    mask = torch.tensor([[True, False, True], [True, False, True]])
    _, td = double_dqn_loss(q_net, target_net, obs, actions, rewards, obs, dones, 0.5, next_action_mask=mask)
    # argmax over legal actions of q_net is action 2 -> target_net value 2.0; terminal row: reward only
    assert torch.allclose(td, torch.tensor([abs(0.0 - (1.0 + 0.5 * 2.0)), abs(0.0 - 1.0)]))
    _, td_unmasked = double_dqn_loss(q_net, target_net, obs, actions, rewards, obs, dones, 0.5)
    assert td_unmasked[0] == pytest.approx(1.0 + 0.5 * 100.0)


def test_replay_episode_layout_and_masks():
    buffer = ReplayBuffer(5, (2,), np.float32, num_actions=3, seed=0)
    obs = np.arange(8, dtype=np.float32).reshape(4, 2)  # T+1 = 4 observations
    masks = np.array([[1, 1, 1], [1, 0, 1], [0, 1, 1], [1, 1, 0]], dtype=bool)
    buffer.add_episode(obs, np.array([0, 2, 1]), np.array([0.0, 0.0, 1.0]), True, masks)
    assert len(buffer) == 3
    assert (buffer.next_obs[:3] == obs[1:]).all() and buffer.dones[:3].tolist() == [False, False, True]
    assert (buffer.next_masks[:3] == masks[1:]).all()
    buffer.add_episode(obs, np.array([0, 1, 2]), np.zeros(3), False, masks)  # wraps around
    assert len(buffer) == 5 and buffer.pos == 1
    assert buffer.dones[:5].tolist() == [False, False, True, False, False]  # truncated: no terminal flag
    sample = buffer.sample(16)
    assert sample.obs.shape == (16, 2) and sample.next_masks.shape == (16, 3)


def test_replay_n_step_returns_from_whole_episodes():
    buffer = ReplayBuffer(8, (1,), np.float32, num_actions=2)
    obs = np.arange(5, dtype=np.float32)[:, None]
    masks = np.array([[1, 1], [1, 0], [0, 1], [1, 1], [1, 1]], dtype=bool)
    buffer.add_episode(obs, np.zeros(4, dtype=np.int64), np.array([1.0, 2.0, 3.0, 4.0]), True, masks,
                       gamma=0.5, n_step=2)
    assert buffer.rewards[:4].tolist() == [2.0, 3.5, 5.0, 4.0]       # r_t + 0.5 r_t+1, cut at the end
    assert buffer.next_obs[:4, 0].tolist() == [2.0, 3.0, 4.0, 4.0]   # two steps ahead, final obs at the end
    assert buffer.discounts[:4].tolist() == [0.25, 0.25, 0.25, 0.5]
    assert buffer.dones[:4].tolist() == [False, False, True, True]
    assert (buffer.next_masks[:4] == masks[[2, 3, 4, 4]]).all()


def test_replay_refuses_a_buffer_larger_than_ram():
    with pytest.raises(ReplayMemoryError, match="RAM"):
        check_replay_memory(10**12, (84,), np.float32, 7)


@pytest.mark.parametrize("args, words", [
    (["--env-id", "NoSuchEnv-v0"], "--env-id"),
    (["--env-id", "Pendulum-v1"], "not Discrete"),
    (["--epsilon-end", "-0.1"], "--epsilon-end"),
    (["--buffer-size", "1000000000000"], "--buffer-size"),
])
def test_bad_input_one_line_exit_2(tmp_path, capsys, args, words):
    with pytest.raises(SystemExit) as exit_info:
        parallel_train_dqn.main([*args, "--output-dir", str(tmp_path / "run")])
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and words in lines[0], lines
    assert not (tmp_path / "run").exists()  # nothing half-written


def test_zero_workers_exit_2_from_the_command_line(tmp_path):
    result = run_script(SCRIPT, "--num-workers", "0", "--output-dir", tmp_path / "run", timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip() == "error: --num-workers 0: must be >= 1"
    assert not (tmp_path / "run").exists()


@pytest.mark.timeout(120)
def test_cartpole_learns(tmp_path):
    run = tmp_path / "run"
    result = run_script(SCRIPT, *CARTPOLE, "--seed", "1", "--total-timesteps", "12000", "--output-dir", run,
                        timeout=110)
    assert result.returncode == 0, result.stderr[-2000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["global_step"] >= 12000
    assert summary["return_mean100"] >= 60, summary  # a random policy averages about 22
    rows = read_metrics(run / "metrics.csv")
    assert rows and list(rows[0])[:6] == ["wall_time", "global_step", "episodes", "episodic_return",
                                          "episodic_length", "sps"]
    assert (run / "plots" / "training.png").exists() and (run / "checkpoints" / "latest.pt").exists()
    assert (run / "logs" / "worker_0.log").exists() and (run / "config.yaml").exists()


@pytest.mark.timeout(150)
def test_self_play_beats_random(tmp_path):
    run = tmp_path / "run"
    result = run_script(SCRIPT, "--seed", "2", "--num-workers", "1", "--hidden-sizes", "64", "64",
                        "--total-episodes", "6000", "--episodes-per-batch", "32", "--eval-episodes", "100",
                        "--epsilon-decay-batches", "30", "--learning-starts", "500", "--replay-ratio", "0.1",
                        "--eval-interval", "0",
                        "--learning-rate", "1e-3", "--target-update-interval", "100", "--opponent-latest", "0.3",
                        "--opponent-snapshot", "0.2", "--opponent-random", "0.5", "--snapshot-interval", "10",
                        "--no-tensorboard", "--output-dir", run, timeout=140)
    assert result.returncode == 0, result.stderr[-2000:]
    final = json.loads((run / "summary.json").read_text())["final_eval"]
    # 100 greedy games from each seat; a random player wins about half its games against random
    assert final["eval_win_random"] > 0.65, final
    assert final["eval_win_random_first"] > 0.55 and final["eval_win_random_second"] > 0.55, final


def rollout_workers(proc) -> list[psutil.Process]:
    try:
        children = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    return [c for c in children if "resource_tracker" not in " ".join(c.cmdline())
            and "spawn_main" in " ".join(c.cmdline())]


def wait_for_rows(path, count: int, proc, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if path.exists() and len(read_metrics(path)) >= count:
            return True
        time.sleep(0.2)
    return False


@pytest.mark.timeout(150)
def test_killed_worker_restarts_then_sigterm_then_resume(tmp_path):
    run = tmp_path / "run"
    proc = start_script(SCRIPT, *CARTPOLE, "--duration", "1", "--output-dir", run, "--log-interval-s", "1")
    try:
        assert wait_for_rows(run / "metrics.csv", 2, proc, 60), "no progress"
        (worker,) = rollout_workers(proc)
        os.kill(worker.pid, signal.SIGKILL)
        log = run / "logs" / "main.log"
        deadline = time.monotonic() + 20
        while "restarted rollout worker 0" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
        text = log.read_text()
        assert "killed by signal SIGKILL" in text and "restarted rollout worker 0" in text
        rows_before = len(read_metrics(run / "metrics.csv"))
        assert wait_for_rows(run / "metrics.csv", rows_before + 2, proc, 30), "training did not continue"
        proc.send_signal(signal.SIGTERM)
        proc.wait(40)
        assert proc.returncode == 143
    finally:
        kill_tree(proc)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["reason"] == "interrupted" and summary["worker_restarts"] == 1
    saved_step = summary["global_step"]

    # --resume auto continues from the checkpoint; the repeated-death limit ends the run with 1
    proc = start_script(SCRIPT, *CARTPOLE, "--duration", "1", "--output-dir", run, "--resume", "auto",
                        "--max-worker-restarts", "0")
    try:
        rows_at_resume = len(read_metrics(run / "metrics.csv"))
        assert wait_for_rows(run / "metrics.csv", rows_at_resume + 2, proc, 60)  # the resumed run is training
        workers = rollout_workers(proc)
        assert workers, "no rollout worker found"
        for worker in workers:
            os.kill(worker.pid, signal.SIGKILL)
        proc.wait(40)
        assert proc.returncode == 1
    finally:
        kill_tree(proc)
    text = (run / "logs" / "main.log").read_text()
    assert re.search(r"resumed from .*latest\.pt", text) and "training failed: rollout worker 0 died" in text
    rows = read_metrics(run / "metrics.csv")
    steps = [int(r["global_step"]) for r in rows]
    assert steps == sorted(steps) and steps[-1] > saved_step  # metrics continue from the saved step
    assert (run / "checkpoints" / "latest.pt").exists()


@pytest.mark.timeout(90)
def test_sigint_saves_and_exits_130(tmp_path):
    run = tmp_path / "run"
    proc = start_script(SCRIPT, "--num-workers", "1", "--hidden-sizes", "32", "--episodes-per-batch", "4",
                        "--duration", "1", "--output-dir", run, "--no-tensorboard")
    try:
        assert wait_for_rows(run / "metrics.csv", 1, proc, 60)
        workers = rollout_workers(proc)
        proc.send_signal(signal.SIGINT)
        proc.wait(40)
        assert proc.returncode == 130
    finally:
        kill_tree(proc)
    assert wait_for_file(run / "summary.json", 1)
    assert json.loads((run / "summary.json").read_text())["reason"] == "interrupted"
    assert (run / "checkpoints" / "latest.pt").exists()
    assert not any(w.is_running() and w.status() != psutil.STATUS_ZOMBIE for w in workers)
