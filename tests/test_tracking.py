"""--track mlflow|wandb (common/tracking.py, docs/tracking.md).

Against a real MLflow tracking server (``mlflow server`` on localhost with a SQLite backend, one per
module): a run's config, its metrics.csv under TensorBoard's tags and its results read back through
MlflowClient, and a resume that continues the same run. From Python, in one process each: a run without
--track imports neither library; MLflow's local store; a population's members nested under its run; W&B
offline, its resume and its population. Under torchrun only rank 0 logs. Refusals before anything starts.
"""

from __future__ import annotations

import csv
import json
import logging
import os
import signal
import struct
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import psutil
import pytest
from conftest import ROOT, script_env, tensorboard_tags
from multinode import free_port

from common.tracking import Tracker, check_tracking, tracked_metrics

TIMED = ["--env-id", "CartPole-v1", "--num-workers", "0", "--num-envs-per-worker", "4", "--n-steps", "32",
         "--batch-size", "64", "--target-return", "none"]
MLFLOW = Path(sys.executable).with_name("mlflow")


def rows(run_dir: Path) -> list[dict[str, str]]:
    with open(run_dir / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def run_tracked(script: str, *args, env: dict[str, str], timeout: float = 150, cwd: Path = ROOT):
    result = subprocess.run([sys.executable, str(ROOT / script), *map(str, args)], cwd=cwd,
                            env={**script_env(), **env}, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """``mlflow server`` with a SQLite backend on a free localhost port; its URI."""
    root = tmp_path_factory.mktemp("mlflow_server")
    port = free_port()
    # A shell that exits at once starts it in its own session: it is then no child of this test process, which
    # the leftover check (conftest.no_leftovers) would take for a process a run left behind. It is stopped here.
    # Without the job runner (MLflow's GenAI jobs, which nothing here uses) it starts twice as fast.
    server = (f'exec setsid "{MLFLOW}" server --backend-store-uri "sqlite:///{root}/mlflow.db" '
              f'--artifacts-destination "{root}/artifacts" --host 127.0.0.1 --port {port} --workers 1 '
              f'> "{root}/server.log" 2>&1')
    started = subprocess.run(["sh", "-c", f"({server}) & echo $!"], capture_output=True, text=True, check=True,
                             env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}, cwd=root)
    pid = int(started.stdout)
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=2) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                pass
            assert psutil.pid_exists(pid), (root / "server.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the MLflow server did not start in 180 s"
            time.sleep(0.5)
        yield uri
    finally:
        stop_group(pid)


def stop_group(pid: int) -> None:
    """SIGTERM to the server's process group (its uvicorn worker too), SIGKILL after 15 s."""
    for sig, wait_s in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if not any(p.info["pid"] for p in psutil.process_iter(["pid"]) if _in_group(p, pid)):
                return
            time.sleep(0.2)


def _in_group(process: psutil.Process, group: int) -> bool:
    try:
        return os.getpgid(process.pid) == group and process.status() != psutil.STATUS_ZOMBIE
    except (ProcessLookupError, psutil.Error):
        return False


# ------------------------------------------------------------------------ MLflow, on a real server

@pytest.mark.timeout(400)
def test_a_run_on_the_server_logs_config_metrics_results_and_resume_continues_it(mlflow_server, tmp_path):
    from mlflow import MlflowClient

    run_dir, env = tmp_path / "run", {"MLFLOW_TRACKING_URI": mlflow_server, "MLFLOW_EXPERIMENT_NAME": "timed"}
    run_tracked("train_parallel_timed.py", *TIMED, "--total-timesteps", 512, "--track", "mlflow",
                "--output-dir", run_dir, env=env)
    client = MlflowClient(mlflow_server)
    state = json.loads((run_dir / "tracking.json").read_text())["mlflow"]
    assert state["tracking_uri"] == mlflow_server
    run = client.get_run(state["run_id"])
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    assert client.get_experiment(run.info.experiment_id).name == "timed"  # MLFLOW_EXPERIMENT_NAME
    assert f"tracking: MLflow run {run.info.run_id} (run), experiment " in (run_dir / "logs" / "main.log").read_text()
    # The config as parameters.
    assert run.data.params["env_id"] == "CartPole-v1" and run.data.params["total_timesteps"] == "512"
    assert run.data.params["track"] == "mlflow" and run.data.params["n_steps"] == "32"
    # metrics.csv's scalars under TensorBoard's tags, each row at its global_step.
    assert set(run.data.metrics) == tensorboard_tags(run_dir / "tb")
    assert {"charts/SPS", "charts/episodic_return", "losses/value_loss", "prl/cpu_percent"} <= set(run.data.metrics)
    first = rows(run_dir)
    history = client.get_metric_history(run.info.run_id, "charts/SPS")
    assert [m.step for m in history] == [int(r["global_step"]) for r in first]
    assert [m.value for m in history] == pytest.approx([float(r["sps"]) for r in first], rel=1e-5)
    # The summary, the plots and the checkpoint common.evaluate plays, as artifacts.
    assert {a.path for a in client.list_artifacts(run.info.run_id)} == {
        "summary.json", "config.yaml", "plots", "checkpoints"}
    assert [a.path for a in client.list_artifacts(run.info.run_id, "plots")] == ["plots/training_curve.png"]
    assert [a.path for a in client.list_artifacts(run.info.run_id, "checkpoints")] == ["checkpoints/latest.pt"]
    summary = client.download_artifacts(run.info.run_id, "summary.json", str(tmp_path))
    assert json.loads(Path(summary).read_text()) == json.loads((run_dir / "summary.json").read_text())

    # --resume continues the same tracked run: its steps go on, its parameters stay the first start's. The YAML
    # key is the flag's field.
    (tmp_path / "track.yaml").write_text("training:\n  track: mlflow\n")
    run_tracked("train_parallel_timed.py", *TIMED, "--total-timesteps", 1024, "--config", tmp_path / "track.yaml",
                "--output-dir", run_dir, "--resume", "auto", env=env)
    assert json.loads((run_dir / "tracking.json").read_text())["mlflow"]["run_id"] == run.info.run_id
    assert [r.info.run_id for r in client.search_runs([run.info.experiment_id])] == [run.info.run_id]
    both = rows(run_dir)
    assert len(both) > len(first) and int(both[-1]["global_step"]) == 1024
    history = client.get_metric_history(run.info.run_id, "charts/SPS")
    assert [m.step for m in history] == [int(r["global_step"]) for r in both]
    resumed = client.get_run(run.info.run_id)
    assert resumed.info.status == "FINISHED" and resumed.data.params["total_timesteps"] == "512"


# ------------------------------------------------------------------------ from Python, one process each

MLFLOW_PROGRAM = """
import json, os, sys

import train_parallel_timed, train_ppo_multiprocess

if __name__ == "__main__":
    out, timed, population = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
    train_parallel_timed.train(**timed, output_dir=f"{out}/plain")
    print(json.dumps({"imported": sorted(m for m in ("mlflow", "wandb") if m in sys.modules)}), flush=True)
    # MLflow's local store: no MLFLOW_TRACKING_URI, the working directory's runs/mlflow.db.
    summary = train_parallel_timed.train(**timed, output_dir=f"{out}/local", track="mlflow")
    assert summary["exit_code"] == 0, summary
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{out}/population.db"
    summary = train_ppo_multiprocess.train(**population, output_dir=f"{out}/population", track="mlflow")
    assert summary["exit_code"] == 0, summary
"""

WANDB_PROGRAM = """
import json, sys

import train_parallel_timed, train_ppo_multiprocess

if __name__ == "__main__":
    out, timed, population = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
    for total, resume in ((512, None), (1024, "auto")):
        summary = train_parallel_timed.train(**{**timed, "total_timesteps": total}, output_dir=f"{out}/timed",
                                             track="wandb", resume=resume)
        assert summary["exit_code"] == 0, summary
    summary = train_ppo_multiprocess.train(**population, output_dir=f"{out}/population", track="wandb")
    assert summary["exit_code"] == 0, summary
"""

TIMED_FIELDS = {"env_id": "CartPole-v1", "num_workers": 0, "num_envs_per_worker": 4, "n_steps": 32, "batch_size": 64,
                "target_return": None, "total_timesteps": 512}
POPULATION_FIELDS = {"env_id": "CartPole-v1", "num_workers": 2, "num_envs_per_worker": 4, "n_steps": 32,
                     "batch_size": 64, "device": "cpu", "target_return": None, "eval_episodes": 2,
                     "max_steps_per_worker": 256, "tensorboard": False}


def run_program(program: str, tmp_path: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    path = tmp_path / "program.py"
    path.write_text(textwrap.dedent(program))
    clean = {k: v for k, v in script_env().items() if not k.startswith(("MLFLOW_", "WANDB_"))}
    result = subprocess.run([sys.executable, str(path), str(tmp_path), json.dumps(TIMED_FIELDS),
                             json.dumps(POPULATION_FIELDS)], cwd=tmp_path, env={**clean, **env},
                            capture_output=True, text=True, timeout=280)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.mark.timeout(300)
def test_no_track_imports_neither_the_local_store_and_a_population_nested_in_mlflow(tmp_path):
    from mlflow import MlflowClient

    result = run_program(MLFLOW_PROGRAM, tmp_path, {})
    assert json.loads(result.stdout.splitlines()[0]) == {"imported": []}
    assert not (tmp_path / "plain" / "tracking.json").exists()
    # The local store: runs/mlflow.db in the working directory, artifacts in runs/mlartifacts/.
    local = MlflowClient(f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    run = local.get_run(json.loads((tmp_path / "local" / "tracking.json").read_text())["mlflow"]["run_id"])
    assert run.info.status == "FINISHED" and local.get_experiment(run.info.experiment_id).name == "train_parallel_timed"
    steps = [m.step for m in local.get_metric_history(run.info.run_id, "charts/SPS")]
    assert steps == [int(r["global_step"]) for r in rows(tmp_path / "local")]
    assert run.info.artifact_uri.startswith((tmp_path / "runs" / "mlartifacts").as_uri())
    assert {a.path for a in local.list_artifacts(run.info.run_id)} >= {"summary.json", "plots", "checkpoints"}
    # A population: one run per member, nested under the population's run, each at its own steps.
    client = MlflowClient(f"sqlite:///{tmp_path / 'population.db'}")
    state = json.loads((tmp_path / "population" / "tracking.json").read_text())["mlflow"]
    parent = client.get_run(state["run_id"])
    assert parent.info.status == "FINISHED" and sorted(state["members"]) == ["0", "1"]
    assert [a.path for a in client.list_artifacts(parent.info.run_id) if a.path == "best.pt"] == ["best.pt"]
    population_rows = rows(tmp_path / "population")
    for member, run_id in state["members"].items():
        child = client.get_run(run_id)
        assert child.data.tags["mlflow.parentRunId"] == parent.info.run_id and child.info.status == "FINISHED"
        assert child.info.run_name == f"population/worker_{member}"
        steps = [m.step for m in client.get_metric_history(run_id, "prl/worker_sps")]
        assert steps == [int(r["worker_step"]) for r in population_rows if r["worker"] == member]
    assert len(client.get_metric_history(parent.info.run_id, "prl/worker_sps")) == len(population_rows)


def wandb_records(path: Path):
    """The records of a W&B transaction log (``run-<id>.wandb``): blocks of 32 KiB after a 7-byte header,
    each record in chunks of checksum, length, type (1 whole, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2

    data, pos, pending = path.read_bytes(), 7, b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def wandb_history(offline_dir: Path) -> list[dict]:
    history = []
    for record in wandb_records(next(offline_dir.glob("run-*.wandb"))):
        if record.WhichOneof("record_type") == "history":
            history.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                            for item in record.history.item})
    return history


def wandb_run_record(offline_dir: Path):
    records = wandb_records(next(offline_dir.glob("run-*.wandb")))
    return next(r.run for r in records if r.WhichOneof("record_type") == "run")


@pytest.mark.timeout(300)
def test_wandb_offline_writes_its_files_resume_continues_the_run_and_a_population_groups_its_members(tmp_path):
    run_program(WANDB_PROGRAM, tmp_path, {"WANDB_MODE": "offline"})
    timed = tmp_path / "timed"
    run_id = json.loads((timed / "tracking.json").read_text())["wandb"]["run_id"]
    # The first start and its resume: two offline directories of the same W&B run (wandb sync uploads both).
    offline = sorted((timed / "wandb").glob("offline-run-*"))
    assert len(offline) == 2 and all(d.name.endswith(f"-{run_id}") for d in offline)
    history = [row for d in offline for row in wandb_history(d)]
    assert [row["global_step"] for row in history] == [int(r["global_step"]) for r in rows(timed)]
    assert {"charts/SPS", "charts/episodic_return", "losses/value_loss", "prl/cpu_percent"} <= set(history[-1])
    first = wandb_run_record(offline[0])
    assert first.project == "train_parallel_timed" and first.display_name == "timed"
    assert json.loads(next(i.value_json for i in first.config.update if i.key == "n_steps")) == 32
    files = offline[-1] / "files"
    assert {p.relative_to(files).as_posix() for p in files.rglob("*") if p.is_file()} >= {
        "summary.json", "config.yaml", "plots/training_curve.png", "checkpoints/latest.pt"}
    # A population: one W&B run per member, in the population's group, beside the population's own.
    population = tmp_path / "population"
    state = json.loads((population / "tracking.json").read_text())["wandb"]
    runs = {d.name.rsplit("-", 1)[1]: d for d in (population / "wandb").glob("offline-run-*")}
    assert sorted(runs) == sorted([state["run_id"], *state["members"].values()])
    for member, member_id in state["members"].items():
        record = wandb_run_record(runs[member_id])
        assert (record.run_group, record.job_type, record.display_name) == (
            "population", "member", f"population/worker_{member}")
        steps = [row["global_step"] for row in wandb_history(runs[member_id])]
        assert steps == [int(r["worker_step"]) for r in rows(population) if r["worker"] == member]
    assert wandb_run_record(runs[state["run_id"]]).run_group == "population"


@pytest.mark.timeout(200)
def test_under_torchrun_only_rank_0_logs(tmp_path):
    run_dir = tmp_path / "dd"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(ROOT / "train_parallel_timed.py"), *TIMED, "--num-workers", "1", "--no-tensorboard",
               "--total-timesteps", "1024", "--track", "wandb", "--output-dir", str(run_dir)]
    result = subprocess.run(command, env={**script_env(), "WANDB_MODE": "offline"}, capture_output=True, text=True,
                            timeout=180)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    offline = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(offline) == 1
    assert [row["global_step"] for row in wandb_history(offline[0])] == [int(r["global_step"]) for r in rows(run_dir)]


# ------------------------------------------------------------------------ refusals, before anything starts

def test_a_missing_package_is_refused_in_one_line_naming_the_requirements_file(tmp_path):
    run_dir = tmp_path / "run"
    program = ("import runpy, sys; sys.modules['wandb'] = None; sys.argv = sys.argv[1:]; "
               "runpy.run_path(sys.argv[0], run_name='__main__')")
    result = subprocess.run([sys.executable, "-c", program, str(ROOT / "train_parallel_timed.py"), *TIMED,
                             "--track", "wandb", "--output-dir", str(run_dir)], cwd=ROOT, env=script_env(),
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr == ("error: --track 'wandb': wandb is not installed: "
                             "pip install -r requirements-tracking.txt\n")
    assert not run_dir.exists()


@pytest.mark.parametrize("track, env, says", [
    ("mlflow", {"MLFLOW_TRACKING_URI": "http://127.0.0.1:{port}"}, "cannot reach the MLflow tracking server at "
                                                                   "http://127.0.0.1:{port} (MLFLOW_TRACKING_URI)"),
    ("wandb", {"WANDB_BASE_URL": "http://127.0.0.1:{port}"}, "cannot reach W&B at http://127.0.0.1:{port}"),
    ("tensorboard", {}, "must be mlflow or wandb or none"),
])
def test_an_unknown_tracker_or_a_server_out_of_reach_is_refused_before_anything_is_written(monkeypatch, tmp_path,
                                                                                          track, env, says):
    import train_parallel_timed

    port = free_port()  # nothing listens there
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)  # online: W&B's server must answer
    for key, value in env.items():
        monkeypatch.setenv(key, value.format(port=port))
    with pytest.raises(ValueError) as refused:
        train_parallel_timed.train(**TIMED_FIELDS, track=track, output_dir=str(tmp_path / "run"))
    message = str(refused.value)
    assert message.startswith(f"--track {track!r}: ") and says.format(port=port) in message and "\n" not in message
    assert not (tmp_path / "run").exists()


def test_the_local_store_needs_sqlalchemy(monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setitem(sys.modules, "sqlalchemy", None)  # as if not installed: find_spec answers None
    with pytest.raises(ValueError, match="sqlalchemy is not installed: pip install -r requirements-tracking.txt"):
        check_tracking("mlflow")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:1")
    with pytest.raises(ValueError, match="cannot reach the MLflow tracking server"):  # a server needs no SQLAlchemy
        check_tracking("mlflow")


# ------------------------------------------------------------------------ tags, and a failure mid-run

def test_rows_go_under_tensorboards_tags():
    row = {"global_step": 640, "wall_time": 2.5, "episodic_return": 21.0, "episodic_length": 21.0, "sps": 900.0,
           "loss": 0.5, "q_mean": 3.0, "value_loss": 0.1, "return_mean100": float("nan"), "flag": True,
           "params_hash": "ab:ab", "policy_lag": 1}
    assert tracked_metrics(row) == {"prl/wall_time": 2.5, "charts/episodic_return": 21.0,
                                    "charts/episodic_length": 21.0, "charts/SPS": 900.0, "losses/td_loss": 0.5,
                                    "losses/q_values": 3.0, "losses/value_loss": 0.1, "prl/policy_lag": 1.0}


def test_a_store_that_fails_after_the_start_is_logged_once_and_the_run_goes_on(monkeypatch, tmp_path, caplog):
    (tmp_path / "a_file").write_text("")  # the store's directory cannot be made: a file is in the way
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/a_file/mlflow.db")
    log = logging.getLogger("prl.test_tracking")
    tracker = Tracker("mlflow", "test", tmp_path, {"a": 1}, None, log)
    with caplog.at_level(logging.ERROR, logger="prl.test_tracking"):
        for step in range(3):
            tracker.log_row({"global_step": step, "sps": 1.0})
        tracker.end(0)
        tracker.close()
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and errors[0].startswith("tracking with mlflow stopped, the run goes on: "), errors
    assert not (tmp_path / "tracking.json").exists()


def test_the_tracked_run_ends_with_the_runs_exit_status(monkeypatch, tmp_path):
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    for exit_code, status in ((0, "FINISHED"), (130, "KILLED"), (1, "FAILED")):
        run_dir = tmp_path / str(exit_code)
        run_dir.mkdir()
        tracker = Tracker("mlflow", "test", run_dir, {"learning_rate": 0.01}, None, logging.getLogger("prl.test"))
        tracker.log_row({"global_step": 64, "sps": 10.0})
        tracker.end(exit_code)
        run = MlflowClient(uri).get_run(json.loads((run_dir / "tracking.json").read_text())["mlflow"]["run_id"])
        assert run.info.status == status and run.data.params == {"learning_rate": "0.01"}
        assert run.data.metrics == {"charts/SPS": 10.0}


def test_the_cost_per_row_is_measured_for_each_tracker(tmp_path):
    env = {k: v for k, v in script_env().items() if not k.startswith(("MLFLOW_", "WANDB_"))}
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_tracking.py"), "--rows", "40", "--block",
                             "10"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    cost = json.loads(result.stdout.splitlines()[-1])
    assert set(cost) == {"none", "mlflow", "wandb"} and all(c["loop_us"] > 0 for c in cost.values())
    assert cost["mlflow"]["sent_us"] > 0 and cost["none"]["sent_us"] is None
    assert list(tmp_path.iterdir()) == []  # its stores and runs were temporary
