"""Training-curve plots written at the end of a run (matplotlib, no display needed)."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _floats(rows: list[dict], key: str) -> list[float]:
    out = []
    for row in rows:
        try:
            out.append(float(row.get(key, "nan") or "nan"))
        except ValueError:
            out.append(math.nan)
    return out


def plot_training_curve(rows: list[dict], path: str | Path, title: str,
                        smoothed_key: str = "return_mean100") -> Path | None:
    """Return vs env steps and vs wall time, from metrics.csv rows; None when there is nothing to plot."""
    if not rows:
        return None
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
    fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
