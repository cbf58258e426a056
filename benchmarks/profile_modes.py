"""Where the seconds of a run go, per mode: the time budget every run writes into summary.json.

    python benchmarks/profile_modes.py              # every mode, its default env and CartPole-v1
    python benchmarks/profile_modes.py --only timed --seconds 20

Each run is a fresh process with a wall-clock budget (``--duration``), so the table shows what a
user waits for: start-up (process start to the first env step), collecting, learning, waiting on
workers, checkpointing, logging and shutting down, plus the whole process as measured from outside.
A markdown table is printed and appended to benchmarks/results/profile.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "profile.md"
PARTS = ("startup", "collect", "learn", "wait", "checkpoint", "log", "shutdown", "other")

# mode -> (script, [(label, extra flags)])
RUNS = {
    "timed": ("train_parallel_timed.py", [("defaults (LunarLander-v3)", []),
                                          ("configs/cartpole_fast.yaml", ["--config", "configs/cartpole_fast.yaml"])]),
    "ppo-multiprocess": ("train_ppo_multiprocess.py", [("defaults (Market-v0)", ["--max-steps-per-worker", "none"]),
                                                      ("CartPole-v1", ["--env-id", "CartPole-v1",
                                                                       "--max-steps-per-worker", "none"])]),
    "dqn": ("parallel_train_dqn.py", [("defaults (ConnectFour-v0)", ["--total-episodes", "none"]),
                                      ("configs/parallel_dqn_cartpole.yaml",
                                       ["--config", "configs/parallel_dqn_cartpole.yaml"])]),
    "ultra": ("ultra_parallel_train_dqn.py", [("defaults (GridCoverage-v0)", ["--total-episodes", "none"]),
                                              ("configs/ultra_cartpole.yaml",
                                               ["--config", "configs/ultra_cartpole.yaml"])]),
}


def profile(script: str, flags: list[str], seconds: float, out: Path) -> dict:
    started = time.monotonic()
    proc = subprocess.run([sys.executable, str(ROOT / script), *flags, "--duration", str(seconds / 3600),
                           "--target-return", "none", "--no-tensorboard", "--output-dir", str(out)],
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True)
    outside = time.monotonic() - started
    if proc.returncode != 0:
        raise RuntimeError(f"{script} {flags} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    summary = json.loads((out / "summary.json").read_text())
    return {**summary["time_budget"], "outside_s": outside, "sps": summary["sps"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=list(RUNS), action="append")
    parser.add_argument("--seconds", type=float, default=15.0, help="training budget of each run")
    args = parser.parse_args()
    header = "| mode | run | " + " | ".join(f"{p} s" for p in PARTS) + " | process s | steps/s |"
    lines = [header, "|" + "---|" * (len(PARTS) + 4)]
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="prl_profile_") as tmp:
        for mode in args.only or RUNS:
            script, runs = RUNS[mode]
            for k, (label, flags) in enumerate(runs):
                budget = profile(script, flags, args.seconds, Path(tmp) / f"{mode}_{k}")
                cells = [f"{budget[f'{p}_s']:.2f}" for p in PARTS]
                lines.append(f"| {mode} | {label} | " + " | ".join(cells)
                             + f" | {budget['outside_s']:.1f} | {budget['sps']:.0f} |")
                print(lines[-1], flush=True)
    text = (f"## {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, {os.cpu_count()} cores, load average {load:.2f}, "
            f"{args.seconds:g} s of training per run\n\n" + "\n".join(lines) + "\n")
    print(text)
    with open(RESULTS, "a") as f:
        f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
