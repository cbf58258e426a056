"""The cost of tracking per metrics row: ``MetricsWriter.write`` without tracking and with each installed
backend (``--track mlflow``, ``--track wandb``), in microseconds of the training loop's own CPU time.

    python benchmarks/bench_tracking.py --rows 1000                       # MLflow on a SQLite store, W&B offline
    MLFLOW_TRACKING_URI=http://127.0.0.1:5000 python benchmarks/bench_tracking.py --rows 1000   # a server
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.tracking import TRACKERS, Tracker  # noqa: E402


def measure(rows: int = 2000, block: int = 50) -> dict[str, dict[str, float | None]]:
    """Microseconds per MetricsWriter.write (metrics.csv and TensorBoard, as every run writes them), without
    tracking and with each installed backend (MLflow: MLFLOW_TRACKING_URI, or a local store in a temporary
    directory; W&B: offline). ``loop_us``: the training loop's own CPU time per row (its thread's: the writers'
    threads and processes work beside it), the median over blocks of ``block`` rows taken in turns, so that
    a busy machine's changing load falls on every writer alike. ``sent_us`` (MLflow): the wall time per row
    until its thread has delivered a burst of ``rows`` rows to the store."""
    import statistics
    import tempfile

    from common.runlog import MetricsWriter

    columns = ["return_mean100", "learning_rate", "value_loss", "policy_loss", "entropy", "approx_kl", "clipfrac",
               "explained_variance", "worker_restarts", "cpu_percent", "rss_mb", "pss_mb"]
    row = {"wall_time": 1.0, "episodes": 10, "episodic_return": 20.0, "episodic_length": 20.0, "sps": 5000.0,
           **{name: 0.5 for name in columns}}
    log = logging.getLogger("prl.measure")
    os.environ.setdefault("WANDB_MODE", "offline")
    tracks = [None, *[t for t in TRACKERS if importlib.util.find_spec(t) is not None]]
    with tempfile.TemporaryDirectory(prefix="prl_track_") as tmp:
        os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{tmp}/mlflow.db")
        writers, times, steps = {}, {track: [] for track in tracks}, dict.fromkeys(tracks, 0)
        for track in tracks:
            run_dir = Path(tmp, track or "none")
            run_dir.mkdir()
            tracker = Tracker(track, "measure", run_dir, {"rows": rows}, None, log) if track else None
            writers[track] = MetricsWriter(run_dir, columns, tensorboard=True, tracker=tracker)
            writers[track].write({**row, "global_step": 0})  # TensorBoard's writer opens at the first row
            if tracker is not None:
                tracker.end_opening()

        def write(track, count: int, clock=time.thread_time) -> float:
            started = clock()
            for _ in range(count):
                steps[track] += 1
                writers[track].write({**row, "global_step": steps[track]})
            return clock() - started

        for _ in range(max(1, rows // block)):
            for track in tracks:
                times[track].append(write(track, block) / block)
        out = {track or "none": {"loop_us": round(statistics.median(times[track]) * 1e6, 1), "sent_us": None}
               for track in tracks}
        if "mlflow" in writers:
            backend = writers["mlflow"].tracker.backend
            backend.flush()
            written = write("mlflow", rows, time.perf_counter)
            started = time.perf_counter()
            backend.flush()
            out["mlflow"]["sent_us"] = round((time.perf_counter() - started + written) / rows * 1e6, 1)
        for writer in writers.values():
            if writer.tracker is not None:
                writer.tracker.end(0)
            writer.close()
    return out


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="The cost of tracking per metrics row (microseconds).")
    parser.add_argument("--rows", type=int, default=2000, help="rows each writer writes (default 2000)")
    parser.add_argument("--block", type=int, default=50, help="rows a writer writes in one turn (default 50)")
    args = parser.parse_args()
    print(json.dumps(measure(args.rows, args.block)))
