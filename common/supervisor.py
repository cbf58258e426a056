"""Worker processes for every mode, supervised the same way: start, ready, death, restart, stop.

A worker is a ``spawn``-ed process (CUDA-safe) that runs a module-level entry point
``target(link, *args)``; :class:`WorkerLink` is its end of one duplex pipe to the coordinator,
which holds a :class:`Supervisor`. The pipe carries small messages only, ``(kind, payload)``;
big arrays travel through shared memory.

What holds, and why:

- **Either side sees the other die, even halfway through a message.** Each end of a worker's
  pipe is held by exactly one process (the coordinator closes the child's end after the
  start), so a death closes the socket and the survivor reads EOF instead of waiting forever
  for the rest of a message. (A ``multiprocessing.Queue`` does not have this property: every
  process that holds it holds both ends.)
- **A worker dies with its parent**, even when the parent was killed with ``kill -9`` or left
  through a second Ctrl+C: ``PR_SET_PDEATHSIG`` on Linux, and a watcher thread everywhere.
- **Ctrl+C and SIGTERM are the coordinator's to handle.** A terminal sends Ctrl+C to the whole
  process group. Workers are started with both signals ignored (a disposition that survives
  ``exec``), so none dies of it while importing; the coordinator's own handler gets every
  signal, also one that arrives while a worker is being started.
- **Arguments stay small.** ``spawn`` writes them through a 64 KiB pipe while the coordinator
  still holds the child's read end: a big argument and a child that dies early would block
  the coordinator forever. Pass shared-memory specs and plain configs, never weights.
- **The ready handshake cannot be lost.** "ready" is a state of the worker, not a message
  someone must be waiting for; commands sent before it simply wait in the pipe.
- **Every wait is bounded.** A worker not ready within ``start_timeout_s``, or silent for
  ``hang_timeout_s`` once ready (workers send a heartbeat while they wait for commands), is
  killed and handled like any other death: reported with its id and reason (its traceback, or
  the signal or status it died of), restarted with fresh arguments (``args_for(index)`` is
  called again, so a restarted worker gets the current state), at most ``max_restarts`` times.
- **A worker's configuration error is final.** A worker raising :class:`WorkerConfigError`
  cannot succeed by trying again: it is not restarted, and :meth:`Supervisor.poll` raises it.
- **Stopping never blocks.** :meth:`Supervisor.stop` asks ready workers to stop, kills those
  still starting (they have nothing to save), and kills whatever is left after ``grace_s``.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from multiprocessing import resource_tracker
from multiprocessing.connection import Connection, wait
from typing import Any

CONTEXT = mp.get_context("spawn")
BEAT_S = 1.0  # a waiting worker says it is alive at least this often
# Fault drills: PRL_INJECT_FAULT="raise:<worker>:<messages>" makes worker <worker> raise, in its first
# life only, when it sends its <messages>-th message ("hang:..." makes it stop answering instead).
INJECT_ENV = "PRL_INJECT_FAULT"
POLL_S = 0.25  # how often a waiting worker checks that its parent is alive
HELD_SIGNALS = (signal.SIGINT, signal.SIGTERM)
log = logging.getLogger("prl.supervisor")


class WorkerConfigError(RuntimeError):
    """A worker found the run cannot work (a bad setting, an unusable env): restarting cannot help."""


class WorkerFailed(RuntimeError):
    """A worker died and may not be restarted again (``worker`` is its index, ``reason`` why)."""

    def __init__(self, message: str, worker: int = -1, reason: str = ""):
        super().__init__(message)
        self.worker, self.reason = worker, reason


# ---------------------------------------------------------------------------- worker side

class WorkerLink:
    """A worker's end of its pipe: handshake, messages, heartbeat, commands, parent watch."""

    def __init__(self, index: int, conn: Connection, life: int = 0):
        self.index, self.life = index, life  # life: 0 at the first start, +1 at every restart
        self._conn = conn
        self._parent = os.getppid()
        self._last_sent = 0.0
        self._sent = 0
        self._fault = _injected_fault(index, life)
        self.stop_requested = False

    def send(self, kind: str, payload: Any = None) -> None:
        self._sent += 1
        if self._fault and self._sent >= self._fault[1]:
            kind, self._fault = self._fault[0], None
            _act_out(kind, self.index)
        try:
            self._conn.send((kind, payload))
        except (BrokenPipeError, ConnectionError, EOFError, OSError):
            os._exit(0)  # the coordinator is gone; nobody would read anything we do now
        self._last_sent = time.monotonic()

    def ready(self, **info: Any) -> None:
        """Tell the coordinator this worker is set up; ``first_step_time`` (time.time()) if it stepped an env."""
        self.send("ready", {"pid": os.getpid(), **info})

    def beat(self) -> None:
        """Say "alive" if nothing was sent for a second (cheap: call it in any loop)."""
        if time.monotonic() - self._last_sent >= BEAT_S:
            self.send("beat")

    def parent_alive(self) -> bool:
        return os.getppid() == self._parent

    def receive(self, timeout: float | None = None) -> tuple[str, Any] | None:
        """The next command, waiting up to ``timeout`` seconds (None: until one comes).

        Sends heartbeats while waiting and exits quietly once the coordinator is gone. A
        ``stop`` command also sets :attr:`stop_requested`.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if not self.parent_alive():
                os._exit(0)
            self.beat()
            remaining = POLL_S if deadline is None else min(POLL_S, deadline - time.monotonic())
            try:
                if self._conn.poll(max(0.0, remaining)):
                    kind, payload = self._conn.recv()
                    self.stop_requested |= kind == "stop"
                    return kind, payload
            except (EOFError, OSError):  # the coordinator closed its end: nothing more will come
                os._exit(0)
            if deadline is not None and time.monotonic() >= deadline:
                return None

    def commands(self) -> Iterator[tuple[str, Any]]:
        """Every command waiting now, without blocking (and a heartbeat if one is due)."""
        while (message := self.receive(0.0)) is not None:
            yield message


def _injected_fault(index: int, life: int) -> tuple[str, int] | None:
    spec = os.environ.get(INJECT_ENV, "")
    if not spec or life > 0:
        return None
    kind, worker, after = spec.split(":")
    return (kind, int(after)) if int(worker) == index else None


def _act_out(kind: str, index: int) -> None:
    if kind == "raise":
        raise RuntimeError(f"fault injected into worker {index} ({INJECT_ENV})")
    while True:  # "hang": alive, silent, deaf
        time.sleep(3600)


def die_with_parent() -> None:
    """End this process when its parent ends, however the parent ends."""
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
    if os.getppid() != parent:  # the parent died before the kernel was told to watch it
        os._exit(0)


def set_torch_threads(threads: int) -> None:
    """Size torch's thread pools (a worker must not oversubscribe the cores it shares)."""
    import torch

    torch.set_num_threads(max(1, threads))
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set by an earlier parallel op
        pass


def _worker_main(target: Callable[..., None], index: int, life: int, conn: Connection, args: tuple) -> None:
    """Entry point of every worker process."""
    die_with_parent()
    for signum in HELD_SIGNALS:  # already ignored since the start; said again for clarity
        signal.signal(signum, signal.SIG_IGN)
    link = WorkerLink(index, conn, life)
    try:
        target(link, *args)
    except WorkerConfigError as err:
        link.send("error", {"traceback": traceback.format_exc(), "fatal": True, "message": str(err)})
        sys.exit(1)
    except Exception:
        link.send("error", {"traceback": traceback.format_exc()})
        sys.exit(1)
    link.send("done_exit")
    conn.close()
    # Skip the interpreter's teardown (torch's takes seconds on a busy machine): all is sent.
    logging.shutdown()
    os._exit(0)


# ---------------------------------------------------------------------------- coordinator side

@dataclass
class Message:
    """A message from worker ``index``. Besides the worker's own kinds, the supervisor reports
    ``ready`` (payload: the worker's info), ``restarted`` (payload: why it died) and
    ``given_up`` (payload: why; only with ``on_give_up="worker"``)."""

    index: int
    kind: str
    payload: Any = None


@dataclass
class _Worker:
    index: int
    process: Any = None
    conn: Connection | None = None
    restarts: int = 0
    ready: bool = False
    started_at: float = 0.0
    last_heard: float = 0.0
    error: dict | None = None  # the traceback a worker sent before dying
    finished: bool = False  # its target returned: it exits on its own, that is no death
    given_up: bool = False
    killed_for: str | None = None  # why the supervisor killed it (hung, no start-up)
    info: dict = field(default_factory=dict)

    @property
    def alive(self) -> bool:
        return self.process is not None and not self.finished and not self.given_up


def describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            return f"killed by signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exited with status {exitcode}"


@contextmanager
def _signals_held():
    """Start children with Ctrl+C and SIGTERM ignored, and lose none meant for this process.

    A signal arriving in between stays pending (Linux never discards a blocked signal) and
    reaches this process's own handler when the block is lifted.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    resource_tracker.ensure_running()  # its start unblocks these signals; have it done before
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, HELD_SIGNALS)
    handlers = {signum: signal.signal(signum, signal.SIG_IGN) for signum in HELD_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)


class Supervisor:
    """``count`` worker processes running ``target(link, *args_for(index))``; see the module docstring.

    ``on_give_up``: past ``max_restarts`` deaths of one worker, ``"run"`` raises
    :class:`WorkerFailed` (the run cannot go on without it), ``"worker"`` reports a
    ``given_up`` message and carries on with the others.
    """

    def __init__(self, target: Callable[..., None], count: int, args_for: Callable[[int], tuple], *,
                 name: str = "worker", max_restarts: int | None = 3, start_timeout_s: float = 120.0,
                 hang_timeout_s: float | None = 120.0, on_give_up: str = "run",
                 logger: logging.Logger | None = None):
        self.target, self.args_for, self.name = target, args_for, name
        self.max_restarts, self.on_give_up = max_restarts, on_give_up
        self.start_timeout_s, self.hang_timeout_s = start_timeout_s, hang_timeout_s
        self.log = logger or log
        self.workers = {index: _Worker(index) for index in range(count)}
        self.stopping = False
        self._closed = False

    # -- start
    def start(self) -> None:
        for index in self.workers:
            self._spawn(index)
        self.log.info("started %d %s process(es): pids %s", len(self.workers), self.name, self.pids())

    def _spawn(self, index: int) -> None:
        worker = self.workers[index]
        parent_conn, child_conn = CONTEXT.Pipe()
        process = CONTEXT.Process(target=_worker_main, name=f"{self.name}-{index}", daemon=True,
                                  args=(self.target, index, worker.restarts, child_conn, self.args_for(index)))
        with _signals_held():
            process.start()
        child_conn.close()
        now = time.monotonic()
        worker.process, worker.conn = process, parent_conn
        worker.ready = worker.finished = False
        worker.error = worker.killed_for = None
        worker.started_at = worker.last_heard = now

    # -- state
    def pids(self) -> list[int]:
        return [w.process.pid for w in self.workers.values() if w.process is not None]

    @property
    def total_restarts(self) -> int:
        return sum(w.restarts for w in self.workers.values())

    def all_ready(self) -> bool:
        return all(w.ready or not w.alive for w in self.workers.values())

    def live(self) -> list[int]:
        return [i for i, w in self.workers.items() if w.alive]

    # -- messages
    def send(self, index: int, kind: str, payload: Any = None) -> bool:
        """Send a command; False if the worker is gone (its death is handled by the next poll)."""
        worker = self.workers[index]
        if not worker.alive:
            return False
        try:
            worker.conn.send((kind, payload))
            return True
        except (BrokenPipeError, ConnectionError, OSError):
            return False

    def broadcast(self, kind: str, payload: Any = None) -> None:
        for index in self.live():
            self.send(index, kind, payload)

    def poll(self, timeout: float = 0.0) -> list[Message]:
        """Messages that arrived within ``timeout`` seconds; deaths, hangs and start-up deadlines handled.

        Raises WorkerConfigError for a worker's fatal configuration error and WorkerFailed
        when a worker may not be restarted again (``on_give_up="run"``).
        """
        waitables: dict[Any, int] = {}
        for index, worker in self.workers.items():
            if worker.alive:
                waitables[worker.conn] = index
                waitables[worker.process.sentinel] = index
        if not waitables:
            time.sleep(min(timeout, 0.05))
            return []
        ready = wait(list(waitables), timeout=max(0.0, timeout))
        messages: list[Message] = []
        for index in sorted({waitables[r] for r in ready}):
            messages += self._drain(index)
        for index, worker in self.workers.items():
            if worker.alive and not worker.process.is_alive():
                messages += self._drain(index)  # a traceback may still be in the pipe
                if worker.alive:
                    messages += self._died(index)
        self._enforce_deadlines()
        return messages

    def wait_ready(self, stop: Callable[[], bool] = lambda: False) -> list[Message]:
        """Poll until every live worker is ready or ``stop()`` is true; returns what arrived meanwhile."""
        messages: list[Message] = []
        while not self.all_ready() and not stop():
            messages += self.poll(0.1)
        return messages

    def _drain(self, index: int) -> list[Message]:
        worker = self.workers[index]
        out: list[Message] = []
        try:
            while worker.conn.poll(0):
                kind, payload = worker.conn.recv()
                worker.last_heard = time.monotonic()
                if kind == "beat":
                    continue
                if kind == "error":
                    worker.error = payload
                elif kind == "done_exit":
                    worker.finished = True
                else:
                    if kind == "ready":
                        worker.ready, worker.info = True, payload or {}
                        if self.all_ready():
                            self.log.info("all %d %s process(es) ready", len(self.live()), self.name)
                    out.append(Message(index, kind, payload))
        except (EOFError, OSError):
            pass  # it died; the sentinel says so
        return out

    def _enforce_deadlines(self) -> None:
        now = time.monotonic()
        for index, worker in self.workers.items():
            if not worker.alive or worker.killed_for:
                continue
            if not worker.ready and now - worker.started_at > self.start_timeout_s:
                self._kill(index, f"not ready within {self.start_timeout_s:.0f} s of its start")
            elif worker.ready and self.hang_timeout_s and now - worker.last_heard > self.hang_timeout_s:
                self._kill(index, f"hung: silent for {now - worker.last_heard:.0f} s")

    def _kill(self, index: int, why: str) -> None:
        worker = self.workers[index]
        worker.killed_for = why
        self.log.error("%s %d (pid %d) %s; killing it", self.name, index, worker.process.pid, why)
        worker.process.kill()

    def _died(self, index: int) -> list[Message]:
        worker = self.workers[index]
        worker.process.join(2.0)
        error = worker.error or {}
        if error.get("fatal"):
            self._reap(worker)
            worker.given_up = True
            raise WorkerConfigError(error["message"])
        reason = (f"raised an exception:\n{error['traceback'].rstrip()}" if error
                  else worker.killed_for or describe_exit(worker.process.exitcode))
        self.log.error("%s %d died: %s (pid %d)", self.name, index, reason, worker.process.pid)
        self._reap(worker)
        if self.stopping:
            worker.given_up = True
            return []
        if self.max_restarts is not None and worker.restarts >= self.max_restarts:
            worker.given_up = True
            first_line = reason.splitlines()[-1] if error else reason
            message = (f"{self.name} {index} died {worker.restarts + 1} times; giving up "
                       f"(--max-worker-restarts {self.max_restarts}); last: {first_line}")
            if self.on_give_up == "run":
                raise WorkerFailed(message, index, reason)
            self.log.error("%s", message)
            return [Message(index, "given_up", reason)]
        worker.restarts += 1
        self._spawn(index)
        self.log.warning("restarted %s %d (restart %d of at most %s), pid %d", self.name, index, worker.restarts,
                         self.max_restarts, worker.process.pid)
        return [Message(index, "restarted", reason)]

    @staticmethod
    def _reap(worker: _Worker) -> None:
        if worker.process.is_alive():
            worker.process.kill()
        worker.process.join(5.0)
        worker.conn.close()

    # -- stop
    def request_stop(self) -> None:
        """Ask ready workers to stop; kill those still starting. No restarts from now on."""
        if self.stopping:
            return
        self.stopping = True
        for index, worker in self.workers.items():
            if not worker.alive:
                continue
            if worker.ready:
                self.send(index, "stop")
            else:
                worker.killed_for = "stopped during its start-up"
                worker.process.kill()

    def stop(self, grace_s: float = 10.0) -> list[Message]:
        """Stop every worker within ``grace_s`` seconds (then kill); safe to call twice.

        Returns the messages that arrived meanwhile (e.g. workers' final reports).
        """
        if self._closed:
            return []
        self.request_stop()
        messages: list[Message] = []
        deadline = time.monotonic() + grace_s
        while self.live() and time.monotonic() < deadline:
            messages += self.poll(0.1)
        for index, worker in self.workers.items():
            if worker.alive:
                self.log.error("%s %d did not stop within %.0f s; killing it", self.name, index, grace_s)
            if worker.process is not None:
                if worker.process.is_alive() and worker.finished:
                    worker.process.join(grace_s)
                self._reap(worker)
        self._closed = True
        return messages
