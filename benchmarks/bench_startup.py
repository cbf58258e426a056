"""Start-up time of the commands a user types first, and of a training run (not part of the test suite).

    python benchmarks/bench_startup.py             # median of 5 runs of each command
    python benchmarks/bench_startup.py --repeats 9
    python benchmarks/bench_startup.py --compare REV          # the same commands here and at revision REV
    python benchmarks/bench_startup.py --runs --compare REV   # training runs, here and at git revision REV

Measures, in fresh processes, ``launch_parallel_training.py --check-only`` (also with a
128-core, 1-GPU machine's facts assumed), ``--help`` of the launcher and of every script, and
``--validate-only`` of every training script: the wall time from process start to exit. Each should
answer in under a second (torch, TensorBoard and matplotlib load only when a run starts). The table
is printed and written to benchmarks/results/startup.md (replacing the previous one), with the
machine's load at the start.

With ``--runs``, short training runs of ``train_parallel_timed.py`` instead (:data:`RUNS`, a fixed
step budget each): the start-up its summary reports (process start to the first env step of a
worker), the training seconds and the whole process's wall time, medians of ``--repeats`` seeds.
``--compare REV`` runs the same commands, alternating, in a temporary git worktree of revision REV,
so both sides share the machine's state. The table is printed and appended to
benchmarks/results/startup_runs.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "startup.md"
RUNS_RESULTS = ROOT / "benchmarks" / "results" / "startup_runs.md"
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
    ["train_parallel_timed.py", "--validate-only"],
    ["parallel_train_dqn.py", "--validate-only"],
    ["ultra_parallel_train_dqn.py", "--validate-only"],
    ["train_ppo_multiprocess.py", "--validate-only"],
]


def time_command(args: list[str], repeats: int, trees: dict[str, Path]) -> dict[str, tuple[list[float], int]]:
    """Wall seconds of ``repeats`` fresh runs in each tree, alternately (after one warm-up run each that fills
    the file cache), and the exit status."""
    def once(tree: Path) -> tuple[float, int]:
        started = time.perf_counter()
        status = subprocess.run([sys.executable, *args], cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)},
                                capture_output=True).returncode
        return time.perf_counter() - started, status

    statuses = {label: once(tree)[1] for label, tree in trees.items()}
    seconds: dict[str, list[float]] = {label: [] for label in trees}
    for _ in range(repeats):
        for label, tree in trees.items():
            seconds[label].append(once(tree)[0])
    return {label: (seconds[label], statuses[label]) for label in trees}


@contextlib.contextmanager
def trees_to_time(compare: str | None):
    """This checkout, and a temporary git worktree of revision ``compare`` if one is asked for."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip() or "this checkout"
    trees = {f"{head} (this checkout)": ROOT}
    with tempfile.TemporaryDirectory(prefix="prl_startup_") as tmp:
        worktree = Path(tmp) / "compare"
        if compare:
            subprocess.run(["git", "worktree", "add", "--detach", "-q", str(worktree), compare], cwd=ROOT, check=True)
            trees[compare] = worktree
        try:
            yield trees, Path(tmp)
        finally:
            if compare:
                subprocess.run(["git", "worktree", "remove", "--force", str(worktree)], cwd=ROOT)


RUNS = {
    "CartPole-v1, 2 workers x 8 envs": ["--env-id", "CartPole-v1", "--num-workers", "2", "--total-timesteps", "40960"],
    "LunarLander-v3, the defaults (2 workers x 8 envs)": ["--total-timesteps", "40960"],
    "CartPole-v1, configs/cartpole_fast.yaml (0 workers)": ["--config", "configs/cartpole_fast.yaml"],
}


def time_run(tree: Path, args: list[str], seed: int, out: Path) -> tuple[float, float, float]:
    """(start-up s, training s, whole-process wall s) of one run of train_parallel_timed.py in ``tree``."""
    shutil.rmtree(out, ignore_errors=True)
    command = [sys.executable, str(tree / "train_parallel_timed.py"), *args, "--seed", str(seed),
               "--output-dir", str(out), "--no-tensorboard"]
    started = time.perf_counter()
    proc = subprocess.run(command, cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)}, capture_output=True,
                          text=True)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} exited {proc.returncode}: {proc.stderr[-1000:]}")
    summary = json.loads((out / "summary.json").read_text())
    return summary["time_budget"]["startup_s"], summary["wall_time_s"], wall


def bench_runs(repeats: int, compare: str | None) -> int:
    load = os.getloadavg()
    started = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    with trees_to_time(compare) as (trees, tmp):
        rows = []
        for name, args in RUNS.items():
            seen: dict[str, list] = {label: [] for label in trees}
            for seed in range(1, repeats + 1):
                for label, tree in trees.items():  # alternately, so both sides see the same machine
                    seen[label].append(time_run(tree, args, seed, tmp / "run"))
            for label, runs in seen.items():
                medians = [statistics.median(run[i] for run in runs) for i in range(3)]
                rows.append(f"| {name} | {label} | {medians[0]:.2f} | {medians[1]:.2f} | {medians[2]:.2f} |")
                print(rows[-1], flush=True)
    command = f"python benchmarks/bench_startup.py --runs --repeats {repeats}"
    command += f" --compare {compare}" if compare else ""
    lines = [f"## {started}, {os.cpu_count()} logical cores, load average at start {load[0]:.2f} {load[1]:.2f} "
             f"{load[2]:.2f}", "", f"`{command}`: medians of {repeats} seeds, run alternately.", "",
             "| run | code | start-up s (to the first env step) | training s | whole process s |",
             "|---|---|---|---|---|", *rows, ""]
    if not RUNS_RESULTS.exists():
        RUNS_RESULTS.write_text("# Start-up of training runs\n\nAppended to by `python benchmarks/bench_startup.py "
                                "--runs`.\n\n")
    with open(RUNS_RESULTS, "a") as f:
        f.write("\n".join(lines) + "\n")
    print(f"appended to {RUNS_RESULTS.relative_to(ROOT)}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--runs", action="store_true", help="time short training runs instead of --help")
    parser.add_argument("--compare", metavar="REV", help="also run git revision REV, alternately")
    opts = parser.parse_args()
    if opts.runs:
        return bench_runs(opts.repeats, opts.compare)
    load = os.getloadavg()
    started = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    rows = []
    with trees_to_time(opts.compare) as (trees, _):
        for args in COMMANDS:
            for label, (seconds, status) in time_command(args, opts.repeats, trees).items():
                median = statistics.median(seconds)
                rows.append(f"| `{' '.join(args)}` | {label} | {median:.2f} | {min(seconds):.2f} | {max(seconds):.2f} "
                            f"| {status} | {'yes' if median < TARGET_S else '**no**'} |")
                print(rows[-1], flush=True)
    command = "python benchmarks/bench_startup.py" + (f" --compare {opts.compare}" if opts.compare else "")
    header = [
        "# Start-up times",
        "",
        f"`{command}` (replaces this file). Wall time of a fresh process, from start "
        f"to exit, median of {opts.repeats} runs after one warm-up run (of each code, alternately).",
        "",
        f"## {started}, {platform.machine()}, {os.cpu_count()} logical cores, Python {platform.python_version()}, "
        f"load average at start {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}",
        "",
        f"| command | code | median s | min s | max s | exit status | under {TARGET_S:.0f} s |",
        "|---|---|---|---|---|---|---|",
    ]
    RESULTS.write_text("\n".join(header + rows) + "\n")
    print(f"written to {RESULTS.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
