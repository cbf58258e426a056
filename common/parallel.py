"""Worker-process lifecycle shared by every mode: start, watch, report, restart, stop.

Workers are started with the ``spawn`` method (safe with CUDA), run a module-level
entry point, ignore SIGINT (the coordinator decides when to stop), exit on their own
when their parent dies, and send their traceback to the coordinator before dying.
Pipes carry small control messages only; big arrays travel through shared memory.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any

log = logging.getLogger("prl.parallel")
CONTEXT = mp.get_context("spawn")
POLL_S = 0.5  # how often an idle worker checks that its parent is still alive


class WorkerDied(RuntimeError):
    """A worker exited, crashed or raised; ``reason`` holds its traceback or signal."""

    def __init__(self, index: int, reason: str):
        self.index, self.reason = index, reason
        super().__init__(f"worker {index} died: {reason}")


class TooManyRestarts(RuntimeError):
    pass


# ---------------------------------------------------------------- worker side

def init_worker_process(torch_threads: int) -> None:
    """First call in every worker: ignore Ctrl+C and size torch's thread pool."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import torch

    torch.set_num_threads(max(1, torch_threads))
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set by an earlier parallel op
        pass


class ParentWatch:
    """Tells a worker that its parent died (it was re-parented), so it can exit on its own."""

    def __init__(self):
        self.parent_pid = os.getppid()

    def parent_alive(self) -> bool:
        return os.getppid() == self.parent_pid


def receive(conn: Connection, watch: ParentWatch, poll_s: float = POLL_S) -> tuple[str, Any]:
    """Block for the next ``(command, payload)``; exit quietly once the parent is gone."""
    while True:
        if not watch.parent_alive():
            os._exit(0)
        try:
            if conn.poll(poll_s):
                return conn.recv()
        except (EOFError, OSError):  # the parent closed its end: nothing more will come
            os._exit(0)


def worker_main(target: Callable[..., None], index: int, conn: Connection, *args: Any) -> None:
    """Entry point of every worker process: runs ``target(index, conn, *args)`` and reports a crash."""
    try:
        target(index, conn, *args)
    except Exception:
        try:
            conn.send(("error", traceback.format_exc()))
        except (OSError, EOFError, BrokenPipeError):
            pass
        sys.exit(1)


# ---------------------------------------------------------- coordinator side

def describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            return f"killed by signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exited with status {exitcode}"


class WorkerHandle:
    def __init__(self, index: int, process: mp.process.BaseProcess, conn: Connection):
        self.index, self.process, self.conn = index, process, conn
        self.restarts = 0


class WorkerPool:
    """A fixed set of worker processes, each with a pipe, restarted when they die.

    ``args_for(index)`` gives a worker's arguments after ``(index, conn)``; it is called
    again on restart, so a restarted worker gets current state (e.g. shared-memory specs).
    """

    def __init__(self, target: Callable[..., None], num_workers: int,
                 args_for: Callable[[int], tuple], max_restarts: int = 3, name: str = "worker"):
        self.target, self.args_for, self.name = target, args_for, name
        self.max_restarts = max_restarts
        self.workers: dict[int, WorkerHandle] = {}
        self.num_workers = num_workers
        self.total_restarts = 0
        self._closed = False
        # Replies that arrived during a gather interrupted by another worker's death are
        # kept here, so the next gather does not wait for a message already received.
        self._inbox: dict[int, tuple[str, Any]] = {}

    def _spawn(self, index: int) -> WorkerHandle:
        parent_conn, child_conn = CONTEXT.Pipe()
        process = CONTEXT.Process(target=worker_main, name=f"{self.name}-{index}",
                                  args=(self.target, index, child_conn, *self.args_for(index)), daemon=True)
        process.start()
        child_conn.close()
        return WorkerHandle(index, process, parent_conn)

    def start(self) -> None:
        for index in range(self.num_workers):
            self.workers[index] = self._spawn(index)

    def send(self, index: int, command: str, payload: Any = None) -> None:
        try:
            self.workers[index].conn.send((command, payload))
        except (BrokenPipeError, OSError) as err:
            raise WorkerDied(index, self._death_reason(index, f"pipe closed ({err})")) from None

    def broadcast(self, command: str, payload: Any = None) -> None:
        for index in self.workers:
            self.send(index, command, payload)

    def _death_reason(self, index: int, fallback: str) -> str:
        handle = self.workers[index]
        handle.process.join(timeout=1.0)
        reason = describe_exit(handle.process.exitcode) if handle.process.exitcode is not None else fallback
        try:  # a traceback may be waiting in the pipe
            while handle.conn.poll(0):
                command, payload = handle.conn.recv()
                if command == "error":
                    return f"raised an exception:\n{payload}"
        except (EOFError, OSError):
            pass
        return reason

    def gather(self, indices: list[int], expect: str, timeout: float) -> dict[int, Any]:
        """Wait for one ``expect`` reply from each of ``indices``.

        Raises WorkerDied as soon as one of them dies or reports an error, and
        TimeoutError if the replies do not all arrive within ``timeout`` seconds.
        """
        pending = set(indices)
        replies: dict[int, Any] = {}
        for index in list(pending):
            if index in self._inbox and self._inbox[index][0] == expect:
                replies[index] = self._inbox.pop(index)[1]
                pending.discard(index)
        deadline = time.monotonic() + timeout
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"{self.name}s {sorted(pending)} sent no '{expect}' within {timeout:.0f}s")
            waitables = {}
            for index in pending:
                waitables[self.workers[index].conn] = index
                waitables[self.workers[index].process.sentinel] = index
            for ready in wait(list(waitables), timeout=min(remaining, 1.0)):
                index = waitables[ready]
                if index not in pending:
                    continue
                handle = self.workers[index]
                if ready is handle.process.sentinel and not handle.conn.poll(0):
                    raise WorkerDied(index, self._death_reason(index, "exited"))
                try:
                    command, payload = handle.conn.recv()
                except (EOFError, OSError):
                    raise WorkerDied(index, self._death_reason(index, "pipe closed")) from None
                if command == "error":
                    handle.process.join(timeout=5.0)
                    raise WorkerDied(index, f"raised an exception:\n{payload}")
                if command == expect:
                    self._inbox[index] = (command, payload)
                    pending.discard(index)
        for index in indices:
            if index in self._inbox and index not in replies:
                replies[index] = self._inbox.pop(index)[1]
        return replies

    def restart(self, index: int) -> None:
        """Replace a dead worker; raises TooManyRestarts past ``max_restarts`` for that worker."""
        old = self.workers[index]
        if old.restarts >= self.max_restarts:
            raise TooManyRestarts(f"{self.name} {index} died {old.restarts + 1} times; giving up")
        self._reap(old)
        self._inbox.pop(index, None)
        fresh = self._spawn(index)
        fresh.restarts = old.restarts + 1
        self.workers[index] = fresh
        self.total_restarts += 1
        log.warning("restarted %s %d (restart %d of at most %d)", self.name, index, fresh.restarts,
                    self.max_restarts)

    @staticmethod
    def _reap(handle: WorkerHandle, timeout: float = 5.0) -> None:
        if handle.process.is_alive():
            handle.process.terminate()
            handle.process.join(timeout)
        if handle.process.is_alive():
            handle.process.kill()
            handle.process.join(timeout)
        handle.conn.close()

    def stop(self, timeout: float = 10.0) -> None:
        """Ask every worker to close, then terminate and kill stragglers. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        for handle in self.workers.values():
            try:
                handle.conn.send(("close", None))
            except (BrokenPipeError, OSError):
                pass
        deadline = time.monotonic() + timeout
        for handle in self.workers.values():
            handle.process.join(max(0.0, deadline - time.monotonic()))
        for handle in self.workers.values():
            self._reap(handle)

    def pids(self) -> list[int]:
        return [h.process.pid for h in self.workers.values()]


class GracefulExit:
    """First Ctrl+C or SIGTERM asks the run to stop (checkpoint, summary, exit 130/143);
    a second Ctrl+C ends the process at once."""

    def __init__(self, logger: logging.Logger | None = None):
        self.signum: int | None = None
        self.logger = logger or log
        self._previous = {}

    def install(self) -> GracefulExit:
        for signum in (signal.SIGINT, signal.SIGTERM):
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            self.logger.warning("second Ctrl+C: exiting now")
            os._exit(130)
        self.signum = signum
        self.logger.warning("%s received: finishing the current step, saving, then exiting "
                            "(Ctrl+C again to exit at once)", signal.Signals(signum).name)

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def exit_code(self) -> int:
        return 128 + self.signum if self.signum else 0


# The rollout-worker manager lives in common/manager.py; it is importable from here too,
# lazily, because common.manager itself builds on this module.
_MANAGER_NAMES = ("ParallelManager", "WorkerCommunicator", "ModelSynchronizer", "ManagerConfig", "WorkerSpec")


def __getattr__(name: str):
    if name in _MANAGER_NAMES:
        from common import manager

        return getattr(manager, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
