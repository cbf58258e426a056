"""This project next to Stable-Baselines3 (rl-baselines3-zoo's settings), whole process, in one run.

    python benchmarks/bench_vs_sb3.py cartpole --seeds 5 [--sb3 ppo]  # PPO and DQN: time to a mean of 475
    python benchmarks/bench_vs_sb3.py lunar --seeds 3        # train_parallel_timed.py defaults: time to 200
    python benchmarks/bench_vs_sb3.py pendulum --seeds 3     # time to a mean of -250
    python benchmarks/bench_vs_sb3.py halfcheetah --minutes 20  # return reached in the same wall-clock budget
    python benchmarks/bench_vs_sb3.py cartpole --sb3 none --against HEAD~3  # this checkout against a commit

``--against REV`` runs every project system twice per seed, from this checkout and from ``git archive REV``
(with the same Python), alternating, so that a change made for structure is measured against the commit
before it in one run.

Needs requirements-bench.txt (Stable-Baselines3). Every run is a fresh process, timed from its
start to its exit (the time a user waits); the training time comes from the run's own records.
Systems alternate seed by seed so that a change in the machine's load hits both alike; the load
average before and after is recorded. Results are printed and appended to
benchmarks/results/vs_sb3.md (curves of halfcheetah as vs_sb3_halfcheetah.png).
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
RESULTS = ROOT / "benchmarks" / "results" / "vs_sb3.md"
NEVER = "not solved"


def run_project(script: str, args: list[str], run_dir: Path, threshold: float, root: Path = ROOT) -> dict:
    """Whole-process seconds of a project run (from the tree ``root``), and when its mean-100 return first
    reached ``threshold``. Paths in ``args`` under this checkout are read from ``root`` instead."""
    args = [arg.replace(str(ROOT), str(root)) for arg in args]
    started = time.monotonic()
    proc = subprocess.run([sys.executable, str(root / script), *args, "--output-dir", str(run_dir),
                           "--no-tensorboard"], env={**os.environ, "PYTHONPATH": str(root)}, capture_output=True,
                          text=True, cwd=root)
    process_s = time.monotonic() - started
    if proc.returncode != 0:
        raise RuntimeError(f"{script} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    with open(run_dir / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    summary = json.loads((run_dir / "summary.json").read_text())
    hit = first_reaching(rows, threshold)
    return {"process_s": process_s, "solve_s": hit[0] if hit else None, "steps": hit[1] if hit else None,
            "budget": summary.get("time_budget", {}), "rows": rows}


def run_sb3(algo: str, env_id: str, seed: int, out: Path, threshold: float, max_steps: int,
            seconds: float | None = None) -> dict:
    args = [sys.executable, str(ROOT / "benchmarks" / "sb3_runner.py"), algo, env_id, "--seed", str(seed),
            "--target", str(threshold), "--max-steps", str(max_steps), "--out", str(out)]
    if seconds:
        args += ["--seconds", str(seconds), "--log-every", "10"]
    started = time.monotonic()
    proc = subprocess.run(args, capture_output=True, text=True)
    process_s = time.monotonic() - started
    if proc.returncode != 0:
        raise RuntimeError(f"SB3 failed ({proc.returncode}): {proc.stderr[-2000:]}")
    with open(out, newline="") as f:
        rows = list(csv.DictReader(f))
    hit = first_reaching(rows, threshold)
    return {"process_s": process_s, "solve_s": hit[0] if hit else None, "steps": hit[1] if hit else None,
            "rows": rows}


def first_reaching(rows: list[dict], threshold: float) -> tuple[float, int] | None:
    for row in rows:
        if row.get("return_mean100") and float(row["return_mean100"]) >= threshold:
            return float(row["wall_time"]), int(float(row["global_step"]))
    return None


def table(headers: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])


def fmt(seconds: float | None) -> str:
    return NEVER if seconds is None else f"{seconds:.1f}"


def median_of(results: list[dict], key: str) -> str:
    """The median over seeds; an unsolved seed counts as slower than every solved one."""
    values = sorted((r[key] if r["solve_s"] is not None else float("inf")) for r in results)
    middle = statistics.median(values)
    return NEVER if middle == float("inf") else f"**{middle:.1f}**"


def solve_section(title: str, systems: dict, seeds: list[int], threshold: float, tmp: Path) -> str:
    """``systems``: name -> run(seed, tmp) -> result; alternated seed by seed."""
    results: dict[str, list[dict]] = {name: [] for name in systems}
    for seed in seeds:
        for name, run in systems.items():
            results[name].append(run(seed, tmp / f"{name.replace(' ', '_')}_{seed}"))
    rows = []
    for name, runs in results.items():
        per_seed = " / ".join(f"{fmt(r['process_s'] if r['solve_s'] is not None else None)}" for r in runs)
        training = " / ".join(fmt(r["solve_s"]) for r in runs)
        rows.append([name, per_seed, median_of(runs, "process_s"), training, median_of(runs, "solve_s")])
    return (f"### {title} (mean of the last 100 training episodes >= {threshold:g}; seeds {seeds})\n\n"
            + table(["system", "whole process, s (per seed)", "median", "training, s (per seed)", "median"], rows))


BASE: tuple[str, Path] | None = None  # (revision, its extracted tree) under --against


def project_systems(name: str, script: str, args_of, threshold: float) -> dict:
    """The project's ``script`` as one system, and as a second one from the --against revision."""
    systems = {name: lambda seed, out: run_project(script, args_of(seed), out, threshold)}
    if BASE is not None:
        rev, root = BASE
        systems[f"{name} at {rev}"] = lambda seed, out: run_project(script, args_of(seed), out, threshold, root)
    return systems


def extract(rev: str, into: Path) -> Path:
    """The tree of ``rev`` (git archive), to run the same benchmark against."""
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def cartpole(seeds: list[int], tmp: Path, sb3: str) -> list[str]:
    def project(script, config):
        return project_systems(f"this project, {script} (configs/{config})", script,
                               lambda seed: ["--config", str(ROOT / "configs" / config), "--seed", str(seed)], 475)

    def sb3_run(algo, max_steps):
        return lambda seed, out: run_sb3(algo, "CartPole-v1", seed, out.with_suffix(".csv"), 475, max_steps)

    ppo = project("train_parallel_timed.py", "cartpole_fast.yaml")
    dqn = {**project("ultra_parallel_train_dqn.py", "ultra_cartpole.yaml"),
           **project("parallel_train_dqn.py", "parallel_dqn_cartpole.yaml")}
    if sb3 in ("all", "ppo"):
        ppo["Stable-Baselines3 PPO (rl-zoo)"] = sb3_run("ppo", 300_000)
    if sb3 == "all":  # SB3's DQN takes minutes per seed (it did not solve within 300k steps when measured)
        dqn["Stable-Baselines3 DQN (rl-zoo)"] = sb3_run("dqn", 300_000)
    return [solve_section("CartPole-v1, PPO", ppo, seeds, 475, tmp),
            solve_section("CartPole-v1, DQN", dqn, seeds, 475, tmp)]


def lunar(seeds: list[int], tmp: Path) -> list[str]:
    run = project_systems("this project, train_parallel_timed.py (defaults)", "train_parallel_timed.py",
                          lambda seed: ["--seed", str(seed)], 200)
    return [solve_section("LunarLander-v3, PPO", run, seeds, 200, tmp)]


def pendulum(seeds: list[int], tmp: Path, sb3: str) -> list[str]:
    config = str(ROOT / "configs" / "pendulum.yaml")
    runs = {"this project, train_parallel_timed.py (configs/pendulum.yaml)":
            lambda seed, out: run_project("train_parallel_timed.py", ["--config", config, "--seed", str(seed),
                                                                      "--target-return", "-250"], out, -250)}
    if sb3 != "none":
        runs["Stable-Baselines3 PPO (rl-zoo, gSDE)"] = \
            lambda seed, out: run_sb3("ppo", "Pendulum-v1", seed, out.with_suffix(".csv"), -250, 1_000_000, 600)
    return [solve_section("Pendulum-v1, PPO", runs, seeds, -250, tmp)]


def halfcheetah(minutes: float, tmp: Path) -> list[str]:
    seconds = minutes * 60
    ours = run_project("train_parallel_timed.py", ["--config", str(ROOT / "configs" / "halfcheetah.yaml"),
                                                   "--duration", str(minutes / 60), "--target-return", "none"],
                       tmp / "ours", float("inf"))
    theirs = run_sb3("ppo", "HalfCheetah-v5", 1, tmp / "sb3.csv", float("inf"), 10**9, seconds)
    curves = {"this project (configs/halfcheetah.yaml)": ours["rows"], "Stable-Baselines3 PPO (rl-zoo)": theirs["rows"]}
    plot_curves(curves, RESULTS.with_name("vs_sb3_halfcheetah.png"), f"HalfCheetah-v5, {minutes:g} minutes each")
    rows = []
    for name, data in curves.items():
        last = [r for r in data if r.get("return_mean100")][-1]
        rows.append([name, f"{float(last['return_mean100']):.0f}", last["global_step"],
                     f"{float(last['wall_time']):.0f}"])
    return [f"### HalfCheetah-v5, {minutes:g} minutes of training each, one after the other\n\n"
            + table(["system", "mean return of the last 100 episodes at the end", "env steps", "training s"], rows)
            + "\n\nCurves: `benchmarks/results/vs_sb3_halfcheetah.png`."]


def plot_curves(curves: dict[str, list[dict]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, rows in curves.items():
        rows = [r for r in rows if r.get("return_mean100")]
        for ax, x in zip(axes, ("wall_time", "global_step")):
            ax.plot([float(r[x]) for r in rows], [float(r["return_mean100"]) for r in rows], label=name)
    for ax, label in zip(axes, ("training seconds", "env steps")):
        ax.set_xlabel(label)
        ax.set_ylabel("mean return of the last 100 episodes")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("which", choices=["cartpole", "lunar", "pendulum", "halfcheetah"])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--minutes", type=float, default=20.0)
    parser.add_argument("--sb3", choices=["all", "ppo", "none"], default="all",
                        help="which Stable-Baselines3 runs to include (its DQN and Pendulum runs take minutes each)")
    parser.add_argument("--against", metavar="REV",
                        help="also run the project's systems from this git revision, alternating (cartpole, lunar)")
    args = parser.parse_args()
    global BASE
    seeds = list(range(1, args.seeds + 1))
    before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="prl_vs_sb3_") as tmp:
        tmp = Path(tmp)
        if args.against:
            rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", args.against], capture_output=True,
                                 text=True, check=True).stdout.strip()
            BASE = (rev, extract(rev, tmp / f"tree_{rev}"))
        sections = {"cartpole": lambda: cartpole(seeds, tmp, args.sb3), "lunar": lambda: lunar(seeds, tmp),
                    "pendulum": lambda: pendulum(seeds, tmp, args.sb3),
                    "halfcheetah": lambda: halfcheetah(args.minutes, tmp)}[args.which]()
    after = os.getloadavg()[0]
    text = (f"## {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, {os.cpu_count()} cores, load average {before:.2f} before, "
            f"{after:.2f} after\n\n" + "\n\n".join(sections) + "\n")
    print(text)
    with open(RESULTS, "a") as f:
        f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
