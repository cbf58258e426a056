"""Shared test helpers: run a script as a user would, and check nothing is left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
SHM = Path("/dev/shm")
# Children of a run that are not its workers: multiprocessing's resource tracker and the plotter
# (common/plots.py), told apart by their command lines.
HELPERS = ("resource_tracker", "common.plots")


def script_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return env


def run_script(script: str, *args: str, timeout: float = 120, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run ``python <script> args`` to completion; returns the CompletedProcess (text output)."""
    return subprocess.run([sys.executable, str(ROOT / script), *map(str, args)], cwd=cwd or ROOT,
                          env=script_env(), capture_output=True, text=True, timeout=timeout)


def start_script(script: str, *args: str, cwd: Path | None = None, env: dict | None = None) -> subprocess.Popen:
    """Start a script in its own process group (as a terminal would), output to pipes."""
    return subprocess.Popen([sys.executable, str(ROOT / script), *map(str, args)], cwd=cwd or ROOT,
                            env={**script_env(), **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def wait_for_file(path: Path, timeout: float, proc: subprocess.Popen | None = None) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            return True
        if proc is not None and proc.poll() is not None:
            return path.exists()
        time.sleep(0.1)
    return False


def descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def kill_tree(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(10)


def _creator(segment: str) -> int:
    """The pid in a ``prl_<pid>_<what>`` name (segments of other live programs are not ours to judge)."""
    try:
        return int(segment.split("_")[1])
    except (IndexError, ValueError):
        return -1


class ProcessTreeWatch:
    """Every pid this test process's tree held while the test ran, sampled every 0.25 s.

    With ``pytest -n`` another worker's test runs beside this one: a segment whose creator has died
    is then this test's leftover only if the creator was one of this test's processes."""

    def __init__(self):
        self.seen = {os.getpid()}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(0.25):
            try:
                self.seen.update(c.pid for c in descendants(os.getpid()))
            except psutil.Error:  # a child that vanished while it was read: the next sample sees the rest
                pass

    def stop(self) -> set[int]:
        self._stop.set()
        self._thread.join()
        return self.seen


def _ours(name: str, mine: set[int], seen: set[int] | None) -> bool:
    creator = _creator(name)
    if creator in mine:
        return True
    if psutil.pid_exists(creator):
        return False  # another live program's (another test worker's, under pytest -n)
    return seen is None or creator in seen  # a dead creator: ours when alone, or when it was in our tree


@pytest.fixture(autouse=True)
def no_leftovers():
    """Every test must leave no new /dev/shm/prl_* segment and no child process behind."""
    before = {p.name for p in SHM.glob("prl_*")} if SHM.is_dir() else set()
    watch = ProcessTreeWatch() if os.environ.get("PYTEST_XDIST_WORKER") else None
    yield
    seen = watch.stop() if watch is not None else None
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        mine = {os.getpid()} | {c.pid for c in psutil.Process().children(recursive=True)}
        left = {name for name in (({p.name for p in SHM.glob("prl_*")} if SHM.is_dir() else set()) - before)
                if _ours(name, mine, seen)}
        children = [c for c in psutil.Process().children(recursive=True) if c.status() != psutil.STATUS_ZOMBIE
                    and "resource_tracker" not in " ".join(c.cmdline())]
        if not left and not children:
            return
        time.sleep(0.2)
    for name in left:
        (SHM / name).unlink(missing_ok=True)
    for child in children:
        child.kill()
    assert not left, f"shared-memory segments left behind: {sorted(left)}"
    assert not children, f"processes left behind: {[c.pid for c in children]}"


def tensorboard_tags(tb_dir) -> set[str]:
    """Scalar tags of every event file under ``tb_dir`` (CleanRL's names, as dashboards expect)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags = set()
    for events in tb_dir.rglob("events.out.tfevents.*"):
        accumulator = EventAccumulator(str(events), size_guidance={"scalars": 0})
        accumulator.Reload()
        tags |= set(accumulator.Tags()["scalars"])
    return tags
