"""Experiment tracking, ``--track mlflow|wandb``: the run in MLflow or Weights & Biases as well.

What a tracked run gets (docs/tracking.md): its config as parameters at its first start; every row of
``metrics.csv`` as scalars under TensorBoard's tags (``charts/SPS``, ``losses/value_loss`` ...,
``prl/<column>``; the row's mean ``episodic_return`` as ``charts/episodic_return``), at its
``global_step``; at the end ``summary.json``, ``config.yaml``, ``plots/`` and the checkpoint
``common.evaluate`` plays, as artifacts. ``--resume`` continues the same tracked run: its id is kept in
the run directory's ``tracking.json``. A population logs one run per member, nested under the
population's run (in W&B, grouped with it). Only the process that writes ``metrics.csv`` logs (rank 0
under torchrun).

:func:`check_tracking` refuses, before anything starts, a library that is not installed and a server that
cannot be reached. Neither library is imported without ``--track``; with it, :class:`Tracker` imports and
opens the tracked run in a thread while the run starts its workers, and logs asynchronously in MLflow's
case, so that a metrics row costs the training loop little (``python -m common.tracking`` measures it).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import threading
import time
from pathlib import Path
from typing import Any

from common.config import ConfigError

TRACKERS = ("mlflow", "wandb")
REQUIREMENTS = "requirements-tracking.txt"
# MLflow without MLFLOW_TRACKING_URI: one store for every run started in this directory (so that MLflow's UI
# compares them), inside runs/ beside the runs themselves, which git ignores; MLflow's own default would put
# mlflow.db and mlruns/ in the working directory, the repository's root.
DEFAULT_MLFLOW_STORE = Path("runs", "mlflow.db")
DEFAULT_MLFLOW_ARTIFACTS = Path("runs", "mlartifacts")
STATE_FILE = "tracking.json"  # the tracked runs' ids, for --resume
REACH_TIMEOUT_S = 5.0
WANDB_LOCAL_MODES = ("offline", "disabled", "dryrun")
# metrics.csv's per-row means, which TensorBoard gets once per episode instead (common.runlog.TB_TAGS).
ROW_TAGS = {"episodic_return": "charts/episodic_return", "episodic_length": "charts/episodic_length"}


# ------------------------------------------------------------------------ before anything starts

def check_tracking(track: str | None) -> None:
    """Refuse ``--track`` (ConfigError, one line) when its library is not installed or its server cannot
    be reached. Reads the import system's finders and asks the server over plain HTTP: neither library
    is imported here."""
    if track is None:
        return
    uri = mlflow_uri() if track == "mlflow" else ""
    server = uri.startswith(("http://", "https://"))
    # MLflow's database stores (the local runs/mlflow.db, any sqlite:// or other database URI) are SQLAlchemy's.
    database = uri.partition("://")[0].partition("+")[0] in ("sqlite", "postgresql", "mysql", "mssql")
    needed = (track, "sqlalchemy", "alembic") if database else (track,)
    missing = [name for name in needed if importlib.util.find_spec(name) is None]
    if missing:
        raise ConfigError("track", track, f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not "
                                          f"installed: pip install -r {REQUIREMENTS}")
    if server:
        _reach(uri.rstrip("/") + "/health", f"the MLflow tracking server at {uri} (MLFLOW_TRACKING_URI)", track)
    elif track == "wandb" and os.environ.get("WANDB_MODE", "online").lower() not in WANDB_LOCAL_MODES:
        base = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")
        _reach(base, f"W&B at {base} (WANDB_MODE=offline logs locally, wandb sync uploads later)", track,
               any_answer=True)


def _reach(url: str, what: str, track: str, any_answer: bool = False) -> None:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=REACH_TIMEOUT_S):
            return
    except urllib.error.HTTPError as err:
        if any_answer:
            return  # it answered: the server is there
        reason = f"it answered HTTP {err.code}"
    except (urllib.error.URLError, OSError) as err:
        reason = str(getattr(err, "reason", err))
    raise ConfigError("track", track, f"cannot reach {what}: {reason}")


def mlflow_uri() -> str:
    """MLFLOW_TRACKING_URI, or the project's local store (``runs/mlflow.db`` in the working directory)."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{DEFAULT_MLFLOW_STORE.resolve()}"


def tracked_metrics(row: dict[str, Any]) -> dict[str, float]:
    """A metrics.csv row's finite numbers under TensorBoard's tags (the step is the x axis, not a scalar)."""
    from common.runlog import TB_TAGS

    out = {}
    for key, value in row.items():
        tag = ROW_TAGS.get(key) or TB_TAGS.get(key, f"prl/{key}")
        if tag and isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out[tag] = float(value)
    return out


def result_files(run_dir: Path) -> list[Path]:
    """What the end of a run uploads, each to its place in the run directory: summary.json, config.yaml, the
    plots, and the checkpoint ``python -m common.evaluate RUN_DIR`` plays (a population's best.pt)."""
    from common.evaluate import EvaluationError, find_checkpoint

    files = [run_dir / name for name in ("summary.json", "config.yaml") if (run_dir / name).is_file()]
    files += sorted((run_dir / "plots").glob("*.png"))
    try:
        files.append(find_checkpoint(run_dir))
    except EvaluationError:
        pass
    return files


# ------------------------------------------------------------------------ the tracked run

class Tracker:
    """The run's tracked run, and its members' under a population.

    Opened in a thread from construction (importing MLflow takes seconds), while rows wait in a list. A
    failure after the start (the server gone, the disk full) is logged once and the run goes on untracked:
    tracking is never worth failing a training run, as a plot is not.
    """

    def __init__(self, track: str, script: str, run_dir: Path, params: dict[str, Any], resumed_from: Path | None,
                 log: logging.Logger):
        self.track, self.run_dir, self.log = track, Path(run_dir), log
        self.backend = MLflowBackend() if track == "mlflow" else WandbBackend()
        state = read_state(self.run_dir, resumed_from) if resumed_from is not None else {}
        self.state = state.get(track, {})  # only a resumed run continues its tracked run
        self.broken: str | None = None
        self.ended = False
        self._waiting: list[tuple[dict, tuple[int, int] | None]] = []
        self._thread = threading.Thread(target=self._open, args=(script, params), name="prl-tracking",
                                        daemon=True)
        self._thread.start()

    def _open(self, script: str, params: dict[str, Any]) -> None:
        try:
            self.state = self.backend.open(script, self.run_dir, params, self.state)
            self._save_state()
            self.log.info("tracking: %s", self.backend.where())
        except Exception as err:
            self.broken = f"{type(err).__name__}: {err}"

    def end_opening(self) -> None:
        """Wait until the tracked run is open; RuntimeError if it could not be."""
        self._thread.join()
        if self.broken:
            raise RuntimeError(f"cannot open the tracked run: {self.broken}")

    def _usable(self) -> bool:
        self._thread.join()
        if self.broken and not self.ended:
            self.log.error("tracking with %s stopped, the run goes on: %s", self.track, self.broken.splitlines()[0])
            self.ended = True
        return not self.ended

    def _guard(self, action, *args) -> None:
        try:
            action(*args)
        except Exception as err:
            self.broken = f"{type(err).__name__}: {err}"
            self._usable()

    def log_row(self, row: dict[str, Any], member: tuple[int, int] | None = None) -> None:
        """One metrics.csv row at its global_step; ``member``: (index, its own step), also to that member's run.
        Rows that come while the tracked run is still opening wait for it in a list, not the training loop."""
        if self._thread.is_alive():
            self._waiting.append((row, member))
            return
        waiting, self._waiting = self._waiting, []
        for earlier in waiting:
            self._log_row(*earlier)
        self._log_row(row, member)

    def _log_row(self, row: dict[str, Any], member: tuple[int, int] | None) -> None:
        if not self._usable():
            return
        metrics = tracked_metrics(row)
        self._guard(self.backend.log, None, metrics, int(row.get("global_step", 0)))
        if member is not None and not self.ended:
            index, step = member
            if str(index) not in self.state.setdefault("members", {}):
                self._guard(self._add_member, index)
            if not self.ended:
                self._guard(self.backend.log, index, metrics, int(step))

    def _add_member(self, index: int) -> None:
        self.state["members"][str(index)] = self.backend.open_member(index, self.state["members"].get(str(index)))
        self._save_state()

    def end(self, exit_code: int) -> None:
        """The rows still waiting, the artifacts, then the tracked runs end with the run's exit status."""
        self._thread.join()
        waiting, self._waiting = self._waiting, []
        for row, member in waiting:
            self._log_row(row, member)
        if self._usable():
            self._guard(self.backend.end, result_files(self.run_dir), exit_code, self.run_dir)
        self.ended = True

    def close(self) -> None:
        """At the very end, also where :meth:`end` was not reached: the tracked runs end as failed."""
        if not self.ended:
            self.end(1)

    def _save_state(self) -> None:
        path = self.run_dir / STATE_FILE
        saved = json.loads(path.read_text()) if path.is_file() else {}
        saved[self.track] = self.state
        tmp = path.with_name(f".{STATE_FILE}.tmp")
        tmp.write_text(json.dumps(saved, indent=2))
        os.replace(tmp, path)


def read_state(run_dir: Path, resumed_from: Path) -> dict:
    """The tracked runs to continue: this run directory's tracking.json, or that of the checkpoint's own."""
    from common.run_setup import checkpoint_run_dir

    for directory in (run_dir, checkpoint_run_dir(resumed_from)):
        try:
            return json.loads((directory / STATE_FILE).read_text())
        except (OSError, ValueError):  # none there, or not readable: look on, else start a new tracked run
            continue
    return {}


class MLflowBackend:
    """MLflow through its client (no global active run: a notebook's own runs stay untouched). Metrics are
    logged asynchronously: a row costs the training loop a queue put, MLflow's thread sends it."""

    def open(self, script: str, run_dir: Path, params: dict[str, Any], state: dict) -> dict:
        from mlflow import MlflowClient
        from mlflow.entities import Param

        self.uri = mlflow_uri()
        if self.uri.startswith("sqlite:///") and "MLFLOW_TRACKING_URI" not in os.environ:
            DEFAULT_MLFLOW_STORE.parent.mkdir(parents=True, exist_ok=True)
        self.client = MlflowClient(tracking_uri=self.uri)
        self.name, self.pending = run_dir.name, {}
        self.run_id = state.get("run_id") if state.get("tracking_uri") == self.uri else None
        logged: dict[str, str] = {}
        if self.run_id is not None:
            self.experiment_id = state["experiment_id"]
            self.client.update_run(self.run_id, status="RUNNING")
            logged = self.client.get_run(self.run_id).data.params
        else:
            self.experiment_id = self._experiment(os.environ.get("MLFLOW_EXPERIMENT_NAME") or script)
            self.run_id = self.client.create_run(self.experiment_id, run_name=self.name, tags={
                "script": script, "run_dir": str(run_dir.resolve())}).info.run_id
        # Parameters are the first start's: MLflow refuses a changed value; config.yaml (an artifact) has the latest.
        new = [Param(key, str(value)[:6000]) for key, value in params.items() if key not in logged]
        for first in range(0, len(new), 100):  # MLflow takes 100 parameters a call
            self.client.log_batch(self.run_id, params=new[first:first + 100])
        self.members = {}
        return {"tracking_uri": self.uri, "experiment_id": self.experiment_id, "run_id": self.run_id,
                "members": dict(state.get("members", {})) if state.get("run_id") == self.run_id else {}}

    def _experiment(self, name: str) -> str:
        from mlflow.exceptions import MlflowException

        found = self.client.get_experiment_by_name(name)
        if found is not None:
            return found.experiment_id
        local = "MLFLOW_TRACKING_URI" not in os.environ
        try:
            return self.client.create_experiment(
                name, artifact_location=DEFAULT_MLFLOW_ARTIFACTS.resolve().as_uri() if local else None)
        except MlflowException:  # another run created it first
            return self.client.get_experiment_by_name(name).experiment_id

    def where(self) -> str:
        return f"MLflow run {self.run_id} ({self.name}), experiment {self.experiment_id}, at {self.uri}"

    def open_member(self, index: int, run_id: str | None) -> str:
        if run_id is not None:
            self.client.update_run(run_id, status="RUNNING")
        else:
            run_id = self.client.create_run(self.experiment_id, run_name=f"{self.name}/worker_{index}", tags={
                "mlflow.parentRunId": self.run_id, "member": str(index)}).info.run_id
        self.members[index] = run_id
        return run_id

    def log(self, member: int | None, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        run_id = self.run_id if member is None else self.members[member]
        now = int(time.time() * 1000)
        self.pending[run_id] = self.client.log_batch(
            run_id, metrics=[Metric(key, value, now, step) for key, value in metrics.items()], synchronous=False)

    def flush(self) -> None:
        for operations in self.pending.values():  # MLflow's queue is in order: each run's last batch is its end
            operations.wait()
        self.pending = {}

    def end(self, files: list[Path], exit_code: int, run_dir: Path) -> None:
        self.flush()
        for path in files:
            folder = path.parent.relative_to(run_dir).as_posix()
            self.client.log_artifact(self.run_id, str(path), None if folder == "." else folder)
        status = "FINISHED" if exit_code == 0 else "KILLED" if exit_code in (130, 143) else "FAILED"
        for run_id in [*self.members.values(), self.run_id]:
            self.client.set_terminated(run_id, status)


class WandbBackend:
    """W&B, each tracked run its own (``reinit="create_new"``: a population's members beside their
    population's run). Files go to the run directory's ``wandb/`` unless WANDB_DIR says where."""

    def open(self, script: str, run_dir: Path, params: dict[str, Any], state: dict) -> dict:
        import wandb

        self.wandb, self.name, self.members = wandb, run_dir.name, {}
        self.project = os.environ.get("WANDB_PROJECT") or script
        self.dir = None if os.environ.get("WANDB_DIR") else str(run_dir)
        self.run = self._init(state.get("run_id"), name=self.name, config=None if state.get("run_id") else params,
                              tags=[script])
        return {"run_id": self.run.id, "project": self.project,
                "members": dict(state.get("members", {})) if state.get("run_id") == self.run.id else {}}

    def _init(self, run_id: str | None, **kwargs):
        # Grouped by the run directory's name, so that a population's members sit with their population.
        run = self.wandb.init(project=self.project, dir=self.dir, id=run_id, resume="allow" if run_id else None,
                              group=self.name, reinit="create_new",
                              settings=self.wandb.Settings(console="off", silent=True, x_disable_stats=True), **kwargs)
        run.define_metric("global_step")
        run.define_metric("*", step_metric="global_step")  # resumed rows may repeat steps: no monotonic _step
        return run

    def where(self) -> str:
        return f"W&B run {self.run.id} ({self.name}), project {self.project}, in {self.run.dir}"

    def open_member(self, index: int, run_id: str | None) -> str:
        run = self._init(run_id, name=f"{self.name}/worker_{index}", job_type="member",
                         config=None if run_id else {"member": index})
        self.members[index] = run
        return run.id

    def log(self, member: int | None, metrics: dict[str, float], step: int) -> None:
        (self.run if member is None else self.members[member]).log({**metrics, "global_step": step})

    def flush(self) -> None:
        pass  # run.log hands the row to W&B's service process, which writes it

    def end(self, files: list[Path], exit_code: int, run_dir: Path) -> None:
        import contextlib
        import io

        with contextlib.redirect_stderr(io.StringIO()):  # run.save warns, for each file, that it symlinked it
            for path in files:
                self.run.save(str(path), base_path=str(run_dir), policy="now")
        for run in [*self.members.values(), self.run]:
            run.finish(exit_code=exit_code)
