"""Several torchrun "nodes" on localhost, as a user would start them on several machines.

Each node is its own ``python -m torch.distributed.run`` invocation (or ``python -m common.torchrun``,
the launcher's, with ``wrapper=True``) joining one c10d rendezvous on 127.0.0.1. Node 0 is started first
and hosts the rendezvous store (``is_host=1``), so it gets rank 0 (c10d ranks nodes by address, then by
the agent's pid) and losing another node never takes the store down with it.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
from conftest import ROOT, script_env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_command(script: str, nnodes: int, port: int, run_id: str, *args, nproc: int = 1, host: bool = False,
                     max_restarts: int = 0, join_timeout_s: int = 60, wrapper: bool = False) -> list[str]:
    torchrun = "common.torchrun" if wrapper else "torch.distributed.run"
    return [sys.executable, "-m", torchrun, "--nnodes", str(nnodes), "--nproc-per-node", str(nproc),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id,
            "--rdzv-conf", f"is_host={int(host)},join_timeout={join_timeout_s}", "--max-restarts", str(max_restarts),
            "--monitor-interval", "0.5", str(ROOT / script), *map(str, args)]


class Nodes:
    """``nnodes`` torchrun invocations of ``script``; node ``i`` logs to ``tmp/node<i>.log``.

    ``per_node`` maps a node to extra arguments for it alone (e.g. another env, to be refused).
    Use as a context manager: every process of every node is gone when it exits.
    """

    def __init__(self, tmp: Path, script: str, *args, nnodes: int = 2, nproc: int = 1, max_restarts: int = 0,
                 env: dict | None = None, per_node: dict[int, list] | None = None, wrapper: bool = False):
        self.tmp, self.port, self.procs = Path(tmp), free_port(), []
        run_id = f"prl{self.port}"
        for node in range(nnodes):
            command = torchrun_command(script, nnodes, self.port, run_id, *args, *(per_node or {}).get(node, []),
                                       nproc=nproc, host=node == 0, max_restarts=max_restarts, wrapper=wrapper)
            log = open(self.tmp / f"node{node}.log", "w")
            self.procs.append(subprocess.Popen(command, cwd=ROOT, env={**script_env(), **(env or {})}, stdout=log,
                                               stderr=subprocess.STDOUT, start_new_session=True))
            log.close()
            time.sleep(0.5 if node == 0 else 0.1)  # node 0's agent first: it hosts the store and sorts first

    def __enter__(self) -> Nodes:
        return self

    def __exit__(self, *exc) -> None:
        for node in range(len(self.procs)):
            self.kill(node)

    def log(self, node: int) -> str:
        return (self.tmp / f"node{node}.log").read_text(errors="replace")

    def workers(self, node: int) -> list[psutil.Process]:
        """The training processes (ranks) this node's torchrun agent started."""
        try:
            children = psutil.Process(self.procs[node].pid).children()
        except psutil.NoSuchProcess:
            return []
        return [c for c in children if _is_alive(c)]

    def kill(self, node: int) -> None:
        """kill -9 the whole node: its agent, its ranks and everything they started."""
        proc = self.procs[node]
        try:
            tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            tree = []
        for p in tree:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(tree, timeout=10)
        if proc.poll() is None:
            proc.wait(10)

    def wait(self, node: int, timeout: float) -> int | None:
        """The exit status of node ``node``'s torchrun, or None if it is still running after ``timeout``."""
        try:
            return self.procs[node].wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def wait_workers_gone(self, node: int, timeout: float) -> bool:
        """True once the node's ranks have exited (plain torchrun's agent may still wait at its exit
        barrier, up to 5 minutes for a node that was lost; the wrapper's, 5 s)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.procs[node].poll() is not None or not self.workers(node):
                return True
            time.sleep(0.2)
        return False


def _is_alive(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
