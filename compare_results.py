"""Compare training runs: a console table, a 4-panel plot and a text report.

    python compare_results.py RUN_DIR RUN_DIR [...] [--threshold 475] [--output DIR]
    python compare_results.py --sequential runs/seq --parallel runs/par

Any run directory of this project works: it needs ``metrics.csv`` (whose first columns
every mode shares) and, when present, reads ``summary.json`` and ``config.yaml``. The
first run is the baseline for speedup and efficiency (efficiency = speedup divided by
the ratio of worker processes, a sequential run counting as one).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import yaml

from common.config import unusable_directory
from common.runlog import CORE_COLUMNS, read_metrics

EXIT_USAGE = 2


@dataclass
class RunRecord:
    """What a finished (or stopped) run directory recorded: its summary, config and metrics columns."""

    path: Path
    name: str
    summary: dict
    config: dict
    wall: np.ndarray
    steps: np.ndarray
    returns: np.ndarray  # per metrics row (NaN where no episode finished)
    mean100: np.ndarray  # mean of the last 100 episodes at each row
    sps: np.ndarray
    cpu: np.ndarray
    memory_mb: np.ndarray
    extra: dict = field(default_factory=dict)

    @property
    def workers(self) -> int:
        source = {**self.config, **self.summary}
        workers = source.get("num_workers", source.get("n_workers", 1)) or 1
        return max(1, int(workers)) * int(source.get("world_size", 1) or 1)


def column(rows: list[dict], key: str) -> np.ndarray:
    values = []
    for row in rows:
        try:
            values.append(float(row.get(key) or "nan"))
        except ValueError:
            values.append(math.nan)
    return np.array(values, dtype=np.float64)


def rolling_episode_mean(rows: list[dict]) -> np.ndarray:
    """Mean of the last 100 episodes at each row, from ``return_mean100`` or rebuilt from the rows.

    Rebuilding treats each row's ``episodic_return`` as ``episodes``-delta episodes of that
    mean, which is exact for modes that log one row per episode.
    """
    if rows and "return_mean100" in rows[0]:
        return column(rows, "return_mean100")
    window: deque[float] = deque(maxlen=100)
    out, previous = [], 0.0
    returns, episodes = column(rows, "episodic_return"), column(rows, "episodes")
    for ret, count in zip(returns, episodes):
        new = int(count - previous) if math.isfinite(count) else 1
        previous = count if math.isfinite(count) else previous
        if math.isfinite(ret):
            window.extend([ret] * max(1, new))
        out.append(float(np.mean(window)) if len(window) == 100 else math.nan)
    return np.array(out)


def load_run(path: Path) -> RunRecord:
    metrics = path / "metrics.csv"
    if not path.is_dir():
        raise ValueError(f"{path}: no such directory")
    if not metrics.is_file():
        raise ValueError(f"{path}: not a run directory (no metrics.csv)")
    rows = read_metrics(metrics)
    if not rows or any(c not in rows[0] for c in ("wall_time", "global_step")):
        raise ValueError(f"{path}: metrics.csv has no rows or lacks the columns {', '.join(CORE_COLUMNS)}")
    summary = json.loads((path / "summary.json").read_text()) if (path / "summary.json").is_file() else {}
    config = {}
    if (path / "config.yaml").is_file():
        loaded = yaml.safe_load((path / "config.yaml").read_text()) or {}
        for value in loaded.values():  # grouped configs are flattened
            if isinstance(value, dict):
                config.update(value)
        config.update({k: v for k, v in loaded.items() if not isinstance(v, dict)})
    wall, steps = column(rows, "wall_time"), column(rows, "global_step")
    sps = column(rows, "sps")
    memory = column(rows, "pss_mb") if "pss_mb" in rows[0] else column(rows, "rss_mb")
    return RunRecord(path, path.name, summary, config, wall, steps, column(rows, "episodic_return"),
               rolling_episode_mean(rows), sps, column(rows, "cpu_percent"), memory)


def windowed_rate(steps: np.ndarray, wall: np.ndarray, points: int = 60) -> tuple[np.ndarray, np.ndarray]:
    """Steps/s over a sliding window of rows: the current throughput, not the run's average so far."""
    k = max(1, len(steps) // points)
    if len(steps) <= k:
        return wall, steps / np.maximum(wall, 1e-9)
    dt = np.maximum(wall[k:] - wall[:-k], 1e-9)
    return wall[k:], (steps[k:] - steps[:-k]) / dt


def first_reaching(run: RunRecord, threshold: float) -> tuple[float, float] | None:
    hits = np.flatnonzero(np.nan_to_num(run.mean100, nan=-np.inf) >= threshold)
    return (float(run.wall[hits[0]]), float(run.steps[hits[0]])) if hits.size else None


def _rate(steps: float, seconds: float) -> float:
    return steps / seconds if seconds > 0 else math.nan


def run_stats(run: RunRecord, baseline: RunRecord, threshold: float | None) -> dict:
    wall_s = float(run.summary.get("wall_time_s", np.nanmax(run.wall)))
    total = float(run.summary.get("global_step", np.nanmax(run.steps)))
    sps = _rate(total, wall_s)
    base_sps = _rate(float(baseline.summary.get("global_step", np.nanmax(baseline.steps))),
                     float(baseline.summary.get("wall_time_s", np.nanmax(baseline.wall))))
    speedup = sps / base_sps if base_sps > 0 else math.nan  # a baseline that took no time has no speed to compare
    finite = run.mean100[np.isfinite(run.mean100)]
    peak_mb = run.summary.get("peak_pss_mb") or run.summary.get("peak_rss_mb") or \
        (float(np.nanmax(run.memory_mb)) if np.isfinite(run.memory_mb).any() else math.nan)
    stats = {"run": run.name, "env": run.summary.get("env_id", run.config.get("env_id", "?")),
             "workers": run.workers, "steps": int(total), "wall_s": wall_s, "sps": sps, "speedup": speedup,
             "efficiency": speedup / (run.workers / baseline.workers),
             "final_return": float(finite[-1]) if finite.size else math.nan,
             "best_return": float(finite.max()) if finite.size else math.nan,
             "peak_mem_mb": float(peak_mb),
             "mean_cpu_pct": float(np.nanmean(run.cpu)) if np.isfinite(run.cpu).any() else math.nan}
    if threshold is not None:
        reached = first_reaching(run, threshold)
        stats["time_to_threshold_s"] = reached[0] if reached else math.nan
        stats["steps_to_threshold"] = reached[1] if reached else math.nan
    return stats


def format_table(all_stats: list[dict]) -> str:
    headers = {"run": "run", "env": "env", "workers": "workers", "steps": "env steps", "wall_s": "wall s",
               "sps": "steps/s", "speedup": "speedup", "efficiency": "efficiency",
               "final_return": "final ret", "best_return": "best ret", "time_to_threshold_s": "t->thr s",
               "steps_to_threshold": "steps->thr", "peak_mem_mb": "peak MiB", "mean_cpu_pct": "cpu %"}
    keys = [k for k in headers if k in all_stats[0]]

    def cell(key, value):
        if isinstance(value, float):
            if math.isnan(value):
                return "-"
            if key in ("speedup", "efficiency"):
                return f"{value:.2f}x" if key == "speedup" else f"{value:.0%}"
            return f"{value:,.1f}" if abs(value) < 1e5 else f"{value:,.0f}"
        return str(value)

    table = [[headers[k] for k in keys]] + [[cell(k, s[k]) for k in keys] for s in all_stats]
    widths = [max(len(row[i]) for row in table) for i in range(len(keys))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths)))
             for row in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def plot(runs: list[RunRecord], path: Path, threshold: float | None) -> None:
    import matplotlib  # here, not at the top: --help and the table need no plotting library

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    (ax_time, ax_steps), (ax_sps, ax_res) = axes
    ax_mem = ax_res.twinx()
    for i, run in enumerate(runs):
        color = f"C{i}"
        ax_time.plot(run.wall, run.mean100, color=color, label=run.name)
        ax_steps.plot(run.steps, run.mean100, color=color, label=run.name)
        ax_sps.plot(*windowed_rate(run.steps, run.wall), color=color, label=run.name)
        if np.isfinite(run.cpu).any():
            ax_res.plot(run.wall, run.cpu, color=color, label=f"{run.name} CPU")
        if np.isfinite(run.memory_mb).any():
            ax_mem.plot(run.wall, run.memory_mb, color=color, linestyle="--", label=f"{run.name} memory")
    for ax in (ax_time, ax_steps):
        ax.set_ylabel("mean return (last 100 episodes)")
        if threshold is not None:
            ax.axhline(threshold, color="grey", linestyle=":", label=f"threshold {threshold:g}")
    ax_time.set_xlabel("wall time (s)")
    ax_steps.set_xlabel("env steps")
    ax_sps.set_xlabel("wall time (s)")
    ax_sps.set_ylabel("env steps/s (sliding window)")
    ax_res.set_xlabel("wall time (s)")
    ax_res.set_ylabel("CPU % (solid; 100 = one core)")
    ax_mem.set_ylabel("memory MiB (dashed)")
    ax_time.set_title("return vs wall time")
    ax_steps.set_title("return vs env steps")
    ax_sps.set_title("throughput")
    ax_res.set_title("CPU and memory of the process tree")
    for ax in (ax_time, ax_steps, ax_sps, ax_res):
        ax.grid(alpha=0.3)
    ax_time.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def report_text(runs: list[RunRecord], all_stats: list[dict], table: str, threshold: float | None) -> str:
    lines = ["Comparison of training runs", "=" * 27, "", table, ""]
    base = all_stats[0]
    for run, stats in zip(runs, all_stats):
        lines.append(f"{run.name}  ({run.path})")
        rate = "no throughput" if math.isnan(stats["sps"]) else f"{stats['sps']:,.0f} steps/s"
        lines.append(f"  env {stats['env']}, {stats['workers']} worker process(es), {stats['steps']:,} env steps "
                     f"in {stats['wall_s']:.1f} s = {rate}")
        if run is not runs[0] and math.isnan(stats["speedup"]):
            lines.append(f"  no speedup to report: {base['run']} took no time (or no step), so it has no throughput")
        elif run is not runs[0]:
            lines.append(f"  {stats['speedup']:.2f}x the throughput of {base['run']} "
                         f"(efficiency {stats['efficiency']:.0%} per worker)")
        if threshold is not None:
            if math.isnan(stats["time_to_threshold_s"]):
                lines.append(f"  never reached a mean return of {threshold:g}")
            else:
                lines.append(f"  reached {threshold:g} after {stats['time_to_threshold_s']:.1f} s "
                             f"and {stats['steps_to_threshold']:,.0f} steps")
        if run.summary.get("stop_reason"):
            lines.append(f"  stopped: {run.summary['stop_reason']}")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="*", type=Path, help="run directories; the first is the baseline")
    parser.add_argument("--sequential", type=Path, help="shorthand: the baseline run")
    parser.add_argument("--parallel", type=Path, action="append", default=[], help="shorthand: a run to compare")
    parser.add_argument("--threshold", type=float, help="report time and steps until the mean return reaches this")
    parser.add_argument("--output", type=Path, default=Path("."), help="where comparison.png and the report go")
    parser.error = lambda message: (print(f"error: {message}", file=sys.stderr), sys.exit(EXIT_USAGE))
    args = parser.parse_args(argv)
    paths = ([args.sequential] if args.sequential else []) + args.runs + args.parallel
    if len(paths) < 1:
        parser.error("give at least one run directory (or --sequential DIR --parallel DIR)")
    unusable = unusable_directory(args.output)
    if unusable:
        parser.error(f"--output {args.output} {unusable}")
    try:
        runs = [load_run(p) for p in paths]
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE
    names = [r.name for r in runs]
    for run in runs:  # disambiguate identical directory names
        if names.count(run.name) > 1:
            run.name = f"{run.path.parent.name}/{run.name}"
    all_stats = [run_stats(run, runs[0], args.threshold) for run in runs]
    table = format_table(all_stats)
    print(table)
    args.output.mkdir(parents=True, exist_ok=True)
    plot(runs, args.output / "comparison.png", args.threshold)
    (args.output / "comparison_report.txt").write_text(report_text(runs, all_stats, table, args.threshold))
    print(f"\nwrote {args.output / 'comparison.png'} and {args.output / 'comparison_report.txt'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
