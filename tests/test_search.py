"""launch_parallel_training.py --search: Optuna studies over a script's config fields (docs/search.md).

Short CartPole-v1 searches with train_parallel_timed.py, a few seconds a run: trials as run directories,
the best trial's YAML taken by --config, two processes on one study, pruning, Ctrl+C and the same command
continuing the study, trials at once from the launcher's plan, and the one-line refusals."""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
import yaml
from conftest import ROOT, kill_tree, run_script, script_env, start_script, wait_for_file
from optuna.storages.journal import JournalFileBackend
from optuna.trial import TrialState

import launch_parallel_training as launcher
from common import system
from common.launcher.search import MAX_SHORTFALL, last_mean, read_rows, run_score

LAUNCHER = "launch_parallel_training.py"
# A CartPole run of a few seconds: the sequential loop (no worker processes), small rollouts, no TensorBoard.
QUICK = {"env_id": "CartPole-v1", "num_workers": 0, "num_envs_per_worker": 8, "n_steps": 64, "batch_size": 256,
         "hidden_sizes": [32, 32], "gamma": 0.99, "total_timesteps": 8_000, "duration": None,
         "target_return": "none", "tensorboard": False, "log_interval_s": 0.2}


def search_file(tmp_path: Path, name: str = "search", **spec) -> Path:
    """A search file of quick CartPole trials into ``tmp_path/<name>/``; ``spec`` overrides its keys."""
    settings = {**QUICK, **spec.pop("settings", {})}
    data = {"script": "train_parallel_timed.py", "settings": settings,
            "ranges": {"learning_rate": {"low": 0.003, "high": 0.03, "log": True}, "n_epochs": {"low": 2, "high": 4}},
            "objective": "final_return", "trials": 2, "trials_at_once": 1, "pruner": "none",
            "output_dir": str(tmp_path / name), **spec}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def wait_for_rows(run_dir: Path, rows: int, proc: subprocess.Popen, timeout: float = 90) -> None:
    """Until the run has written ``rows`` rows of metrics.csv (it is training), or the search has ended."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        metrics = run_dir / "metrics.csv"
        if metrics.is_file() and len(metrics.read_text().splitlines()) > rows:
            return
        time.sleep(0.2)


def load_study(tmp_path: Path, name: str = "search"):
    """The study of the search file ``name``, in its default SQLite database."""
    return optuna.load_study(study_name=name, storage=f"sqlite:///{tmp_path / name / 'study.db'}")


def test_a_search_runs_trials_as_run_directories_and_writes_the_best_as_a_config(tmp_path):
    """Two trials of two seeds each, the median of their final returns; a flag of the script's passed to every run."""
    path = search_file(tmp_path, trials=2, seeds=2, aggregate="median",
                       ranges={"learning_rate": {"low": 0.003, "high": 0.03, "log": True},
                               "hidden_sizes": {"choices": [[32, 32], [16]]}})
    result = run_script(LAUNCHER, "--search", str(path), "--gamma", "0.98", timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    study = load_study(tmp_path)
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 2
    for t in study.trials:  # each run an ordinary run directory; the trial's value the median over its seeds
        run_dirs = [tmp_path / "search" / f"trial_{t.number:04d}" / f"seed_{seed}" for seed in (1, 2)]
        assert t.user_attrs["run_dirs"] == [str(d) for d in run_dirs] and t.user_attrs["exit_codes"] == [0, 0]
        summaries = [json.loads((d / "summary.json").read_text()) for d in run_dirs]
        assert [s["seed"] for s in summaries] == [1, 2]
        # The summary's final mean, or (a summary without one) the last mean metrics.csv holds.
        finals = [s["final_mean_return"] if s["final_mean_return"] is not None
                  else last_mean(read_rows(d / "metrics.csv")) for s, d in zip(summaries, run_dirs)]
        assert t.user_attrs["scores"] == {"1": finals[0], "2": finals[1]}
        assert t.value == pytest.approx(statistics.median(finals))
        config = yaml.safe_load((run_dirs[0] / "config.yaml").read_text())
        assert config["hidden_sizes"] == json.loads(t.params["hidden_sizes"]) and config["gamma"] == 0.98
        assert t.user_attrs["settings"]["hidden_sizes"] == config["hidden_sizes"]
    best_file = tmp_path / "search" / "best.yaml"
    best = yaml.safe_load(best_file.read_text())
    assert best["learning_rate"] == study.best_params["learning_rate"]
    assert best["hidden_sizes"] == json.loads(study.best_params["hidden_sizes"])
    assert f"--config {best_file} --gamma 0.98" in best_file.read_text()  # its comment: the command that runs it

    taken = run_script("train_parallel_timed.py", "--config", str(best_file), "--total-timesteps", "2000",
                       "--output-dir", str(tmp_path / "again"), timeout=120)
    assert taken.returncode == 0, taken.stderr
    assert yaml.safe_load((tmp_path / "again" / "config.yaml").read_text())["learning_rate"] == best["learning_rate"]

    trial_runs = [str(tmp_path / "search" / f"trial_{n:04d}" / "seed_1") for n in range(2)]
    compared = run_script("compare_results.py", *trial_runs, "--output", str(tmp_path / "compared"), timeout=120)
    assert compared.returncode == 0, compared.stderr
    assert (tmp_path / "compared" / "comparison_report.txt").is_file()
    played = subprocess.run([sys.executable, "-m", "common.evaluate",
                             study.best_trial.user_attrs["run_dirs"][0], "--episodes", "2", "--json"],
                            cwd=ROOT, env=script_env(), capture_output=True, text=True, timeout=120)
    assert played.returncode == 0, played.stderr
    assert json.loads(played.stdout)["episodes"] == 2


def test_two_processes_add_trials_to_one_study(tmp_path):
    """Two searching processes (as on two machines) share one study through an Optuna journal file."""
    journal = f"journal:{tmp_path / 'shared.journal'}"
    procs = [start_script(LAUNCHER, "--search", str(search_file(tmp_path, "shared", trials=4,
                                                                  settings={"total_timesteps": 6000})),
                          "--storage", journal, "--search-dir", str(tmp_path / f"machine{i}"))
             for i in range(2)]
    try:
        outputs = [p.communicate(timeout=180)[0] for p in procs]
    finally:
        for p in procs:
            kill_tree(p)
    assert [p.returncode for p in procs] == [0, 0], outputs
    study = optuna.load_study(study_name="shared", storage=optuna.storages.JournalStorage(
        JournalFileBackend(str(tmp_path / "shared.journal"))))
    complete = [t for t in study.trials if t.state == TrialState.COMPLETE]
    assert len(complete) >= 4 and len(study.trials) == len(complete)
    searchers = {t.user_attrs["searcher"] for t in complete}
    assert searchers == {f"{os.uname().nodename}:{p.pid}" for p in procs}
    assert len({t.number for t in complete}) == len(complete)  # one number, one trial directory each


@pytest.mark.parametrize("pruner", ["median", "successive_halving"])
def test_a_hopeless_trial_is_pruned_from_its_own_metrics(tmp_path, pruner):
    """A good trial first, then one whose step size cannot learn: the pruner stops the second with SIGINT, from the
    mean returns its metrics.csv shows, and its run exits as after Ctrl+C (130, with a checkpoint). The budget is
    one a quiet machine does not finish between two of the pruner's reads."""
    path = search_file(tmp_path, trials=2, pruner=pruner, prune_every_steps=1000, prune_warmup_steps=0,
                       prune_startup_trials=1, settings={"total_timesteps": 60_000},
                       ranges={"learning_rate": {"low": 1e-6, "high": 0.03, "log": True}},
                       enqueue=[{"learning_rate": 0.02}, {"learning_rate": 1e-6}])
    result = run_script(LAUNCHER, "--search", str(path), timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    good, hopeless = load_study(tmp_path).trials
    assert good.state == TrialState.COMPLETE and good.params["learning_rate"] == 0.02
    assert hopeless.state == TrialState.PRUNED and hopeless.params["learning_rate"] == 1e-6
    assert hopeless.user_attrs["exit_codes"] == [130]
    run_dir = tmp_path / "search" / "trial_0001" / "seed_1"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stop_reason"] == "interrupted" and summary["global_step"] < 60_000
    assert any((run_dir / "checkpoints").iterdir())
    assert f"trial 1 pruned at {hopeless.user_attrs['pruned_at_step']} env steps" in result.stdout


def test_ctrl_c_stops_the_study_and_the_same_command_continues_it(tmp_path):
    path = search_file(tmp_path, trials=1, settings={"total_timesteps": 50_000},
                       enqueue=[{"learning_rate": 0.01, "n_epochs": 3}])
    run_dir = tmp_path / "search" / "trial_0000" / "seed_1"
    first = start_script(LAUNCHER, "--search", str(path))
    try:
        wait_for_rows(run_dir, 3, first)
        os.kill(first.pid, signal.SIGINT)  # the search alone, as a terminal's Ctrl+C reaches it
        output = first.communicate(timeout=60)[0]
    finally:
        kill_tree(first)
    assert first.returncode == 130, output
    stopped = json.loads((run_dir / "summary.json").read_text())
    assert stopped["exit_code"] == 130 and stopped["global_step"] < 50_000
    trials = load_study(tmp_path).trials
    assert [t.state for t in trials] == [TrialState.FAIL, TrialState.WAITING]
    assert trials[0].user_attrs["interrupted"] and trials[1].user_attrs["continues"] == 0
    assert trials[0].params == {"learning_rate": 0.01, "n_epochs": 3}

    again = run_script(LAUNCHER, "--search", str(path), timeout=180)
    assert again.returncode == 0, again.stdout + again.stderr
    trials = load_study(tmp_path).trials
    assert [t.state for t in trials] == [TrialState.FAIL, TrialState.COMPLETE]
    # a step budget: the interrupted run continued from its checkpoint, in its own directory
    assert trials[1].user_attrs["run_dirs"] == [str(run_dir)]
    finished = json.loads((run_dir / "summary.json").read_text())
    assert finished["exit_code"] == 0 and finished["resumed_from"] and finished["global_step"] >= 50_000
    assert (tmp_path / "search" / "best.yaml").is_file()
    assert trials[1].params == trials[0].params  # and the enqueued trial, in the study already, was not queued again
    # once the study has its trials, the same command has nothing left to do
    done = run_script(LAUNCHER, "--search", str(path), timeout=60)
    assert done.returncode == 0 and "started" not in done.stdout and len(load_study(tmp_path).trials) == 2


def test_search_hours_stops_the_trials_and_queues_them_again(tmp_path):
    """The search's own deadline stops its trials as Ctrl+C does; a trial whose runs have a duration (hours per
    invocation) is queued to start again, not to continue."""
    path = search_file(tmp_path, trials=1, search_hours=0.001, settings={"total_timesteps": None, "duration": 0.01})
    result = run_script(LAUNCHER, "--search", str(path), timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "search_hours 0.001 reached" in result.stdout
    stopped, queued = load_study(tmp_path).trials
    assert stopped.state == TrialState.FAIL and stopped.user_attrs["interrupted"]
    assert queued.state == TrialState.WAITING and queued.user_attrs == {"continues": 0}


def test_no_trial_outlives_its_search(tmp_path):
    """kill -9 of the search: each of its runs gets SIGTERM and ends as it does on SIGTERM (a checkpoint, 143)."""
    run_dir = tmp_path / "search" / "trial_0000" / "seed_1"
    search = start_script(LAUNCHER, "--search", str(search_file(tmp_path, trials=1,
                                                                settings={"total_timesteps": 1_000_000})))
    try:
        wait_for_rows(run_dir, 3, search)
        search.kill()
        search.wait(10)
        assert wait_for_file(run_dir / "summary.json", 60)
    finally:
        kill_tree(search)
    time.sleep(0.5)  # the summary is written whole (renamed into place); the exit follows it
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["exit_code"] == 143 and summary["global_step"] < 1_000_000
    assert any((run_dir / "checkpoints").iterdir())


def test_a_study_whose_every_trial_failed_exits_1(tmp_path):
    """Each range's ends pass the script's checks alone, but not together: the trial fails, with the run's line."""
    path = search_file(tmp_path, trials=1, ranges={"n_steps": {"choices": [64, 96]},
                                                   "batch_size": {"choices": [256, 512]}},
                       enqueue=[{"n_steps": 96, "batch_size": 512}])
    result = run_script(LAUNCHER, "--search", str(path), timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    (failed,) = load_study(tmp_path).trials
    assert failed.state == TrialState.FAIL and not failed.user_attrs.get("interrupted")
    assert failed.user_attrs["failure"].startswith("seed 1 exited 2: error: --batch-size 512: must divide")
    assert not (tmp_path / "search" / "best.yaml").exists()


def test_time_to_target_counts_training_seconds_and_scores_a_miss_by_how_close_it_came():
    rows = [{"wall_time": "1.0", "global_step": "100", "return_mean100": ""},
            {"wall_time": "2.0", "global_step": "200", "return_mean100": "150"},
            {"wall_time": "3.0", "global_step": "300", "return_mean100": "210"},
            {"wall_time": "4.0", "global_step": "400", "return_mean100": "190"}]
    assert run_score(rows, "time_to_target", 200.0) == 3.0  # the first row at the target
    assert run_score(rows[:2], "time_to_target", 200.0) == pytest.approx(2.0 * (1 + 50 / 200))  # 50 short
    assert run_score(rows[:1], "time_to_target", 200.0) == pytest.approx(1.0 * (1 + MAX_SHORTFALL))  # no mean yet
    stopped_at_target = {"stop_reason": "target return 200 reached (mean of the last 100 episodes)",
                         "wall_time_s": 2.5, "final_mean_return": 200.5}
    assert run_score(rows[:2], "time_to_target", 200.0, stopped_at_target) == 2.5
    assert run_score(rows, "final_return", 200.0) == 190.0
    assert run_score(rows, "final_return", 200.0, stopped_at_target) == 200.5
    episodes = [{"wall_time": "1", "episodes": "2", "episodic_return": "10"},  # fewer than 100 episodes: all of them
                {"wall_time": "2", "episodes": "5", "episodic_return": "20"}]
    assert run_score(episodes, "final_return", None) == pytest.approx((2 * 10 + 3 * 20) / 5)


def dry_run(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        status = launcher.main(list(argv) + ["--dry-run"])
    finally:
        os.environ.pop(system.ASSUME_ENV, None)
        system.forget_machine()
    out, err = capsys.readouterr()
    return status, out, err


def test_trials_at_once_come_from_the_launchers_plan(tmp_path, capsys):
    """One core per sequential run, one per worker (lockstep) otherwise; K seeds share a trial's runs."""
    facts = str(ROOT / "configs" / "machines" / "desktop_16thread_cpu.json")
    path = search_file(tmp_path, trials_at_once="auto")
    assert dry_run(capsys, "--search", str(path), "--assume-facts", facts)[1].count("16 at once") == 1
    assert "4 at once" in dry_run(capsys, "--search", str(path), "--assume-facts", facts, "--seeds", "4")[1]
    workers = search_file(tmp_path, "workers", trials_at_once="auto",
                          ranges={"num_workers": {"low": 1, "high": 4}})  # sized for the most workers searched
    assert "4 at once" in dry_run(capsys, "--search", str(workers), "--assume-facts", facts)[1]
    assert not (tmp_path / "search").exists()  # a dry run writes nothing


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("search_*.yaml")), ids=lambda p: p.stem)
def test_every_search_file_the_project_ships_plans(capsys, path):
    status, out, err = dry_run(capsys, "--search", str(path))
    assert status == 0 and f"search {path.stem}: train_parallel_timed.py" in out, err


@pytest.mark.parametrize("change, message", [
    ({"ranges": {"learning_rat": {"low": 0.001, "high": 0.01}}}, "ranges.learning_rat: not a field of the script"),
    ({"ranges": {"learning_rate": {"low": 0.01, "high": 0.001}}}, "low 0.01 must be below high 0.001"),
    ({"ranges": {"learning_rate": {"low": 0.0, "high": 0.01, "log": True}}}, "a log range needs low > 0"),
    ({"ranges": {"n_epochs": {"low": 0, "high": 4}}}, "ranges.n_epochs: --n-epochs 0: must be > 0"),
    ({"ranges": {"hidden_sizes": {"low": 16, "high": 64}}}, "a list field is searched over choices"),
    ({"ranges": {"n_epochs": {"low": 2, "high": 4.5}}}, "an integer field needs integer low, high and step"),
    ({"ranges": {"learning_rate": {"low": 0.001, "high": 0.01, "log": True, "step": 0.001}}}, "excludes log"),
    ({"ranges": {"activation": {"choices": []}}}, "ranges.activation: choices must be a non-empty list"),
    ({"ranges": {"seed": {"low": 1, "high": 9}}}, "ranges.seed: a trial's seeds are --seeds K"),
    ({"objective": "fastest"}, "objective 'fastest': must be time_to_target or final_return"),
    ({"objective": "time_to_target"}, "objective time_to_target needs target_return"),
    ({"objective": "time_to_target", "settings": {"target_return": "auto"},
      "ranges": {"target_return": {"choices": ["100", "200"]}}}, "time_to_target needs one target for every trial"),
    ({"trials_per_hour": 3}, "unknown key 'trials_per_hour'"),
    ({"settings": {"output_dir": "x"}}, "output_dir: set by the search"),
])
def test_a_bad_search_file_is_refused_in_one_line(tmp_path, capsys, change, message):
    status, out, err = dry_run(capsys, "--search", str(search_file(tmp_path, **change)))
    assert status == 2 and out == ""
    assert err.count("\n") == 1 and message in err, err


def test_search_flags_without_search_and_a_missing_optuna_are_refused_in_one_line(tmp_path, capsys):
    status, _, err = dry_run(capsys, "--trials", "3")
    assert status == 2 and err == "error: --trials needs --search FILE.yaml\n"
    status, _, err = dry_run(capsys, "--search", str(search_file(tmp_path)), "--mode", "dqn")
    assert status == 2 and err.count("\n") == 1 and "--mode does not apply" in err
    for flag in ("--seed", "--learning-rate"):  # what the search sets for each run
        status, _, err = dry_run(capsys, "--search", str(search_file(tmp_path)), flag, "3")
        assert status == 2 and err.count("\n") == 1 and f"{flag}: set by the search for each run" in err
    status = launcher.main(["--search", str(search_file(tmp_path)), "--storage", "journal:/proc/no/such/study.log"])
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1 and err.startswith("error: storage journal:/proc/no/such/study.log")
    assert not (tmp_path / "search").exists()
    hidden = tmp_path / "no_optuna" / "optuna"  # an optuna that cannot be imported, first on the path
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text("raise ImportError('no optuna here')\n")
    env = {**script_env(), "PYTHONPATH": f"{hidden.parent}{os.pathsep}{script_env()['PYTHONPATH']}"}
    result = subprocess.run([sys.executable, LAUNCHER, "--search", str(search_file(tmp_path))], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr == "error: --search needs optuna: pip install -r requirements-tracking.txt\n"
