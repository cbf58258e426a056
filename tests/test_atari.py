"""Atari ids in every mode, as a user runs them: frames stay uint8 in every buffer, and the configs load.

Each script logs how its buffer really holds observations (read from the arrays themselves), e.g.
``replay: 4000 x (4, 84, 84) uint8 observations x 2 (obs, next_obs), 225.8 MB``; the tests check
that line against what uint8 frames of that many rows must take. Needs ale-py and opencv
(requirements-extras.txt); skipped without them.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, run_script

pytest.importorskip("ale_py")
pytest.importorskip("cv2")

FRAMES = (4, 84, 84)
STORAGE = re.compile(r"(replay|rollout): ([\d x]+?) x \(([\d, ]+)\) (\w+) observations(?: x (\d) \([^)]*\))?, "
                     r"([\d.]+) MB")
COMMON = ("--no-tensorboard", "--seed", "3", "--device", "cpu")


def storage(log: str) -> dict:
    """The storage line of a log: rows (leading dims), frame shape, dtype, copies and the MB it reports."""
    found = STORAGE.search(log)
    assert found, f"no storage line in the log:\n{log[-2000:]}"
    what, rows, shape, dtype, copies, mb = found.groups()
    return {"what": what, "rows": tuple(int(n) for n in rows.split(" x ")),
            "shape": tuple(int(n) for n in shape.split(", ")), "dtype": dtype, "copies": int(copies or 1),
            "mb": float(mb)}


def check_uint8(log: str, what: str, rows: tuple[int, ...], copies: int) -> None:
    line = storage(log)
    assert (line["what"], line["rows"], line["shape"], line["dtype"], line["copies"]) == \
        (what, rows, FRAMES, "uint8", copies)
    uint8_mb = math.prod(rows) * math.prod(FRAMES) * copies / 1e6  # one byte per pixel
    assert line["mb"] == pytest.approx(uint8_mb, abs=0.06)


def finished(proc, run_dir: Path) -> dict:
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["exit_code"] == 0 and summary["global_step"] > 0
    return summary


def test_timed_ppo_rollout_of_frames_is_uint8(tmp_path):
    out = tmp_path / "run"
    proc = run_script("train_parallel_timed.py", "--env-id", "ALE/Breakout-v5", "--num-workers", "1",
                      "--num-envs-per-worker", "4", "--n-steps", "32", "--batch-size", "64", "--n-epochs", "1",
                      "--total-timesteps", "512", "--output-dir", out, *COMMON)
    finished(proc, out)
    check_uint8((out / "logs" / "main.log").read_text(), "rollout", (32, 4), 1)


def test_population_ppo_rollout_of_frames_is_uint8(tmp_path):
    out = tmp_path / "run"
    # Sampled (not greedy) evaluation: a greedy Breakout policy that never serves plays 27 000 steps.
    proc = run_script("train_ppo_multiprocess.py", "--env-id", "ALE/Breakout-v5", "--num-workers", "1",
                      "--num-envs-per-worker", "2", "--n-steps", "32", "--batch-size", "64", "--n-epochs", "1",
                      "--max-steps-per-worker", "256", "--eval-episodes", "1", "--eval-num-envs", "1",
                      "--no-eval-deterministic", "--no-eval-random-baseline", "--output-dir", out, *COMMON)
    finished(proc, out)
    log = (out / "logs" / "worker_0.log").read_text()
    check_uint8(log, "rollout", (32, 2), 1)
    assert "evaluation" in log


def test_ultra_shared_replay_of_frames_is_uint8(tmp_path):
    out = tmp_path / "run"
    proc = run_script("ultra_parallel_train_dqn.py", "--env-id", "ALE/Pong-v5", "--num-workers", "1",
                      "--num-envs-per-worker", "4", "--total-timesteps", "800", "--buffer-size", "2000",
                      "--learning-starts", "400", "--batch-size", "32", "--replay-ratio", "0.02",
                      "--replay-backend", "shm", "--output-dir", out, *COMMON)
    finished(proc, out)
    log = (out / "logs" / "main.log").read_text()
    check_uint8(log, "replay", (2000,), 2)
    assert re.search(STORAGE.pattern + r" \(shm\)", log)  # in shared memory, where the actors write


def test_parallel_dqn_replay_of_frames_is_uint8(tmp_path):
    out = tmp_path / "run"
    proc = run_script("parallel_train_dqn.py", "--env-id", "ALE/Breakout-v5", "--num-workers", "1",
                      "--episodes-per-batch", "1", "--total-timesteps", "300", "--buffer-size", "3000",
                      "--learning-starts", "150", "--batch-size", "32", "--replay-ratio", "0.05",
                      "--eval-interval", "0", "--eval-episodes", "1", "--max-game-length", "300",
                      "--output-dir", out, *COMMON)
    summary = finished(proc, out)
    assert summary["updates"] > 0  # learned from frames sampled out of the uint8 replay
    check_uint8((out / "logs" / "main.log").read_text(), "replay", (3000,), 2)


CONFIGS = {"atari_breakout_ppo.yaml": "train_parallel_timed.py",
           "atari_pong_ultra_dqn.yaml": "ultra_parallel_train_dqn.py",
           "atari_pong_parallel_dqn.yaml": "parallel_train_dqn.py"}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_atari_config_validates_in_its_script(name):
    path = ROOT / "configs" / name
    proc = run_script(CONFIGS[name], "--config", path, "--validate-only", timeout=60)
    if proc.returncode == 2 and ("RAM" in proc.stderr or "/dev/shm" in proc.stderr):
        pytest.skip(f"this machine cannot hold the config's replay buffer: {proc.stderr.strip()}")
    assert proc.returncode == 0, proc.stderr
    resolved = yaml.safe_load(proc.stdout)
    for key, value in yaml.safe_load(path.read_text()).items():
        assert same(resolved[key], value), (key, resolved[key], value)
    others = sorted(script for script in set(CONFIGS.values()) if script != CONFIGS[name])
    wrong = run_script(others[0], "--config", path, "--validate-only", timeout=60)
    assert wrong.returncode == 2 and "error:" in wrong.stderr  # its keys belong to its own script


def same(a, b) -> bool:
    """Equal as config values (``none`` = null, ``18`` = ``"18"``, ``2.5e-4`` = ``0.00025``)."""
    def norm(v):
        if v is None or str(v).lower() in ("none", "null"):
            return None
        try:
            return float(v)
        except (TypeError, ValueError):
            return v
    return norm(a) == norm(b)
