"""python -m common.torchrun: torchrun, keeping the project's promises past one machine.

A rendezvous nobody answers: one line within join_timeout. On two localhost nodes (tests/multinode.py,
each node the wrapper, with --max-restarts 1 where a restart could undo an ending, as the launcher's
commands have restarts): Ctrl+C on node 1 gives 130 from both wrappers, SIGTERM 143, a bad configuration
on one node 2 from both, a run directory locked on node 0 3 from both, each with one line and no
torchrun report; kill -9 of a node that does not learn leaves the surviving wrapper to exit with rank 0's
own status within seconds of rank 0's summary (plain torchrun: 5 minutes at its exit barrier). Each
launch costs ~10 s of start-up on 2 cores, so every budget is tiny and each case runs on one mode, the
kill -9 on each mode that survives it.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import ROOT, script_env
from multinode import Nodes, free_port
from test_distributed_parallel_dqn import CARTPOLE as DQN_CARTPOLE
from test_distributed_population import CARTPOLE as POPULATION_CARTPOLE
from test_distributed_population import worker_rows
from test_distributed_ultra import CARTPOLE as ULTRA_CARTPOLE
from test_distributed_ultra import rank_1_steps, rows
from test_faults import wait_until

from common import torchrun
from common.population_relay import reclaim_stale_scratch
from common.runlog import RunLock
from common.shm import reclaim_stale_segments
from common.torchrun import EXIT_BARRIER_S, agreed_status

SCRIPT_ARGS = [str(ROOT / "train_parallel_timed.py"), "--env-id", "CartPole-v1", "--no-tensorboard"]
TIMED = ["--env-id", "CartPole-v1", "--num-workers", "0", "--num-envs-per-worker", "4", "--n-steps", "32",
         "--batch-size", "64", "--target-return", "none", "--no-tensorboard"]
ENDLESS = ["--total-timesteps", str(10**9)]
STOP_TIMEOUT_S = 30  # torchrun's shutdown timeout: a rank still running after it is killed


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


@pytest.mark.parametrize("ended, status", [
    ([(0, 130)], 130),
    ([(1, 143), (0, 143)], 143),
    ([(0, 2), (1, -signal.SIGTERM)], 2),  # torchrun ended the node's other rank once the first had
    ([(0, 0), (1, 3)], 3),
    ([(0, 130), (1, 143)], 130),  # the first to end decides
    ([(0, 1)], None),  # training failed: torchrun's report and 1
    ([(0, 130), (1, 1)], None),
    ([(0, -signal.SIGKILL)], None),  # killed (the OOM killer, kill -9) first
    ([(0, -signal.SIGSEGV), (1, 130)], None),
])
def test_the_status_a_node_reports_is_the_one_its_ranks_ended_with_on_purpose(ended, status):
    assert agreed_status(ended) == status


def test_a_rendezvous_store_gone_with_its_host_means_no_node_is_waiting(monkeypatch):
    """Node 0's agent, which serves the rendezvous store, may leave before another node's ranks have ended
    (after its bounded exit barrier): that node's agent goes on watching them instead of failing."""
    monkeypatch.setattr(torchrun._Node, "host_gone", False)
    quieted = logging.getLogger("torch.distributed.elastic.rendezvous.dynamic_rendezvous")
    monkeypatch.setattr(quieted, "level", quieted.level)

    class StoreGone:
        run_id, asked = "job1", 0

        def num_nodes_waiting(self) -> int:
            self.asked += 1
            raise RuntimeError("Connection refused")

        def shutdown(self) -> bool:
            raise AssertionError("nobody serves the rendezvous any more: there is nothing to close")

    gone = StoreGone()
    handler = torchrun.HostGoneTolerantRendezvous(gone)
    assert handler.num_nodes_waiting() == 0 and handler.num_nodes_waiting() == 0 and gone.asked == 1
    assert handler.shutdown() is False and handler.run_id == "job1"
    assert quieted.level == logging.ERROR  # torchrun's heartbeat would say it every 5 s until the ranks end


def ending(nodes: Nodes, node: int) -> list[str]:
    """The wrapper's own line(s) in a node's output; torchrun's report (a traceback) must not be there."""
    log = nodes.log(node)
    assert "Traceback" not in log and "ChildFailedError" not in log and "failed (exitcode" not in log, log[-3000:]
    return [line for line in log.splitlines() if line.startswith("torchrun:")]


def summary(run_dir) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def wait_both(nodes: Nodes, timeout: float) -> tuple[list[int | None], float]:
    started = time.monotonic()
    statuses = [nodes.wait(1, timeout), nodes.wait(0, max(1.0, timeout - (time.monotonic() - started)))]
    return statuses[::-1], time.monotonic() - started


@pytest.mark.timeout(150)
@pytest.mark.parametrize("script", ["parallel_train_dqn.py", "train_parallel_timed.py"])
def test_ctrl_c_on_node_1_gives_130_from_both_wrappers_and_no_restart(tmp_path, script):
    """The actor-learner form (rank 1 an actor) and DD-PPO (rank 1 a learner too: a signal that reaches one
    rank stops both, and each exits 130)."""
    run_dir = tmp_path / "run"
    dqn = script == "parallel_train_dqn.py"
    started = (lambda: "its first" in nodes.log(0)) if dqn else (lambda: len(rows(run_dir)) > 0)
    with Nodes(tmp_path, script, *(DQN_CARTPOLE if dqn else TIMED), *ENDLESS, "--output-dir", run_dir,
               max_restarts=1, wrapper=True) as nodes:
        assert wait_until(started, 90), nodes.log(0)[-3000:] + nodes.log(1)[-3000:]
        os.killpg(nodes.procs[1].pid, signal.SIGINT)  # Ctrl+C in node 1's terminal
        statuses, seconds = wait_both(nodes, STOP_TIMEOUT_S)
        assert statuses == [130, 130], (statuses, nodes.log(0)[-3000:] + nodes.log(1)[-3000:])
        assert seconds < STOP_TIMEOUT_S
        assert ending(nodes, 0) == ["torchrun: rank 0 of this node: exit status 130, stopped cleanly on SIGINT "
                                    "(Ctrl+C), after rank 0 saved a checkpoint"]
        assert ending(nodes, 1) == ["torchrun: rank 1 of this node: exit status 130, stopped cleanly on SIGINT "
                                    "(Ctrl+C), after rank 0 saved a checkpoint"]
        assert "[rank 1] exit status 130" in nodes.log(1)
    done = summary(run_dir)
    assert done["exit_code"] == 130 and done["stop_reason"] == "interrupted" and done["world_size"] == 2
    assert (run_dir / "checkpoints" / "latest.pt").exists()
    assert "resumed from" not in (run_dir / "logs" / "main.log").read_text()  # torchrun restarted nothing


@pytest.mark.timeout(150)
def test_sigterm_on_node_0_gives_143_from_both(tmp_path):
    """SIGTERM to node 0's torchrun, the one that hosts the rendezvous: it passes the signal on to rank 0,
    which stops every rank."""
    run_dir = tmp_path / "run"
    with Nodes(tmp_path, "ultra_parallel_train_dqn.py", *ULTRA_CARTPOLE, *ENDLESS, "--output-dir", run_dir,
               max_restarts=1, wrapper=True) as nodes:
        assert wait_until(lambda: rank_1_steps(rows(run_dir)) > 0, 90), nodes.log(0)[-3000:] + nodes.log(1)[-3000:]
        os.killpg(nodes.procs[0].pid, signal.SIGTERM)  # as scancel or a preemption stops a job's step
        statuses, seconds = wait_both(nodes, STOP_TIMEOUT_S)
        assert statuses == [143, 143], (statuses, nodes.log(0)[-3000:] + nodes.log(1)[-3000:])
        assert seconds < STOP_TIMEOUT_S
        assert ending(nodes, 0) == ["torchrun: rank 0 of this node: exit status 143, stopped cleanly on SIGTERM, "
                                    "after rank 0 saved a checkpoint"]
        assert len(ending(nodes, 1)) == 1 and "[rank 1] exit status 143" in nodes.log(1)
    assert summary(run_dir)["exit_code"] == 143


# The mode, its tiny run, what says node 1's rank is at work; rank 0 ends by itself after the kill. The budgets
# are large enough that rank 0 has not finished when node 1 first is at work, on a quiet machine too.
KILLED = {
    "dqn": ("parallel_train_dqn.py", [*DQN_CARTPOLE, "--total-timesteps", "30000"],
            lambda nodes, run_dir: "its first" in nodes.log(0)),
    "ultra": ("ultra_parallel_train_dqn.py", [*ULTRA_CARTPOLE, "--total-timesteps", "30000"],
              lambda nodes, run_dir: rank_1_steps(rows(run_dir)) > 0),
    # Synchronous PBT rounds keep worker 0 within a round of worker 1, so rank 0 is at work when node 1 dies.
    "population": ("train_ppo_multiprocess.py", [*POPULATION_CARTPOLE, "--max-steps-per-worker", "20480",
                                                 "--pbt-interval", "2048"],
                   lambda nodes, run_dir: worker_rows(run_dir, 1)),
}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", list(KILLED))
def test_kill_9_of_node_1_the_survivor_exits_with_rank_0s_status_within_seconds_of_its_summary(mode, tmp_path):
    script, args, at_work = KILLED[mode]
    run_dir = tmp_path / "run"
    try:
        with Nodes(tmp_path, script, *args, "--output-dir", run_dir, wrapper=True) as nodes:
            assert wait_until(lambda: at_work(nodes, run_dir), 90), nodes.log(0)[-3000:] + nodes.log(1)[-3000:]
            nodes.kill(1)
            assert not (run_dir / "summary.json").exists(), "rank 0 had finished before node 1 was killed"
            assert wait_until(lambda: (run_dir / "summary.json").exists(), 90), nodes.log(0)[-3000:]
            written = time.monotonic()
            status = nodes.wait(0, 30)
            seconds = time.monotonic() - written
            log = nodes.log(0)
        done = summary(run_dir)
        assert status == done["exit_code"], (status, log[-3000:])
        assert seconds < 30 and done["ranks_lost"] == 1, (seconds, done["ranks_lost"])
        if status == 0:  # the DQN modes: rank 0 trained on alone; its node did not wait for node 1's agent
            assert f"not waiting more than {EXIT_BARRIER_S:g} s for the other nodes' agents" in log, log[-3000:]
        else:  # the population is incomplete: a failure (1), torchrun's report as ever
            assert mode == "population" and "ChildFailedError" in log
    finally:
        reclaim_stale_segments()  # what the killed node left, as the next run on it does
        reclaim_stale_scratch()  # (the population's node-1 scratch directory, as the next node on it does)


@pytest.mark.timeout(120)
def test_a_bad_configuration_on_node_1_gives_2_from_both_at_once(tmp_path):
    run_dir = tmp_path / "run"
    with Nodes(tmp_path, "train_parallel_timed.py", *TIMED, *ENDLESS, "--output-dir", run_dir,
               per_node={1: ["--learning-rate", "-1"]}, max_restarts=1, wrapper=True) as nodes:
        statuses, _ = wait_both(nodes, 90)  # the ranks' collective timeout (120 s) is not waited for
        assert statuses == [2, 2], (statuses, nodes.log(0)[-3000:] + nodes.log(1)[-3000:])
        errors = [line for line in nodes.log(0).splitlines() if line.startswith("error:")]
        assert errors == ["error: rank 1 cannot start: --learning-rate -1.0: must be > 0"], nodes.log(0)[-3000:]
        assert "error: --learning-rate -1.0: must be > 0" in nodes.log(1).splitlines()
        for node in (0, 1):
            assert ending(nodes, node) == [f"torchrun: rank {node} of this node: exit status 2, a bad configuration "
                                           "(its line above says which)"]
    assert not run_dir.exists()  # refused before rank 0 opened it


@pytest.mark.timeout(120)
def test_a_run_directory_locked_on_node_0_gives_3_from_both(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    lock = RunLock(run_dir)
    assert lock.acquire()  # another run, still going
    try:
        with Nodes(tmp_path, "train_parallel_timed.py", *TIMED, *ENDLESS, "--output-dir", run_dir, max_restarts=1,
                   wrapper=True) as nodes:
            statuses, _ = wait_both(nodes, 90)
            assert statuses == [3, 3], (statuses, nodes.log(0)[-3000:] + nodes.log(1)[-3000:])
            assert "error: rank 0 cannot start: another run holds the lock on its run directory" in nodes.log(1)
            for node in (0, 1):
                assert ending(nodes, node) == [f"torchrun: rank {node} of this node: exit status 3, the run "
                                               "directory is locked by another run"]
    finally:
        lock.release()
    assert sorted(p.name for p in run_dir.iterdir()) == [".lock"]  # nothing written into the other run's directory
