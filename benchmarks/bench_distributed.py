"""DD-PPO on one machine: 2 torchrun ranks of 1 worker each vs 1 process with 2 workers.

    python benchmarks/bench_distributed.py [--seconds 60] [--env-id LunarLander-v3]

Both runs use the same total number of environments (2 x 8) and rollout length. Prints
steps/s of both and, for the distributed run, the time and bytes of the gradient
all-reduces per update next to the whole update time; appends the table to
benchmarks/results/distributed.md.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "distributed.md"


def read_rows(run_dir: Path) -> list[dict]:
    with open(run_dir / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--env-id", default="LunarLander-v3")
    args = parser.parse_args()
    common = ["--env-id", args.env_id, "--num-envs-per-worker", "8", "--n-steps", "256", "--batch-size", "1024",
              "--target-return", "none", "--no-tensorboard", "--duration", str(args.seconds / 3600)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    load = os.getloadavg()[0]
    table = []
    with tempfile.TemporaryDirectory(prefix="prl_bench_dd_") as tmp:
        runs = {
            "1 rank x 2 workers": [sys.executable, str(ROOT / "train_parallel_timed.py"), "--num-workers", "2"],
            "2 ranks x 1 worker (torchrun, gloo)": [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                    "--nproc-per-node", "2", str(ROOT / "train_parallel_timed.py"),
                                                    "--num-workers", "1"],
        }
        for i, (name, command) in enumerate(runs.items()):
            run_dir = Path(tmp) / f"run{i}"
            proc = subprocess.run([*command, *common, "--output-dir", str(run_dir)], env=env, capture_output=True,
                                  text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"{name} failed: {proc.stderr[-2000:]}")
            rows = read_rows(run_dir)[1:]  # the first update includes start-up
            steps = float(rows[-1]["global_step"]) - float(rows[0]["global_step"])
            seconds = float(rows[-1]["wall_time"]) - float(rows[0]["wall_time"])
            update_ms = statistics.median(float(r["update_ms"]) for r in rows)
            allreduce = statistics.median(float(r["allreduce_ms"]) for r in rows)
            kib = statistics.median(float(r["allreduce_kib"]) for r in rows)
            table.append([name, f"{steps / seconds:.0f}", f"{update_ms:.1f}", f"{allreduce:.1f}", f"{kib:.0f}",
                          len(rows)])
    lines = [f"## {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, {os.cpu_count()} cores, load average at start "
             f"{load:.2f}, {args.env_id}, {args.seconds:.0f} s per run",
             "", "| run | steps/s | update ms (median) | all-reduce ms per update | KiB all-reduced per update "
             "| updates |", "|---|---|---|---|---|---|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in table]
    text = "\n".join(lines) + "\n"
    print(text)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    with open(RESULTS, "a") as f:
        f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
