"""parallel_train_dqn.py past one machine: torchrun nodes on localhost, one rank each, joined by one c10d
rendezvous (tests/multinode.py). Rank 0 learns; the other ranks' rollout workers send it whole episodes.

Each run costs ~10 s of start-up on 2 cores, so the cells share runs: self-play with a signal on node 1,
then the same command with --resume auto on 3 nodes, one refused at the handshake and one killed with
kill -9; rank 0 killed (CartPole-v1: no masks, unbounded observations); --validate-only.
"""

from __future__ import annotations

import csv
import json
import os
import re
import signal
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
from multinode import Nodes
from test_faults import wait_until

from common.dqn_rollouts import check_episodes, episode_schema, pack_episodes, unpack_episodes
from common.shm import reclaim_stale_segments

SCRIPT = "parallel_train_dqn.py"
TINY = ["--num-workers", "1", "--hidden-sizes", "32", "32", "--episodes-per-batch", "8", "--learning-starts", "200",
        "--eval-interval", "0", "--eval-episodes", "4", "--no-tensorboard", "--total-episodes", "none"]
SELF_PLAY = [*TINY, "--snapshot-interval", "2", "--opponent-latest", "0.4", "--opponent-snapshot", "0.4",
             "--opponent-random", "0.2"]
CARTPOLE = [*TINY, "--env-id", "CartPole-v1", "--target-return", "none"]


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def metrics(run_dir: Path) -> list[dict]:
    with open(run_dir / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def rank_lines(log: str, rank: int, pattern: str) -> list[str]:
    return [line for line in log.splitlines() if f"[rank {rank}]" in line and re.search(pattern, line)]


def test_episodes_travel_as_arrays_and_rank_0_refuses_what_is_not_whole_legal_episodes():
    from common.run import probe_env

    env = probe_env("ConnectFour-v0", actions=("Discrete",))
    schema = episode_schema(env)
    rng = np.random.default_rng(0)

    def episode(steps: int, result: float) -> dict:
        masks = np.ones((steps + 1, 7), dtype=bool)
        masks[:, 6] = False  # column 6 is full throughout: its action is illegal
        return {"obs": rng.integers(0, 2, (steps + 1, 2, 6, 7)).astype(np.float32),
                "actions": rng.integers(0, 6, steps), "rewards": np.r_[np.zeros(steps - 1), result].astype(np.float32),
                "masks": masks, "terminated": True, "length": steps, "return": result, "result": result}

    sent = [episode(4, 1.0), episode(7, -1.0)]
    arrays, stats = pack_episodes(sent, np.float32)
    info = {"episodes": stats, "model_version": 3}
    assert len(arrays["obs"]) == 5 + 8 and arrays["obs"].dtype == np.float32 and arrays["masks"].dtype == bool
    assert schema.check(arrays, info) is None
    got = unpack_episodes(arrays, stats)
    for a, b in zip(sent, got):
        assert (a["length"], a["return"], a["result"], a["terminated"]) == (b["length"], b["return"], b["result"],
                                                                           b["terminated"])
        for key in ("obs", "actions", "rewards", "masks"):
            assert np.array_equal(a[key], b[key]), key

    def refused(why: str, **changes) -> None:
        bad = {**arrays, **{k: v for k, v in changes.items() if k != "info"}}
        assert why in (schema.check(bad, changes.get("info", info)) or ""), why

    refused("out of range", actions=np.where(arrays["actions"] == 0, 7, arrays["actions"]))
    refused("NaN", rewards=np.full_like(arrays["rewards"], np.nan))
    refused("expected float32[2, 6, 7]", obs=arrays["obs"].astype(np.float64))
    refused("out of range", obs=arrays["obs"] * 3)
    refused("not whole episodes", last=np.r_[arrays["last"][:-1], False])
    refused("not whole episodes", last=np.r_[True, arrays["last"][1:]])  # an episode of one observation
    refused("terminated on a row", terminated=np.ones_like(arrays["terminated"]))
    refused("mask forbids", actions=np.where(arrays["last"], 0, 6))
    refused("statistics of 1 episode(s) for 2", info={"episodes": stats[:1]})
    refused("not numbers", info={"episodes": [{"result": "win"}, {}]})
    refused("unknown info key", info={**info, "code": "print(1)"})
    refused("signal", info={**info, "signal": 9})
    assert check_episodes({"episodes": stats}, {}, tuple(arrays)) is not None  # numbers without the episodes
    assert check_episodes({"signal": 15}, {}, tuple(arrays)) is None  # a signal travels alone


@pytest.mark.timeout(180)
def test_self_play_signal_on_node_1_then_resume_with_a_refused_and_a_killed_node(tmp_path):
    run_dir = tmp_path / "run"
    args = [*SELF_PLAY, "--output-dir", run_dir]
    (tmp_path / "a").mkdir()
    with Nodes(tmp_path / "a", SCRIPT, *args, "--duration", "0.05") as nodes:
        # Snapshots and weights reached node 1's workers before the signal.
        assert wait_until(lambda: "its first" in nodes.log(0) and rank_lines(nodes.log(1), 1, r"pool of [1-9]"), 60), \
            nodes.log(0)[-3000:] + nodes.log(1)[-3000:]
        os.kill(nodes.procs[1].pid, signal.SIGTERM)  # what Ctrl+C or scancel does to node 1's torchrun
        assert nodes.wait(1, 45) is not None and nodes.wait(0, 45) is not None
        log0, log1 = nodes.log(0), nodes.log(1)
    assert "rank 1 received signal 15: stopping every rank" in log0 and "exit status 143" in log0
    assert rank_lines(log1, 1, r"exit status 143$"), log1[-3000:]
    first = summary(run_dir)
    assert first["exit_code"] == 143 and first["stop_reason"] == "interrupted" and first["world_size"] == 2
    assert (run_dir / "checkpoints" / "latest.pt").exists()
    # Both ranks' episodes were stored, and rank 0 counted what rank 1 sent.
    assert first["episodes_by_rank"]["0"] > 0 and first["episodes_by_rank"]["1"] > 0, first["episodes_by_rank"]
    assert sum(first["transitions_by_rank"].values()) == first["global_step"]
    assert first["rank_traffic"]["1"]["messages"] > 0 and first["ranks_lost"] == 0
    rows = metrics(run_dir)
    assert rows[-1]["world_size"] == "2" and [int(n) for n in rows[-1]["episodes_by_rank"].split(":")][1] > 0
    # Rank 1 played with the learner's newer weights and an opponent pool it got from rank 0.
    report = rank_lines(log1, 1, r"sent to rank 0; learner weights version")[-1]
    assert int(re.search(r"version (\d+)", report).group(1)) > 1 and not report.endswith(" 0 snapshot(s) in the "
                                                                                         "opponent pool"), report
    # Rank 0 alone wrote files: its own log and its own single worker's log, nothing of rank 1.
    assert sorted(p.name for p in (run_dir / "logs").iterdir()) == ["main.log", "worker_0.log"]
    assert "[rank 1]" not in (run_dir / "logs" / "main.log").read_text()

    # The same command with --resume auto continues the run, here on 3 nodes: node 2 runs another
    # network, so rank 0 refuses it at the handshake, and node 1 is killed with kill -9 mid-run.
    (tmp_path / "b").mkdir()
    with Nodes(tmp_path / "b", SCRIPT, *args, "--duration", "0.004", "--resume", "auto", nnodes=3,
               per_node={2: ["--hidden-sizes", "16", "16"]}) as nodes:
        assert wait_until(lambda: "its first" in nodes.log(0), 60), nodes.log(0)[-3000:]
        assert nodes.wait(2, 10) is not None  # the refused node has ended by itself
        refused_line = [line for line in nodes.log(2).splitlines() if line.startswith("error:")]
        assert len(refused_line) == 1 and "refused by rank 0" in refused_line[0], nodes.log(2)
        assert "hidden_sizes [16, 16] vs [32, 32]" in refused_line[0]
        assert re.search(r"exit status 2$", nodes.log(2), re.M)
        log1 = nodes.log(1)
        nodes.kill(1)
        assert nodes.wait_workers_gone(0, 60), nodes.log(0)[-3000:]  # rank 0 finished on its own
        log0 = nodes.log(0)
    reclaim_stale_segments()  # node 1's rank was killed with its shared memory; a new run reclaims it
    assert rank_lines(log1, 1, r"resumed from .*latest.pt") and "eval:" not in log1  # rank 0 evaluates alone
    lost = re.findall(r"rank (\d) lost: .*; going on with rank\(s\) 0 alone", log0)
    assert len(lost) == 1, log0[-3000:]
    second = summary(run_dir)
    assert second["resumed_from"].endswith("latest.pt") and second["exit_code"] == 0
    assert second["stop_reason"].startswith("duration") and second["final_eval"]["eval_win_random"] is not None
    assert int(metrics(run_dir)[len(rows)]["global_step"]) > first["global_step"]  # the metrics go on from there
    assert second["ranks_lost"] == 2 and sorted(e["rank"] for e in second["lost_ranks"]) == [1, 2]
    killed, refused = int(lost[0]), 3 - int(lost[0])
    assert [e["reason"] for e in second["lost_ranks"] if e["rank"] == refused][0].startswith("refused")
    assert second["episodes_by_rank"][str(killed)] > 0 and str(refused) not in second["episodes_by_rank"]
    # The learner went on with its local worker after the loss.
    after = [r for r in metrics(run_dir)[len(rows):] if r["ranks_lost"] == "2"]
    assert len(after) >= 2 and int(after[-1]["global_step"]) > int(after[0]["global_step"])
    assert after[-1]["episodes_by_rank"].split(":")[killed] == str(second["episodes_by_rank"][str(killed)])


@pytest.mark.timeout(90)
def test_rank_0_killed_ends_node_1_in_one_line_leaving_nothing(tmp_path):
    with Nodes(tmp_path, SCRIPT, *CARTPOLE, "--duration", "0.05", "--output-dir", tmp_path / "run",
               env={"PRL_COLLECTIVE_TIMEOUT_S": "10"}) as nodes:
        assert wait_until(lambda: "its first" in nodes.log(0), 60), nodes.log(0)[-3000:]
        rank_1 = nodes.workers(1)[0]
        node_1 = [rank_1, *rank_1.children(recursive=True)]  # its rollout worker too
        nodes.kill(0)
        killed = time.monotonic()
        gone = wait_until(lambda: not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in node_1), 30)
        took = time.monotonic() - killed
        log1 = nodes.log(1)
    assert gone and took < 10 + 5, (took, log1[-3000:])
    failed = rank_lines(log1, 1, r"training failed")
    assert len(failed) == 1 and "rank 1: rank 0 (the learner) is gone" in failed[0], log1[-3000:]
    assert rank_lines(log1, 1, r"exit status 1$")
    assert not list(Path("/dev/shm").glob(f"prl_{rank_1.pid}_*"))  # node 1 released its shared memory
    reclaim_stale_segments()  # node 0's, killed with it


@pytest.mark.timeout(60)
def test_validate_only_under_torchrun(tmp_path):
    run_dir = tmp_path / "run"
    with Nodes(tmp_path, SCRIPT, *SELF_PLAY, "--validate-only", "--output-dir", run_dir) as nodes:
        assert nodes.wait(0, 45) == 0 and nodes.wait(1, 15) == 0, nodes.log(0) + nodes.log(1)
        logs = [nodes.log(0), nodes.log(1)]
    assert all("env_id: ConnectFour-v0" in log and "snapshot_interval: 2" in log for log in logs)
    assert not run_dir.exists()
