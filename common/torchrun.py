"""``torchrun`` itself, keeping the project's promises on every node: the run's own exit status, one line.

    python -m common.torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d \\
        --rdzv-endpoint HOST:29400 --rdzv-id job1 --rdzv-conf join_timeout=120 \\
        ultra_parallel_train_dqn.py --duration 1 --output-dir runs/apex

It takes exactly torchrun's arguments and runs torchrun's own ``main``: the same agent, rendezvous and
restarts. What differs is how a node ends (start it on every node of the job):

- **Exit status.** When this node's ranks end as the project's scripts end on purpose (2 a bad
  configuration, 3 a locked run directory, 130 Ctrl+C, 143 SIGTERM, each after its own line), the
  node exits with that status and one line, instead of torchrun's ``ChildFailedError`` report and 1.
  torchrun does not restart such an ending (``--max-restarts`` is for failures). A rank that failed
  (exit 1, a traceback, a signal) keeps torchrun's report, its restarts and exit status 1.
- **No idle node.** Once its ranks have finished, a node waits at most ``EXIT_BARRIER_S`` seconds for
  the other nodes' agents (torchrun: 300 s), so a node that was lost (kill -9, a crash) holds no
  surviving node of the allocation; and a node whose rendezvous host has already left goes on
  watching its own ranks, which end by themselves, instead of killing them.
- **Nobody answers the rendezvous** (node 0 not started, a wrong address, a firewall): after
  ``join_timeout`` (or the store's ``read_timeout``) seconds, one line and exit status 1; Ctrl+C
  while waiting there, one line and 130.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

EXIT_RENDEZVOUS = 1
EXIT_BARRIER_S = 5.0  # how long a node whose ranks finished waits for the other nodes' agents
# The statuses a rank ends with on purpose (common/run.py), each after logging its own line.
ENDINGS = {
    2: "a bad configuration (its line above says which)",
    3: "the run directory is locked by another run",
    130: "stopped cleanly on SIGINT (Ctrl+C), after rank 0 saved a checkpoint",
    143: "stopped cleanly on SIGTERM, after rank 0 saved a checkpoint",
}
# How torchrun ends the other ranks of a node once one has ended (and after its shutdown timeout).
ENDED_BY_THE_AGENT = (-signal.SIGTERM, -signal.SIGKILL)
STOP_SIGNALS = {text for sig in (signal.SIGINT, signal.SIGTERM) for text in (sig.name, str(int(sig)))}


def _import_torch_quietly() -> None:
    """c10d's C++ layer logs each failed connection attempt with a stack dump. The level is read once,
    when torch loads, so this process (the agent) is quiet while its workers, started with the
    environment restored, keep the usual warnings."""
    previous = os.environ.get("TORCH_CPP_LOG_LEVEL")
    os.environ["TORCH_CPP_LOG_LEVEL"] = "FATAL"
    try:
        import torch  # noqa: F401
    finally:
        if previous is None:
            os.environ.pop("TORCH_CPP_LOG_LEVEL")
        else:
            os.environ["TORCH_CPP_LOG_LEVEL"] = previous


def _endpoint(argv: list[str]) -> str:
    for i, arg in enumerate(argv):
        for flag in ("--rdzv-endpoint", "--rdzv_endpoint"):
            if arg == flag and i + 1 < len(argv):
                return argv[i + 1]
            if arg.startswith(flag + "="):
                return arg.split("=", 1)[1]
    return "the rendezvous endpoint"


def agreed_status(exit_codes: list[tuple[int, int]]) -> int | None:
    """The status this node's ranks ended with on purpose, or None if one of them failed.

    ``exit_codes`` holds ``(rank, exit code)`` in the order the ranks ended. The first one to end
    decides; the others may have ended the same way or been ended by torchrun after it (SIGTERM, then
    SIGKILL once its shutdown timeout has passed). A negative code is a signal, as torchrun reports it.
    """
    codes = [code for _, code in exit_codes if code != 0]
    if not codes or codes[0] not in ENDINGS:
        return None
    if any(code not in ENDINGS and code not in ENDED_BY_THE_AGENT for code in codes[1:]):
        return None
    return codes[0]


def ending_line(exit_codes: list[tuple[int, int]], status: int) -> str:
    ranks = sorted(rank for rank, code in exit_codes if code == status)
    which = f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
    return f"torchrun: {which} of this node: exit status {status}, {ENDINGS[status]}"


def in_order(failures: dict) -> list[tuple[int, int]]:
    """torchrun's failures (global rank -> ProcessFailure) as ``(rank, exit code)``, first ended first."""
    return [(rank, failure.exitcode) for rank, failure in sorted(failures.items(), key=lambda f: f[1].timestamp)]


class _Node:
    """What this node's agent saw, for the one line at its end."""

    stopped: list[tuple[int, int]] = []  # (global rank, exit code) of the ranks the agent stopped on a signal
    host_gone = False  # the rendezvous host (node 0's agent) has left: the job is over there


class HostGoneTolerantRendezvous:
    """The rendezvous handler, except that a rendezvous store nobody serves any more means no node
    is waiting to join: node 0's agent has left, and this node's ranks end by themselves (rank 0
    told them to stop, or they find it gone within PRL_COLLECTIVE_TIMEOUT_S)."""

    def __init__(self, handler):
        self._handler = handler

    def __getattr__(self, name):
        return getattr(self._handler, name)

    def num_nodes_waiting(self) -> int:
        if _Node.host_gone:
            return 0
        try:
            return self._handler.num_nodes_waiting()
        except Exception:  # any store error: the host is unreachable
            _host_left()
            return 0

    def shutdown(self) -> bool:
        return False if _Node.host_gone else self._handler.shutdown()


def _install_agent() -> None:
    """torchrun's own agent, with the three changes of this module's docstring. ``launch_agent`` builds
    its ``LocalElasticAgent`` by that name, with no way to pass ``exit_barrier_timeout``; this process
    is torchrun itself, so rebinding the name reaches it and nothing else."""
    from torch.distributed.elastic.agent.server.api import _TERMINAL_STATE_SYNC_ID, WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.utils import store as store_util
    from torch.distributed.launcher import api as launcher_api

    class ProjectAgent(LocalElasticAgent):
        def __init__(self, spec, *args, **kwargs):
            kwargs["exit_barrier_timeout"] = EXIT_BARRIER_S
            spec.rdzv_handler = HostGoneTolerantRendezvous(spec.rdzv_handler)
            super().__init__(spec, *args, **kwargs)

        def _monitor_workers(self, worker_group):
            result = super()._monitor_workers(worker_group)
            if result.state == WorkerState.FAILED and agreed_status(in_order(result.failures)) is not None:
                self._remaining_restarts = 0  # an ending on purpose: restarting would undo it
            return result

        def _shutdown(self, death_sig=signal.SIGTERM, timeout: int = 30) -> None:
            super()._shutdown(death_sig, timeout)  # on a signal this agent got: passed on, ranks awaited
            handlers = getattr(self._pcontext, "subprocess_handlers", None) or {}
            _Node.stopped = [(worker.global_rank, handlers[worker.local_rank].proc.returncode)
                             for worker in self._worker_group.workers if worker.local_rank in handlers]

        def _exit_barrier(self) -> None:
            """torchrun's exit barrier, bounded: the agents of the nodes still alive arrive within
            seconds of rank 0's end, and waiting longer only waits for a node that is gone."""
            if _Node.host_gone:
                return
            self._in_exit_barrier = True
            try:
                store_util.barrier(store=self._store, world_size=self._worker_group.group_world_size,
                                   key_prefix=_TERMINAL_STATE_SYNC_ID, barrier_timeout=EXIT_BARRIER_S)
            except SignalException:
                raise
            except Exception:  # a timeout, or a store gone with its host
                print(f"torchrun: this node's ranks have finished; not waiting more than {EXIT_BARRIER_S:g} s "
                      "for the other nodes' agents (a node lost, or already gone)", file=sys.stderr)
            finally:
                self._in_exit_barrier = False

    launcher_api.LocalElasticAgent = ProjectAgent


class _EndingsOnPurposeQuiet(logging.Filter):
    """torchrun's own lines about an ending that is no failure: ``failed (exitcode: 130)`` when a rank
    stopped on purpose, and, on a Ctrl+C or SIGTERM this agent got, that it passes the signal on.
    Everything else torchrun logs (a rank that fails, one that has to be killed) still shows."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        if record.msg.startswith("failed (exitcode: %s)"):
            return not (args and args[0] in ENDINGS)
        passing_on = record.msg.startswith(("Received %s death signal", "Sending process %s closing signal %s"))
        return not (passing_on and args and str(args[-1]) in STOP_SIGNALS)


def _host_left() -> None:
    """From now on the rendezvous store is unreachable: torchrun's heartbeat and shutdown would say so
    every few seconds until the ranks are done; this node knows, and says nothing more about it."""
    _Node.host_gone = True
    logging.getLogger("torch.distributed.elastic.rendezvous.dynamic_rendezvous").setLevel(logging.ERROR)


def main(argv: list[str] | None = None) -> int:
    try:
        return _torchrun(sys.argv[1:] if argv is None else argv)
    except KeyboardInterrupt:  # Ctrl+C before torchrun turns it into a SignalException (its ranks start)
        print("torchrun: stopped on SIGINT before this node's ranks started", file=sys.stderr)
        return 128 + int(signal.SIGINT)


def _torchrun(argv: list[str]) -> int:
    # Restarted ranks on several nodes otherwise read the old ranks' addresses from the agent's shared
    # store and cannot connect (pytorch/pytorch#135712).
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    _import_torch_quietly()
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError, RendezvousTimeoutError
    from torch.distributed.run import main as torchrun_main

    _install_agent()
    quiet = _EndingsOnPurposeQuiet()
    for name in ("torch.distributed.elastic.multiprocessing.api", "torch.distributed.elastic.agent.server.api"):
        logging.getLogger(name).addFilter(quiet)
    try:
        torchrun_main(argv)
    except RendezvousTimeoutError:
        print(f"error: rendezvous at {_endpoint(argv)}: not every node joined within join_timeout; start the "
              "same command on every node (--nnodes of them)", file=sys.stderr)
        return EXIT_RENDEZVOUS
    except RendezvousError as err:
        print(f"error: rendezvous at {_endpoint(argv)}: nobody answers ({type(err).__name__}); start node 0 "
              "first, and check that every node reaches that address and port", file=sys.stderr)
        return EXIT_RENDEZVOUS
    except (ChildFailedError, SignalException) as err:
        # ChildFailedError: this node's ranks ended, one of them not with 0. SignalException: this agent got
        # Ctrl+C or SIGTERM itself, passed it on to its ranks and waited for them.
        ended = in_order(err.failures) if isinstance(err, ChildFailedError) else _Node.stopped
        if isinstance(err, SignalException) and not ended:  # still at the rendezvous: no rank to wait for
            print(f"torchrun: stopped on {signal.Signals(err.sigval).name} before this node's ranks started",
                  file=sys.stderr)
            return 128 + int(err.sigval)
        status = None if any(code is None for _, code in ended) else agreed_status(ended)
        if status is None:
            raise  # a rank failed: torchrun's report (the rank's own traceback is above it), exit status 1
        print(ending_line(ended, status), file=sys.stderr)
        return status
    return 0


if __name__ == "__main__":
    sys.exit(main())
