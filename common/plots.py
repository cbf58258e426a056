"""The end-of-run plots, drawn from ``metrics.csv`` by a plotter process that starts with the run.

Importing matplotlib takes most of a second, and every run ends with its plots. So a run starts a
plotter (``python -m common.plots``) as it starts: it imports matplotlib while the run imports
torch and trains, then waits. At the end the run sends it the plots to draw (:class:`Plotter`) and
waits a fraction of a second for them, instead of the import. The plotter runs at a lower priority
(``nice`` 10), so it takes only the CPU the run leaves idle, ignores Ctrl+C (the run
decides when to stop, and still wants its plots), holds nothing but its pipes, and exits when its
run has gone (end of file on its input), even after ``kill -9``. A plotter that never started, or
died, leaves the drawing to the run's own process, as before.

A plot is a dict: ``{"plot": <a name in PLOTS>, "metrics": <metrics.csv>, "out": <png>, "title": ...}``.
"""

from __future__ import annotations

import csv
import json
import math
import os
import signal
import subprocess
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DRAW_TIMEOUT_S = 120.0  # a plotter still drawing after this long is killed (its plots are reported missing)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    return plt


def _rows(metrics: str | Path) -> list[dict]:
    with open(metrics, newline="") as f:
        return list(csv.DictReader(f))


def _floats(rows: list[dict], key: str) -> list[float]:
    out = []
    for row in rows:
        try:
            out.append(float(row.get(key, "nan") or "nan"))
        except ValueError:
            out.append(math.nan)
    return out


def _save(plt, fig, path: str | Path, title: str) -> None:
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# --------------------------------------------------------------------------- the plots

def training_curve(rows: list[dict], path: str | Path, title: str, smoothed_key: str = "return_mean100") -> None:
    """``plots/training_curve.png`` of every script: return against env steps and against wall time."""
    plt = _pyplot()
    steps, wall = _floats(rows, "global_step"), _floats(rows, "wall_time")
    returns = _floats(rows, "episodic_return")
    smoothed = _floats(rows, smoothed_key) if smoothed_key in rows[0] else None
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, x, label in ((axes[0], steps, "env steps"), (axes[1], wall, "wall time (s)")):
        ax.plot(x, returns, ".", markersize=2, alpha=0.4, label="episode return (per update)")
        if smoothed is not None:
            ax.plot(x, smoothed, "-", linewidth=1.5, label="mean of last 100 episodes")
        ax.set_xlabel(label)
        ax.set_ylabel("return")
        ax.grid(alpha=0.3)
    axes[0].legend(loc="lower right", fontsize=8)
    _save(plt, fig, path, title)


def ultra_results(rows: list[dict], path: str | Path, title: str) -> None:
    """``plots/ultra_training_results.png``: reward, coverage (or episode length), loss and throughput over time."""
    plt = _pyplot()

    def col(key: str) -> list[float]:
        return _floats(rows, key)

    t = col("wall_time")
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    has_coverage = any(math.isfinite(v) for v in col("coverage"))
    for ax, key, label in ((axes[0, 0], "return", "episode return"), (axes[0, 1], "coverage", "coverage (%)")):
        if key == "coverage" and not has_coverage:
            ax.plot(t, col("episodic_length"), ".", markersize=3)
            ax.set_ylabel("episode length")
            continue
        scale = 100 if key == "coverage" else 1
        ax.plot(t, [scale * v for v in col("coverage" if key == "coverage" else "episodic_return")], ".",
                markersize=3, alpha=0.5, label="episodes in interval")
        ax.plot(t, [scale * v for v in col(f"{key}_mean100")], "-", label="mean of last 100")
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    axes[1, 0].plot(t, col("loss"))
    axes[1, 0].set_ylabel("TD loss")
    axes[1, 0].set_yscale("log")
    axes[1, 1].plot(t, col("sps"), label="env steps/s")
    axes[1, 1].plot(t, col("samples_per_s"), label="learner samples/s")
    axes[1, 1].set_ylabel("throughput")
    axes[1, 1].legend(fontsize=8)
    for ax in axes.flat:
        ax.set_xlabel("wall time (s)")
        ax.grid(alpha=0.3)
    _save(plt, fig, path, title)


def population(rows: list[dict], path: str | Path, title: str) -> None:
    """``plots/population.png``: every member's training return against its own steps, one line each."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    workers = sorted({int(r["worker"]) for r in rows if r.get("worker")})
    for index in workers:
        mine = [r for r in rows if r.get("worker") == str(index) and r.get("episodic_return")]
        ax.plot([int(r["worker_step"]) for r in mine], [float(r["episodic_return"]) for r in mine], linewidth=1,
                label=f"worker {index}")
    ax.set_xlabel("env steps of the worker")
    ax.set_ylabel("mean episode return per update")
    ax.grid(alpha=0.3)
    if 0 < len(workers) <= 16:
        ax.legend(fontsize=7, ncol=2)
    _save(plt, fig, path, title)


PLOTS = {"training_curve": training_curve, "ultra_results": ultra_results, "population": population}


def draw(plot: dict) -> str | None:
    """Draw one plot; None when done (or with no rows to draw), else the traceback of what went wrong."""
    try:
        rows = _rows(plot["metrics"])
        if rows:
            Path(plot["out"]).parent.mkdir(parents=True, exist_ok=True)
            PLOTS[plot["plot"]](rows, plot["out"], plot["title"])
        return None
    except Exception:  # reported by the run, which goes on: a plot is never worth failing a run
        return traceback.format_exc()


# --------------------------------------------------------------------------- the plotter process

class Plotter:
    """The run's side of its plotter process: :meth:`start` it early, :meth:`draw` at the end."""

    def __init__(self, proc: subprocess.Popen | None):
        self.proc = proc

    @classmethod
    def start(cls) -> Plotter:
        """Start the plotter; one that cannot start leaves the plots to this process."""
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH"))
                                                           if p)}
        try:
            proc = subprocess.Popen([sys.executable, "-m", "common.plots"], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True)
        except OSError:
            proc = None
        return cls(proc)

    def draw(self, plots: list[dict]) -> list[str]:
        """Draw ``plots`` (in the plotter, or here if it is gone); returns the errors, one text per failed plot."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return [e for e in map(draw, plots) if e]
        try:
            out, _ = proc.communicate(json.dumps(plots) + "\n", timeout=DRAW_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            return [f"the plotter did not finish within {DRAW_TIMEOUT_S:.0f} s"]
        answers = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        if len(answers) != len(plots):  # it died on the way (killed, or Ctrl+C before it could ignore it)
            return [e for e in map(draw, plots[len(answers):]) if e] + [a["error"] for a in answers if a["error"]]
        return [a["error"] for a in answers if a["error"]]

    def close(self) -> None:
        """End a plotter that was never asked to draw (the run ended before its plots)."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()


def serve() -> int:
    """The plotter process: import matplotlib, read the plots to draw (one JSON line), draw them, answer
    one JSON line each, exit. End of file first means the run has gone without plots."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl+C reaches the process group; the run decides
    # Its import takes only the CPU the run leaves idle (the workers and the learner come first); by the end
    # of the run, when it draws, it is the only process left.
    os.nice(10)
    _pyplot()
    line = sys.stdin.readline()
    if not line.strip():
        return 0
    for plot in json.loads(line):
        print(json.dumps({"error": draw(plot)}), flush=True)
    # The run waits for this process to end. Every plot is saved and answered, and nothing else is held, so
    # skip the interpreter's teardown of matplotlib's modules: 0.1-0.2 s at the end of every run.
    os._exit(0)


if __name__ == "__main__":
    sys.exit(serve())
