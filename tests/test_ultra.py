"""ultra_parallel_train_dqn.py: n-step returns, mixed precision, learning in both modes, and faults."""

from __future__ import annotations

import json
import os
import signal
import time

import numpy as np
import psutil
import pytest
import torch
from conftest import ROOT, SHM, descendants, kill_tree, run_script, start_script, wait_for_file

from common.checkpoint import load_checkpoint
from common.runlog import read_metrics
from common.shm import reclaim_stale_segments

SCRIPT = "ultra_parallel_train_dqn.py"
CARTPOLE = ["--config", str(ROOT / "configs" / "ultra_cartpole.yaml"), "--no-tensorboard", "--log-interval-s", "1"]


def ultra():
    import ultra_parallel_train_dqn

    return ultra_parallel_train_dqn


# ----------------------------------------------------------------------------- in-process units

def test_nstep_returns_match_a_direct_computation():
    mod = ultra()
    n, gamma, envs = 3, 0.9, 2
    acc = mod.NStepAccumulator(n, gamma, envs, (1,))
    rng = np.random.default_rng(0)
    rewards = rng.normal(size=(12, envs)).astype(np.float32)
    terms = np.zeros((12, envs), bool)
    truncs = np.zeros((12, envs), bool)
    terms[4, 0] = True  # env 0: episode of 5 steps, then another
    truncs[1, 1] = True  # env 1: a 2-step episode cut by a time limit
    emitted = []
    for t in range(12):
        obs = np.array([[100 * e + t] for e in range(envs)], np.float32)
        batch = acc.push(obs, np.full(envs, t), rewards[t], obs + 0.5, terms[t], truncs[t])
        if batch is not None:
            emitted += [{k: v[i] for k, v in batch.items()} for i in range(len(batch["actions"]))]
    by_start = {(int(tr["obs"][0]) // 100, int(tr["obs"][0]) % 100): tr for tr in emitted}
    # env 0, t=0: full 3-step return; bootstraps from the observation after step 2.
    tr = by_start[(0, 0)]
    assert tr["rewards"] == pytest.approx(rewards[0, 0] + 0.9 * rewards[1, 0] + 0.81 * rewards[2, 0], rel=1e-5)
    assert tr["discounts"] == pytest.approx(0.9 ** 3) and tr["dones"] == 0 and tr["next_obs"][0] == 2.5
    # env 0, t=3: only 2 rewards before the terminal step 4; no bootstrap.
    tr = by_start[(0, 3)]
    assert tr["rewards"] == pytest.approx(rewards[3, 0] + 0.9 * rewards[4, 0], rel=1e-5)
    assert tr["dones"] == 1 and tr["discounts"] == pytest.approx(0.81) and tr["next_obs"][0] == 4.5
    # env 1, t=0: truncated after 2 steps: not terminal, bootstraps from the final observation.
    tr = by_start[(1, 0)]
    assert tr["dones"] == 0 and tr["discounts"] == pytest.approx(0.81) and tr["next_obs"][0] == 101.5
    # Every step of a finished episode leaves exactly once; the open tails are still pending.
    assert sorted(t for e, t in by_start if e == 0) == list(range(10))
    assert len(emitted) == len(by_start)


@pytest.mark.parametrize("precision", ["bf16"])
def test_bf16_learning_step_runs_and_matches_fp32(precision):
    mod = ultra()
    import gymnasium as gym

    from common.replay_shm import ReplayLayout, make_replay

    env = gym.make("CartPole-v1")
    cfg = mod.UltraTrainingConfig(env_id="CartPole-v1", n_workers=1, batch_size=512, hidden_sizes=[64, 64],
                                  device="cpu", grad_accum_steps=2)
    replay = make_replay(ReplayLayout(2048, 1, (4,)), backend="queue")
    try:
        rng = np.random.default_rng(0)
        obs = rng.normal(size=(2048, 4)).astype(np.float32)
        from common.replay_shm import write_batch

        write_batch(replay.arrays, 2048, 0, {"obs": obs, "next_obs": obs + 0.1, "actions": rng.integers(0, 2, 2048),
                                             "rewards": np.ones(2048, np.float32), "dones": np.zeros(2048, np.float32),
                                             "discounts": np.full(2048, 0.99, np.float32)})
        losses = {}
        params = {}
        for mode in ("off", precision):
            torch.manual_seed(0)
            cfg.mixed_precision = mode
            learner = mod.Learner(cfg, env.observation_space, env.action_space, torch.device("cpu"))
            replay.seed(1)
            stats = learner.update(replay, beta=0.4)
            losses[mode] = stats["loss"]
            params[mode] = torch.nn.utils.parameters_to_vector(learner.q_net.parameters())
        assert np.isfinite(losses[precision])
        assert losses[precision] == pytest.approx(losses["off"], rel=0.05)
        torch.manual_seed(0)
        fresh = torch.nn.utils.parameters_to_vector(mod.Learner(cfg, env.observation_space, env.action_space,
                                                                torch.device("cpu")).q_net.parameters())
        step_fp32, step_amp = params["off"] - fresh, params[precision] - fresh
        assert torch.nn.functional.cosine_similarity(step_fp32, step_amp, dim=0) > 0.9
    finally:
        replay.close()


# ----------------------------------------------------------------------------- whole runs

def summary_of(run_dir):
    return json.loads((run_dir / "summary.json").read_text())


# Sync runs repeat exactly for a seed; async ones depend on scheduling, so their bar is lower
# (a random policy averages about 22).
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode, threshold", [("--async-training", 50), ("--no-async-training", 75)])
def test_learns_cartpole_in_both_modes(tmp_path, mode, threshold):
    # Checkpoints every 200 episodes: the run must go on past each one (the rate limiter once stalled there).
    proc = run_script(SCRIPT, *CARTPOLE, mode, "--seed", "1", "--save-every-episodes", "200", "--total-timesteps",
                      "60000", "--target-return", str(threshold), "--output-dir", tmp_path / "run", timeout=110)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = summary_of(tmp_path / "run")
    assert summary["best_mean_return"] is not None and summary["best_mean_return"] >= threshold, summary
    assert (tmp_path / "run" / "ultra_final_model.pth").exists()
    assert (tmp_path / "run" / "plots" / "ultra_training_results.png").exists()
    rows = read_metrics(tmp_path / "run" / "metrics.csv")
    assert list(rows[0])[:6] == ["wall_time", "global_step", "episodes", "episodic_return", "episodic_length", "sps"]
    state = load_checkpoint(tmp_path / "run" / "ultra_final_model.pth", required=("model", "optimizer"))
    assert state["global_step"] == summary["global_step"]


@pytest.mark.timeout(150)
def test_learns_grid_coverage_from_the_egocentric_view(tmp_path):
    # A random walk covers about 70 % of a 6 x 6 grid within the step limit; the sync run repeats for a seed.
    proc = run_script(SCRIPT, "--config", ROOT / "configs" / "ultra_grid_coverage.yaml", "--no-async-training",
                      "--seed", "1", "--total-timesteps", "80000", "--target-coverage", "0.9", "--no-tensorboard",
                      "--log-interval-s", "5", "--output-dir", tmp_path / "run", timeout=140)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = summary_of(tmp_path / "run")
    assert summary["stop_reason"].startswith("target coverage"), summary
    assert summary["final_mean_coverage"] >= 0.9


@pytest.mark.timeout(90)
def test_queue_fallback_prioritized_bf16_grid_coverage(tmp_path):
    proc = run_script(SCRIPT, "--env-id", "GridCoverage-v0", "--grid-size", "4", "--replay-backend", "queue",
                      "--prioritized", "--mixed-precision", "bf16", "--grad-accum-steps", "2", "--batch-size", "64",
                      "--n-workers", "2", "--envs-per-worker", "8", "--learning-starts", "500",
                      "--total-timesteps", "6000", "--buffer-size", "4000", "--save-every-episodes", "100",
                      "--keep-checkpoints", "2", "--no-tensorboard", "--output-dir", tmp_path / "run", timeout=80)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = summary_of(tmp_path / "run")
    assert summary["replay_backend"] == "queue" and summary["precision"] == "bf16" and summary["prioritized"]
    assert summary["updates"] > 0 and summary["global_step"] >= 6000
    rows = read_metrics(tmp_path / "run" / "metrics.csv")
    coverage = [float(r["coverage"]) for r in rows if r["coverage"]]
    assert coverage and all(0 < c <= 1 for c in coverage)
    assert len(list((tmp_path / "run" / "checkpoints").glob("ultra_model_ep*.pth"))) <= 2


def start_long_run(tmp_path, *extra):
    run_dir = tmp_path / "run"
    proc = start_script(SCRIPT, *CARTPOLE, "--duration", "0.05", "--n-episodes", "10000000",
                        "--checkpoint-interval-s", "1000", "--output-dir", run_dir, *extra)
    assert wait_for_file(run_dir / "metrics.csv", 60, proc), proc.communicate(timeout=10)[0][-3000:]
    deadline = time.monotonic() + 60
    while len(read_metrics(run_dir / "metrics.csv")) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    return proc, run_dir


def actor_pids(proc) -> list[int]:
    return [p.pid for p in descendants(proc.pid) if "resource_tracker" not in " ".join(p.cmdline())]


@pytest.mark.timeout(120)
def test_killed_actor_is_restarted_then_sigterm_exits_143(tmp_path):
    proc, run_dir = start_long_run(tmp_path, "--n-workers", "2")
    try:
        victim = actor_pids(proc)[0]
        os.kill(victim, signal.SIGKILL)
        log = run_dir / "logs" / "main.log"
        deadline = time.monotonic() + 40
        while "restarted actor" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "restarted actor" in log.read_text()
        steps_at_restart = int(read_metrics(run_dir / "metrics.csv")[-1]["global_step"])
        deadline = time.monotonic() + 30
        while int(read_metrics(run_dir / "metrics.csv")[-1]["global_step"]) <= steps_at_restart \
                and time.monotonic() < deadline:
            time.sleep(0.2)
        assert int(read_metrics(run_dir / "metrics.csv")[-1]["global_step"]) > steps_at_restart, "training stalled"
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
        assert time.monotonic() - started < 30
        assert proc.returncode == 143, out[-3000:]
        assert "killed by signal SIGKILL" in log.read_text()
        summary = summary_of(run_dir)
        assert summary["actor_restarts"] == 1 and summary["stop_reason"] == "interrupted"
        assert not list(SHM.glob(f"prl_{proc.pid}_*"))
    finally:
        kill_tree(proc)


@pytest.mark.timeout(150)
def test_sigint_checkpoints_and_resume_continues(tmp_path):
    proc, run_dir = start_long_run(tmp_path, "--n-workers", "1")
    try:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 130, out[-3000:]
    finally:
        kill_tree(proc)
    assert not list(SHM.glob(f"prl_{proc.pid}_*"))
    checkpoints = list((run_dir / "checkpoints").glob("ultra_model_ep*.pth"))
    assert len(checkpoints) == 1
    saved = load_checkpoint(checkpoints[0], required=("model", "optimizer", "global_step"))
    assert saved["global_step"] > 0 and not (run_dir / "ultra_final_model.pth").exists()
    rows_before = len(read_metrics(run_dir / "metrics.csv"))
    resumed = run_script(SCRIPT, *CARTPOLE, "--n-workers", "1", "--output-dir", run_dir, "--resume", "auto",
                         "--n-episodes", str(saved["episodes"] + 30), timeout=100)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr
    summary = summary_of(run_dir)
    assert summary["global_step"] > saved["global_step"] and summary["episodes"] >= saved["episodes"] + 30
    rows = read_metrics(run_dir / "metrics.csv")
    assert len(rows) > rows_before and int(rows[rows_before]["global_step"]) >= saved["global_step"]


@pytest.mark.timeout(90)
def test_actors_exit_when_the_learner_is_killed(tmp_path):
    proc, run_dir = start_long_run(tmp_path, "--n-workers", "2")
    try:
        actors = [psutil.Process(pid) for pid in actor_pids(proc)]
        assert actors
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        gone, alive = psutil.wait_procs(actors, timeout=10)
        assert not alive, f"actors still running 10 s after the learner died: {alive}"
    finally:
        kill_tree(proc)
        reclaim_stale_segments()  # the killed learner could not unlink its segments; the next run would


@pytest.mark.timeout(90)
def test_nan_loss_exits_1_and_keeps_the_last_good_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_script(SCRIPT, *CARTPOLE, "--learning-rate", "1e30", "--learning-starts", "20000",
                      "--save-every-episodes", "20", "--n-episodes", "100000", "--output-dir", run_dir, timeout=80)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "loss became nan" in proc.stderr or "loss became inf" in proc.stderr
    assert "Last good checkpoint" in proc.stderr
    checkpoints = list((run_dir / "checkpoints").glob("ultra_model_ep*.pth"))
    assert checkpoints
    for path in checkpoints:
        state = load_checkpoint(path, required=("model",))
        assert all(torch.isfinite(t).all() for t in state["model"].values())
    assert not (run_dir / "ultra_final_model.pth").exists()


@pytest.mark.parametrize("args, message", [
    (["--n-workers", "0"], "--n-workers 0: must be > 0"),
    (["--buffer-size", "1e13"], "--buffer-size"),
    (["--env-id", "NoSuchEnv-v9"], "--env-id"),
    (["--env-id", "Pendulum-v1"], "Discrete"),
    (["--mixed-precision", "fp16", "--device", "cpu"], "--mixed-precision"),
    (["--resume", "/nonexistent.pth"], "no such checkpoint"),
    (["--batch-size", "lots"], "--batch-size"),
    (["--buffer-size", "10", "--envs-per-worker", "16", "--learning-starts", "0"], "--buffer-size"),
])
def test_bad_input_one_line_exit_2_nothing_written(tmp_path, capsys, args, message):
    with pytest.raises(SystemExit) as exit_info:
        ultra().main([*args, "--output-dir", str(tmp_path / "run")])
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], lines
    assert not (tmp_path / "run").exists()


def test_bad_input_from_the_command_line(tmp_path):
    proc = run_script(SCRIPT, "--learning-rate", "-1", "--output-dir", tmp_path / "run", timeout=60)
    assert proc.returncode == 2 and proc.stderr.strip() == "error: --learning-rate -1.0: must be > 0", proc.stderr
    assert not (tmp_path / "run").exists()
