"""``--tune``: short real runs over worker counts and envs per worker instead of a guess; the fastest
setting is cached per machine, mode and env, and later launches use it."""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
import tempfile
from datetime import datetime
from pathlib import Path

from common.launcher import ROOT
from common.launcher.modes import LaunchMode

TUNE_CACHE = Path(os.environ.get("PRL_TUNE_CACHE", Path.home() / ".cache" / "parallel-rl" / "tune.json"))


def _cache_key(facts: dict, mode: str, env_id: str) -> str:
    return f"{facts['hostname']}|{facts['usable_cores']}|{len(facts['gpus'])}|{mode}|{env_id}"


def tuned_choice(facts: dict, mode: str, env_id: str) -> dict | None:
    """The cached ``--tune`` measurement for this machine, mode and env, or None."""
    if facts["assumed"]:  # measured on this machine, not on the one assumed
        return None
    try:
        return json.loads(TUNE_CACHE.read_text()).get(_cache_key(facts, mode, env_id))
    except (OSError, ValueError):
        return None


def tune(mode: LaunchMode, env_id: str, facts: dict, passthrough: list[str], trial_seconds: float) -> dict:
    """Short real runs over worker counts and envs per worker; the fastest is cached and returned."""
    cores = facts["usable_cores"]
    worker_counts = sorted({1, max(1, cores // 2), cores, max(1, cores - 2)})
    env_counts = [4, 16] if mode.envs_flag else [None]
    results = []
    print(f"tuning {mode.name} on {env_id}: {len(worker_counts) * len(env_counts)} trials of "
          f"{trial_seconds:.0f} s")
    for workers in worker_counts:
        for envs in env_counts:
            args = [mode.workers_flag, str(workers)] + ([mode.envs_flag, str(envs)] if envs else [])
            sps = _trial(mode, env_id, args + passthrough, trial_seconds)
            results.append({"workers": workers, "envs_per_worker": envs, "args": args, "sps": sps})
            print(f"  workers {workers:>3}  envs/worker {envs if envs else '-':>3}  "
                  f"{'failed' if math.isnan(sps) else f'{sps:10.0f} steps/s'}")
    best = max((r for r in results if not math.isnan(r["sps"])), key=lambda r: r["sps"], default=None)
    if best is None:
        raise RuntimeError("every tuning trial failed")
    cache = {}
    try:
        cache = json.loads(TUNE_CACHE.read_text())
    except (OSError, ValueError):
        pass
    cache[_cache_key(facts, mode.name, env_id)] = {**best, "measured": datetime.now().isoformat(timespec="seconds"),
                                                   "table": results}
    TUNE_CACHE.parent.mkdir(parents=True, exist_ok=True)
    TUNE_CACHE.write_text(json.dumps(cache, indent=2))
    print(f"fastest: {' '.join(best['args'])} at {best['sps']:.0f} steps/s (cached in {TUNE_CACHE})")
    return best


def _trial(mode: LaunchMode, env_id: str, args: list[str], seconds: float) -> float:
    with tempfile.TemporaryDirectory(prefix="prl_tune_") as tmp:
        command = [sys.executable, str(ROOT / mode.script), "--env-id", env_id, "--output-dir", tmp,
                   "--no-tensorboard", mode.duration_flag, str(seconds / 3600), *args]
        try:
            subprocess.run(command, capture_output=True, text=True, timeout=seconds + 120,
                           env={**os.environ, "PYTHONPATH": str(ROOT)})
        except subprocess.TimeoutExpired:
            return math.nan
        return _steps_per_second(Path(tmp))


def _steps_per_second(run_dir: Path) -> float:
    """Steps/s between the first and last metrics rows (start-up excluded; every mode has these columns),
    or, in a trial too short for two rows, the summary's steps/s of the whole run."""
    try:
        with open(run_dir / "metrics.csv", newline="") as f:
            rows = [r for r in csv.DictReader(f) if r.get("global_step") and r.get("wall_time")]
    except OSError:
        rows = []
    if len(rows) >= 2:
        first, last = rows[0], rows[-1]
        seconds = float(last["wall_time"]) - float(first["wall_time"])
        if seconds > 0:
            return (float(last["global_step"]) - float(first["global_step"])) / seconds
    try:
        sps = json.loads((run_dir / "summary.json").read_text()).get("sps")
    except (OSError, ValueError):
        return math.nan
    return float(sps) if sps else math.nan
