"""ultra_parallel_train_dqn.py: n-step returns, the shared learner step, derived settings, learning in both modes;
the rate limiter's replay ratio, --save-replay then --resume.

Signals, worker deaths, resume and bad input common to every script are in test_faults.py.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import ROOT, run_script, tensorboard_tags

from common import system
from common.checkpoint import load_checkpoint
from common.config import ConfigError
from common.replay import NStepAccumulator
from common.run import probe_env
from common.runlog import read_metrics

SCRIPT = "ultra_parallel_train_dqn.py"
CARTPOLE = ["--config", str(ROOT / "configs" / "ultra_cartpole.yaml"), "--no-tensorboard", "--log-interval-s", "1"]
SEED_001_MACHINE = {"logical_cores": 128, "ram_total_gib": 512, "shm_total_gib": 256,
                    "gpus": [{"name": "assumed GPU", "memory_gib": 80, "capability": "9.0"}]}


def ultra():
    import ultra_parallel_train_dqn

    return ultra_parallel_train_dqn


@pytest.fixture
def machine_of_seed_001():
    """The 128-core, 512 GB, 1-GPU workstation seed 001 was written for (common.system's facts)."""
    with system.assumed_machine(SEED_001_MACHINE) as facts:
        yield facts


# ----------------------------------------------------------------------------- in-process units

def test_nstep_returns_match_a_direct_computation():
    n, gamma, envs = 3, 0.9, 2
    acc = NStepAccumulator(n, gamma, envs, (1,), np.float32)
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


def test_bf16_learning_step_runs_and_matches_fp32():
    import gymnasium as gym

    from common.dqn import DQNLearner
    from common.networks import QNetwork
    from common.replay_shm import ReplayLayout, make_replay, write_batch

    env = gym.make("CartPole-v1")
    replay = make_replay(ReplayLayout(2048, 1, (4,)), backend="queue")  # local arrays: no shared memory needed
    try:
        rng = np.random.default_rng(0)
        obs = rng.normal(size=(2048, 4)).astype(np.float32)
        write_batch(replay.arrays, 2048, 0, {"obs": obs, "next_obs": obs + 0.1, "actions": rng.integers(0, 2, 2048),
                                             "rewards": np.ones(2048, np.float32), "dones": np.zeros(2048, np.float32),
                                             "discounts": np.full(2048, 0.99, np.float32)})

        def learner(precision: str) -> DQNLearner:
            torch.manual_seed(0)
            net = QNetwork(env.observation_space, env.action_space, (64, 64))
            return DQNLearner(net, torch.device("cpu"), 2.5e-4, 10.0, 250, grad_accum_steps=2, precision=precision)

        fresh = torch.nn.utils.parameters_to_vector(learner("off").q_net.parameters())
        losses, steps = {}, {}
        for precision in ("off", "bf16"):
            replay.seed(1)
            trained = learner(precision)
            losses[precision] = trained.update(replay, 512)["loss"]
            steps[precision] = torch.nn.utils.parameters_to_vector(trained.q_net.parameters()) - fresh
            assert trained.precision == precision and trained.updates == 1
        assert np.isfinite(losses["bf16"]) and losses["bf16"] == pytest.approx(losses["off"], rel=0.05)
        assert torch.nn.functional.cosine_similarity(steps["off"], steps["bf16"], dim=0) > 0.9
    finally:
        replay.close()


def test_seed_001_config_validates_on_the_machine_it_was_written_for(machine_of_seed_001):
    mod = ultra()
    cfg = mod.UltraTrainingConfig(n_episodes=100000, n_workers=120, batch_size=256, buffer_size=1000000,
                                  learning_rate=2e-4, async_training=True)
    cfg.validate()
    assert cfg.num_workers == 120 and cfg.total_episodes == 100000 and cfg.rate_limit_slack is None
    assert cfg.slack >= cfg.min_slack  # derived from 120 actors x 16 envs x 3-step windows
    mod.check_memory(cfg, probe_env(cfg.env_id, cfg.grid_kwargs(), ("Discrete",)))  # 1 M transitions fit 512 GB
    assert cfg.buffer_size == 1000000


def test_launcher_style_command_validates_and_only_an_explicit_slack_is_refused(machine_of_seed_001, capsys):
    main = ultra().main
    big = ["--n-workers", "126", "--envs-per-worker", "32", "--batch-size", "1024", "--device", "cuda:0"]
    assert main([*big, "--validate-only"]) == 0
    assert "rate_limit_slack: null" in capsys.readouterr().out
    with pytest.raises(SystemExit) as refused:
        main([*big, "--rate-limit-slack", "5000", "--validate-only"])
    assert refused.value.code == 2
    assert "--rate-limit-slack 5000: must be >= 12128" in capsys.readouterr().err


def test_buffer_default_shrinks_to_fit_but_an_explicit_one_is_refused():
    mod = ultra()
    env = probe_env("GridCoverage-v0", {"view": "egocentric"}, ("Discrete",))
    cfg = mod.Config()
    with system.assumed_machine({"ram_total_gib": 0.25, "ram_available_gib": 0.2}):
        mod.check_memory(cfg, env)
        assert 0 < cfg.buffer_size < mod.DEFAULT_BUFFER and "fits this machine's RAM" in env.extra["notes"][0]
        with pytest.raises(ConfigError, match="lower it"):
            mod.check_memory(mod.Config(buffer_size=mod.DEFAULT_BUFFER), env)


def test_aliases_of_seed_001_in_yaml_and_flags(tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_text("n_workers: 3\nenvs_per_worker: 5\nn_episodes: 77\n")
    assert ultra().main(["--config", str(config), "--env-id", "CartPole-v1", "--validate-only"]) == 0
    out = capsys.readouterr().out
    assert "num_workers: 3" in out and "num_envs_per_worker: 5" in out and "total_episodes: 77" in out


# ----------------------------------------------------------------------------- whole runs

def summary_of(run_dir):
    return json.loads((run_dir / "summary.json").read_text())


# Sync runs repeat exactly for a seed; async ones depend on scheduling, so their bar is lower
# (a random policy averages about 22).
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode, threshold", [("--async-training", 50), ("--no-async-training", 75)])
def test_learns_cartpole_in_both_modes(tmp_path, mode, threshold):
    # Checkpoints every 200 episodes: the run must go on past each one (the rate limiter once stalled there).
    run = tmp_path / "run"
    proc = run_script(SCRIPT, *CARTPOLE, mode, "--seed", "1", "--save-every-episodes", "200", "--keep-checkpoints",
                      "2", "--total-timesteps", "60000", "--target-return", str(threshold), "--output-dir", run,
                      timeout=110)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = summary_of(run)
    assert summary["stop_reason"].startswith("target return") and summary["best_mean_return"] >= threshold, summary
    assert (run / "plots" / "ultra_training_results.png").exists() and (run / "plots" / "training_curve.png").exists()
    rows = read_metrics(run / "metrics.csv")
    assert list(rows[0])[:6] == ["wall_time", "global_step", "episodes", "episodic_return", "episodic_length", "sps"]
    periodic = sorted(run.glob("checkpoints/*"))
    assert 1 <= len(periodic) <= 2 and all(p.name.startswith("ultra_model_ep") for p in periodic), periodic
    final = load_checkpoint(run / "ultra_final_model.pth", required=("model", "policy", "optimizer"))
    assert final["counters"]["global_step"] == summary["global_step"] and final["policy"]["class"] == "QNetwork"


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
def test_message_fed_replay_prioritized_bf16_grid_coverage(tmp_path):
    proc = run_script(SCRIPT, "--env-id", "GridCoverage-v0", "--grid-size", "4", "--replay-backend", "queue",
                      "--prioritized", "--mixed-precision", "bf16", "--grad-accum-steps", "2", "--batch-size", "64",
                      "--num-workers", "2", "--num-envs-per-worker", "8", "--learning-starts", "500",
                      "--total-timesteps", "6000", "--buffer-size", "4000", "--tensorboard",
                      "--output-dir", tmp_path / "run", timeout=80)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = summary_of(tmp_path / "run")
    assert summary["replay_backend"] == "queue" and summary["precision"] == "bf16" and summary["prioritized"]
    assert summary["updates"] > 0 and summary["global_step"] >= 6000
    rows = read_metrics(tmp_path / "run" / "metrics.csv")
    coverage = [float(r["coverage"]) for r in rows if r["coverage"]]
    assert coverage and all(0 < c <= 1 for c in coverage)
    assert int(rows[-1]["buffer_size"]) == 4000  # the learner wrote what the actors sent
    tags = tensorboard_tags(tmp_path / "run" / "tb")
    assert {"charts/episodic_return", "charts/SPS", "losses/td_loss", "prl/coverage"} <= tags, sorted(tags)


# ----------------------------------------------------------------------------- promises of the docs

TINY = dict(env_id="CartPole-v1", num_workers=2, num_envs_per_worker=4, hidden_sizes=[64, 64], batch_size=64,
            n_step=1, total_episodes=None, target_return=None, device="cpu", tensorboard=False)


@pytest.mark.timeout(90)
def test_the_rate_limiter_holds_the_replay_ratio(tmp_path):
    """Async with --rate-limit: the learner keeps to replay_ratio updates per inserted transition (it waits
    beyond it) and the actors stop once they are rate_limit_slack env steps ahead of what the learner's
    updates allow; so at every metrics row, and at the end, updates per env step stay at replay_ratio."""
    ratio, starts, slack = 0.25, 200, 100
    vector_step = TINY["num_workers"] * TINY["num_envs_per_worker"]  # actors that passed the check take one more
    summary = ultra().train(**TINY, replay_ratio=ratio, learning_starts=starts, rate_limit_slack=slack,
                            total_timesteps=3000, buffer_size=10_000, metrics_interval_s=0.02,
                            output_dir=str(tmp_path / "run"))
    assert summary["exit_code"] == 0 and summary["global_step"] >= 3000, summary
    rows = read_metrics(tmp_path / "run" / "metrics.csv")
    assert len(rows) >= 5
    for row in rows:
        steps, updates = int(row["global_step"]), int(row["learner_updates"])
        assert steps <= starts + slack + updates / ratio + vector_step, row  # actors held by the limiter
        assert updates <= ratio * (steps + vector_step) + 1, row  # the learner held by the actors
    at_limit = [int(r["learner_updates"]) > 0 and int(r["global_step"]) >= starts + slack - vector_step
                + int(r["learner_updates"]) / ratio for r in rows]
    assert any(at_limit), "the actors never reached the limit: this run did not exercise the limiter"
    past_the_start = summary["global_step"] - starts - slack  # the steps the limiter paces
    assert 0.95 * ratio <= summary["updates"] / past_the_start <= 1.05 * ratio, summary


@pytest.mark.timeout(120)
def test_save_replay_then_resume_brings_the_replay_back(tmp_path):
    """--save-replay writes checkpoints/replay.npz with each checkpoint; --resume with --save-replay loads it,
    so the resumed learner samples the transitions of the first invocation and its actors write after them.
    The first invocation anneals its learning rate to 0 (--anneal-lr); the resumed one, without, learns at
    the configured rate, not at the rate its checkpoint ended on."""
    out = tmp_path / "run"
    settings = dict(TINY, save_replay=True, buffer_size=8_000, learning_starts=300, output_dir=str(out))
    first = ultra().train(**settings, total_timesteps=1500, anneal_lr=True, metrics_interval_s=0.1)
    assert first["exit_code"] == 0, first
    with np.load(out / "checkpoints" / "replay.npz") as saved:
        before = dict(saved)
    kept = int(np.minimum(before["cursors"], 4000).sum())
    assert kept >= 1500 and (before["seq"][before["seq"] > 0] % 2 == 0).all()
    second = ultra().train(**settings, total_timesteps=2500, resume="auto")
    assert second["exit_code"] == 0 and second["global_step"] >= 2500, second
    assert f"replay buffer restored: {kept} transitions" in (out / "logs" / "main.log").read_text()
    with np.load(out / "checkpoints" / "replay.npz") as saved:
        after = dict(saved)
    assert (after["cursors"] > before["cursors"]).all()  # the actors went on from the saved cursors
    for writer, cursor in enumerate(before["cursors"]):  # and left the first invocation's transitions as they were
        first_slots = slice(writer * 4000, writer * 4000 + int(cursor))
        for name in ("obs", "next_obs", "actions", "rewards", "dones"):
            assert np.array_equal(after[name][first_slots], before[name][first_slots]), name
    rates = [(int(row["global_step"]), float(row["learning_rate"])) for row in read_metrics(out / "metrics.csv")]
    annealed = [rate for step, rate in rates if step <= first["global_step"]]
    # Decreasing, and well below the configured rate by the end (the first row may come after learning began).
    assert annealed == sorted(annealed, reverse=True) and annealed[-1] < 0.5 * 2.5e-4, annealed
    resumed = [rate for step, rate in rates if step > first["global_step"]]
    assert resumed and resumed == pytest.approx([2.5e-4] * len(resumed)), resumed


def test_a_saved_replay_of_another_layout_is_not_loaded_at_all():
    from common.replay_shm import ReplayLayout, make_replay

    saved = make_replay(ReplayLayout(64, 2, (4,)), "queue")
    saved.receive(0, {"obs": np.ones((8, 4), np.float32), "next_obs": np.ones((8, 4), np.float32),
                      "actions": np.zeros(8, np.int64), "rewards": np.ones(8, np.float32),
                      "dones": np.zeros(8, np.float32), "discounts": np.full(8, 0.99, np.float32)})
    state = saved.state()
    for other in (ReplayLayout(128, 2, (4,)), ReplayLayout(64, 4, (4,)), ReplayLayout(64, 2, (4,), "uint8")):
        fresh = make_replay(other, "queue")
        with pytest.raises(ValueError, match="another layout"):
            fresh.load_state(state)
        assert len(fresh) == 0 and fresh.arrays["cursors"].sum() == 0  # nothing half-restored
    same = make_replay(ReplayLayout(64, 2, (4,)), "queue")
    same.load_state(state)
    assert len(same) == 8 and np.array_equal(same.arrays["obs"], state["obs"])
