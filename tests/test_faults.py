"""The fault matrix: every training script behaves the same under every fault.

Each cell runs a real script in its own process group, as a terminal would, and ends with no
live process of the run and no ``/dev/shm/prl_*`` segment of it (the autouse fixture in
conftest.py checks both after every test). Bad-input cells call a script's ``main(argv)`` in
this process: they must fail before anything is written, which is what makes them fast.
Cells that one run can show together share that run.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest
import torch
from conftest import HELPERS, kill_tree, run_script, start_script

from common.checkpoint import load_checkpoint, save_checkpoint
from common.runlog import read_metrics
from common.shm import segments_of


@dataclass
class Script:
    file: str
    tiny: list[str]  # small, fast settings with 2 worker processes and no TensorBoard
    endless: list[str]  # budget flags of a run that goes on until it is stopped
    short: list[str]  # budget flags of a run that ends by itself within a few seconds of training
    quick: list[str]  # budget flags of a fresh run that ends by itself within about a second of training
    diverge: list[str]  # flags that make the loss NaN soon after the first checkpoint
    untrainable_env: str  # an env id whose spaces this mode cannot train
    checkpoints: str = "checkpoints/*.pt"  # glob of the checkpoints a run writes
    zero_budget: list[str] = field(default_factory=lambda: ["--total-timesteps", "0"])

    @property
    def name(self) -> str:
        return Path(self.file).stem


SCRIPTS = [
    Script("train_parallel_timed.py",
           tiny=["--env-id", "CartPole-v1", "--num-workers", "2", "--num-envs-per-worker", "4", "--n-steps", "32",
                 "--batch-size", "64", "--no-tensorboard", "--target-return", "none", "--duration", "none"],
           # A resumed run is past any small step budget, and a step budget runs out in well under a second
           # of training: a short run is a short time.
           endless=["--total-timesteps", str(10**9)], short=["--duration", "0.002", "--total-timesteps", "none"],
           quick=["--total-timesteps", "2048"],
           diverge=["--learning-rate", "1e30", "--no-anneal-lr", "--max-grad-norm", "1e30",
                    "--checkpoint-interval-s", "0.01"],
           untrainable_env="Blackjack-v1"),
    Script("ultra_parallel_train_dqn.py",
           tiny=["--env-id", "CartPole-v1", "--num-workers", "2", "--num-envs-per-worker", "4", "--batch-size", "64",
                 "--buffer-size", "20000", "--learning-starts", "500", "--no-tensorboard", "--target-return", "none",
                 "--duration", "none", "--metrics-interval-s", "0.01"],
           endless=["--total-timesteps", str(10**9), "--total-episodes", "none"],
           short=["--duration", "0.002", "--total-episodes", "none"],  # a resumed run is past any small step budget
           quick=["--total-timesteps", "2000", "--total-episodes", "none"],
           diverge=["--learning-rate", "1e30", "--checkpoint-interval-s", "0.01"],
           untrainable_env="Pendulum-v1"),
    Script("parallel_train_dqn.py",
           tiny=["--env-id", "CartPole-v1", "--num-workers", "2", "--episodes-per-batch", "4", "--batch-size", "64",
                 "--learning-starts", "200", "--no-tensorboard", "--target-return", "none", "--duration", "none",
                 "--eval-interval", "0"],
           endless=["--total-timesteps", str(10**9), "--total-episodes", "none"],
           short=["--total-timesteps", "6000", "--total-episodes", "none"],
           quick=["--total-timesteps", "2000", "--total-episodes", "none"],
           diverge=["--learning-rate", "1e30", "--checkpoint-interval-s", "0.01"],
           untrainable_env="Pendulum-v1"),
    Script("train_ppo_multiprocess.py",
           tiny=["--env-id", "CartPole-v1", "--num-workers", "2", "--num-envs-per-worker", "4", "--n-steps", "64",
                 "--batch-size", "64", "--no-tensorboard", "--duration", "none", "--target-return", "none"],
           # Workers train independently, so a resumed worker is past any small step budget: a short
           # run is a short time.
           endless=["--max-steps-per-worker", str(10**9)], short=["--duration", "0.002"],
           quick=["--max-steps-per-worker", "1024"],
           diverge=["--learning-rate", "1e30", "--no-anneal-lr", "--max-grad-norm", "1e30",
                    "--checkpoint-every", "256"],
           untrainable_env="Blackjack-v1", checkpoints="checkpoints/worker_*.pt",  # population.pt holds no weights
           zero_budget=["--max-steps-per-worker", "0"]),
]
IDS = [s.name for s in SCRIPTS]


# ------------------------------------------------------------------------ helpers

def workers_of(pid: int) -> list[int]:
    """Pids of a run's worker processes (not multiprocessing's resource tracker, nor the run's plotter)."""
    try:
        children = psutil.Process(pid).children()
    except psutil.NoSuchProcess:
        return []
    return [c.pid for c in children if not any(helper in " ".join(c.cmdline()) for helper in HELPERS)]


def alive(pids: list[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def wait_until(predicate, timeout: float, proc=None) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        if proc is not None and proc.poll() is not None:
            return bool(predicate())
        time.sleep(0.05)
    return bool(predicate())


def rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.csv"
    return read_metrics(path) if path.exists() else []


def log_text(run_dir: Path) -> str:
    path = run_dir / "logs" / "main.log"
    return path.read_text() if path.exists() else ""


def output(proc) -> str:
    try:
        return proc.communicate(timeout=10)[0][-4000:]
    except Exception:  # still running or already read
        return ""


def ready_since_last_restart(run_dir: Path) -> bool:
    text = log_text(run_dir)
    return "worker process(es) ready" in text[text.rfind("restarted worker"):]


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def start(script: Script, run_dir: Path, *extra: str, env: dict | None = None):
    return start_script(script.file, *script.tiny, "--output-dir", run_dir, *extra, env=env)


def assert_clean_exit(proc, status: int, within: float) -> None:
    try:
        code = proc.wait(within)
    except Exception:
        kill_tree(proc)
        raise AssertionError(f"did not exit within {within} s") from None
    assert code == status, output(proc)


# ------------------------------------------------------------------------ signals

# Ctrl+C while workers start, in every script; SIGTERM takes the same path (one handler, common/training_run.py's
# GracefulExit), so one script shows it here; every script's SIGTERM mid-run: test_sigterm_mid_run_saves_and_exits_143.
STARTUP_SIGNALS = [(s, signal.SIGINT) for s in SCRIPTS] + [(SCRIPTS[-1], signal.SIGTERM)]


@pytest.mark.parametrize("script, signum", STARTUP_SIGNALS,
                         ids=[f"{s.name}-{signal.Signals(k).name}" for s, k in STARTUP_SIGNALS])
def test_signal_during_worker_startup(tmp_path, script, signum):
    run_dir = tmp_path / "run"
    proc = start(script, run_dir, *script.endless)
    try:
        assert wait_until(lambda: "started 2 worker process(es)" in log_text(run_dir), 60, proc), output(proc)
        assert "worker process(es) ready" not in log_text(run_dir)  # still importing, most likely
        workers = workers_of(proc.pid)
        # Ctrl+C in a terminal reaches the whole process group; SIGTERM comes to the main process.
        os.killpg(proc.pid, signum) if signum == signal.SIGINT else proc.send_signal(signum)
        assert_clean_exit(proc, 128 + signum, 30)
    finally:
        kill_tree(proc)
    assert wait_until(lambda: not alive(workers), 10)
    assert summary(run_dir)["stop_reason"] == "interrupted"
    assert segments_of(proc.pid) == []


@pytest.mark.timeout(240)
@pytest.mark.parametrize("script", SCRIPTS, ids=IDS)
def test_worker_faults_then_ctrl_c_then_resume_and_a_second_run_is_locked_out(tmp_path, script):
    """Mid-run: a worker raising, one killed with kill -9, one that hangs; then Ctrl+C; then --resume auto."""
    run_dir = tmp_path / "run"
    env = {"PRL_INJECT_FAULT": "raise:1:4"}
    proc = start(script, run_dir, *script.endless, "--worker-timeout-s", "6", env=env)
    try:
        assert wait_until(lambda: "fault injected into worker 1" in log_text(run_dir), 90, proc), output(proc)
        assert re.search(r"worker 1 died: raised an exception:\nTraceback", log_text(run_dir))
        assert wait_until(lambda: len(rows(run_dir)) >= 2 and len(workers_of(proc.pid)) == 2, 60, proc)
        victim = workers_of(proc.pid)[0]
        os.kill(victim, signal.SIGKILL)
        assert wait_until(lambda: re.search(r"worker \d died: killed by signal SIGKILL", log_text(run_dir)), 5)
        # Freeze a worker only once the restarted one is ready: a starting worker has its own deadline.
        assert wait_until(lambda: ready_since_last_restart(run_dir), 60, proc), log_text(run_dir)[-3000:]
        frozen = workers_of(proc.pid)[1]
        os.kill(frozen, signal.SIGSTOP)
        assert wait_until(lambda: "hung: silent for" in log_text(run_dir), 30, proc), log_text(run_dir)[-3000:]
        # The hung worker is restarted once its killed process is reaped; on a busy machine the others may
        # report twice before that, and a stop ends restarts.
        assert wait_until(lambda: len(re.findall(r"restarted [\w ]+ \d+ \(restart \d+ of", log_text(run_dir))) >= 3,
                          30, proc), log_text(run_dir)[-3000:]
        before = len(rows(run_dir))
        assert wait_until(lambda: len(rows(run_dir)) >= before + 2, 60, proc), "training did not go on"
        os.killpg(proc.pid, signal.SIGINT)
        assert_clean_exit(proc, 130, 30)
    finally:
        kill_tree(proc)
    done = summary(run_dir)
    assert done["stop_reason"] == "interrupted" and done["worker_restarts"] == 3, done
    saved_steps = done["global_step"]
    assert sorted(run_dir.glob(script.checkpoints)), "no checkpoint written on Ctrl+C"
    fresh = run_script(script.file, *script.tiny, "--output-dir", run_dir, *script.short, timeout=60)
    assert fresh.returncode == 2 and "holds checkpoints of an earlier run; pass --resume auto" in fresh.stderr, \
        fresh.stderr

    resumed = start(script, run_dir, "--resume", "auto", *script.short)
    try:
        assert wait_until(lambda: "resumed from" in log_text(run_dir), 60, resumed), output(resumed)
        second = run_script(script.file, *script.tiny, "--output-dir", run_dir, *script.short, timeout=60)
        assert second.returncode == 3 and "another run holds the lock" in second.stderr, second.stderr
        assert_clean_exit(resumed, 0, 120)
    finally:
        kill_tree(resumed)
    steps = [int(r["global_step"]) for r in rows(run_dir)]
    assert all(b > a for a, b in zip(steps, steps[1:])), f"steps repeat or go back: {steps}"
    assert summary(run_dir)["global_step"] > saved_steps


# The 1-in-4 race (a worker blocked on a half-written command outliving its parent) was
# parallel_train_dqn.py's: that script gets two trials, the second Ctrl+C at another moment, the others one each.
DOUBLE_CTRL_C = [(s, k) for s in SCRIPTS for k in range(2 if s.name == "parallel_train_dqn" else 1)]


@pytest.mark.parametrize("script, repeat", DOUBLE_CTRL_C, ids=[f"{s.name}-{k}" for s, k in DOUBLE_CTRL_C])
def test_double_ctrl_c_exits_at_once_and_no_worker_survives(tmp_path, script, repeat):
    run_dir = tmp_path / "run"
    proc = start(script, run_dir, *script.endless)
    try:
        assert wait_until(lambda: len(rows(run_dir)) >= 1, 90, proc), output(proc)
        workers = workers_of(proc.pid)
        os.killpg(proc.pid, signal.SIGINT)
        time.sleep(0.03 * repeat)  # the second Ctrl+C at different moments of the first one's handling
        os.killpg(proc.pid, signal.SIGINT)
        assert_clean_exit(proc, 130, 5)
    finally:
        kill_tree(proc)
    assert wait_until(lambda: not alive(workers), 10), f"workers outlived a double Ctrl+C: {alive(workers)}"


@pytest.mark.parametrize("script", SCRIPTS, ids=IDS)
def test_sigterm_mid_run_saves_and_exits_143(tmp_path, script):
    run_dir = tmp_path / "run"
    proc = start(script, run_dir, *script.endless)
    try:
        assert wait_until(lambda: len(rows(run_dir)) >= 2, 90, proc), output(proc)
        workers = workers_of(proc.pid)
        proc.send_signal(signal.SIGTERM)  # systemd, a batch scheduler, kill: to the main process only
        assert_clean_exit(proc, 143, 30)
    finally:
        kill_tree(proc)
    assert wait_until(lambda: not alive(workers), 10)
    done = summary(run_dir)
    assert done["stop_reason"] == "interrupted" and done["exit_code"] == 143
    assert sorted(run_dir.glob(script.checkpoints)), "no checkpoint written on SIGTERM"


# ------------------------------------------------------------------------ process deaths

@pytest.mark.parametrize("script", SCRIPTS, ids=IDS)
def test_worker_killed_during_startup_is_restarted_and_the_run_finishes(tmp_path, script):
    run_dir = tmp_path / "run"
    proc = start(script, run_dir, *script.short)
    try:
        assert wait_until(lambda: len(workers_of(proc.pid)) == 2, 60, proc), output(proc)
        os.kill(workers_of(proc.pid)[0], signal.SIGKILL)
        assert_clean_exit(proc, 0, 120)
    finally:
        kill_tree(proc)
    text = log_text(run_dir)
    assert re.search(r"worker 0 died: killed by signal SIGKILL", text) and "restarted worker 0" in text, text
    done = summary(run_dir)
    assert done["worker_restarts"] == 1
    # The same summary keys in every script, and a time budget that accounts for the whole process.
    assert SUMMARY_KEYS <= set(done), SUMMARY_KEYS - set(done)
    budget = done["time_budget"]
    assert set(budget) == TIME_BUDGET_KEYS, budget
    assert budget["startup_s"] > 0 and budget["collect_s"] + budget["learn_s"] + budget["wait_s"] > 0, budget
    parts = sum(v for k, v in budget.items() if k != "process_s")
    assert abs(parts - budget["process_s"]) < 0.01 + 1e-3 * budget["process_s"], budget
    assert budget["process_s"] >= done["wall_time_s"], budget


SUMMARY_KEYS = {"script", "env_id", "seed", "stop_reason", "exit_code", "global_step", "episodes", "updates",
                "wall_time_s", "sps", "final_mean_return", "best_mean_return", "target_return", "num_workers",
                "num_envs_per_worker", "worker_restarts", "world_size", "peak_rss_mb", "peak_pss_mb",
                "resumed_from", "time_budget"}
TIME_BUDGET_KEYS = {f"{part}_s" for part in ("startup", "collect", "learn", "wait", "checkpoint", "log", "shutdown",
                                             "other", "process")}


@pytest.mark.parametrize("script", SCRIPTS, ids=IDS)
def test_main_process_killed_workers_exit_and_the_next_run_reclaims_memory(tmp_path, script):
    run_dir = tmp_path / "run"
    proc = start(script, run_dir, *script.endless)
    try:
        assert wait_until(lambda: len(rows(run_dir)) >= 1, 90, proc), output(proc)
        workers = workers_of(proc.pid)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        assert wait_until(lambda: not alive(workers), 10), "workers outlived their parent by more than 10 s"
    finally:
        kill_tree(proc)
    result = run_script(script.file, *script.tiny, "--output-dir", tmp_path / "next", *script.quick, timeout=120)
    assert result.returncode == 0, result.stderr
    assert segments_of(proc.pid) == []


@pytest.mark.parametrize("script", SCRIPTS, ids=IDS)
def test_nan_loss_exits_1_and_keeps_the_last_good_checkpoint(tmp_path, script):
    run_dir = tmp_path / "run"
    result = run_script(script.file, *script.tiny, "--output-dir", run_dir, *script.endless, *script.diverge,
                        timeout=120)
    assert result.returncode == 1, result.stderr
    assert "Last good checkpoint" in log_text(run_dir)
    assert summary(run_dir)["stop_reason"].startswith("diverged")
    for path in run_dir.glob(script.checkpoints):
        model = load_checkpoint(path)["model"]
        assert all(torch.isfinite(t).all() for t in model.values()), f"{path} holds non-finite weights"


# ------------------------------------------------------------------------ bad input

def load_main(script: Script):
    return importlib.import_module(script.name).main  # the repository root is on sys.path (conftest)


def fake_checkpoint(path: Path, script: str, **config) -> Path:
    base = {"env_id": "CartPole-v1", "hidden_sizes": [64, 64]}
    state = {"script": script, "config": {**base, **config}, "model": {}, "optimizer": {}, "target": {},
             "counters": {}, "rng": {}}
    return save_checkpoint(state, path)


BAD_INPUTS = {
    "unknown env id": (lambda s, t: ["--env-id", "NoSuchEnv-v9"], "not a registered Gymnasium id"),
    "untrainable env": (lambda s, t: ["--env-id", s.untrainable_env], "which this mode needs"),
    "negative workers": (lambda s, t: ["--num-workers", "-1"], "--num-workers -1: must be >="),
    "zero budget": (lambda s, t: s.zero_budget, "must be > 0"),
    "unknown yaml key": (lambda s, t: ["--config", write(t / "c.yaml", "learnig_rate: 0.1\n")], "unknown key"),
    "wrong yaml type": (lambda s, t: ["--config", write(t / "c.yaml", "seed: many\n"), "--seed", "3"],
                        "--seed 'many': must be an integer"),
    "yaml not a mapping": (lambda s, t: ["--config", write(t / "c.yaml", "- 1\n- 2\n")], "must hold a mapping"),
    "resume missing": (lambda s, t: ["--resume", str(t / "nothing.pt")], "no such checkpoint"),
    "resume not a checkpoint": (lambda s, t: ["--resume", write(t / "x.pt", "hello")], "not a readable checkpoint"),
    "resume of another script": (lambda s, t: ["--resume", str(fake_checkpoint(t / "o.pt", "other_script"))],
                                 "is a checkpoint of other_script.py"),
    "resume of another env": (lambda s, t: ["--resume", str(fake_checkpoint(t / "e.pt", s.name, env_id="Acrobot-v1"))],
                              "was trained with env_id 'Acrobot-v1'"),
    "resume of another width": (lambda s, t: ["--resume", str(fake_checkpoint(t / "w.pt", s.name, hidden_sizes=[3]))],
                                "was trained with hidden_sizes [3]"),
    "output dir is a file": (lambda s, t: ["--output-dir", write(t / "file", "x")], "is a file, not a directory"),
    "output dir under a file": (lambda s, t: ["--output-dir", write(t / "file", "x") + "/run"],
                                "cannot be created: "),
    "unknown key in a YAML section": (lambda s, t: ["--config", write(t / "sections.yaml", "parallel:\n  seed: 7\n")],
                                      "unknown key 'parallel.seed'; the parallel section takes"),
}


def write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("case", list(BAD_INPUTS))
@pytest.mark.parametrize("script", SCRIPTS, ids=IDS)
def test_bad_input_is_one_line_exit_2_and_nothing_written(tmp_path, monkeypatch, capsys, script, case):
    monkeypatch.chdir(tmp_path)  # a default run directory would appear under ./runs
    make_args, message = BAD_INPUTS[case]
    args = make_args(script, tmp_path)
    out_dir = [] if "--output-dir" in args else ["--output-dir", str(tmp_path / "never")]
    # The env-id cases keep the tiny settings' other flags; CartPole stands in for the mode's env.
    argv = [*script.tiny, *out_dir, *args]
    try:
        status = load_main(script)(argv)
    except SystemExit as err:
        status = err.code
    err = capsys.readouterr().err.strip()
    assert status == 2, err
    assert message in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "never").exists() and not (tmp_path / "runs").exists()


@pytest.mark.parametrize("script", SCRIPTS, ids=IDS)
def test_validate_only_writes_nothing(tmp_path, monkeypatch, capsys, script):
    """--validate-only checks everything a run would (the script's default env too: the market history, the
    self-play game, the grid) and leaves the directory it ran in as it was."""
    monkeypatch.chdir(tmp_path)  # default paths (runs/..., the market cache) are relative to it
    for argv in (["--validate-only"], [*script.tiny, "--validate-only"]):
        assert load_main(script)(argv) == 0, capsys.readouterr().err
        assert "env_id:" in capsys.readouterr().out
        assert list(tmp_path.iterdir()) == [], argv
