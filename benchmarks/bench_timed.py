"""Benchmarks of train_parallel_timed.py (not part of the test suite).

    python benchmarks/bench_timed.py cartpole   # time to solve CartPole-v1 (475), 5 seeds
    python benchmarks/bench_timed.py lunar      # LunarLander-v3 to 200 on the default settings, 5 seeds
    python benchmarks/bench_timed.py lunar --variant "async=--async-training"   # and beside a variant
    python benchmarks/bench_timed.py scaling    # steps/s with 0, 1, 2 workers on CartPole and LunarLander
    python benchmarks/bench_timed.py learners   # the numpy and the torch learner, update time and whole process
    python benchmarks/bench_timed.py all

Every run is a real run of the script in a fresh process; the numbers come from its
metrics.csv and summary.json. A markdown table is printed and appended to
benchmarks/results/timed.md together with the machine load at the start.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "timed.md"
SCRIPT = ROOT / "train_parallel_timed.py"


def run(args: list[str], run_dir: Path) -> tuple[dict, list[dict], float]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    started = time.monotonic()
    proc = subprocess.run([sys.executable, str(SCRIPT), *args, "--output-dir", str(run_dir), "--no-tensorboard"],
                          env=env, capture_output=True, text=True)
    process_seconds = time.monotonic() - started
    if proc.returncode != 0:
        raise RuntimeError(f"run failed ({proc.returncode}): {proc.stderr[-2000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    with open(run_dir / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    return summary, rows, process_seconds


def first_reaching(rows: list[dict], threshold: float) -> dict | None:
    for row in rows:
        if row["return_mean100"] and float(row["return_mean100"]) >= threshold:
            return row
    return None


def table(headers: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def bench_cartpole(tmp: Path, seeds: int) -> str:
    rows_out, times, collect_rates = [], [], []
    for seed in range(1, seeds + 1):
        summary, rows, process_s = run(["--config", str(ROOT / "configs" / "cartpole_fast.yaml"), "--seed", str(seed)],
                                       tmp / f"cartpole_{seed}")
        hit = first_reaching(rows, 475)
        solve_s = float(hit["wall_time"]) if hit else float("nan")
        times.append(solve_s)
        collection = summary["global_step"] / summary["time_budget"]["collect_s"]  # the rollouts alone
        collect_rates.append(collection)
        rows_out.append([seed, f"{solve_s:.2f}" if hit else "not solved", hit["global_step"] if hit else "-",
                         f"{process_s:.1f}", f"{summary['sps']:.0f}", f"{collection:.0f}"])
    median = statistics.median(times)
    rows_out.append(["**median**", f"**{median:.2f}**", "", "", "", f"**{statistics.median(collect_rates):.0f}**"])
    return ("### Time to solve CartPole-v1 (mean of last 100 episodes >= 475), configs/cartpole_fast.yaml\n\n"
            + table(["seed", "training seconds to solve", "env steps", "process seconds (incl. start-up)",
                     "steps/s", "collection steps/s"], rows_out))


def bench_lunar(tmp: Path, seeds: int, variants: dict[str, list[str]]) -> str:
    """LunarLander-v3 to 200, seeds 1..N, each variant's run of a seed right after the others' (so the machine's
    load falls on them alike): the whole process (start-up included) and the training to 200 of each."""
    results: dict[str, list] = {name: [] for name in variants}
    for seed in range(1, seeds + 1):
        for name, extra in variants.items():
            summary, _, process_s = run([*extra, "--seed", str(seed)], tmp / f"lunar_{name}_{seed}")
            reached = summary["stop_reason"].startswith("target return")  # stopped at the target: its wall time
            results[name].append((seed, process_s if reached else float("inf"), summary["wall_time_s"],
                                  summary["global_step"] if reached else None, summary["stop_reason"]))
    out = []
    for name, runs in results.items():
        process = [r[1] for r in runs]
        out.append([name, " / ".join(f"{p:.1f}" if p != float("inf") else "not reached" for p in process),
                    f"**{statistics.median(process):.1f}**", f"{max(process):.1f}",
                    f"{statistics.median(r[2] for r in runs):.1f}",
                    " / ".join(f"{r[3]:,}" if r[3] else "-" for r in runs)])
    missed = [f"{name}, seed {r[0]}: stopped with \"{r[4]}\"" for name, runs in results.items() for r in runs
              if r[3] is None]
    return (f"### LunarLander-v3 to 200, seeds 1-{seeds}, whole process (start-up included)\n\n"
            + "\n".join(f"- {name}: `python train_parallel_timed.py {' '.join(extra)} --seed S`"
                        for name, extra in variants.items()) + "\n\n"
            + table(["settings", "whole process per seed (s)", "median (s)", "slowest (s)",
                     "training, median (s)", "env steps to 200 per seed"], out)
            + "".join(f"\n\n- {line}" for line in missed))


def bench_scaling(tmp: Path, seconds: float) -> str:
    out = []
    for env_id in ("CartPole-v1", "LunarLander-v3"):
        for workers in (0, 1, 2):
            summary, rows, _ = run(["--env-id", env_id, "--num-workers", str(workers), "--num-envs-per-worker", "8",
                                    "--n-steps", "256", "--batch-size", "1024", "--target-return", "none",
                                    "--duration", str(seconds / 3600)], tmp / f"scale_{env_id}_{workers}")
            collect = [float(r["collect_sps"]) for r in rows[1:]]  # the first rollout includes start-up
            out.append([env_id, workers, 8 * max(1, workers), f"{statistics.median(collect):.0f}",
                        f"{summary['sps']:.0f}"])
    lunar = {row[1]: float(row[3]) for row in out if row[0] == "LunarLander-v3"}
    ratio = lunar[2] / lunar[1]
    return (f"### Scaling ({seconds:.0f} s runs, 8 envs per worker, n_steps 256)\n\n"
            + table(["env", "workers", "envs", "collection steps/s (median)", "whole-training steps/s"], out)
            + f"\n\nLunarLander-v3 collection, 2 workers / 1 worker: **{ratio:.2f}x**")


def bench_learners(tmp: Path, seeds: int) -> str:
    """The numpy and the torch learner on the same runs: a fixed number of updates from the same seeds, so
    the updates are alike and only the learner's arithmetic differs."""
    cartpole = ["--config", str(ROOT / "configs" / "cartpole_fast.yaml"), "--total-timesteps", "61440"]
    runs = {"CartPole-v1, configs/cartpole_fast.yaml, 61,440 steps": cartpole,
            "LunarLander-v3, the defaults, 262,144 steps": ["--total-timesteps", "262144"]}
    out = []
    for name, args in runs.items():
        for learner in ("torch", "numpy"):
            update_ms, process, training = [], [], []
            for seed in range(1, seeds + 1):
                summary, rows, process_s = run([*args, "--seed", str(seed), "--target-return", "none",
                                                "--learner", learner], tmp / f"learner_{len(out)}_{learner}_{seed}")
                update_ms.append(statistics.median(float(r["update_ms"]) for r in rows))
                process.append(process_s)
                training.append(summary["wall_time_s"])
            out.append([name, learner, f"{statistics.median(update_ms):.1f}", f"{statistics.median(training):.2f}",
                        f"{statistics.median(process):.2f}"])
    return (f"### The two learners (medians of {seeds} seeds)\n\n"
            + table(["run", "learner", "update ms (median per run)", "training s", "whole process s"], out))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("which", choices=["cartpole", "lunar", "scaling", "learners", "all"])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--scaling-seconds", type=float, default=40.0)
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=ARGS",
                        help="lunar: a variant of the defaults to run beside them, e.g. 'async=--async-training'")
    args = parser.parse_args()
    load = os.getloadavg()
    header = (f"## {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, {os.cpu_count()} cores, "
              f"load average at start {load[0]:.2f}")
    sections = []
    with tempfile.TemporaryDirectory(prefix="prl_bench_") as tmp:
        tmp = Path(tmp)
        if args.which in ("cartpole", "all"):
            sections.append(bench_cartpole(tmp, args.seeds))
        if args.which in ("scaling", "all"):
            sections.append(bench_scaling(tmp, args.scaling_seconds))
        if args.which in ("lunar", "all"):
            variants = {"defaults": []} | {v.split("=", 1)[0]: v.split("=", 1)[1].split() for v in args.variant}
            sections.append(bench_lunar(tmp, args.seeds, variants))
        if args.which in ("learners", "all"):
            sections.append(bench_learners(tmp, min(args.seeds, 3)))
    text = header + "\n\n" + "\n\n".join(sections) + "\n"
    print(text)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    with open(RESULTS, "a") as f:
        f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
