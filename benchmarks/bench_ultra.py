"""Benchmarks of ultra_parallel_train_dqn.py; each writes a markdown table to benchmarks/results/.

    python benchmarks/bench_ultra.py solve        # CartPole-v1 time to solve, 5 seeds, async mode
    python benchmarks/bench_ultra.py coverage     # GridCoverage-v0 mean coverage within 10 minutes
    python benchmarks/bench_ultra.py throughput   # env steps/s and learner updates/s: 1 vs 2 actors, async vs sync

Every table records the machine's load average before and after each run: on a shared
machine the numbers are only comparable at similar load.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "ultra_parallel_train_dqn.py"
RESULTS = ROOT / "benchmarks" / "results"
CARTPOLE = ROOT / "configs" / "ultra_cartpole.yaml"
GRID = ROOT / "configs" / "ultra_grid_coverage.yaml"


def load() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    return f"{cpu}, {os.cpu_count()} logical cores, Python {platform.python_version()}"


def run(args: list[str], timeout: float) -> dict:
    """Run the script once in a fresh directory; returns summary.json, metrics rows and timings."""
    result = {"load_before": load()}
    with tempfile.TemporaryDirectory(prefix="bench_ultra_") as tmp:
        command = [sys.executable, str(SCRIPT), *args, "--output-dir", f"{tmp}/run", "--no-tensorboard"]
        started = time.monotonic()
        proc = subprocess.run(command, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                              text=True, timeout=timeout)
        result["process_s"] = time.monotonic() - started
        if proc.returncode != 0:
            raise RuntimeError(f"run failed ({proc.returncode}): {proc.stderr[-2000:]}")
        result["summary"] = json.loads(Path(tmp, "run", "summary.json").read_text())
        with open(Path(tmp, "run", "metrics.csv"), newline="") as f:
            result["rows"] = list(csv.DictReader(f))
    return {**result, "load_after": load()}


def first_at_least(rows: list[dict], key: str, threshold: float) -> dict | None:
    return next((r for r in rows if r.get(key) and float(r[key]) >= threshold), None)


def write(name: str, title: str, command: str, lines: list[str]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.md"
    text = [f"# {title}", "", f"Command: `{command}`", "", f"Machine: {machine()}",
            f"Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
            "Load averages (1/5/15 min) are from `os.getloadavg()` before and after each run; a load above the",
            "core count means other work shared the cores and the times are pessimistic.", "", *lines, ""]
    path.write_text("\n".join(text))
    print("\n".join(text))
    return path


def bench_solve(seeds: int, budget_s: float) -> None:
    lines = ["| seed | solved | time to solve (s, training clock) | process wall (s) | env steps | updates | "
             "best mean of 100 | load before | load after |", "|---|---|---|---|---|---|---|---|---|"]
    times = []
    for seed in range(1, seeds + 1):
        result = run(["--config", str(CARTPOLE), "--async-training", "--seed", str(seed),
                      "--duration", str(budget_s / 3600)], timeout=budget_s + 120)
        s = result["summary"]
        solved = s["stop_reason"].startswith("target return")
        t = s["wall_time_s"] if solved else float("inf")
        times.append(t)
        lines.append(f"| {seed} | {'yes' if solved else 'no'} | {t:.1f} | {result['process_s']:.1f} | "
                     f"{s['global_step']} | {s['updates']} | {s['best_mean_return']} | {result['load_before']} | "
                     f"{result['load_after']} |")
    median = statistics.median(times)
    lines += ["", f"**Median time to solve: {median:.1f} s** (target: at most 15 s on 2 cores; inf = not solved "
              f"within {budget_s:g} s). The training clock starts once every actor process is up; process wall adds "
              "interpreter, torch import and actor start-up."]
    write("ultra_cartpole_solve", "CartPole-v1 solved (mean of last 100 training episodes >= 475), async mode",
          f"python benchmarks/bench_ultra.py solve --seeds {seeds} --solve-budget-s {budget_s:g}", lines)


def bench_coverage(minutes: float) -> None:
    """Both observation views for the same time, without the early stop at the target coverage.

    Running on past the target shows whether the coverage holds: the mean of the last 100 episodes
    can touch 95 % early on by chance (the first episodes to finish are the short, complete ones).
    """
    lines = ["| view | 95 % first reached at (s) | lowest mean coverage after that | final mean coverage (last 100) | "
             "env steps | episodes | updates | load before | load after |", "|---|---|---|---|---|---|---|---|---|"]
    for view in ("egocentric", "global"):
        result = run(["--config", str(GRID), "--grid-view", view, "--target-coverage", "none",
                      "--duration", str(minutes / 60)], timeout=minutes * 60 + 180)
        s, rows = result["summary"], result["rows"]
        reached = first_at_least(rows, "coverage_mean100", 0.95)
        if reached:
            after = [float(r["coverage_mean100"]) for r in rows[rows.index(reached):] if r["coverage_mean100"]]
            first, lowest = f"{float(reached['wall_time']):.0f}", f"{100 * min(after):.1f} %"
        else:
            first, lowest = "not reached", "-"
        lines.append(f"| {view} | {first} | {lowest} | {100 * (s['final_mean_coverage'] or 0):.1f} % | "
                     f"{s['global_step']} | {s['episodes']} | {s['updates']} | {result['load_before']} | "
                     f"{result['load_after']} |")
    lines += ["", f"Each view trained for {minutes:g} minutes with configs/ultra_grid_coverage.yaml (6 x 6 grid, "
              "15 % obstacles). Target: mean coverage of the last 100 training episodes at least 95 % within "
              "10 minutes on 2 cores."]
    write("ultra_grid_coverage", "GridCoverage-v0 coverage within a time budget, egocentric vs global view",
          f"python benchmarks/bench_ultra.py coverage --minutes {minutes:g}", lines)


def bench_throughput(seconds: float, replay_ratio: float | None) -> None:
    """Both modes at the same learner settings; ``replay_ratio`` overrides the config's.

    How much async can gain depends on the balance of the work: with a high replay ratio the
    learner's share dominates and overlapping it with collection saves little.
    """
    learner = ["--config", str(CARTPOLE), "--target-return", "none", "--total-episodes", "none",
               "--duration", str(seconds / 3600), "--epsilon-end", "0.02"]
    if replay_ratio is not None:
        learner += ["--replay-ratio", str(replay_ratio)]
    lines = ["| actors | mode | env steps/s | learner updates/s | learner samples/s | policy lag | load before | "
             "load after |", "|---|---|---|---|---|---|---|---|"]
    results = {}
    for workers in (1, 2):
        for mode, flags in (("sync", ["--no-async-training"]), ("async", ["--async-training"]),
                            ("async, no rate limit", ["--async-training", "--no-rate-limit"])):
            r = run([*learner, "--num-workers", str(workers), *flags], timeout=seconds + 120)
            s, rows = r["summary"], r["rows"]
            steady = rows[len(rows) // 4:] or rows  # skip the warm-up before learning starts
            updates = statistics.mean(float(x["updates_per_s"]) for x in steady)
            samples = statistics.mean(float(x["samples_per_s"]) for x in steady)
            lag = statistics.mean(float(x["policy_lag"]) for x in steady)
            results[(workers, mode)] = s["sps"]
            lines.append(f"| {workers} | {mode} | {s['sps']:.0f} | {updates:.0f} | {samples:.0f} | {lag:.1f} | "
                         f"{r['load_before']} | {r['load_after']} |")
    lines.append("")
    for workers in (1, 2):
        ratio = results[(workers, "async")] / max(1e-9, results[(workers, "sync")])
        lines.append(f"- {workers} actor(s): async / sync env steps/s = **{ratio:.2f}x** at equal learner settings "
                     f"(replay ratio, batch, network); target at least 1.5x.")
    lines += ["", "Env steps/s is over the whole run (steps / training wall time); updates/s and samples/s average the "
              "metrics rows after the first quarter (learning starts after the warm-up). Learner settings: "
              "configs/ultra_cartpole.yaml (batch, network, replay ratio). 'no rate limit' lets actors run free "
              "(Ape-X); the default async mode holds actors to the replay ratio as the sync mode does. On a "
              "machine loaded above its core count, a run with more busy processes also gets a larger share of "
              "the contended cores, which flatters async; compare at low load."]
    name, title = "ultra_throughput", f"Actor and learner throughput, CartPole-v1, {seconds:g} s per run"
    command = f"python benchmarks/bench_ultra.py throughput --seconds {seconds:g}"
    if replay_ratio is not None:
        name, title = f"{name}_ratio{replay_ratio:g}", f"{title}, replay ratio {replay_ratio:g}"
        command += f" --replay-ratio {replay_ratio:g}"
    write(name, title, command, lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=["solve", "coverage", "throughput", "all"])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--solve-budget-s", type=float, default=120.0, help="give up on a seed after this long")
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--seconds", type=float, default=30.0, help="length of each throughput run")
    parser.add_argument("--replay-ratio", type=float, default=None,
                        help="throughput: gradient updates per env transition for both modes (default: the config's)")
    args = parser.parse_args()
    if args.what in ("solve", "all"):
        bench_solve(args.seeds, args.solve_budget_s)
    if args.what in ("throughput", "all"):
        bench_throughput(args.seconds, args.replay_ratio)
    if args.what in ("coverage", "all"):
        bench_coverage(args.minutes)


if __name__ == "__main__":
    main()
