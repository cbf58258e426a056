"""train_ppo_multiprocess.py: the population learns, ranks and keeps its agents; a worker continues from
its own newest checkpoint after a crash, a stop or a resume; Box actions train; bad input is refused;
PBT's exploit/explore step and answers that come late; workers on the documented GPUs (3 assumed);
--validate-only writes nothing; a final evaluation ends by the stop deadline instead of being killed.

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
from types import SimpleNamespace

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
from common.population import Population, WorkerStatus, member_hyperparams, pbt_donor, perturb
from common.population_member import MemberSetup, policy_actions

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
    assert summary["learner"] == "numpy" and ", numpy learner, target" in main_log  # MLP members on the CPU
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
        # Both workers past 2048 (worker 1 alone gets there in under a second, before worker 0 may be up).
        assert wait_until(lambda: len(worker_steps(out)) == 2 and min(worker_steps(out).values()) >= 2048, 90, proc), \
            log_text(out)[-3000:]
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
    act = policy_actions(agent, space, True, normalizer)
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
    assert "numpy learns an MLP policy (vector observations) on the CPU" in fails(
        [*small, "--env-id", "Catch-v0", "--learner", "numpy"], capsys)
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
    population = member_hyperparams(cfg, tpm.PER_WORKER, 3, seed=5)
    assert population == member_hyperparams(cfg, tpm.PER_WORKER, 3, seed=5)  # same seed, same population
    lrs = [h["learning_rate"] for h in population]
    assert all(1e-4 <= lr <= 1e-2 for lr in lrs) and len(set(lrs)) == 3
    assert [h["ent_coef"] for h in population] == [0.0, 0.01, 0.02]
    assert all(h["gamma"] == 0.99 for h in population)
    perturbed = perturb(population[0], 0.2, np.random.default_rng(0))
    assert np.isclose(perturbed["learning_rate"] / lrs[0], 0.8) or np.isclose(perturbed["learning_rate"] / lrs[0], 1.2)
    assert 0.98 < perturbed["gamma"] < 0.9999 and all(type(v) is float for v in perturbed.values())


def test_pbt_the_weakest_copies_a_stronger_worker():
    rng = np.random.default_rng(0)
    assert pbt_donor([5.0, None, 1.0, 9.0], 2, 0.25, rng) is None  # not everyone has reported yet
    assert pbt_donor([-3.0, 5.0, 1.0, 9.0], 0, 0.25, rng) == 3  # the weakest copies the strongest
    assert pbt_donor([-3.0, 5.0, 1.0, 9.0], 3, 0.25, rng) is None  # the strongest keeps its weights
    assert pbt_donor([-3.0, 5.0, 1.0, 9.0], 1, 0.25, rng) is None  # the middle too
    assert pbt_donor([2.0, 2.0], 0, 0.5, rng) is None  # a copy must be better, not equal


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


# --------------------------------------------------------------------------- PBT, devices, stop deadline

class ScriptedLink:
    """A worker's link to a scripted coordinator: ``answers`` come out of receive() in order (None stands for
    a wait that times out); what the worker sends is kept in ``sent``."""

    def __init__(self, answers=()):
        self.index, self.stop_requested, self.sent, self.answers = 0, False, [], list(answers)

    def send(self, kind, payload=None):
        self.sent.append((kind, payload))

    def beat(self):
        pass

    def receive(self, timeout=None):
        message = self.answers.pop(0) if self.answers else None
        self.stop_requested |= message is not None and message[0] == "stop"
        return message

    def commands(self):
        while self.answers and self.answers[0] is not None:
            yield self.receive(0.0)

    def kinds(self):
        return [kind for kind, _ in self.sent]


def tiny_agent(tmp_path, link, member=0, **settings):
    """One population worker's agent in this process, on CartPole with 2 envs x 16 steps per rollout."""
    import logging

    from common.run import config_dict

    cfg = tpm.Config(env_id="CartPole-v1", num_workers=2, num_envs_per_worker=2, n_steps=16, batch_size=16,
                     n_epochs=1, device="cpu", target_return=None, learning_rate=[1e-3], **settings)
    for sub in ("checkpoints", "logs"):
        (tmp_path / sub).mkdir(exist_ok=True)
    setup = MemberSetup(member, config_dict(cfg), {}, str(tmp_path), None, None, "cpu", 1,
                        member_hyperparams(cfg, tpm.PER_WORKER, 2, cfg.seed)[member], None, None)
    return tpm.Agent(link, setup, None, logging.getLogger(f"prl.test.worker{member}"))


@pytest.mark.parametrize("donor_learner, learner", [("numpy", "numpy"), ("torch", "torch"), ("numpy", "torch"),
                                                    ("torch", "numpy")])
def test_a_pbt_copy_takes_the_donors_weights_optimizer_statistics_and_perturbed_hyperparameters(tmp_path, donor_learner,
                                                                                               learner):
    """The exploit/explore step as documented: the copier loads the donor's checkpoint of that step (weights,
    optimizer state, normalization statistics), takes the donor's hyperparameters each scaled by 1 +- pbt_perturb
    (gamma and gae_lambda on their 1 - x scale, capped at 0.9999) and empties its window of recent returns.
    With either learner, across learners too: the numpy one (auto's choice for an MLP on the CPU) writes and
    loads the torch learner's checkpoints."""
    donor = tiny_agent(tmp_path, ScriptedLink(), member=1, norm_obs=True, gamma=[0.9, 0.9999], learner=donor_learner)
    assert donor.learner.name == donor_learner
    donor.collector.next_obs = donor.envs.reset()
    donor.collector.collect(16)
    donor.update()
    donor_path = donor.save("worker_1_step_32.pt")
    offers = [perturb(donor.hyper, 0.2, np.random.default_rng(seed)) for seed in range(8)]
    for name, value in donor.hyper.items():  # explore: 1 -/+ 20 % (discounts on their 1 - x scale, capped)
        if name in ("gamma", "gae_lambda"):
            allowed = {round(min(0.9999, 1 - (1 - value) * f), 6) for f in (0.8, 1.2)}
        else:
            allowed = {float(f"{value * f:.6g}") for f in (0.8, 1.2)}
        assert {offer[name] for offer in offers} == allowed, (name, value)  # both directions, nothing else
    assert donor.hyper["gamma"] == 0.9999 and {offer["gamma"] for offer in offers} == {0.9999, 0.99988}  # capped
    offer = offers[0]
    link = ScriptedLink([("pbt", {"step": 32, "donor": 1, "donor_score": 20.0, "path": str(donor_path),
                                  "hyper": offer})])
    copier = tiny_agent(tmp_path, link, member=0, norm_obs=True, gamma=[0.9, 0.9999], learner=learner)
    copier.counters["global_step"] = 32
    copier.recent.extend([5.0, 6.0])
    copier.pbt_step(None)
    assert link.kinds() == ["pbt_ready", "pbt_copied"]
    assert copier.learner.name == learner
    for mine, theirs in zip(copier.learner.model.state_dict().values(), donor.learner.model.state_dict().values()):
        assert np.array_equal(np.asarray(mine), np.asarray(theirs))
    assert np.array_equal(np.asarray(copier.learner.optimizer.state_dict()["state"][0]["exp_avg"]),
                          np.asarray(donor.learner.optimizer.state_dict()["state"][0]["exp_avg"]))
    mine, theirs = copier.normalizer.state_dict()["obs_norm"], donor.normalizer.state_dict()["obs_norm"]
    assert theirs["count"] > 1 and all(np.array_equal(mine[k], theirs[k]) for k in theirs)
    assert copier.hyper == offer and copier.normalizer.gamma == offer["gamma"] and offer["gamma"] <= 0.9999
    assert len(copier.recent) == 0 and copier.counters["pbt_exploits"] == 1
    assert link.sent[-1][1] == {"step": 32, "copied": 1, "score": 5.5, "donor_score": 20.0, "hyper": offer}
    donor.envs.close()
    copier.envs.close()


def test_a_late_pbt_answer_changes_nothing_in_the_worker(tmp_path):
    """A worker whose PBT wait timed out trains on; the answer that comes later (in its training loop, or
    during its next PBT wait) is out of date and skipped; its own step's answer is the one that counts."""
    stale = ("pbt", {"step": 32, "donor": 1, "donor_score": 9.0, "path": str(tmp_path / "nowhere.pt"),
                     "hyper": {"learning_rate": 1.0}})
    link = ScriptedLink([None, stale, stale, ("pbt", {"step": 64})])  # wait at 32 times out; 64's answer: no copy
    agent = tiny_agent(tmp_path, link, pbt_interval=32, max_steps_per_worker=96, worker_timeout_s=0.01)
    hyper = dict(agent.hyper)
    assert agent.train()
    assert link.kinds() == ["update", "pbt_ready", "update", "pbt_ready", "update"] and not link.answers
    assert agent.hyper == hyper and agent.counters["pbt_exploits"] == 0
    agent.envs.close()


class StubRun:
    """What Population.handle needs of a run, for the coordinator's PBT rounds alone."""

    def __init__(self, cfg):
        import logging

        self.cfg, self.log, self.stopping = cfg, logging.getLogger("prl.test.coordinator"), None
        self.counters = {"global_step": 0, "updates": 0}
        self.budget = SimpleNamespace(mark_first_step=lambda started: None)

    def stop_reason(self):
        return self.stopping

    def record_episodes(self, episodes):
        pass

    def write_metrics(self, row, shown, member=None):
        pass


def coordinator(workers: int) -> tuple:
    population = Population.__new__(Population)  # the coordinator's bookkeeping without processes
    population.run = StubRun(tpm.Config(num_workers=workers, pbt_interval=1024, pbt_fraction=0.34))
    population.status = [WorkerStatus(hyper={"learning_rate": 1e-3 * (i + 1)}) for i in range(workers)]
    population.pbt_waiting, population.pbt_events = {}, []
    population.pbt_rng = np.random.default_rng(0)
    told = []
    population.tell = lambda index, kind, payload, files=None: told.append((index, payload))
    return population, told


def ready(population, index, step, score):
    population.handle(index, "pbt_ready", {"step": step, "score": score, "path": f"w{index}_{step}.pt",
                                           "hyper": population.status[index].hyper})


def test_a_late_pbt_round_skips_workers_that_stopped_waiting_finished_or_are_stopping():
    population, told = coordinator(3)
    ready(population, 0, 1024, 5.0)
    population.handle(0, "update", {"step": 1536, "steps": 512, "episodes": [], "stats": {}, "started": 0.0,
                                    "learning_rate": 1e-3, "recent_return": 5.0, "sps": 1.0, "cpu_sps": 1.0,
                                    "checkpoint": ""})  # its wait timed out: it trains on, and waits no more
    assert population.pbt_waiting == {}
    population.handle(0, "done", {"step": 2048, "recent_return": 5.0, "sps": 1.0, "finished": True,
                                  "eval": {"episodes": 32, "mean_return": 5.0}})
    ready(population, 1, 1024, 1.0)
    ready(population, 2, 1024, 9.0)  # every worker still training waits: the round, without the finished one
    assert [index for index, _ in told] == [1, 2] and all(answer["step"] == 1024 for _, answer in told)
    offer = told[0][1]
    assert offer["donor"] == 2 and offer["path"] == "w2_1024.pt" and "donor" not in told[1][1]
    assert population.pbt_events == [] and population.status[1].hyper == {"learning_rate": 2e-3}  # not yet made
    population.handle(1, "pbt_copied", {"step": 1024, "copied": 2, "score": 1.0, "donor_score": 9.0,
                                        "hyper": offer["hyper"]})
    assert population.pbt_events == [{"step": 1024, "worker": 1, "copied": 2, "hyper": offer["hyper"]}]
    assert population.status[1].hyper == offer["hyper"]
    told.clear()
    population.run.stopping = "duration 0.1 h reached"  # stopping: the stop order ends the waits, no round
    ready(population, 1, 2048, 1.0)
    ready(population, 2, 2048, 9.0)
    assert told == [] and population.pbt_waiting == {}



def test_a_restarted_worker_leaves_the_pbt_round_and_one_that_died_or_was_lost_is_not_waited_for(tmp_path):
    population, told = coordinator(4)
    population.sources = [tmp_path]  # no checkpoint: a restart continues "from scratch"
    population.handle(3, "given_up", "Traceback ...\nRuntimeError: worker 3 crashed once too often")
    ready(population, 0, 1024, 5.0)
    ready(population, 1, 1024, 1.0)
    population.handle(1, "restarted", "Traceback ...\nRuntimeError: worker 1 crashed")
    assert population.pbt_waiting == {0: 1024}  # the restarted one left the round
    ready(population, 2, 1024, 9.0)
    assert told == []  # and the others wait for it to reach a PBT step again
    population.handle(1, "lost", "node 1 lost: connection reset")
    # Lost (like given up): no longer training, so the round goes on with those that wait.
    assert [index for index, _ in told] == [0, 2] and all(answer["step"] == 1024 for _, answer in told)
    assert told[0][1]["donor"] == 2 and "donor" not in told[1][1]
    assert population.pbt_waiting == {} and population.status[1].restarts == 1

@pytest.fixture
def three_gpus(monkeypatch):
    """A machine with 3 CUDA GPUs, as far as device placement can tell (no GPU is touched)."""
    from common import system

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    with system.assumed_machine({"gpus": [{"name": f"assumed GPU {i}"} for i in range(3)]}):
        yield


def test_workers_are_placed_on_the_documented_gpus(three_gpus, capsys):
    """--gpu-strategy round-robin puts worker i on cuda:(i mod G), G = --num-gpus or every GPU; single or
    an explicit cuda:N puts every worker on one GPU; --device cpu keeps them all on the CPU. auto uses the
    GPUs for image observations (a CNN policy) and keeps MLP policies on the CPU."""
    import gymnasium as gym

    from common.config import parse_args
    from common.run import FlatConfig

    frames = gym.spaces.Box(0, 255, (4, 84, 84), np.uint8)
    vectors = gym.spaces.Box(-1.0, 1.0, (8,), np.float32)

    def devices(*flags, observations=frames):
        groups, _ = parse_args(tpm.CONFIG_GROUPS, ["--num-workers", "5", *flags], exit_on_error=False)
        return tpm.worker_devices(FlatConfig(groups), observations)

    assert devices() == devices("--device", "cuda") == ["cuda:0", "cuda:1", "cuda:2", "cuda:0", "cuda:1"]
    assert devices(observations=vectors) == ["cpu"] * 5
    assert devices("--device", "cuda", observations=vectors) == ["cuda:0", "cuda:1", "cuda:2", "cuda:0", "cuda:1"]
    assert devices("--num-gpus", "2") == ["cuda:0", "cuda:1", "cuda:0", "cuda:1", "cuda:0"]
    assert devices("--gpu-strategy", "single") == ["cuda:0"] * 5
    assert devices("--device", "cuda:2") == devices("--device", "cuda:2", "--gpu-strategy", "single") == ["cuda:2"] * 5
    assert devices("--device", "cpu") == ["cpu"] * 5
    assert "--num-gpus 4: this machine has 3 CUDA GPU(s)" in fails(["--num-gpus", "4", "--validate-only"], capsys)
    assert "--device 'cuda:3': this machine has 3 CUDA GPU(s)" in fails(["--device", "cuda:3"], capsys)


def test_validate_only_writes_nothing_not_even_the_market_cache(tmp_path, monkeypatch, capsys):
    """--validate-only checks the market history (built in memory) and writes nothing, even under relative
    default paths; a bad one is still refused."""
    monkeypatch.chdir(tmp_path)
    small = ["--num-items", "5", "--history-steps", "800", "--top-n-items", "3", "--episode-length", "32"]
    assert tpm.main([*small, "--validate-only"]) == 0
    assert "top_n_items: 3" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []  # no runs/cache/market, no run directory
    assert "is too short for window 16 + episode_length 256" in fails([*small, "--episode-length", "256",
                                                                       "--validate-only"], capsys)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.timeout(90)
def test_a_final_evaluation_that_outlasts_stop_timeout_ends_in_time_and_is_reported(tmp_path):
    """At the duration's end the workers evaluate themselves; an evaluation that would outlast stop_timeout_s
    ends a moment before it with the episodes it finished (leaderboard eval_episodes, a line in main.log),
    instead of the worker being killed; so does the coordinator's random-policy row. The run writes the market
    cache the checks only built in memory.
    The duration (1.8 s) counts from when the workers are up, so a slow start-up does not leave it untrained."""
    out, cache = tmp_path / "run", tmp_path / "cache"
    summary = tpm.train(num_items=5, history_steps=800, top_n_items=3, episode_length=32, cache_dir=str(cache),
                        num_workers=2, num_envs_per_worker=4, n_steps=32, batch_size=64, n_epochs=1,
                        max_steps_per_worker=None, duration=0.0005, stop_timeout_s=3.0, eval_episodes=10**7,
                        tensorboard=False, output_dir=str(out))
    assert summary["exit_code"] == 0 and summary["stop_reason"].startswith("duration"), summary
    board = read_csv(out / "leaderboard.csv")
    assert sorted(r["worker"] for r in board) == ["0", "1", "random"]
    assert all(0 < int(r["eval_episodes"]) < 10**7 for r in board), board  # the random row's too
    log = (out / "logs" / "main.log").read_text()
    assert log.count("evaluation ended at the stop deadline (stop_timeout_s) after") == 2, log[-3000:]
    assert "did not stop within" not in log
    assert summary["cache"]["built"] and (Path(summary["cache"]["path"]) / "meta.json").is_file()
