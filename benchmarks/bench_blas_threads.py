"""numpy's BLAS threads in the rollout workers: one (the default the scripts set) against one per core.

    python benchmarks/bench_blas_threads.py                 # 3 seeds per setting, 128 envs per worker
    python benchmarks/bench_blas_threads.py --envs 8 16 128 --seeds 5

Each run is train_parallel_timed.py on CartPole-v1 in a fresh process: 2 workers x N envs, a fixed
step budget, OPENBLAS_NUM_THREADS set for the whole process tree (the scripts set 1 unless the
environment says otherwise). The settings are interleaved per seed, so a change in the machine's load
falls on both alike. Reported per setting: medians over the seeds of the whole process (start to exit),
the training time, and env steps per second of training time. A markdown section with the command is
printed and appended to benchmarks/results/blas_threads.md.
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
RESULTS = ROOT / "benchmarks" / "results" / "blas_threads.md"

from bench_timed import run, table  # noqa: E402  (benchmarks/ is on sys.path when run)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--envs", type=int, nargs="+", default=[128], help="envs per worker (one table row each)")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=300_000, help="env steps per run")
    opts = parser.parse_args()
    threads = ["1", str(os.cpu_count())]
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    rows = []
    with tempfile.TemporaryDirectory(prefix="prl-blas-") as tmp:
        for envs in opts.envs:
            results: dict[str, list] = {t: [] for t in threads}
            for seed in range(1, opts.seeds + 1):
                for count in threads:
                    os.environ["OPENBLAS_NUM_THREADS"] = count  # inherited by the run and its workers
                    summary, _, process_s = run(
                        ["--env-id", "CartPole-v1", "--num-workers", "2", "--num-envs-per-worker", str(envs),
                         "--n-steps", "32", "--batch-size", str(16 * envs), "--n-epochs", "2", "--seed", str(seed),
                         "--total-timesteps", str(opts.steps), "--target-return", "none"],
                        Path(tmp) / f"{envs}_{count}_{seed}")
                    results[count].append((process_s, summary["wall_time_s"], summary["global_step"]))
                    print(f"{envs} envs, {count} BLAS thread(s), seed {seed}: process {process_s:.1f} s, "
                          f"training {summary['wall_time_s']:.1f} s", file=sys.stderr, flush=True)
            for count in threads:
                process_s, train_s, steps = (statistics.median(x) for x in zip(*results[count]))
                rows.append([f"2 x {envs}", count, f"{process_s:.1f}", f"{train_s:.1f}", f"{steps / train_s:,.0f}"])
    os.environ.pop("OPENBLAS_NUM_THREADS")
    command = "python benchmarks/bench_blas_threads.py " + shlex.join(
        ["--envs", *map(str, opts.envs), "--seeds", str(opts.seeds), "--steps", str(opts.steps)])
    section = "\n".join([
        f"## {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, {os.cpu_count()} logical cores, load average at start {load}",
        "", f"`{command}`: CartPole-v1, {opts.steps:,} env steps, medians of {opts.seeds} seeds.", "",
        table(["workers x envs", "BLAS threads", "whole process (s)", "training (s)", "steps/s of training"], rows),
        ""])
    print(section)
    if not RESULTS.exists():
        RESULTS.write_text("# numpy's BLAS threads in the rollout workers\n\n")
    with open(RESULTS, "a") as f:
        f.write("\n" + section)


if __name__ == "__main__":
    main()
