"""Start-up time of the commands a user types first (not part of the test suite).

    python benchmarks/bench_startup.py             # median of 5 runs of each command
    python benchmarks/bench_startup.py --repeats 9

Measures, in fresh processes, ``launch_parallel_training.py --check-only`` (also with a
128-core, 1-GPU machine's facts assumed) and ``--help`` of the launcher and of every script:
the wall time from process start to exit. Each should answer in under a second (torch,
TensorBoard and matplotlib load only when a run starts). The table is printed and written to
benchmarks/results/startup.md (replacing the previous one), with the machine's load at the start.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "startup.md"
TARGET_S = 1.0
COMMANDS = [
    ["launch_parallel_training.py", "--check-only"],
    ["launch_parallel_training.py", "--check-only", "--assume-facts", "configs/machines/workstation_128core_1gpu.json"],
    ["launch_parallel_training.py", "--help"],
    ["train_parallel_timed.py", "--help"],
    ["parallel_train_dqn.py", "--help"],
    ["ultra_parallel_train_dqn.py", "--help"],
    ["train_ppo_multiprocess.py", "--help"],
    ["compare_results.py", "--help"],
]


def time_command(args: list[str], repeats: int) -> tuple[list[float], int]:
    """Wall seconds of ``repeats`` fresh runs (after one warm-up run that fills the file cache)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, *args]
    status = subprocess.run(command, cwd=ROOT, env=env, capture_output=True).returncode
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        subprocess.run(command, cwd=ROOT, env=env, capture_output=True)
        seconds.append(time.perf_counter() - started)
    return seconds, status


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    opts = parser.parse_args()
    load = os.getloadavg()
    started = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    rows = []
    for args in COMMANDS:
        seconds, status = time_command(args, opts.repeats)
        median = statistics.median(seconds)
        rows.append(f"| `{' '.join(args)}` | {median:.2f} | {min(seconds):.2f} | {max(seconds):.2f} | {status} | "
                    f"{'yes' if median < TARGET_S else '**no**'} |")
        print(rows[-1], flush=True)
    header = [
        "# Start-up times",
        "",
        "`python benchmarks/bench_startup.py` (replaces this file). Wall time of a fresh process, from start "
        f"to exit, median of {opts.repeats} runs after one warm-up run.",
        "",
        f"## {started}, {platform.machine()}, {os.cpu_count()} logical cores, Python {platform.python_version()}, "
        f"load average at start {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}",
        "",
        f"| command | median s | min s | max s | exit status | under {TARGET_S:.0f} s |",
        "|---|---|---|---|---|---|",
    ]
    RESULTS.write_text("\n".join(header + rows) + "\n")
    print(f"written to {RESULTS.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
