"""Run directories, log files, metrics.csv + TensorBoard, and progress display.

Layout of a run directory (DESIGN.md): ``config.yaml``, ``logs/main.log``,
``logs/worker_<i>.log``, ``metrics.csv``, ``tb/``, ``checkpoints/``, ``plots/``,
``summary.json``. ``metrics.csv`` starts with the columns every mode shares so that
``compare_results.py`` and a spreadsheet can read any run.
"""

from __future__ import annotations

import csv
import fcntl
import itertools
import json
import logging
import math
import os
import socket
import sys
import time
from collections import deque
from datetime import datetime
from pathlib import Path
from typing import Any

CORE_COLUMNS = ["wall_time", "global_step", "episodes", "episodic_return", "episodic_length", "sps"]
EXIT_LOCKED = 3
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def default_run_dir(script: str, env_id: str, seed: int) -> Path:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("runs") / script / f"{env_id.replace('/', '_')}__{seed}__{stamp}"


class RunLock:
    """An exclusive ``flock`` on ``<run_dir>/.lock``; a second run in the same directory exits 3."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / ".lock"
        self._fd: int | None = None

    def acquire(self, create: bool = True) -> bool:
        """Take the lock; False if another process holds it. ``create=False`` only tests an existing file."""
        self._fd = os.open(self.path, os.O_RDWR | (os.O_CREAT if create else 0), 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            self._fd = None
            return False
        if create:
            os.ftruncate(self._fd, 0)
            os.write(self._fd, f"{os.getpid()}\n".encode())
        return True

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def setup_logging(path: Path, logger_name: str = "prl", console: bool = False,
                  level: int = logging.INFO) -> logging.Logger:
    """Log to ``path`` (appending, so a resumed run keeps its history) and optionally stderr."""
    root = logging.getLogger(logger_name.split(".")[0])
    root.setLevel(level)
    for handler in list(root.handlers):
        root.removeHandler(handler)
        handler.close()
    file_handler = logging.FileHandler(path, mode="a")
    file_handler.setFormatter(logging.Formatter(LOG_FORMAT))
    root.addHandler(file_handler)
    if console:
        stream = logging.StreamHandler(sys.stderr)
        stream.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
        root.addHandler(stream)
    root.propagate = False
    return logging.getLogger(logger_name)


def close_log_files(logger: logging.Logger) -> None:
    """Detach and close the handlers :func:`setup_logging` gave ``logger``'s root (a run called from
    Python ends with nothing of it left behind)."""
    root = logging.getLogger(logger.name.split(".")[0])
    for handler in list(root.handlers):
        root.removeHandler(handler)
        handler.close()


class MetricsWriter:
    """Appends rows to ``metrics.csv`` and mirrors every numeric value to TensorBoard.

    TensorBoard tags are CleanRL's (``charts/episodic_return`` and ``charts/episodic_length``
    once per finished episode, ``charts/SPS``, ``losses/value_loss`` ...), so dashboards made
    for CleanRL or Stable-Baselines3 runs read these too; this project's own columns go under
    ``prl/``. On resume the CSV is reopened in append mode and TensorBoard continues at the
    saved ``global_step``, so curves continue instead of restarting.
    """

    def __init__(self, run_dir: Path, extra_columns: list[str], tensorboard: bool = True,
                 filename: str = "metrics.csv", tb_subdir: str = "tb", tracker: Any = None):
        self.tracker = tracker  # --track: every row to MLflow or W&B too (common.tracking.Tracker)
        self.columns = CORE_COLUMNS + [c for c in extra_columns if c not in CORE_COLUMNS]
        self.path = Path(run_dir) / filename
        new_file = not self.path.exists() or self.path.stat().st_size == 0
        if not new_file:
            with open(self.path, newline="") as f:
                header = next(csv.reader(f), [])
            if header:
                self.columns = header + [c for c in self.columns if c not in header]
        self._file = open(self.path, "a", newline="")
        self._csv = csv.DictWriter(self._file, fieldnames=self.columns, extrasaction="ignore")
        if new_file:
            self._csv.writeheader()
            self._file.flush()
        # The writer is made at the first value written, not here: a script starts its workers first.
        self._tb_dir = Path(run_dir) / tb_subdir if tensorboard else None
        self._tb = None

    def _board(self):
        """The TensorBoard writer, made on first use; None without TensorBoard."""
        if self._tb is None and self._tb_dir is not None:
            self._tb = ScalarBoard(self._tb_dir)
        return self._tb

    def write(self, row: dict[str, Any], member: tuple[int, int] | None = None) -> None:
        """One row; ``member``: (index, its own step) of the population member the row is about."""
        clean = {k: _csv_value(v) for k, v in row.items()}
        self._csv.writerow(clean)
        self._file.flush()
        board = self._board()
        if board is not None:
            scalars = {}
            for key, value in row.items():
                tag = TB_TAGS.get(key, f"prl/{key}")
                if tag and isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                    scalars[tag] = value
            board.add_scalars(scalars, int(row.get("global_step", 0)))
        if self.tracker is not None:
            self.tracker.log_row(row, member)

    def episode(self, global_step: int, episodic_return: float, episodic_length: int) -> None:
        """One finished episode, in TensorBoard (metrics.csv has their mean per row)."""
        board = self._board()
        if board is not None:
            board.add_scalars({"charts/episodic_return": episodic_return, "charts/episodic_length": episodic_length},
                              global_step)

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()
        if self._tb is not None:
            self._tb.close()
        self._tb, self._tb_dir = None, None
        if self.tracker is not None:
            self.tracker.close()


class ScalarBoard:
    """TensorBoard scalars in an event file written by tensorboard's own record writer, in the caller's
    thread, without importing torch, which a run that learns in numpy never needs otherwise (1.4 s of
    its start on 2 cores).

    torch's ``SummaryWriter`` (through tensorboard's ``EventFileWriter``) hands every scalar to a writer
    thread through a queue 10 deep, so a training loop blocks on it and pays a thread switch per
    scalar: 0.6 s for the 4,600 scalars of a CartPole run to 475, where writing them costs 0.07 s. Here
    one event holds every scalar of a metrics row (TensorBoard reads each value of an event as its own
    scalar), and the file is flushed at most every ``FLUSH_INTERVAL_S`` seconds and at the end.
    """

    FLUSH_INTERVAL_S = 5.0
    _made = itertools.count()  # one process may write several boards in the same second

    def __init__(self, log_dir: Path):
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.record_writer import RecordWriter

        self._event, self._summary = Event, Summary
        log_dir = Path(log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        # The name EventFileWriter gives (TensorBoard finds files by the "events.out.tfevents" part).
        made = next(ScalarBoard._made)
        name = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}.{made}"
        self._file = open(log_dir / name, "wb")
        self._records = RecordWriter(self._file)
        self._write(Event(wall_time=time.time(), file_version="brain.Event:2"))
        self.flush()

    def add_scalars(self, values: dict[str, float], step: int) -> None:
        """One event at ``step`` holding a scalar per tag."""
        if values:
            summary = self._summary(value=[self._summary.Value(tag=tag, simple_value=float(value))
                                           for tag, value in values.items()])
            self._write(self._event(wall_time=time.time(), step=int(step), summary=summary))
            if time.monotonic() >= self._next_flush:
                self.flush()

    def _write(self, event: Any) -> None:
        self._records.write(event.SerializeToString())

    def flush(self) -> None:
        self._file.flush()
        self._next_flush = time.monotonic() + self.FLUSH_INTERVAL_S

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


def _csv_value(value: Any) -> Any:
    if isinstance(value, float):
        return "" if math.isnan(value) else f"{value:.6g}"
    return value


# metrics.csv column -> TensorBoard tag, as CleanRL names them; None: not mirrored (per-episode
# values are written by MetricsWriter.episode, and the step is the x axis already).
TB_TAGS: dict[str, str | None] = {
    "global_step": None, "episodic_return": None, "episodic_length": None, "sps": "charts/SPS",
    "learning_rate": "charts/learning_rate", "epsilon": "charts/epsilon", "return_mean100": "charts/return_mean100",
    "value_loss": "losses/value_loss", "policy_loss": "losses/policy_loss", "entropy": "losses/entropy",
    "approx_kl": "losses/approx_kl", "old_approx_kl": "losses/old_approx_kl", "clipfrac": "losses/clipfrac",
    "explained_variance": "losses/explained_variance", "loss": "losses/td_loss", "q_mean": "losses/q_values",
}


def read_metrics(path: str | Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def write_summary(run_dir: Path, summary: dict[str, Any]) -> None:
    tmp = Path(run_dir) / ".summary.json.tmp"
    tmp.write_text(json.dumps(summary, indent=2, default=str))
    os.replace(tmp, Path(run_dir) / "summary.json")


class Progress:
    """A tqdm bar when stderr is a terminal; otherwise one plain log line per interval.

    Cron jobs and CI logs then get readable lines instead of carriage-return noise.
    """

    def __init__(self, total: float | None, unit: str, logger: logging.Logger,
                 interval_s: float = 10.0, initial: float = 0):
        self.logger = logger
        self.interval_s = interval_s
        self._last_log = 0.0
        self._bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=initial, unit=unit, dynamic_ncols=True, leave=True)
        self.total, self.unit, self.done = total, unit, initial

    def update(self, done: float, fields: dict[str, Any]) -> None:
        text = "  ".join(f"{k}={_fmt(v)}" for k, v in fields.items())
        if self._bar is not None:
            self._bar.update(done - self.done)
            self._bar.set_postfix_str(text, refresh=False)
        elif time.monotonic() - self._last_log >= self.interval_s:
            self._last_log = time.monotonic()
            self.logger.info("%s %s  %s", self.unit, of_budget(done, self.total) if self.total else int(done), text)
        self.done = done

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


class RecentRate:
    """How fast a count grew over about the last ``span_s`` seconds: steadier than one metrics row's
    window, and current, unlike the mean since the start (the progress display's episodes per second)."""

    def __init__(self, span_s: float, count: float = 0):
        self.span_s = span_s
        self.marks: deque[tuple[float, float]] = deque([(time.monotonic(), count)])

    def update(self, count: float, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        self.marks.append((now, count))
        while len(self.marks) > 2 and now - self.marks[1][0] >= self.span_s:
            self.marks.popleft()
        then, count_then = self.marks[0]
        return (count - count_then) / (now - then) if now > then else 0.0


def of_budget(done: float, total: float) -> str:
    """``45000/100000 (45.0%)``: how much of a budget is done."""
    return f"{int(done)}/{int(total)} ({100 * done / total:.1f}%)"


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e4 else f"{value:.0f}"
    return str(value)
