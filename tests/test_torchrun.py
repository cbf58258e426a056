"""A rendezvous nobody answers: torchrun gives up within join_timeout; python -m common.torchrun says so in one line."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from conftest import ROOT, script_env
from multinode import free_port

SCRIPT_ARGS = [str(ROOT / "train_parallel_timed.py"), "--env-id", "CartPole-v1", "--no-tensorboard"]


def rendezvous(launcher: list[str], port: int, host: bool) -> tuple[subprocess.CompletedProcess, float]:
    command = [*launcher, "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
               f"127.0.0.1:{port}", "--rdzv-id", "nobody", "--rdzv-conf",
               f"is_host={int(host)},join_timeout=3,read_timeout=3", *SCRIPT_ARGS]
    started = time.monotonic()
    result = subprocess.run(command, cwd=ROOT, env=script_env(), capture_output=True, text=True, timeout=90)
    return result, time.monotonic() - started


@pytest.mark.timeout(120)
def test_nobody_answers_the_rendezvous_one_line_and_a_bounded_wait():
    wrapper = [sys.executable, "-m", "common.torchrun"]
    # A node whose endpoint nobody serves (node 0 never started).
    result, seconds = rendezvous(wrapper, free_port(), host=False)
    assert result.returncode == 1 and seconds < 40
    lines = (result.stdout + result.stderr).strip().splitlines()
    assert len(lines) == 1 and "nobody answers" in lines[0] and "start node 0 first" in lines[0], lines
    # Node 0 itself, waiting for a second node that never comes: join_timeout bounds it.
    result, seconds = rendezvous(wrapper, free_port(), host=True)
    assert result.returncode == 1 and seconds < 40
    lines = (result.stdout + result.stderr).strip().splitlines()
    assert len(lines) == 1 and "not every node joined within join_timeout" in lines[0], lines
