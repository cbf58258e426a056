"""What torchrun costs, in every mode: 1 node x 2 workers against 2 localhost nodes x 1 worker each.

    python benchmarks/bench_distributed.py [--seconds 60] [--modes timed ultra dqn population] [--repeats 3]

Both forms run the same total number of workers and environments on this machine. The single
node is the script as usual (``--num-workers 2``); the two nodes are two ``torchrun`` invocations
joined by one c10d rendezvous on 127.0.0.1, each with ``--num-workers 1`` (``num_workers`` is per
rank). The figure is env steps per second of the whole job over the run's second half (start-up
and the first updates excluded), read from rank 0's ``metrics.csv``; the ratio is two nodes over
one node, medians over ``--repeats`` runs. Whole-process times (start-up included) are reported
next to them. DD-PPO also gets the time and bytes of its gradient all-reduces per update.
Appends the table to benchmarks/results/distributed.md.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "distributed.md"

# Each mode on a config that keeps its learner busy and its actors honest on 2 cores.
MODES = {
    "timed": ("train_parallel_timed.py", ["--env-id", "LunarLander-v3", "--num-envs-per-worker", "8", "--n-steps",
                                          "256", "--batch-size", "1024", "--target-return", "none"]),
    "ultra": ("ultra_parallel_train_dqn.py", ["--config", "configs/ultra_cartpole.yaml", "--target-return", "none",
                                              "--total-episodes", "none"]),
    "dqn": ("parallel_train_dqn.py", ["--config", "configs/parallel_dqn_cartpole.yaml", "--target-return", "none",
                                      "--total-episodes", "none", "--eval-interval", "0"]),
    "population": ("train_ppo_multiprocess.py", ["--env-id", "CartPole-v1", "--target-return", "none",
                                                 "--max-steps-per-worker", "none", "--eval-episodes", "2",
                                                 "--threads-per-worker", "1"]),
}
# Two torchrun agents on one machine each see every core (LOCAL_WORLD_SIZE is 1 in each), so left to
# itself a member on each of the two "nodes" would take 2 torch threads: 4 on 2 cores, which real nodes
# never share. One thread per member, as the single node gives its 2 members, compares like with like.


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def single(script: str, args: list[str]) -> list[list[str]]:
    return [[sys.executable, str(ROOT / script), "--num-workers", "2", *args]]


def two_nodes(script: str, args: list[str]) -> list[list[str]]:
    port = free_port()
    return [[sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
             "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"bench{port}",
             "--rdzv-conf", f"is_host={int(node == 0)}", str(ROOT / script), "--num-workers", "1", *args]
            for node in range(2)]


def run_job(commands: list[list[str]], run_dir: Path, seconds: float) -> dict:
    """Start every node's command, wait for rank 0's summary; the whole-process time and the rows."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_WAIT_POLICY": "PASSIVE"}
    extra = ["--duration", str(seconds / 3600), "--no-tensorboard", "--output-dir", str(run_dir)]
    started = time.monotonic()
    procs = []
    for command in commands:
        procs.append(subprocess.Popen([*command, *extra], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, start_new_session=True))
        time.sleep(0.5 if len(commands) > 1 else 0)  # node 0 first: it hosts the rendezvous and gets rank 0
    outputs = [p.communicate(timeout=seconds + 300)[0] for p in procs]
    process_s = time.monotonic() - started
    if any(p.returncode != 0 for p in procs):
        raise RuntimeError(f"a node failed: {[p.returncode for p in procs]}\n" + "\n".join(o[-1500:] for o in outputs))
    with open(run_dir / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    return {"process_s": process_s, "rows": rows, "summary": json.loads((run_dir / "summary.json").read_text())}


def steady_sps(rows: list[dict]) -> float:
    """Env steps per second over the second half of the run (the rows are in wall-time order)."""
    rows = [r for r in rows if r.get("wall_time")]
    half = rows[len(rows) // 2:]
    steps = float(half[-1]["global_step"]) - float(half[0]["global_step"])
    return steps / max(1e-9, float(half[-1]["wall_time"]) - float(half[0]["wall_time"]))


def allreduce(rows: list[dict]) -> str:
    values = [float(r["allreduce_ms"]) for r in rows if r.get("allreduce_ms")]
    kib = [float(r["allreduce_kib"]) for r in rows if r.get("allreduce_kib")]
    return f"{statistics.median(values):.1f} ms, {statistics.median(kib):.0f} KiB" if values else ""


def measure(mode: str, seconds: float, repeats: int, tmp: Path) -> list:
    script, args = MODES[mode]
    results = {"1 node x 2 workers": [], "2 nodes x 1 worker": []}
    for repeat in range(repeats):
        for name, build in (("1 node x 2 workers", single), ("2 nodes x 1 worker", two_nodes)):
            job = run_job(build(script, args), tmp / f"{mode}_{repeat}_{len(results[name])}_{name[0]}", seconds)
            results[name].append(job)
            print(f"{mode} {name} #{repeat + 1}: {steady_sps(job['rows']):.0f} steps/s, "
                  f"process {job['process_s']:.1f} s", flush=True)
    one, two = (statistics.median(steady_sps(j["rows"]) for j in results[k]) for k in results)
    row = [mode]
    for name, sps in zip(results, (one, two)):
        jobs = results[name]
        row += [f"{sps:.0f}", f"{statistics.median(j['process_s'] for j in jobs):.1f}"]
    row += [f"{two / one:.2f}", allreduce(results["2 nodes x 1 worker"][0]["rows"])]
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="training seconds per run (--duration)")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="prl_bench_dist_") as tmp:
        table = [measure(mode, args.seconds, args.repeats, Path(tmp)) for mode in args.modes]
    lines = [f"## {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, {os.cpu_count()} cores, load average at start {load:.2f}, "
             f"{args.seconds:.0f} s of training per run, medians of {args.repeats}",
             "", "| mode | 1 node x 2 workers: steps/s | process s | 2 nodes x 1 worker: steps/s | process s "
             "| ratio | DD-PPO all-reduce per update |", "|---|---|---|---|---|---|---|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in table]
    text = "\n".join(lines) + "\n"
    print(text)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    with open(RESULTS, "a") as f:
        f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
