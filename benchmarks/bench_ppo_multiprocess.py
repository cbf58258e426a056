"""Benchmarks for train_ppo_multiprocess.py; prints a table (and optionally writes it as Markdown).

1. Throughput: aggregate env steps/s of the population with 1 and with 2 workers, one torch
   thread each, so that 2 workers on 2 cores should approach twice the 1-worker rate; with each
   learner of ``--learners`` (numpy, the default for an MLP on the CPU, and torch). The
   rate of a worker is its steps divided by its training time (from its first rollout to its
   last update, as its last row in metrics.csv says); process start-up is reported apart.
   On a machine shared with other work the wall-clock ratio says more about the others than
   about this script, so the table also gives each worker's steps per second of its own CPU
   time (the rate it would reach with a free core).
2. Memory: peak proportional set size (PSS) of the whole process tree while training (every
   worker running) with a >= 1 GB market cache, 1 worker vs 4 workers. PSS splits a shared
   page among the processes mapping it, so a cache that is shared, not copied, adds little
   per extra worker. The same two runs with a
   tiny cache give each worker's own overhead (interpreter, torch), which does not depend on
   the cache.
3. Cache: time to build the cache the first time vs. to load it later (open + copy into
   shared memory, which is what the coordinator does at start-up).

    python benchmarks/bench_ppo_multiprocess.py                       # everything (~3 min on 2 cores)
    python benchmarks/bench_ppo_multiprocess.py --only throughput --steps 65536 --learners numpy torch
    python benchmarks/bench_ppo_multiprocess.py --markdown benchmarks/results/ppo_multiprocess.md
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common.envs.market import cache_path, load_market_data, share_market_data  # noqa: E402
from common.system import ProcessTreeSampler, format_bytes  # noqa: E402

SCRIPT = ROOT / "train_ppo_multiprocess.py"


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def run_training(out: Path, *args: str, sample_memory: bool = False) -> dict:
    """Run the script to completion; returns its summary, wall time and (optionally) peak PSS."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "--output-dir", str(out), "--device", "cpu",
                             "--no-tensorboard", "--eval-episodes", "8", *args], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    peak_pss = peak_training_pss = 0
    if sample_memory:
        # Two peaks: over the whole run (start-up holds the cache file's pages while copying it
        # into shared memory), and while training, once every worker runs (the steady state).
        sampler, log = ProcessTreeSampler(proc.pid), out / "logs" / "main.log"
        workers = int(args[args.index("--num-workers") + 1])
        while proc.poll() is None:
            pss = sampler.sample().pss_bytes
            peak_pss = max(peak_pss, pss)
            if log.exists() and log.read_text().count(" running (pid ") >= workers:
                peak_training_pss = max(peak_training_pss, pss)
            time.sleep(0.25)
    _, err = proc.communicate(timeout=1800)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise RuntimeError(f"training run failed ({proc.returncode}): {err[-2000:]}")
    summary = json.loads((out / "summary.json").read_text())
    return {"summary": summary, "wall_s": wall, "peak_pss": peak_pss, "peak_training_pss": peak_training_pss}


def worker_rates(out: Path, workers: int, column: str = "worker_sps") -> list[float]:
    """Each worker's rate from its last row in metrics.csv (one row per update of some worker)."""
    with open(out / "metrics.csv", newline="") as f:
        last = {row["worker"]: float(row[column]) for row in csv.DictReader(f)}
    return [last[str(i)] for i in range(workers)]


def bench_throughput(work: Path, steps: int, cache_dir: Path, learners: list[str]) -> list[list[str]]:
    rows = []
    for learner in learners:
        base = cpu_base = None
        for workers in (1, 2):
            out = work / f"throughput_{learner}_{workers}"
            result = run_training(out, "--num-workers", str(workers), "--threads-per-worker", "1",
                                  "--max-steps-per-worker", str(steps), "--checkpoint-every", str(10 * steps),
                                  "--cache-dir", str(cache_dir), "--num-items", "200", "--history-steps", "20000",
                                  "--learner", learner)
            rates = worker_rates(out, workers)
            total = sum(rates)
            base = base or total
            rows.append([f"{learner} learner, {workers} worker(s), 1 thread each", f"{total:,.0f} steps/s",
                         f"{total / base:.2f}x", f"per worker {', '.join(f'{r:,.0f}' for r in rates)}; "
                         f"{workers * steps:,} steps, wall {result['wall_s']:.1f} s incl. start-up; "
                         f"load {load_average()}"])
            cpu_total = sum(worker_rates(out, workers, "worker_cpu_sps"))
            cpu_base = cpu_base or cpu_total
            rows.append([f"{learner} learner, {workers} worker(s), per CPU-second", f"{cpu_total:,.0f} steps/s",
                         f"{cpu_total / cpu_base:.2f}x",
                         "sum of each worker's steps per second of its own CPU time: the rate with a free core each"])
    return rows


def bench_memory(work: Path, big_cache: Path, items: int, history: int, steps: int) -> list[list[str]]:
    rows, measured = [], {}
    for label, cache_args in (("tiny cache", ["--num-items", "20", "--history-steps", "5000",
                                             "--cache-dir", str(work / "tiny_cache")]),
                              ("big cache", ["--num-items", str(items), "--history-steps", str(history),
                                             "--cache-dir", str(big_cache)])):
        for workers in (1, 4):
            out = work / f"memory_{label.split()[0]}_{workers}"
            result = run_training(out, "--num-workers", str(workers), "--max-steps-per-worker", str(steps),
                                  "--checkpoint-every", str(10 * steps), "--rollout-steps", "1024",
                                  "--num-envs-per-worker", "4", *cache_args, sample_memory=True)
            measured[label, workers] = result["peak_training_pss"]
            rows.append([f"{workers} worker(s), {label}", format_bytes(result["peak_training_pss"]), "",
                         f"peak PSS of the process tree while training (whole run incl. start-up: "
                         f"{format_bytes(result['peak_pss'])}); load {load_average()}"])
    cache_bytes = 2 * 4 * items * history
    per_extra = (measured["big cache", 4] - measured["big cache", 1]) / 3
    per_extra_tiny = (measured["tiny cache", 4] - measured["tiny cache", 1]) / 3
    rows.append(["extra PSS per extra worker, big cache", format_bytes(per_extra),
                 f"{100 * per_extra / cache_bytes:.1f} % of cache",
                 f"cache {format_bytes(cache_bytes)}; target < 5 % of the cache per extra worker"])
    rows.append(["extra PSS per extra worker, tiny cache", format_bytes(per_extra_tiny), "",
                 "a worker's own overhead (interpreter, torch, buffers)"])
    rows.append(["cache-attributable PSS per extra worker", format_bytes(per_extra - per_extra_tiny),
                 f"{100 * (per_extra - per_extra_tiny) / cache_bytes:.1f} % of cache",
                 "a copied cache would add 100 %"])
    return rows


def bench_cache(big_cache: Path, items: int, history: int) -> list[list[str]]:
    shutil.rmtree(cache_path(big_cache, "synthetic", items, history, 0), ignore_errors=True)
    started = time.perf_counter()
    load_market_data("synthetic", big_cache, items, history, 0)
    build = time.perf_counter() - started
    timings = []
    for _ in range(2):
        started = time.perf_counter()
        data, _ = load_market_data("synthetic", big_cache, items, history, 0)
        opened = time.perf_counter() - started
        shared, _ = share_market_data(data)
        total = time.perf_counter() - started
        shared.unlink_all()
        del data
        timings.append((opened, total))
    size = format_bytes(2 * 4 * items * history)
    return [["cache first build", f"{build:.2f} s", "", f"{items} items x {history} steps ({size}): generate + "
             f"write .npy; load {load_average()}"],
            ["cache later load", f"{timings[-1][1]:.2f} s", f"{build / timings[-1][1]:.1f}x faster",
             f"open {timings[-1][0]:.3f} s + copy into shared memory; first load after the build "
             f"{timings[0][1]:.2f} s; load {load_average()}"]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=["throughput", "memory", "cache"], help="run one benchmark")
    parser.add_argument("--steps", type=int, default=32768, help="steps per worker in the throughput runs")
    parser.add_argument("--cache-items", type=int, default=2048, help="items of the big cache")
    parser.add_argument("--cache-history", type=int, default=65536, help="timesteps of the big cache")
    parser.add_argument("--memory-steps", type=int, default=8192, help="steps per worker in the memory runs")
    parser.add_argument("--keep-cache", action="store_true", help="keep the big cache in runs/cache/bench")
    parser.add_argument("--markdown", type=Path, help="also append the table to this Markdown file")
    parser.add_argument("--learners", nargs="+", choices=["numpy", "torch"], default=["numpy", "torch"],
                        help="the throughput runs' learners, each with 1 and 2 workers")
    args = parser.parse_args()

    big_cache = ROOT / "runs" / "cache" / "bench"
    rows: list[list[str]] = []
    start_load = load_average()
    with tempfile.TemporaryDirectory(prefix="bench_ppo_mp_") as tmp:
        work = Path(tmp)
        if args.only in (None, "cache"):
            rows += bench_cache(big_cache, args.cache_items, args.cache_history)
        if args.only in (None, "throughput"):
            rows += bench_throughput(work, args.steps, work / "cache", args.learners)
        if args.only in (None, "memory"):
            rows += bench_memory(work, big_cache, args.cache_items, args.cache_history, args.memory_steps)
    if not args.keep_cache:
        shutil.rmtree(big_cache, ignore_errors=True)

    header = ["measurement", "value", "ratio", "notes"]
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(4)]
    lines = [" | ".join(str(c).ljust(w) for c, w in zip(row, widths)) for row in [header, *rows]]
    print("\n".join([lines[0], "-+-".join("-" * w for w in widths), *lines[1:]]))
    if args.markdown:
        machine = (f"{platform.machine()}, {os.cpu_count()} logical cores, Python {platform.python_version()}; "
                   f"load average at start {start_load}, at end {load_average()}")
        md = ["| " + " | ".join(map(str, r)) + " |" for r in [header, ["---"] * 4, *rows]]
        title = "" if args.markdown.exists() else "# train_ppo_multiprocess benchmarks\n"
        with open(args.markdown, "a") as f:  # each run adds a section: earlier measurements stay
            f.write(f"{title}\n## {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n\n"
                    f"`python benchmarks/bench_ppo_multiprocess.py {' '.join(sys.argv[1:])}`\n\n{machine}\n\n"
                    + "\n".join(md) + "\n")


if __name__ == "__main__":
    main()
