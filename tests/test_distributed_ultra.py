"""ultra_parallel_train_dqn.py under torchrun: Ape-X over two localhost nodes of one rank each.

Rank 0 learns over its shared-memory replay with its own actors; rank 1 runs actors only and ships
their transitions to rank 0 (common.transition_relay). Few launches, many assertions each: every
launch starts two torchrun agents, two ranks and their actors, and that start-up is most of a
test's time.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time

import numpy as np
import psutil
import pytest
from multinode import Nodes
from test_faults import wait_until

from common.checkpoint import load_checkpoint
from common.config import ConfigError
from common.replay import NStepAccumulator
from common.run import probe_env
from common.runlog import read_metrics
from common.shm import reclaim_stale_segments, segments_of
from common.transition_relay import one_batch, transition_schema

SCRIPT = "ultra_parallel_train_dqn.py"
TINY = ["--num-workers", "1", "--num-envs-per-worker", "4", "--batch-size", "32", "--buffer-size", "20000",
        "--learning-starts", "200", "--no-tensorboard", "--target-return", "none", "--total-episodes", "none",
        "--metrics-interval-s", "0.5", "--checkpoint-interval-s", "1", "--log-interval-s", "1"]
CARTPOLE = ["--env-id", "CartPole-v1", *TINY]
CATCH = ["--env-id", "Catch-v0", "--prioritized", *TINY]  # uint8 (1, 40, 40) frames, priorities from the actors
ENDLESS = ["--total-timesteps", str(10**9)]
FAST_FAILURE = {"PRL_COLLECTIVE_TIMEOUT_S": "10"}
# torchrun's agents share one TCP store with the ranks and keep it over restarts, so a restarted rank 0
# can read the dead ranks' addresses and fail to connect (pytorch/pytorch#135712): with --max-restarts
# across nodes each round needs a store of its own (docs/multi-node.md says so too).
ELASTIC = {**FAST_FAILURE, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
CATCH_ROW_BYTES = 2 * 1600 + 8 + 4 * 4  # obs and next_obs as uint8, action int64, reward/done/discount/priority f32


def ultra():
    import ultra_parallel_train_dqn

    return ultra_parallel_train_dqn


def rows(run_dir) -> list[dict]:
    try:
        return read_metrics(run_dir / "metrics.csv")
    except (FileNotFoundError, ValueError):
        return []


def rank_1_steps(metrics: list[dict]) -> float:
    """Rank 1's env steps over these metrics rows, from its rate in each (rank_sps is "rank 0:rank 1")."""
    steps, then = 0.0, None
    for row in metrics:
        now = float(row["wall_time"])
        if then is not None and ":" in row["rank_sps"]:
            steps += float(row["rank_sps"].split(":")[1]) * (now - then)
        then = now
    return steps


def rank_1_contributed(run_dir, since_row: int = 0) -> bool:
    """Rank 1's actors took enough steps to finish episodes (Catch's last 9) and a checkpoint exists."""
    return rank_1_steps(rows(run_dir)[since_row:]) >= 200 and any((run_dir / "checkpoints").glob("ultra_model_ep*"))


def summary(run_dir) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def saved_step(run_dir) -> int:
    newest = max((run_dir / "checkpoints").glob("ultra_model_ep*.pt"), key=os.path.getmtime)
    return load_checkpoint(newest)["counters"]["global_step"]


# ----------------------------------------------------------------------------- in-process units

def test_actor_rank_batches_keep_uint8_and_the_schema_refuses_what_does_not_fit():
    cfg = ultra().Config(env_id="Catch-v0", prioritized=True, num_workers=2)
    env = probe_env("Catch-v0", actions=("Discrete",))
    schema = transition_schema(cfg, env)
    acc = NStepAccumulator(3, 0.99, 2, (1, 40, 40), np.uint8)
    frames = np.full((2, 1, 40, 40), 255, np.uint8)
    batches = []
    for step in range(5):  # as an actor's pipe delivers them: one batch per vector step
        batch = acc.push(frames, np.array([0, 2]), np.ones(2, np.float32), frames, np.array([step == 4, False]),
                         np.zeros(2, bool))
        if batch is not None:
            batches.append({**batch, "priorities": np.full(len(batch["actions"]), 0.5, np.float32)})
    arrays = one_batch(batches, schema)
    count = len(arrays["actions"])
    assert arrays["obs"].dtype == np.uint8 and arrays["next_obs"].dtype == np.uint8
    assert sum(a.nbytes for a in arrays.values()) == count * CATCH_ROW_BYTES
    info = {"steps": 10, "rows": [count - 1, 1], "episodes": [{"return": 1.0, "length": 5, "epsilon": 0.3}]}
    assert schema.check(arrays, info) is None

    def refused(why: str, info=info, **changed) -> None:
        message = schema.check({**arrays, **changed}, info)
        assert message is not None and why in message, message

    refused("obs is float32", obs=arrays["obs"].astype(np.float32))
    refused("actions out of range", actions=np.full(count, 3))
    refused("dones holds non-integral", dones=np.full(count, 0.5, np.float32))
    refused("discounts out of range", discounts=np.full(count, 1.5, np.float32))
    refused("priorities out of range", priorities=np.full(count, -1.0, np.float32))
    refused("rewards holds NaN", rewards=np.full(count, np.nan, np.float32))
    refused("split among 2 actors", info={**info, "rows": [count, 1]})
    refused("episodes that are not numbers", info={**info, "episodes": [{"return": "lots", "length": 5}]})
    assert "instead of" in schema.check({k: v for k, v in arrays.items() if k != "priorities"}, info)


def test_sync_mode_is_refused_under_torchrun_with_several_ranks(monkeypatch):
    for name, value in {"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match="async-training False: must be true under torchrun"):
        ultra().Config(async_training=False).validate()
    cfg = ultra().Config(num_workers=3)
    assert cfg.num_actors == 6  # num_workers is per rank; the epsilon spread and the replay count every rank's
    assert ultra().MODE.distributed and ultra().MODE.cpu_collectives  # gloo between ranks, whatever the device


# ----------------------------------------------------------------------------- two localhost nodes

@pytest.mark.timeout(240)
def test_both_nodes_fill_one_replay_ctrl_c_on_node_1_stops_both_and_the_resumed_run_survives_losing_it(tmp_path):
    run_dir = tmp_path / "apex"
    with Nodes(tmp_path, SCRIPT, *CATCH, *ENDLESS, "--output-dir", run_dir, env=FAST_FAILURE) as nodes:
        assert wait_until(lambda: rank_1_contributed(run_dir), 150), nodes.log(0)[-3000:] + nodes.log(1)[-3000:]
        os.killpg(nodes.procs[1].pid, signal.SIGINT)  # Ctrl+C in node 1's terminal (its torchrun passes it on)
        assert wait_until(lambda: (run_dir / "summary.json").exists(), 60), nodes.log(0)[-3000:]
        assert nodes.wait_workers_gone(1, 30) and nodes.wait_workers_gone(0, 30)
        first, second = nodes.log(0), nodes.log(1)
    assert "exit status 130" in first and "[rank 1] exit status 130" in second, first[-2000:] + second[-2000:]
    done = summary(run_dir)
    assert done["exit_code"] == 130 and done["stop_reason"] == "interrupted" and done["world_size"] == 2
    # Both nodes' actors reached rank 0's replay, and their episodes its statistics.
    for key in ("rank_steps", "rank_transitions", "rank_episodes"):
        assert done[key]["0"] > 0 and done[key]["1"] > 0, (key, done)
    assert done["global_step"] == done["rank_steps"]["0"] + done["rank_steps"]["1"]
    traffic = done["rank_traffic"]["1"]
    assert traffic["rows"] >= done["rank_transitions"]["1"] > 0
    per_row = traffic["mib"] * 2**20 / traffic["rows"]
    # uint8 frames on the wire: float32 would be 4x (the rest is the messages' JSON, heartbeats included)
    assert CATCH_ROW_BYTES <= per_row < 2 * CATCH_ROW_BYTES, per_row
    assert done["ranks_lost"] == 0 and done["prioritized"]
    # Rank 0 alone wrote the run directory.
    written = {str(p.relative_to(run_dir)) for p in run_dir.rglob("*") if p.is_file()}
    assert {f for f in written if not f.startswith("checkpoints/ultra_model_ep")} == {
        ".lock", "config.yaml", "logs/main.log", "metrics.csv", "summary.json", "plots/training_curve.png",
        "plots/ultra_training_results.png"}, written
    log = (run_dir / "logs" / "main.log").read_text()
    assert "rank 1 received signal 2: stopping every rank" in log and "[rank 1]" not in log
    saved = saved_step(run_dir)
    assert saved == done["global_step"]
    before = len(rows(run_dir))
    (run_dir / "summary.json").unlink()  # the resumed run writes its own

    # The same command with --resume auto continues; then node 1 is killed with kill -9 and rank 0 goes on.
    resume = tmp_path / "resume"
    resume.mkdir()
    with Nodes(resume, SCRIPT, *CATCH, *ENDLESS, "--output-dir", run_dir, "--resume", "auto",
               env=FAST_FAILURE) as nodes:
        assert wait_until(lambda: rank_1_contributed(run_dir, since_row=before), 150), \
            nodes.log(0)[-3000:] + nodes.log(1)[-3000:]
        rank_1 = nodes.workers(1)[0].pid
        nodes.kill(1)
        assert wait_until(lambda: "rank 1 lost" in (run_dir / "logs" / "main.log").read_text(), 30)
        lost_at = len(rows(run_dir))
        assert wait_until(lambda: len(rows(run_dir)) >= lost_at + 3, 30), "the learner stopped with node 1"
        os.killpg(nodes.procs[0].pid, signal.SIGINT)  # (torchrun would wait minutes for node 1 at its exit)
        assert wait_until(lambda: (run_dir / "summary.json").exists(), 60), nodes.log(0)[-3000:]
        assert nodes.wait_workers_gone(0, 30)
    reclaim_stale_segments()  # what the killed rank left, as the next run on its node does
    assert segments_of(rank_1) == []
    done = summary(run_dir)
    assert done["exit_code"] == 130 and done["resumed_from"]
    log = (run_dir / "logs" / "main.log").read_text()
    assert f"resumed from {run_dir / 'checkpoints'}" in log and f"at step {saved}" in log
    steps = [int(r["global_step"]) for r in rows(run_dir)]
    assert steps[before] > saved and steps[-1] > steps[lost_at - 1]  # continued the count, and after the loss
    assert re.search(r"rank 1 lost: .*; going on with rank\(s\) 0 alone", log), log[-2000:]
    assert done["ranks_lost"] == 1 and done["lost_ranks"][0]["rank"] == 1 and done["rank_steps"]["1"] > 0


@pytest.mark.timeout(240)
def test_elastic_restart_resumes_every_rank_then_rank_0_death_ends_node_1_within_the_timeout(tmp_path):
    run_dir = tmp_path / "elastic"
    with Nodes(tmp_path, SCRIPT, *CARTPOLE, *ENDLESS, "--output-dir", run_dir, max_restarts=1,
               env=ELASTIC) as nodes:
        assert wait_until(lambda: len(rows(run_dir)) >= 2 and any((run_dir / "checkpoints").glob("*.pt")), 150), \
            nodes.log(0)[-3000:] + nodes.log(1)[-3000:]
        nodes.workers(1)[0].kill()  # rank 1's process, not its torchrun: torchrun restarts every rank
        main_log = run_dir / "logs" / "main.log"
        assert wait_until(lambda: "resumed from" in main_log.read_text(), 120), nodes.log(0)[-3000:]
        # Before its restart rank 0 got torchrun's SIGTERM: it saved a checkpoint and exited 143.
        log = main_log.read_text()
        interrupted = log[:log.index("resumed from")]
        assert "SIGTERM received" in interrupted and "exit status 143" in interrupted, interrupted[-2000:]
        resumed_at = int(re.search(r"resumed from .*ultra_model_ep\d+\.pt at step (\d+)", log)[1])
        assert resumed_at == int(re.findall(r"checkpoint saved: .* \(step (\d+)\)", interrupted)[-1]) > 0
        assert wait_until(lambda: "[rank 1] resumed from" in nodes.log(1), 30)
        assert wait_until(lambda: int(rows(run_dir)[-1]["global_step"]) > resumed_at, 60)

        # Rank 0's node dies: node 1 ends within PRL_COLLECTIVE_TIMEOUT_S, every process and segment with it.
        rank_1 = nodes.workers(1)[0]
        tree = [rank_1, *rank_1.children(recursive=True)]
        rank_0 = nodes.workers(0)[0].pid
        nodes.kill(0)
        killed = time.monotonic()
        assert nodes.wait_workers_gone(1, 30), nodes.log(1)[-3000:]
        assert time.monotonic() - killed < 20  # PRL_COLLECTIVE_TIMEOUT_S is 10 s; a broken connection shows at once
        assert not [p.pid for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        text = nodes.log(1)
    assert segments_of(rank_1.pid) == []
    assert "[rank 1] training failed: rank 1: rank 0 (the learner) is gone" in text, text[-3000:]
    reclaim_stale_segments()  # what the killed rank 0 left: the next run on that node reclaims it
    assert segments_of(rank_0) == []
    steps = [int(r["global_step"]) for r in rows(run_dir)]
    assert steps == sorted(steps) and steps[-1] > resumed_at  # the restarted job continued the count (no restart at 0)


@pytest.mark.timeout(180)
def test_a_mismatched_node_is_refused_and_validate_only_works_under_torchrun(tmp_path):
    (tmp_path / "check").mkdir()
    with Nodes(tmp_path / "check", SCRIPT, *CARTPOLE, "--validate-only") as nodes:
        assert nodes.wait(0, 60) == 0 and nodes.wait(1, 60) == 0, nodes.log(0)[-2000:] + nodes.log(1)[-2000:]
        assert "env_id: CartPole-v1" in nodes.log(0) and "env_id: CartPole-v1" in nodes.log(1)

    run_dir = tmp_path / "alone"
    with Nodes(tmp_path, SCRIPT, *CARTPOLE, "--total-timesteps", "3000", "--output-dir", run_dir,
               per_node={1: ["--n-step", "5"]}, env=FAST_FAILURE) as nodes:
        assert wait_until(lambda: (run_dir / "summary.json").exists(), 150), nodes.log(0)[-3000:]
        assert nodes.wait_workers_gone(1, 10)
        refused = nodes.log(1)
    assert re.search(r"error: rank 1 refused by rank 0: .*n_step 5 vs 3", refused), refused[-2000:]
    assert "[rank 1] exit status 2" in refused
    done = summary(run_dir)
    assert done["exit_code"] == 0 and done["global_step"] >= 3000 and done["rank_steps"]["1"] == 0
    assert done["ranks_lost"] == 1 and done["lost_ranks"][0]["reason"].startswith("refused")
