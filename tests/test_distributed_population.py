"""train_ppo_multiprocess.py under torchrun: one population over two localhost nodes, one rank and one
worker each, so worker 0 trains on node 0 (rank 0) and worker 1 on node 1 (rank 1).

Rank 0 coordinates every member and alone writes the run directory; node 1's checkpoints and logs
reach it through the relay. The cells: PBT copies a member across nodes, a SIGTERM on node 1 stops
both nodes with checkpoints, the same command with --resume auto finishes the run (one leaderboard,
best.pt, the remote member evaluated from rank 0's directory), kill -9 of node 1 (rank 0 goes on),
rank 0's death (node 1 ends at once and leaves nothing behind), --validate-only.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import ROOT, SHM, script_env
from multinode import Nodes
from test_faults import log_text, rows, wait_until

from common.checkpoint import load_checkpoint
from common.config import parse_args
from common.envs.market import load_market_data
from common.population_relay import FILE_PLACES, REPORTS, Parcel, check_parcel, fingerprint, reclaim_stale_scratch
from common.run import FlatConfig, probe_env
from common.shm import reclaim_stale_segments
from train_ppo_multiprocess import MODE

SCRIPT = "train_ppo_multiprocess.py"
CARTPOLE = ["--env-id", "CartPole-v1", "--num-workers", "1", "--num-envs-per-worker", "4", "--n-steps", "64",
            "--batch-size", "64", "--device", "cpu", "--target-return", "none", "--eval-episodes", "4",
            "--no-tensorboard", "--log-interval-s", "1"]
# The tiny market of tests/test_ppo_multiprocess.py: its cache is built once, by whichever node comes first.
MARKET = ["--num-items", "30", "--history-steps", "4000", "--num-workers", "1", "--num-envs-per-worker", "8",
          "--n-steps", "64", "--batch-size", "128", "--episode-length", "128", "--device", "cpu",
          "--eval-episodes", "8", "--log-interval-s", "1", "--no-tensorboard"]


def worker_rows(run_dir: Path, worker: int) -> list[dict]:
    return [r for r in rows(run_dir) if r["worker"] == str(worker)]


def scratch_of(node_log: str) -> Path:
    """Node 1's scratch directory, which its log names."""
    return Path(re.search(r"as they report them, from (\S+)", node_log).group(1))


def rank_exit(node_log: str, rank: int) -> int:
    return int(re.search(rf"\[rank {rank}\] exit status (\d+)", node_log).group(1))


def test_scratch_directories_of_dead_nodes_are_reclaimed_and_no_other(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a node process that has exited (kill -9 leaves the same)
    dead = tmp_path / f"prl-population-rank1-{gone.pid}-abc_123"
    live = tmp_path / f"prl-population-rank1-{os.getpid()}-def456"
    others = [tmp_path / "prl-population-rank1-0zxs79vr", tmp_path / "unrelated-123-abc"]  # not a node's name
    for path in (dead, live, *others):
        (path / "checkpoints").mkdir(parents=True)
    assert reclaim_stale_scratch(tmp_path) == [dead]
    assert not dead.exists() and live.is_dir() and all(p.is_dir() for p in others)


@pytest.mark.timeout(180)
def test_pbt_across_nodes_a_signal_on_node_1_and_resume_to_one_leaderboard(tmp_path):
    out, first, second = tmp_path / "run", tmp_path / "first", tmp_path / "second"
    first.mkdir(), second.mkdir()
    # Worker 1 does not learn (learning rate 0), so at the PBT step it scores below worker 0 and copies
    # it: the donor's checkpoint travels from rank 0 to node 1.
    args = [*CARTPOLE, "--output-dir", out, "--pbt-interval", "2048", "--pbt-fraction", "0.5",
            "--checkpoint-every", "1024", "--learning-rate", "2.5e-3", "0", "--no-anneal-lr"]
    with Nodes(first, SCRIPT, *args, "--max-steps-per-worker", 10**9) as nodes:
        assert wait_until(lambda: "copies worker 0" in log_text(out), 120), log_text(out)[-3000:] + nodes.log(1)
        assert wait_until(lambda: int((worker_rows(out, 1) or [{"worker_step": 0}])[-1]["worker_step"]) > 2048, 30)
        nodes.workers(1)[0].send_signal(signal.SIGTERM)  # as a scheduler stops a job on one node
        assert nodes.wait(1, 60) is not None and nodes.wait(0, 60) is not None
    node1 = nodes.log(1)
    assert rank_exit(node1, 1) == 143 and "exit status 143" in log_text(out), node1[-3000:]
    assert "rank 1 received signal 15: stopping every rank" in log_text(out)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["exit_code"] == 143 and summary["stop_reason"] == "interrupted"
    assert summary["world_size"] == 2 and summary["population_size"] == 2 and summary["ranks_lost"] == 0
    assert [w["rank"] for w in summary["workers"]] == [0, 1]
    assert summary["rank_traffic"]["1"]["sent_mib"] > 0.1  # the donor's checkpoint (141 KB) went to node 1
    steps = {i: w["step"] for i, w in enumerate(summary["workers"])}
    for i, step in steps.items():  # every member saved where it stopped, node 1's into rank 0's directory
        assert (out / "checkpoints" / f"worker_{i}_step_{step}.pt").is_file(), sorted((out / "checkpoints").iterdir())
    # The copy reached node 1: worker 1 then trained with the donor's perturbed rate (it had 0 before).
    copy = next(e for e in summary["pbt_events"] if e["worker"] == 1 and e["copied"] == 0)
    rates = [(int(r["worker_step"]), float(r["learning_rate"])) for r in worker_rows(out, 1)]
    assert all(rate == 0 for step, rate in rates if step <= copy["step"])
    assert [rate for step, rate in rates if step > copy["step"]][0] == pytest.approx(copy["hyper"]["learning_rate"])
    assert "PBT: copied worker 0" in (out / "logs" / "worker_1.log").read_text()  # node 1's log, shipped
    assert not scratch_of(node1).exists()
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["checkpoints", "logs", "plots"]

    # The same command with --resume auto: rank 0 hands node 1 its member's newest checkpoint.
    target = max(steps.values()) + 512
    with Nodes(second, SCRIPT, *args, "--max-steps-per-worker", target, "--resume", "auto") as nodes:
        assert nodes.wait(0, 120) == 0 and nodes.wait(1, 30) == 0, nodes.log(0)[-3000:] + nodes.log(1)[-3000:]
    main_log = log_text(out)
    for i, step in steps.items():
        assert re.search(rf"worker {i} running \(pid \d+\) from step {step}{' on rank 1' if i else ''}\n", main_log)
    worker_1_log = (out / "logs" / "worker_1.log").read_text()  # both sessions' parts, appended
    assert "PBT: copied worker 0" in worker_1_log
    assert re.search(rf"worker 1 resumed from \S+worker_1_step_{steps[1]}\.pt at step {steps[1]}", worker_1_log)
    assert {int(r["worker"]): int(r["worker_step"]) for r in rows(out)} == {0: target, 1: target}
    summary = json.loads((out / "summary.json").read_text())
    assert summary["exit_code"] == 0 and summary["rank_traffic"]["1"]["sent_mib"] > 0.1  # the handed-back file
    board = [line.split(",")[1] for line in (out / "leaderboard.csv").read_text().splitlines()[1:]]
    assert sorted(board) == ["0", "1", "random"] and summary["best_worker"] == int(board[0])
    assert load_checkpoint(out / "best.pt", required=("worker",))["worker"] == summary["best_worker"]
    result = subprocess.run([sys.executable, "-m", "common.evaluate", str(out), "--member", "1", "--episodes", "2",
                             "--json"], cwd=ROOT, env=script_env(), capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    played = json.loads(result.stdout)
    assert played["member"] == 1 and played["checkpoint"] == str(out / "checkpoints" / "worker_1_final.pt")
    assert played["global_step"] == target


@pytest.mark.timeout(120)
def test_kill_9_of_node_1_rank_0_goes_on_and_reports_its_member(tmp_path):
    out = tmp_path / "run"
    # Synchronous PBT rounds every 2048 steps keep worker 0 within one round of worker 1 (it waits for it at
    # each), so worker 0 still has most of its budget ahead when node 1 dies, and must go on without it.
    args = [*MARKET, "--cache-dir", tmp_path / "cache", "--output-dir", out, "--max-steps-per-worker", 10240,
            "--pbt-interval", "2048"]
    rank_1 = 0
    try:
        with Nodes(tmp_path, SCRIPT, *args) as nodes:
            assert wait_until(lambda: worker_rows(out, 1), 90), log_text(out)[-3000:] + nodes.log(1)[-3000:]
            rank_1 = nodes.workers(1)[0].pid
            # Counted before the kill: the rest of worker 0's budget takes rank 0 about a second, less than
            # reaping a killed node may take.
            at_loss = len(worker_rows(out, 0))
            nodes.kill(1)
            # Rank 0's worker finishes its budget, then rank 0 exits (plain torchrun here: the context manager
            # ends its agent; tests/test_torchrun.py has what python -m common.torchrun does after a lost node).
            assert wait_until(lambda: (out / "summary.json").exists(), 60), log_text(out)[-3000:]
            assert nodes.wait_workers_gone(0, 30)
        main_log = log_text(out)
        assert re.search(r"rank 1 lost: .*; going on with rank\(s\) 0 alone", main_log)
        assert re.search(r"worker 1 lost with its node \(rank 1 lost: .*\); its newest checkpoint here: "
                         r"(none|worker_1_\S+\.pt); the others go on", main_log)
        assert at_loss < 10240 // 512, "worker 0 had finished before node 1 was killed"
        assert len(worker_rows(out, 0)) > at_loss and int(worker_rows(out, 0)[-1]["worker_step"]) == 10240
        summary = json.loads((out / "summary.json").read_text())
        assert summary["exit_code"] == 1 and "worker(s) [1] lost with their node" in summary["stop_reason"]
        assert summary["ranks_lost"] == 1 and summary["lost_ranks"][0]["rank"] == 1
        assert summary["workers"][1]["lost"].startswith("rank 1 lost") and summary["workers"][0]["finished"]
        assert [r["worker"] for r in summary["leaderboard"]] == [0] and (out / "best.pt").is_file()
    finally:
        # What kill -9 leaves of node 1: its scratch directory and its copy of the market cache, which the next
        # node (or run) to start on that machine reclaims.
        node_log = (tmp_path / "node1.log").read_text(errors="replace") if (tmp_path / "node1.log").exists() else ""
        scratch = scratch_of(node_log) if "as they report them, from" in node_log else None
        reclaim_stale_scratch()  # (a test beside this one may have reclaimed it first)
        reclaim_stale_segments()
    assert not list(SHM.glob(f"prl_{rank_1}_*"))
    assert scratch is not None and not scratch.exists(), scratch


@pytest.mark.timeout(90)
def test_rank_0_dies_node_1_ends_at_once_and_leaves_nothing(tmp_path):
    out = tmp_path / "run"
    args = [*MARKET, "--cache-dir", tmp_path / "cache", "--output-dir", out, "--max-steps-per-worker", 10**9]
    with Nodes(tmp_path, SCRIPT, *args, env={"PRL_COLLECTIVE_TIMEOUT_S": "10"}) as nodes:
        assert wait_until(lambda: worker_rows(out, 1), 90), log_text(out)[-3000:] + nodes.log(1)[-3000:]
        rank_1 = nodes.workers(1)[0].pid
        assert sorted(p.name for p in SHM.glob(f"prl_{rank_1}_*")) == [f"prl_{rank_1}_market_prices",
                                                                       f"prl_{rank_1}_market_volumes"]
        nodes.kill(0)
        killed = time.monotonic()
        assert nodes.wait_workers_gone(1, 15), nodes.log(1)[-3000:]
        assert time.monotonic() - killed < 10
    reclaim_stale_segments()  # rank 0's own, as the next run on node 0 would
    node1 = nodes.log(1)
    assert rank_exit(node1, 1) == 1
    failed = re.findall(r"\[rank 1\] training failed: (.*)", node1)
    assert len(failed) == 1 and failed[0].startswith("rank 1: rank 0 (the learner) is gone"), node1[-3000:]
    assert not list(SHM.glob(f"prl_{rank_1}_*")) and not scratch_of(node1).exists()


@pytest.mark.timeout(60)
def test_validate_only_under_torchrun_checks_on_every_node_and_writes_nothing(tmp_path):
    out = tmp_path / "run"
    with Nodes(tmp_path, SCRIPT, *CARTPOLE, "--output-dir", out, "--learning-rate", "1e-3", "2e-3",
               "--validate-only") as nodes:
        assert nodes.wait(0, 50) == 0 and nodes.wait(1, 10) == 0, nodes.log(0)[-2000:]
    for node in (0, 1):
        assert "  learning_rate:\n  - 0.001\n  - 0.002\n" in nodes.log(node)
    assert not out.exists()


def test_a_parcel_carries_files_to_where_their_names_say_and_nowhere_else(tmp_path):
    sender, receiver = tmp_path / "node1", tmp_path / "rank0"
    for base in (sender, receiver):
        (base / "checkpoints").mkdir(parents=True), (base / "logs").mkdir()
    (sender / "checkpoints" / "worker_3_step_512.pt").write_bytes(b"weights")
    (sender / "logs" / "worker_3.log").write_text("second session\n")
    (receiver / "logs" / "worker_3.log").write_text("first session\n")
    parcel = Parcel()
    parcel.add(3, "done", {"checkpoint": str(sender / "checkpoints" / "worker_3_step_512.pt"), "step": 512},
               {"checkpoint": sender / "checkpoints" / "worker_3_step_512.pt", "log": sender / "logs" / "worker_3.log"})
    info, arrays = json.loads(json.dumps(parcel.wire()[0])), parcel.wire()[1]
    assert check_parcel(info, arrays, FILE_PLACES, REPORTS) is None
    assert parcel.members(FILE_PLACES) == {3}
    [message] = Parcel.unwire(info, arrays).deliver(receiver, FILE_PLACES)
    copy = receiver / "checkpoints" / "worker_3_step_512.pt"
    assert message.index == 3 and message.payload == {"checkpoint": str(copy), "step": 512}
    assert copy.read_bytes() == b"weights"
    assert (receiver / "logs" / "worker_3.log").read_text() == "first session\nsecond session\n"  # logs add up

    def refused(**change) -> str:
        return check_parcel({**info, **change}, arrays, FILE_PLACES, REPORTS)

    assert "no place here takes" in refused(files=[["../worker_3_step_512.pt", 7], ["worker_3.log", 15]])
    assert "no place here takes" in refused(files=[["population.pt", 7], ["worker_3.log", 15]])
    assert "bytes attached" in refused(files=[["worker_3_step_512.pt", 8], ["worker_3.log", 15]])
    assert "a message" in refused(events=[{**info["events"][0], "kind": "exec"}])
    assert "does not carry" in refused(events=[{**info["events"][0], "files": {"log": "worker_4.log"}}])


def test_the_fingerprint_differs_with_the_settings_and_the_data_but_not_with_node_local_paths(tmp_path):
    """What a rank shows rank 0 at the start: another training setting or market history is refused,
    another cache directory, device or output directory is not."""
    env = probe_env("CartPole-v1")
    env.extra["item_indices"] = [0, 1]

    def shown(*argv, data=None) -> dict:
        cfg = FlatConfig(parse_args(MODE.config, [str(a) for a in argv], "")[0])
        return fingerprint(SimpleNamespace(cfg=cfg, env=env), data, str(ROOT / SCRIPT))

    base = shown("--env-id", "CartPole-v1")
    assert shown("--env-id", "CartPole-v1", "--device", "cpu", "--cache-dir", tmp_path, "--output-dir", tmp_path,
                 "--threads-per-worker", "3", "--no-tensorboard") == base
    assert shown("--env-id", "CartPole-v1", "--n-epochs", "2") != base
    assert shown("--env-id", "CartPole-v1", "--num-workers", "2") != base
    one, _ = load_market_data("synthetic", tmp_path, 5, 800, 0)
    other, _ = load_market_data("synthetic", tmp_path, 5, 800, 1)
    assert shown("--env-id", "CartPole-v1", data=one) == shown("--env-id", "CartPole-v1", data=one)
    assert shown("--env-id", "CartPole-v1", data=one) != shown("--env-id", "CartPole-v1", data=other)
