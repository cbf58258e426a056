"""The installed packages against the ranges ``requirements.txt`` states, the optional extras, torch's build.

Read from package metadata and the import system's finders, never by importing the packages
themselves: importing torch takes seconds, and a missing package must be reported, not crashed on.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
from pathlib import Path

from common.launcher import ROOT

# Optional packages: what each enables and the requirements file that pins it (``packages`` are its lines
# there; Box2D comes with requirements.txt's gymnasium[box2d], the rest with requirements-extras.txt).
EXTRAS = [
    # gymnasium.envs.box2d imports pygame with any of its envs (CarRacing draws with it even unrendered)
    {"extra": "Box2D", "modules": ["Box2D", "pygame"], "packages": ["gymnasium[box2d]"], "file": "requirements.txt",
     "enables": "LunarLander-v3, BipedalWalker-v3, CarRacing-v3"},
    {"extra": "onnx", "modules": ["onnx", "onnxruntime", "onnxscript"], "file": "requirements-extras.txt",
     "packages": ["onnx", "onnxruntime", "onnxscript"],
     "enables": "python -m common.evaluate RUN --export policy.onnx (checked with onnxruntime)"},
    {"extra": "moviepy", "modules": ["moviepy"], "packages": ["moviepy"], "file": "requirements-extras.txt",
     "enables": "python -m common.evaluate RUN --video DIR (MP4 of evaluation episodes)"},
    {"extra": "ale-py", "modules": ["ale_py", "cv2"], "packages": ["ale-py", "opencv-python-headless"],
     "file": "requirements-extras.txt", "enables": "Atari ids such as ALE/Pong-v5 (configs/atari_*.yaml)"},
    {"extra": "mujoco", "modules": ["mujoco"], "packages": ["mujoco"], "file": "requirements-extras.txt",
     "enables": "MuJoCo tasks such as HalfCheetah-v5 (configs/halfcheetah.yaml)"},
    {"extra": "pettingzoo", "modules": ["pettingzoo"], "packages": ["pettingzoo"], "file": "requirements-extras.txt",
     "enables": "PettingZoo's classic games: pettingzoo/tictactoe-v3, pettingzoo/connect_four-v3, pettingzoo/go-v5"},
    {"extra": "cshogi", "modules": ["cshogi"], "packages": ["cshogi"], "file": "requirements-extras.txt",
     "enables": "Shogi-v0 (configs/shogi_selfplay.yaml)"},
    {"extra": "bitbully", "modules": ["bitbully"], "packages": ["bitbully"], "file": "requirements-extras.txt",
     "enables": "python -m common.evaluate RUN --grade on ConnectFour-v0 (a perfect player)"},
    {"extra": "mlflow", "modules": ["mlflow", "sqlalchemy"], "packages": ["mlflow-skinny", "sqlalchemy"],
     "file": "requirements-tracking.txt", "enables": "--track mlflow in every training script (docs/tracking.md)"},
    {"extra": "wandb", "modules": ["wandb"], "packages": ["wandb"], "file": "requirements-tracking.txt",
     "enables": "--track wandb in every training script (docs/tracking.md)"},
]


def tested_versions() -> dict[str, str]:
    """The exact versions the tests and benchmarks ran on (constraints.txt), by package name."""
    path = ROOT / "constraints.txt"
    pins = {}
    for line in (path.read_text().splitlines() if path.is_file() else []):
        name, _, version = line.split("#", 1)[0].strip().partition("==")
        if version:
            pins[name.strip().lower()] = version.strip()
    return pins


def dependency_report() -> dict:
    """Each requirement: installed version or missing, whether it is inside the range requirements.txt
    states, and the version the tests ran on."""
    entries, missing, tested = [], [], tested_versions()
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        match = re.match(r"([A-Za-z0-9_.-]+)(\[[^\]]*\])?\s*(.*)", line)
        name, spec = match.group(1), match.group(3)
        try:
            version = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            version = None
        ok = version is not None and satisfies(version, spec)
        entries.append({"package": name, "required": spec or "any", "installed": version, "ok": ok,
                        "tested": tested.get(name.lower())})
        if not ok:
            missing.append(name)
    extras = [{**extra, "installed": all(importlib.util.find_spec(m) is not None for m in extra["modules"]),
               "install_hint": f"pip install -r {extra['file']}"} for extra in EXTRAS]
    return {"packages": entries, "missing": missing, "torch_build": torch_build(), "extras": extras,
            "install_hint": "pip install -r requirements.txt" if missing else None}


def torch_build() -> str | None:
    """CUDA / ROCm / CPU-only, from torch's installed files (importing torch takes seconds)."""
    try:
        dist = importlib.metadata.distribution("torch")
    except importlib.metadata.PackageNotFoundError:
        return None
    try:
        text = Path(dist.locate_file("torch/version.py")).read_text()
    except OSError:
        text = ""
    for key, label in (("cuda", "CUDA"), ("hip", "ROCm")):
        found = re.search(rf"^{key}\s*(?::[^=]*)?=\s*['\"]([^'\"]+)['\"]", text, re.MULTILINE)
        if found:
            return f"{label} {found.group(1)}"
    local = dist.version.partition("+")[2]
    return "CPU only" if text or local == "cpu" else f"unknown ({dist.version})"


def _version_tuple(version: str) -> tuple:
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"[.+-]", version.split("+")[0]))


def satisfies(version: str, spec: str) -> bool:
    """Whether ``version`` lies inside ``spec``: ``==``, ``!=``, ``>=``, ``<=``, ``>``, ``<`` clauses (what
    requirements.txt uses), comma-joined; a local build label (``+cu126``) does not count."""
    checks = {"==": lambda a, b: a == b, "!=": lambda a, b: a != b, ">=": lambda a, b: a >= b,
              "<=": lambda a, b: a <= b, ">": lambda a, b: a > b, "<": lambda a, b: a < b}
    for clause in filter(None, (c.strip() for c in spec.split(","))):
        match = re.match(r"(==|!=|>=|<=|>|<)\s*(\S+)", clause)
        if match is None:
            return False
        op, wanted = match.groups()
        if wanted.endswith(".*"):
            if (op == "==") != version.startswith(wanted[:-1]):
                return False
            continue
        try:
            if not checks[op](_version_tuple(version), _version_tuple(wanted)):
                return False
        except TypeError:  # mixed letters and numbers: compare as text
            if not checks[op](version, wanted):
                return False
    return True
