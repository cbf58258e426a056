"""Synchronous against overlapped collection (--async-training) in train_parallel_timed.py.

    python benchmarks/bench_overlap.py cartpole          # configs/cartpole_fast.yaml to 475, 3 seeds per form
    python benchmarks/bench_overlap.py lunar             # LunarLander-v3 to 200 on the defaults, 3 seeds per form
    python benchmarks/bench_overlap.py all --seeds 5

Every run is a real run of the script in a fresh process, stopped by its target return. Per form
it reports medians over the seeds: the whole process (start to exit, start-up included), the
training time to the target and the env steps to it (from metrics.csv: the first row whose mean of
the last 100 returns reaches the target; a seed that never does counts as slower than every seed
that does, and a median that falls on one reads inf), the training time per env step (speed apart from sample
efficiency), and where the learner's time went (summary.json's time budget: waiting for rollouts and
learning); then each seed's steps and time to the target. Every form of one env collects the same rollout size
(n_steps x envs in total), so steps to target compare the algorithms, not the batch. A markdown
section with the command is printed and appended to benchmarks/results/overlap.md.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "overlap.md"

# One way to run the script and read its run, shared with the timed benchmark.
from bench_timed import first_reaching, run, table  # noqa: E402  (benchmarks/ is on sys.path when run)

CARTPOLE = ["--config", str(ROOT / "configs" / "cartpole_fast.yaml")]

# (label, flags): the sequential baseline first, then each worker count in both forms. The YAML's
# 16 envs are kept in total, so every form learns from the same rollouts of 16 x 64 steps.
CARTPOLE_FORMS = [
    ("0 workers x 16 envs, synchronous (the YAML)", [*CARTPOLE]),
    ("1 worker x 16 envs, synchronous", [*CARTPOLE, "--num-workers", "1", "--no-async-training"]),
    ("1 worker x 16 envs, overlapped", [*CARTPOLE, "--num-workers", "1", "--async-training"]),
    ("2 workers x 8 envs, synchronous", [*CARTPOLE, "--num-workers", "2", "--num-envs-per-worker", "8",
                                         "--no-async-training"]),
    ("2 workers x 8 envs, overlapped", [*CARTPOLE, "--num-workers", "2", "--num-envs-per-worker", "8",
                                        "--async-training"]),
]
LUNAR_FORMS = [
    ("2 workers x 8 envs, synchronous (defaults)", ["--no-async-training"]),
    ("2 workers x 8 envs, overlapped", ["--async-training"]),
]


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def bench(title: str, forms: list[tuple[str, list[str]]], target: float, seeds: int, tmp: Path) -> str:
    """Every form for ``seeds`` seeds, the forms interleaved per seed so a change in the machine's load
    falls on all of them alike."""
    results: dict[str, list[dict]] = {label: [] for label, _ in forms}
    for seed in range(1, seeds + 1):
        for number, (label, flags) in enumerate(forms):
            summary, rows, process_s = run([*flags, "--seed", str(seed)], tmp / f"{title[:8]}_{number}_{seed}")
            hit = first_reaching(rows, target)
            budget = summary["time_budget"]
            results[label].append({
                "process_s": process_s, "solved": hit is not None,
                # a run that never reaches the target counts as slower than any that does, in the medians
                "train_s": float(hit["wall_time"]) if hit else float("inf"),
                "steps": int(hit["global_step"]) if hit else float("inf"),
                "waiting_s": budget["collect_s"] + budget["wait_s"], "learn_s": budget["learn_s"],
                "startup_s": budget["startup_s"]})
            print(f"{label}, seed {seed}: {results[label][-1]}", file=sys.stderr, flush=True)
    out = []
    for label, runs in results.items():
        solved = [r for r in runs if r["solved"]]
        out.append([label, f"{len(solved)}/{len(runs)}", f"{median([r['process_s'] for r in runs]):.2f}",
                    f"{median([r['train_s'] for r in runs]):.2f}", f"{median([r['steps'] for r in runs]):.0f}",
                    f"{median([1e6 * r['train_s'] / r['steps'] for r in solved]):.1f}",
                    f"{median([r['startup_s'] for r in runs]):.2f}", f"{median([r['waiting_s'] for r in runs]):.2f}",
                    f"{median([r['learn_s'] for r in runs]):.2f}"])
    # Steps to a target vary a lot from seed to seed: the seeds one by one, so a median is read with its spread.
    per_seed = [[seed, *(f"{r['steps']:.0f} ({r['train_s']:.1f} s)" if r["solved"] else "not reached"
                         for r in (results[label][seed - 1] for label in results))] for seed in range(1, seeds + 1)]
    return (f"### {title}: medians of {seeds} seeds\n\n"
            + table(["form", "reached", "whole process (s)", "training to target (s)", "env steps to target",
                     "training us per env step", "start-up (s)", "learner waiting for rollouts (s)", "learning (s)"],
                    out)
            + "\n\nPer seed, env steps to target (training seconds):\n\n" + table(["seed", *results], per_seed))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("which", choices=["cartpole", "lunar", "all"])
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    load = os.getloadavg()
    command = "benchmarks/prioritized.sh .venv/bin/python benchmarks/bench_overlap.py " + shlex.join(sys.argv[1:])
    header = (f"## {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, {os.cpu_count()} cores, "
              f"load average at start {load[0]:.2f}\n\n`{command}`")
    sections = []
    with tempfile.TemporaryDirectory(prefix="prl_bench_") as tmp:
        tmp = Path(tmp)
        if args.which in ("cartpole", "all"):
            sections.append(bench("CartPole-v1 to 475, configs/cartpole_fast.yaml", CARTPOLE_FORMS, 475,
                                  args.seeds, tmp))
        if args.which in ("lunar", "all"):
            sections.append(bench("LunarLander-v3 to 200, the defaults", LUNAR_FORMS, 200, args.seeds, tmp))
    text = header + "\n\n" + "\n\n".join(sections) + "\n"
    print(text)
    if not RESULTS.exists():
        RESULTS.write_text("# train_parallel_timed.py: synchronous against overlapped collection\n\n"
                           "Written by benchmarks/bench_overlap.py (its docstring says what each column is).\n\n")
    with open(RESULTS, "a") as f:
        f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
