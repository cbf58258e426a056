"""Inspect this machine, recommend a training mode with settings that fit it, and run it.

    python launch_parallel_training.py --check-only        # dependencies, machine, recommendation, memory plan
    python launch_parallel_training.py --json              # the same as one JSON object; starts nothing
    python launch_parallel_training.py                     # run the recommended mode (about 10 minutes)
    python launch_parallel_training.py --mode dqn --episodes 5000 --seed 3
    python launch_parallel_training.py --mode timed --dry-run --duration 1
    python launch_parallel_training.py --assume-facts configs/machines/workstation_128core_1gpu.json --check-only
    python launch_parallel_training.py --tune [--run]      # measure worker counts instead of guessing
    python launch_parallel_training.py --nnodes 2          # print the torchrun command of every node and a SLURM script

Every machine fact (cores, RAM, /dev/shm, GPUs, open-files limit) comes from
``common.system.machine()``; ``--assume-facts FILE.json`` replaces some of them, for the launcher
and for the script it starts, so the advice for another machine can be read (and tested) here.
Every flag the launcher does not know passes through untouched to the chosen script. The
launcher then replaces itself with the script (``os.execv``), so Ctrl+C, SIGTERM and the exit
status are the script's own. It imports only the standard library and ``common.system`` (no
torch: the torch build is read from package metadata), so it answers at once and can report
missing packages instead of crashing on them.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import math
import os
import re
import socket
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path

from common import system
from common.config import ConfigError

ROOT = Path(__file__).resolve().parent
EXIT_MISSING = 1
EXIT_USAGE = 2
MiB, GiB = 2**20, 2**30
DEFAULT_DURATION_H = 0.16  # the no-argument run: about 10 minutes
TUNE_CACHE = Path(os.environ.get("PRL_TUNE_CACHE", Path.home() / ".cache" / "parallel-rl" / "tune.json"))

# What the memory plan counts on (measured on the 2-core development machine, rounded up).
WORKER_RSS = 256 * MiB  # one worker process: interpreter, numpy, torch, its envs (226-230 MiB PSS measured)
MAIN_RSS = 512 * MiB  # the coordinator / learner process, with logs and TensorBoard
CUDA_HOST_RSS = 512 * MiB  # host memory a CUDA context adds to a process
POPULATION_VRAM = 1 * GiB  # GPU memory of one population worker: CUDA context, small nets, PPO batches
GPU_MEMORY_SHARE = 0.85  # plan to use at most this share of a GPU's memory
RAM_SHARE = system.RAM_HEADROOM  # and of the RAM available now (shared memory counts as RAM too)
SHM_SHARE = 0.9  # and of /dev/shm's free space
FDS_BASE = 128  # open files of a run before its workers (logs, TensorBoard, shared-memory segments)
FDS_PER_WORKER = 4  # the coordinator's pipe and process sentinel per worker (3 measured)
ULTRA_MIN_CORES = 8  # fewer, and the learner starves the asynchronous actors
MIN_REPLAY = 10_000  # the smallest replay buffer worth running the DQN modes with


@dataclass(frozen=True)
class Mode:
    name: str
    script: str
    default_env: str
    summary: str
    obs_floats: int  # float32 values in one observation of default_env: the memory plan's unit
    defaults: dict  # the script's defaults the plan relies on (tests check them against the script)
    episodes_flag: str | None = "--total-episodes"  # the script's episode budget
    envs_flag: str | None = "--num-envs-per-worker"
    workers_flag: str = "--num-workers"
    duration_flag: str = "--duration"


MODES = {
    "timed": Mode("timed", "train_parallel_timed.py", "LunarLander-v3",
                  "synchronous parallel PPO on a wall-clock budget", 8,
                  {"num_envs_per_worker": 8, "n_steps": 256, "device": "cpu", "torch_threads": 1}),
    "dqn": Mode("dqn", "parallel_train_dqn.py", "ConnectFour-v0",
                "central DQN learner fed by rollout processes, self-play", 2 * 6 * 7,
                {"buffer_size": 100_000, "device": "cpu"}, envs_flag=None),
    "ultra": Mode("ultra", "ultra_parallel_train_dqn.py", "GridCoverage-v0",
                  "asynchronous actors -> shared-memory replay -> one learner (GPU where there is one)", 2 * 11 * 11,
                  {"num_envs_per_worker": 16, "buffer_size": 200_000, "n_step": 3, "device": "auto"}),
    "ppo-multiprocess": Mode("ppo-multiprocess", "train_ppo_multiprocess.py", "Market-v0",
                             "population of independent PPO agents over a shared data cache", 333,
                             {"num_envs_per_worker": 8, "num_items": 200, "history_steps": 20_000, "device": "auto"},
                             episodes_flag=None),
}


# --------------------------------------------------------------------------- dependencies

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
        ok = version is not None and _satisfies(version, spec)
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


def _satisfies(version: str, spec: str) -> bool:
    """``==``, ``!=``, ``>=``, ``<=``, ``>``, ``<`` clauses (what requirements.txt uses), comma-joined."""
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


# --------------------------------------------------------------------------- facts

def facts_report(m: system.Machine) -> dict:
    """The machine's facts for people and JSON (GiB rounded), with which were assumed and from where."""
    return {"physical_cores": m.physical_cores, "logical_cores": m.logical_cores, "usable_cores": m.usable_cores,
            "ram_total_gib": round(m.ram_total / GiB, 1), "ram_available_gib": round(m.ram_available / GiB, 1),
            "gpus": [{"index": g.index, "name": g.name, "memory_gib": round(g.memory / GiB, 1),
                      "capability": g.capability} for g in m.gpus],
            "shm_total_gib": round(m.shm_total / GiB, 2), "shm_free_gib": round(m.shm_free / GiB, 2),
            "open_files_limit": m.open_files_limit,
            "start_method": f"{m.start_method} (set by every script; the platform default is "
                            f"{system.platform_start_method()})",
            "hostname": socket.gethostname(), "assumed": list(m.assumed),
            "assumed_from": os.environ.get(system.ASSUME_ENV) if m.assumed else None}


# --------------------------------------------------------------------------- plans

@dataclass
class Plan:
    """How one mode would run on this machine: its flags, threads, devices and memory."""

    mode: str
    args: list[str]  # flags for the script: only what differs from its defaults
    settings: dict  # what the run will use (the flags and the defaults the plan relies on)
    threads: dict  # torch threads per process
    devices: str  # where the learner(s) and workers run
    memory: dict  # bytes: buffers, cache, per-process RSS, the total against the budget
    reason: str = ""  # why this mode suits this machine
    not_recommended: str | None = None  # the launcher asks for --force
    cannot_run: str | None = None  # the launcher refuses it, --force or not
    warnings: list[str] = field(default_factory=list)


def fit_workers(m: system.Machine, wanted: int, per_worker: int, fixed: int, what: str = "workers",
                per_gpu: int | None = None) -> tuple[int, list[str]]:
    """The most workers, up to ``wanted``, whose RAM, GPU memory and open files fit; and what bounded them."""
    limits = {"RAM": int((RAM_SHARE * m.ram_available - fixed) // per_worker),
              "the open-files limit": (m.open_files_limit - FDS_BASE) // FDS_PER_WORKER}
    if per_gpu and m.gpus:
        limits["GPU memory"] = sum(int(GPU_MEMORY_SHARE * g.memory // per_gpu) for g in m.gpus)
    count = max(0, min(wanted, *limits.values()))
    notes = []
    for name, limit in limits.items():
        if limit < wanted:
            hint = f" (ulimit -n {FDS_BASE + FDS_PER_WORKER * wanted} for {wanted})" if name.startswith("the") else ""
            notes.append(f"{name} allows {max(0, limit)} {what}, not {wanted}{hint}")
    return count, notes


def memory_plan(m: system.Machine, workers: int, per_worker: int, main: int, buffers: dict[str, int],
                shm_keys: tuple[str, ...] = ()) -> dict:
    """Bytes of every buffer, the per-process estimates, and the totals against RAM and /dev/shm."""
    shm = sum(buffers[k] for k in shm_keys)
    total = main + workers * per_worker + sum(buffers.values())
    return {**{f"{k}_bytes": v for k, v in buffers.items()}, "per_worker_rss_bytes": per_worker,
            "main_rss_bytes": main, "total_ram_bytes": total, "ram_budget_bytes": int(RAM_SHARE * m.ram_available),
            "shm_bytes": shm, "shm_free_bytes": m.shm_free}


def plan_timed(m: system.Machine) -> Plan:
    mode = MODES["timed"]
    d = mode.defaults
    step = 4 * mode.obs_floats + 8 + 6 * 4  # obs, action (int64), logprob/value/reward/final value/2 flags

    def rollout(workers: int) -> int:
        return d["n_steps"] * max(1, workers) * d["num_envs_per_worker"] * step

    # Lockstep workers wait for the slowest, and two on one core's hyperthreads slow each other: one per core.
    wanted = min(m.usable_cores, m.physical_cores) if m.usable_cores > 1 else 0
    per_worker = WORKER_RSS + 2 * rollout(1)  # its share of the shared rollout and of the learner's batch
    workers, notes = fit_workers(m, wanted, per_worker, MAIN_RSS + 2 * rollout(0))
    by_shm = int(SHM_SHARE * m.shm_free // rollout(1))
    if by_shm < workers:
        notes.append(f"/dev/shm holds the rollout of {by_shm} workers, not {workers}")
        workers = by_shm
    memory = memory_plan(m, workers, WORKER_RSS, MAIN_RSS, {"rollout": rollout(workers), "batch": rollout(workers)},
                         ("rollout",))
    plan = Plan("timed", [mode.workers_flag, str(workers)],
                {"num_workers": workers, "num_envs_per_worker": d["num_envs_per_worker"], "n_steps": d["n_steps"],
                 "device": d["device"]},
                {"per_worker": 1, "learner": d["torch_threads"]},
                "learner and workers on the CPU (a 64-wide MLP updates fastest there)", memory,
                warnings=notes)
    if memory["total_ram_bytes"] > memory["ram_budget_bytes"] or memory["shm_bytes"] > m.shm_free:
        plan.cannot_run = (f"even the sequential run needs {system.format_bytes(memory['total_ram_bytes'])} of RAM "
                           f"and {system.format_bytes(memory['shm_bytes'])} of /dev/shm")
    cores = (f"{m.usable_cores} cores ({m.physical_cores} physical)" if m.physical_cores < m.usable_cores
             else f"{m.usable_cores} core{'s' * (m.usable_cores > 1)}")
    per_core = " (one per physical core)" if workers == wanted else ""
    who = (f"{workers} worker processes{per_core} in lockstep" if workers > 1 else
           "1 worker process" if workers else "its envs in the main process (no worker processes)")
    plan.reason = (f"{cores}, no GPU needed: synchronous PPO steps {who} and updates on the CPU, where a small "
                   "network learns fastest")
    return plan


@dataclass
class ReplayBudget:
    """Workers and replay capacity of a DQN mode: the replay first (up to half the RAM budget, and in
    /dev/shm where it lives there), then as many workers as the rest holds."""

    workers: int
    buffer: int
    transition: int  # bytes of one transition
    main: int  # bytes of the learner process
    notes: list[str]

    def refusal(self, what: str) -> str | None:
        if self.workers >= 1 and self.buffer >= MIN_REPLAY:
            return None
        return (f"room for {self.workers} {what} and a replay of {self.buffer} transitions "
                f"({'; '.join(self.notes)}), it needs 1 and {MIN_REPLAY} transitions")


def replay_budget(m: system.Machine, mode: Mode, wanted: int, in_shm: bool, what: str) -> ReplayBudget:
    default = mode.defaults["buffer_size"]
    transition = 2 * 4 * mode.obs_floats + 48  # obs, next obs, action, reward, done, discount, priority, mask
    main = MAIN_RSS + (CUDA_HOST_RSS if m.gpus else 0)
    room, why = (RAM_SHARE * m.ram_available - main) / 2, "half the RAM budget"
    if in_shm and SHM_SHARE * m.shm_free < room:
        room, why = SHM_SHARE * m.shm_free, "/dev/shm (docker: --shm-size=8g)"
    buffer, notes = default, []
    if default * transition > room:
        buffer = max(0, int(room // transition) // 1000 * 1000)
        notes.append(f"replay buffer bounded to {buffer} transitions ({system.format_bytes(buffer * transition)}) "
                     f"by {why}")
    workers, limits = fit_workers(m, wanted, WORKER_RSS, main + buffer * transition, what)
    return ReplayBudget(workers, buffer, transition, main, notes + limits)


def idle_gpus(m: system.Machine) -> list[str]:
    """A single learner uses one GPU; say so where there are more."""
    if len(m.gpus) < 2:
        return []
    others = len(m.gpus) - 1
    return [f"the learner uses cuda:0; {others} more GPU{'s' * (others > 1)} would stay idle "
            "(the ppo-multiprocess population spreads its workers over all of them)"]


def replay_flags(mode: Mode, budget: ReplayBudget, device: str | None = None) -> list[str]:
    """The worker count; a device and a replay size only where they differ from the script's defaults."""
    args = [mode.workers_flag, str(max(1, budget.workers))]
    if device is not None and device != mode.defaults["device"]:
        args += ["--device", device]
    if budget.buffer != mode.defaults["buffer_size"]:
        args += ["--buffer-size", str(budget.buffer)]
    return args


def plan_ultra(m: system.Machine) -> Plan:
    mode = MODES["ultra"]
    d = mode.defaults
    gpu, cores = bool(m.gpus), m.usable_cores
    learner_threads = 1 if gpu else max(1, min(8, cores // 4))  # a GPU learner needs one core to feed it
    # and one core stays for the system and the bookkeeping
    budget = replay_budget(m, mode, max(1, cores - learner_threads - 1), in_shm=True, what="actors")
    actors, buffer = budget.workers, budget.buffer
    burst = d["n_step"] * d["num_envs_per_worker"]  # each actor's replay share must hold one vector step's output
    if actors and buffer // actors < burst:
        actors = budget.workers = buffer // burst
        budget.notes.append(f"a replay of {buffer} transitions holds {actors} actors' shares")
    args = replay_flags(mode, budget)  # the script's device "auto" puts the learner on the GPU
    device = "cuda:0" if gpu else "cpu"
    memory = memory_plan(m, actors, WORKER_RSS, budget.main, {"replay": buffer * budget.transition}, ("replay",))
    # fp32 by default: at these networks' sizes autocast measured slower on an H200 (common.dqn.resolve_precision)
    precision = ("fp32; bf16 autocast" if float(m.gpus[0].capability) >= 8.0 else "fp32; fp16 with a GradScaler") \
        if gpu else "fp32"
    plan = Plan("ultra", args, {"num_workers": actors, "num_envs_per_worker": d["num_envs_per_worker"],
                                "buffer_size": buffer, "device": device,
                                "split": f"{actors} actor processes, 1 learner ({learner_threads} thread(s))"},
                {"per_actor": 1, "learner": learner_threads},
                f"learner on {device} ({precision} possible, --mixed-precision); actors act on the CPU", memory,
                warnings=budget.notes + idle_gpus(m), cannot_run=budget.refusal("actors"))
    if plan.cannot_run is None and cores < ULTRA_MIN_CORES:
        plan.not_recommended = (f"{cores} cores: asynchronous actors and a learner need at least {ULTRA_MIN_CORES} "
                                "cores, or the learner starves the actors")
    plan.reason = (f"{cores} cores{' and a GPU' if gpu else ''}: {actors} asynchronous actors keep the replay full "
                   f"while the {'GPU' if gpu else 'CPU'} learner trains")
    return plan


def plan_dqn(m: system.Machine) -> Plan:
    mode = MODES["dqn"]
    cores = m.usable_cores
    learner_threads = 1 if m.gpus or cores < 4 else 2
    budget = replay_budget(m, mode, max(1, cores - learner_threads), in_shm=False, what="workers")
    workers = budget.workers
    device = "cuda:0" if m.gpus else mode.defaults["device"]
    memory = memory_plan(m, workers, WORKER_RSS, budget.main, {"replay": budget.buffer * budget.transition})
    plan = Plan("dqn", replay_flags(mode, budget, device),
                {"num_workers": workers, "buffer_size": budget.buffer, "device": device},
                {"per_worker": 1, "learner": learner_threads},
                f"learner on {device}; rollout workers act on the CPU and send whole episodes", memory,
                warnings=budget.notes + idle_gpus(m), cannot_run=budget.refusal("workers"))
    plan.reason = (f"{cores} cores{' and a GPU' if m.gpus else ''}: {workers} rollout processes feed one "
                   f"{'GPU' if m.gpus else 'CPU'} learner; nothing large goes through /dev/shm")
    return plan


def plan_population(m: system.Machine) -> Plan:
    mode, gpus = MODES["ppo-multiprocess"], len(m.gpus)
    d = mode.defaults
    cache = d["num_items"] * d["history_steps"] * 2 * 4  # prices and volumes, float32, in shared memory
    per_worker = WORKER_RSS + (CUDA_HOST_RSS if gpus else 0)
    # One core stays for the coordinator; each worker's GPU memory counts too.
    workers, notes = fit_workers(m, max(1, m.usable_cores - 1), per_worker, MAIN_RSS + cache, per_gpu=POPULATION_VRAM)
    threads = max(1, m.usable_cores // max(1, workers))
    # The script's device "auto" puts image (CNN) policies on the GPUs and MLP policies, the default
    # market's among them, on the CPU, where they measured faster; the memory plan still counts the GPUs.
    if gpus:
        on_gpus = (f"round robin over {gpus} GPUs: worker i on cuda:(i mod {gpus}), "
                   f"{math.ceil(max(1, workers) / gpus)} per GPU" if gpus > 1 else "every worker on cuda:0")
        devices = (f"MLP policies (the default {mode.default_env}'s) on the CPU, where they train faster; "
                   f"image policies {on_gpus}")
    else:
        devices = "every worker on the CPU"
    memory = memory_plan(m, workers, per_worker, MAIN_RSS, {"cache": cache}, ("cache",))
    plan = Plan("ppo-multiprocess", [mode.workers_flag, str(max(1, workers))],
                {"num_workers": workers, "num_envs_per_worker": d["num_envs_per_worker"],
                 "device": "cpu"},  # what the script's device "auto" picks for the default env's MLP policy
                {"per_worker": threads}, devices, memory, warnings=notes)
    if workers < 1:
        plan.cannot_run = "not enough RAM or GPU memory for one worker"
    elif cache > SHM_SHARE * m.shm_free:
        plan.cannot_run = (f"the market cache needs {system.format_bytes(cache)} of /dev/shm, "
                           f"{system.format_bytes(m.shm_free)} free (docker: --shm-size=8g)")
    plan.reason = (f"{gpus} GPUs: a population of {workers} independent agents, one per core; image policies "
                   "spread round robin over the GPUs" if gpus > 1
                   else f"a population of {workers} independent agents, one per core")
    return plan


PLANNERS = {"timed": plan_timed, "dqn": plan_dqn, "ultra": plan_ultra, "ppo-multiprocess": plan_population}


@dataclass
class Recommendation:
    mode: str
    plan: Plan
    plans: dict[str, Plan]  # every mode's plan on this machine
    refused: dict[str, str]  # mode -> why it does not run (or is not recommended) here
    warnings: list[str]


def recommend(m: system.Machine) -> Recommendation:
    """Pick a mode and its settings from the machine's facts. A pure function of ``m``."""
    plans = {name: planner(m) for name, planner in PLANNERS.items()}
    refused = {name: p.cannot_run or p.not_recommended for name, p in plans.items()
               if p.cannot_run or p.not_recommended}
    gpus = len(m.gpus)
    if gpus >= 2 and "ppo-multiprocess" not in refused:
        choice = "ppo-multiprocess"
    elif gpus and "ultra" not in refused:
        choice = "ultra"
    elif gpus or "timed" in refused:
        choice = "dqn"
        if not gpus:
            plans["dqn"].reason = "/dev/shm or RAM is too small for the shared-memory rollout; " + plans["dqn"].reason
    else:
        choice = "timed"
    warnings = list(plans[choice].warnings)
    if not gpus:
        warnings.append("no CUDA GPU: learners run on the CPU (the ultra mode prefers a GPU)")
    return Recommendation(choice, plans[choice], plans, refused, warnings)


# --------------------------------------------------------------------------- report

def build_report(m: system.Machine, mode: str | None = None, env_id: str | None = None) -> dict:
    """Dependencies, facts, the recommendation, every mode's plan, and the mode selected (``mode`` or
    the recommended one) with its ``--tune`` measurement for ``env_id`` if there is one."""
    deps = dependency_report()
    facts = facts_report(m)
    rec = recommend(m)
    chosen = mode or rec.mode
    return {"dependencies": deps, "system": facts, "recommendation": {"mode": rec.mode, **asdict(rec.plan),
                                                                      "refused": rec.refused,
                                                                      "warnings": rec.warnings},
            "plans": {name: asdict(p) for name, p in rec.plans.items()}, "selected": chosen,
            "tuned": tuned_choice(facts, chosen, env_id or MODES[chosen].default_env), "ready": not deps["missing"]}


def print_report(report: dict) -> None:
    deps, facts, rec = report["dependencies"], report["system"], report["recommendation"]
    print("Dependencies")
    for p in deps["packages"]:
        state = p["installed"] or "MISSING"
        tested = f", tested with {p['tested']}" if p.get("tested") else ""
        print(f"  {'ok ' if p['ok'] else 'BAD'} {p['package']:<15} {state:<14} (requires {p['required']}{tested})")
    print(f"  torch build: {deps['torch_build'] or 'torch not installed'}")
    for extra in deps["extras"]:
        state = "installed" if extra["installed"] else f"not installed ({extra['install_hint']})"
        print(f"  extra {extra['extra']:<7} -> {extra['enables']}: {state}")
    if deps["missing"]:
        print(f"  missing or wrong version: {', '.join(deps['missing'])} -> {deps['install_hint']}")
    print_system(facts)
    for warning in rec["warnings"]:
        print(f"  warning: {warning}")
    print("\nRecommendation")
    print(f"  mode: {rec['mode']} ({MODES[rec['mode']].script}: {MODES[rec['mode']].summary})")
    print(f"  why: {rec['reason']}")
    selected = report["selected"]
    if selected != rec["mode"]:
        print(f"\nSelected with --mode: {selected} ({MODES[selected].script})")
    print_plan(report["plans"][selected])
    if report["tuned"]:
        print(f"  measured by --tune: {report['tuned']['args']} ({report['tuned']['sps']:.0f} steps/s), "
              "used instead of the guess")
    print("\nOther modes on this machine")
    for name, plan in report["plans"].items():
        if name != selected:
            state = (f"cannot run: {plan['cannot_run']}" if plan["cannot_run"] else
                     f"not recommended: {plan['not_recommended']}" if plan["not_recommended"] else
                     f"would run with {' '.join(plan['args'])}")
            print(f"  {name:<17} {state}")


def print_system(facts: dict) -> None:
    print("\nSystem")
    if facts["assumed"]:
        print(f"  assumed (from {facts['assumed_from']}): {', '.join(facts['assumed'])}; the rest is measured")
    print(f"  cores: {facts['physical_cores']} physical, {facts['logical_cores']} logical "
          f"({facts['usable_cores']} usable by this process)")
    print(f"  RAM: {facts['ram_total_gib']} GiB total, {facts['ram_available_gib']} GiB available")
    for gpu in facts["gpus"]:
        print(f"  GPU {gpu['index']}: {gpu['name']}, {gpu['memory_gib']} GiB, compute capability {gpu['capability']}")
    if not facts["gpus"]:
        print("  GPUs: none")
    print(f"  /dev/shm: {facts['shm_total_gib']} GiB, {facts['shm_free_gib']} GiB free")
    print(f"  open-files limit: {facts['open_files_limit']}")
    print(f"  start method: {facts['start_method']}")


def print_plan(plan: dict) -> None:
    fmt = system.format_bytes
    print(f"  flags: {' '.join(plan['args']) or '(the script defaults)'}")
    print(f"  settings: {', '.join(f'{k}={v}' for k, v in plan['settings'].items())}")
    print(f"  threads: {', '.join(f'{k} {v}' for k, v in plan['threads'].items())}")
    print(f"  devices: {plan['devices']}")
    mem = plan["memory"]
    buffers = [f"{k[:-6]} {fmt(v)}" for k, v in mem.items()
               if k.endswith("_bytes") and k[:-6] in ("rollout", "batch", "replay", "cache")]
    print(f"  memory plan: {', '.join(buffers)}; per worker ~{fmt(mem['per_worker_rss_bytes'])} RSS, "
          f"main ~{fmt(mem['main_rss_bytes'])}; total ~{fmt(mem['total_ram_bytes'])} of a "
          f"{fmt(mem['ram_budget_bytes'])} RAM budget; /dev/shm {fmt(mem['shm_bytes'])} of "
          f"{fmt(mem['shm_free_bytes'])} free")
    for warning in plan["warnings"]:
        print(f"  note: {warning}")
    if plan["cannot_run"]:
        print(f"  cannot run here: {plan['cannot_run']}")
    elif plan["not_recommended"]:
        print(f"  not recommended here: {plan['not_recommended']}")


# --------------------------------------------------------------------------- tuning

def _cache_key(facts: dict, mode: str, env_id: str) -> str:
    return f"{facts['hostname']}|{facts['usable_cores']}|{len(facts['gpus'])}|{mode}|{env_id}"


def tuned_choice(facts: dict, mode: str, env_id: str) -> dict | None:
    if facts["assumed"]:  # measured on this machine, not on the one assumed
        return None
    try:
        return json.loads(TUNE_CACHE.read_text()).get(_cache_key(facts, mode, env_id))
    except (OSError, ValueError):
        return None


def tune(mode: Mode, env_id: str, facts: dict, passthrough: list[str], trial_seconds: float) -> dict:
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


def _trial(mode: Mode, env_id: str, args: list[str], seconds: float) -> float:
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
    import csv

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


# --------------------------------------------------------------------------- command line

def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--check-only", action="store_true",
                        help="report dependencies, machine, recommendation and memory plan; start nothing")
    parser.add_argument("--json", action="store_true",
                        help="print the report, and the command it would run, as JSON; start nothing")
    parser.add_argument("--mode", help=f"run this mode instead of the recommended one: {', '.join(MODES)}")
    parser.add_argument("--force", action="store_true", help="run a mode the check does not recommend here")
    parser.add_argument("--assume-facts", metavar="FILE.json",
                        help="take these machine facts instead of measured ones, for the launcher and the script "
                             "(sets PRL_ASSUME_FACTS; see configs/machines/)")
    parser.add_argument("--episodes", type=int, help="episode budget, translated into the script's own flag")
    parser.add_argument("--duration", type=float, help="hours of wall time, passed to the script")
    parser.add_argument("--dry-run", action="store_true", help="print the exact command instead of running it")
    parser.add_argument("--tune", action="store_true", help="measure worker counts and envs per worker")
    parser.add_argument("--run", action="store_true", help="with --tune: run the fastest setting afterwards")
    parser.add_argument("--trial-seconds", type=float, default=8.0, help="--tune: seconds per trial")
    nodes = parser.add_argument_group("past one machine (print the commands, run nothing)")
    nodes.add_argument("--nnodes", type=int, metavar="N",
                       help="print the torchrun command for each of N nodes like this one, and a SLURM batch script")
    nodes.add_argument("--nproc-per-node", type=int, metavar="M", help="ranks per node (default: decided per mode)")
    nodes.add_argument("--rdzv-endpoint", metavar="HOST[:PORT]",
                       help=f"node 0's address on the cluster network (default: this machine, port {RDZV_PORT})")
    nodes.add_argument("--rdzv-id", metavar="ID", help="the job's rendezvous id (default: prl-<mode>-<date>)")
    nodes.add_argument("--max-restarts", type=int, default=MAX_RESTARTS,
                       help=f"torchrun restarts of a failed job, each resuming its newest checkpoint ({MAX_RESTARTS})")
    nodes.add_argument("--join-timeout", type=int, default=JOIN_TIMEOUT_S, metavar="SECONDS",
                       help=f"how long the rendezvous waits for every node ({JOIN_TIMEOUT_S})")
    nodes.add_argument("--slurm-script", metavar="FILE", help="also write the SLURM batch script to FILE")
    parser.error = lambda message: _usage_error(message)
    return parser.parse_known_args(argv)


def _usage_error(message: str):
    print(f"error: {message}", file=sys.stderr)
    sys.exit(EXIT_USAGE)


def has_flag(args: list[str], *flags: str) -> bool:
    return any(a == f or a.startswith(f + "=") for a in args for f in flags)


def build_command(mode: Mode, rec_args: list[str], opts: argparse.Namespace, passthrough: list[str],
                  run_dir: Path | None, ranks: int = 1) -> list[str]:
    """The script's command line: the plan's flags, translated budgets, then the user's flags
    (``ranks``: how many ranks run it, each with the workers it names)."""
    command = [sys.executable, str(ROOT / mode.script)]
    user_flags = {a.split("=", 1)[0] for a in passthrough if a.startswith("--")}
    for flag, value in zip(rec_args[::2], rec_args[1::2]):  # the user's own flags win over the plan
        if flag not in user_flags:
            command += [flag, value]
    if opts.episodes is not None:
        command += translate_episodes(mode, opts.episodes, command[2:] + passthrough, ranks)
    if opts.duration is not None:
        command += [mode.duration_flag, str(opts.duration)]
    elif opts.episodes is None and not has_flag(passthrough, mode.duration_flag):
        command += [mode.duration_flag, str(DEFAULT_DURATION_H)]
    if run_dir is not None:
        command += ["--output-dir", str(run_dir)]
    return command + passthrough


def translate_episodes(mode: Mode, episodes: int, args: list[str], ranks: int = 1) -> list[str]:
    """``--episodes N`` in the script's own terms (``args``: the flags it gets, the user's last; ``ranks``:
    how many ranks run them, each with ``--num-workers`` workers)."""
    if mode.episodes_flag:
        return [mode.episodes_flag, str(episodes)]
    # The population trains fixed-length Market episodes per worker: convert to steps per worker.
    episode_length = int(_flag_value(args, "--episode-length") or 256)
    workers = int(_flag_value(args, "--num-workers") or 4) * ranks
    return ["--max-steps-per-worker", str(math.ceil(episodes / workers) * episode_length)]


def merge_flags(base: list[str], overrides: list[str]) -> list[str]:
    """``--flag value`` pairs of ``base`` with those of ``overrides`` replacing or added."""
    merged = dict(zip(base[::2], base[1::2]))
    merged.update(zip(overrides[::2], overrides[1::2]))
    return [item for pair in merged.items() for item in pair]


def _flag_value(args: list[str], flag: str) -> str | None:
    """The value of the last ``flag`` in ``args`` (the one argparse keeps), or None."""
    for i in range(len(args) - 1, -1, -1):
        if args[i] == flag and i + 1 < len(args):
            return args[i + 1]
        if args[i].startswith(flag + "="):
            return args[i].split("=", 1)[1]
    return None


def load_machine(opts: argparse.Namespace) -> system.Machine:
    """The facts, with ``--assume-facts`` applied (and exported, so the script sees them too)."""
    if opts.assume_facts:
        path = Path(opts.assume_facts)
        if not path.is_file():
            _usage_error(f"--assume-facts {opts.assume_facts!r}: no such file")
        os.environ[system.ASSUME_ENV] = str(path.resolve())
        system.forget_machine()
    try:
        return system.machine()
    except ConfigError as err:
        _usage_error(str(err))


def check_usage(opts: argparse.Namespace) -> None:
    if opts.episodes is not None and opts.episodes <= 0:
        _usage_error(f"--episodes {opts.episodes}: must be > 0")
    if opts.duration is not None and opts.duration <= 0:
        _usage_error(f"--duration {opts.duration}: must be > 0")
    if opts.mode is not None and opts.mode not in MODES:
        _usage_error(f"--mode {opts.mode!r}: must be one of {', '.join(MODES)}")
    check_multinode_usage(opts)
    if opts.tune and (opts.assume_facts or os.environ.get(system.ASSUME_ENV)):
        _usage_error("--tune measures this machine; it cannot run with assumed facts")


def refusal(plan: dict, force: bool) -> str | None:
    """Why the launcher will not start this plan, or None."""
    if plan["cannot_run"]:
        return f"mode {plan['mode']} cannot run on this machine: {plan['cannot_run']}"
    if plan["not_recommended"] and not force:
        return (f"mode {plan['mode']} is not recommended on this machine: {plan['not_recommended']} "
                "(add --force to run it anyway)")
    return None


def plan_args(report: dict) -> list[str]:
    """The selected mode's flags: the plan's, a measured ``--tune`` setting replacing the guess."""
    rec_args = report["plans"][report["selected"]]["args"]
    return merge_flags(rec_args, report["tuned"]["args"]) if report["tuned"] else rec_args


def default_run_dir(mode: Mode, passthrough: list[str], run_name: str) -> Path | None:
    """``runs/<script>/<env>__<seed>__<run_name>``, or None where the user named one (or a checkpoint's)."""
    if has_flag(passthrough, "--output-dir") or has_flag(passthrough, "--resume"):
        return None
    seed = _flag_value(passthrough, "--seed") or "1"
    env_id = _flag_value(passthrough, "--env-id") or mode.default_env
    return Path("runs") / Path(mode.script).stem / f"{env_id.replace('/', '_')}__{seed}__{run_name}"


def plan_command(report: dict, opts: argparse.Namespace, passthrough: list[str]) -> tuple[list[str], Path | None]:
    """The command for the selected mode's plan."""
    mode = MODES[report["selected"]]
    run_dir = default_run_dir(mode, passthrough, datetime.now().strftime("%Y%m%d-%H%M%S"))
    # A flag the script does not know is left for the script's own parser to refuse (exit 2),
    # before it starts anything.
    return build_command(mode, plan_args(report), opts, passthrough, run_dir), run_dir


def shell_line(command: list[str]) -> str:
    """The command as one shell line, with the assumed facts it depends on."""
    assume = os.environ.get(system.ASSUME_ENV)
    prefix = [f"{system.ASSUME_ENV}={_quote(assume)}"] if assume else []
    return " ".join(prefix + [_quote(c) for c in command])


# --------------------------------------------------------------------------- past one machine

RDZV_PORT = 29400  # the port torchrun's docs use for the c10d rendezvous
MAX_RESTARTS = 3  # torchrun restarts of a failed job; each one resumes from the newest checkpoint
JOIN_TIMEOUT_S = 600  # torch's own default, written out so that the command says how long nodes wait
READ_TIMEOUT_S = 60  # torch's default: how long a node tries to reach the rendezvous host
RANK0_ROLE = {  # what rank 0 does beyond the other ranks, per mode
    "timed": "writes the run directory (every rank collects and learns)",
    "dqn": "is the central learner: it trains, evaluates and writes the run directory",
    "ultra": "is the learner: it owns the replay and writes the run directory; the other nodes only act",
    "ppo-multiprocess": "keeps the leaderboard, runs PBT across the nodes and writes the run directory",
}


def check_multinode_usage(opts: argparse.Namespace) -> None:
    """``--nnodes`` and its flags: one line and exit 2 for anything torchrun or a shell would trip on."""
    if opts.nnodes is None:
        given = [flag for flag, value in (("--nproc-per-node", opts.nproc_per_node),
                                          ("--rdzv-endpoint", opts.rdzv_endpoint), ("--rdzv-id", opts.rdzv_id),
                                          ("--slurm-script", opts.slurm_script)) if value is not None]
        if given:
            _usage_error(f"{given[0]} describes a multi-node job: add --nnodes N")
        return
    if opts.nnodes < 1:
        _usage_error(f"--nnodes {opts.nnodes}: must be >= 1 (the number of machines)")
    if opts.tune:
        _usage_error("--nnodes prints commands for other machines; it cannot run with --tune (tune on one node, "
                     "then print the commands there)")
    if opts.nproc_per_node is not None and opts.nproc_per_node < 1:
        _usage_error(f"--nproc-per-node {opts.nproc_per_node}: must be >= 1")
    if opts.max_restarts < 0:
        _usage_error(f"--max-restarts {opts.max_restarts}: must be >= 0")
    if opts.join_timeout < 1:
        _usage_error(f"--join-timeout {opts.join_timeout}: must be >= 1 second")
    if opts.rdzv_endpoint is not None:
        parse_endpoint(opts.rdzv_endpoint)
    if opts.rdzv_id is not None and not re.fullmatch(r"[A-Za-z0-9_.-]+", opts.rdzv_id):
        _usage_error(f"--rdzv-id {opts.rdzv_id!r}: letters, digits, '_', '.' and '-' only (it names the run "
                     "directory too)")


def parse_endpoint(text: str) -> tuple[str, int]:
    """``HOST[:PORT]`` (``[IPv6]:PORT``) as torchrun reads it; a usage error otherwise."""
    match = re.fullmatch(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+)(?::(\d{1,5}))?", text)
    port = int(match.group(2)) if match and match.group(2) else RDZV_PORT
    if match is None or not 1 <= port <= 65535:
        _usage_error(f"--rdzv-endpoint {text!r}: must be HOST or HOST:PORT with PORT 1-65535 (node 0's address "
                     "on the job's cluster network)")
    return match.group(1), port


def ranks_per_node(mode: Mode, plan: dict, facts: dict, passthrough: list[str],
                   requested: int | None) -> tuple[int, str]:
    """How many ranks torchrun starts on each node for this mode, and why."""
    if requested is not None:
        return requested, f"{requested} rank(s) per node, as --nproc-per-node asks"
    gpus = len(facts["gpus"])
    device = _flag_value(passthrough, "--device") or plan["settings"]["device"]
    if mode.name == "timed" and gpus and device != "cpu":
        return gpus, (f"one rank per GPU: every DD-PPO rank learns on its own cuda:LOCAL_RANK, and NCCL averages "
                      f"the gradients of the {gpus} GPUs")
    if mode.name == "timed":
        on_gpus = " (with --device cuda: one rank per GPU)" if gpus else ""
        return 1, ("one rank per node: every DD-PPO rank repeats the whole update on its share of the rollout, "
                   "so on one node more workers under one rank collect the same steps for less; the learner is "
                   f"on the CPU, where a small MLP learns fastest{on_gpus}")
    if mode.name == "ppo-multiprocess":
        return 1, ("one rank per node: a rank already spreads its members over the node's cores"
                   f"{' and GPUs' if gpus else ''}, and reads one market cache in the node's shared memory")
    return 1, ("one rank per node: rank 0 learns beside its local actors and every other node's rank only acts; "
               "a rank already fills its node's cores with worker processes, so more ranks would split them")


def per_rank_args(rec_args: list[str], mode: Mode, nproc: int) -> list[str]:
    """The plan's flags for one of ``nproc`` ranks that share a node: the node's workers split between them."""
    args = dict(zip(rec_args[::2], rec_args[1::2]))
    workers = int(args.get(mode.workers_flag, "0"))
    if nproc > 1 and workers:
        args[mode.workers_flag] = str(max(1, workers // nproc))
    return [item for pair in args.items() for item in pair]


# Without it, ranks restarted by --max-restarts on several nodes read the old ranks' addresses from the
# agent's shared TCP store and cannot connect (pytorch/pytorch#135712); every node's torchrun needs it.
RESTART_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"


def torchrun_words(nnodes: str, nproc: int, endpoint: str, rdzv_id: str, opts: argparse.Namespace,
                   is_host: bool | None) -> list[str]:
    """torchrun's options, already shell-quoted (``nnodes`` and ``endpoint`` may be shell variables).
    ``is_host`` says outright which node hosts the rendezvous: torch's guess compares the endpoint with
    the machine's hostname and misses an address on a second network card, a cluster network's."""
    conf = f"join_timeout={opts.join_timeout}" + ("" if is_host is None else f",is_host={int(is_host)}")
    return [*([RESTART_ENV] if is_host is not None and opts.max_restarts else []), "torchrun", "--nnodes", nnodes,
            "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
            "--rdzv-id", _quote(rdzv_id), "--rdzv-conf", conf, "--max-restarts", str(opts.max_restarts)]


def build_multinode(report: dict, opts: argparse.Namespace, passthrough: list[str]) -> dict:
    """The torchrun command of every node, the SLURM batch script, and what a user must know to start them."""
    mode, facts = MODES[report["selected"]], report["system"]
    plan = report["plans"][mode.name]
    nproc, why = ranks_per_node(mode, plan, facts, passthrough, opts.nproc_per_node)
    host, port = parse_endpoint(opts.rdzv_endpoint or socket.gethostname())
    endpoint = f"{host}:{port}"
    rdzv_id = opts.rdzv_id or f"prl-{mode.name}-{datetime.now():%Y%m%d}"
    # A fixed run directory (the job's id in place of a timestamp) and --resume auto: the same commands start
    # the run or continue it, and torchrun's restarts find its newest checkpoint.
    run_dir = default_run_dir(mode, passthrough, rdzv_id)
    script = build_command(mode, per_rank_args(plan_args(report), mode, nproc), opts, passthrough, run_dir,
                           ranks=opts.nnodes * nproc)[1:]
    if not has_flag(passthrough, "--resume"):
        script += ["--resume", "auto"]
    script_words = [_quote(word) for word in script]
    commands = [" ".join(torchrun_words(str(opts.nnodes), nproc, _quote(endpoint), rdzv_id, opts, node == 0)
                         + script_words) for node in range(opts.nnodes)]
    workers = _flag_value(script, mode.workers_flag)
    output_dir = _flag_value(script, "--output-dir")
    multinode = {"mode": mode.name, "nnodes": opts.nnodes, "nproc_per_node": nproc, "nproc_reason": why,
                 "world_size": opts.nnodes * nproc, "num_workers_per_rank": int(workers) if workers else None,
                 "rdzv_endpoint": endpoint, "rdzv_id": rdzv_id, "join_timeout_s": opts.join_timeout,
                 "max_restarts": opts.max_restarts, "output_dir": output_dir, "script": script,
                 "commands": commands}
    multinode["slurm"] = slurm_script(multinode, facts, script_words, port, opts)
    multinode["notes"] = multinode_notes(multinode, host)
    return multinode


def slurm_script(multinode: dict, facts: dict, script_words: list[str], port: int, opts: argparse.Namespace) -> str:
    """The same job as one ``sbatch`` file: one torchrun per node, started by ``srun``."""
    gpus = len(facts["gpus"])
    torchrun = torchrun_words('"$SLURM_NNODES"', multinode["nproc_per_node"], f'"$head:{port}"',
                              multinode["rdzv_id"], opts, None)
    lines = [
        "#!/bin/bash",
        f"# {multinode['mode']} on {multinode['nnodes']} nodes (written by launch_parallel_training.py --nnodes)",
        f"#SBATCH --job-name={multinode['rdzv_id']}",
        f"#SBATCH --nodes={multinode['nnodes']}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --cpus-per-task={facts['usable_cores']}",
        *([f"#SBATCH --gpus-per-node={gpus}"] if gpus else []),
        "set -euo pipefail",
        "# srun does not inherit --cpus-per-task from sbatch since Slurm 22.05",
        'export SRUN_CPUS_PER_TASK="$SLURM_CPUS_PER_TASK"',
        *(["# torchrun's restarts across nodes need it (pytorch/pytorch#135712)", f"export {RESTART_ENV}"]
          if opts.max_restarts else []),
        "# The rendezvous host: the node whose name sorts first, the one c10d makes rank 0. Its address must be",
        "# reachable only from this job's nodes (a cluster network, never a public interface).",
        'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | LC_ALL=C sort | head -n 1)',
        "srun " + " ".join(torchrun) + " \\",
        "    " + " ".join(script_words),
    ]
    return "\n".join(lines) + "\n"


def multinode_notes(multinode: dict, host: str) -> list[str]:
    """What a user must know to start the commands: order, rank 0, trust, timeouts, restarts, workers."""
    mode = multinode["mode"]
    notes = [
        f"start node 0 first, on {host}: it hosts the rendezvous (is_host=1) and every other node connects to it; "
        f"a node that cannot reach {multinode['rdzv_endpoint']} gives up after about the store's read_timeout "
        f"({READ_TIMEOUT_S} s) with exit 1",
        f"rank 0 {RANK0_ROLE[mode]}. c10d ranks the nodes by hostname (FQDN, compared as text), then by "
        "torchrun's pid, not by who hosts the rendezvous: make node 0 the machine whose `hostname -f` sorts "
        "first (node01 before node02); otherwise rank 0 lands on another node, and losing either of the two "
        "ends the job",
        f"trust: torch.distributed trusts every peer (what it broadcasts travels pickled), so "
        f"{multinode['rdzv_endpoint']} and the ports the ranks open to each other must be reachable only from "
        "the job's own nodes: a cluster network, never a public interface",
        f"nobody answers: the rendezvous waits join_timeout={multinode['join_timeout_s']} s for all "
        f"{multinode['nnodes']} nodes, then every node that waited exits 1 (RendezvousTimeoutError; "
        "python -m common.torchrun, with the same arguments, says so in one line)",
        f"torchrun restarts a failed job up to --max-restarts {multinode['max_restarts']} times; each restart "
        f"resumes from the newest checkpoint in {multinode['output_dir'] or 'the run directory'}, and the same "
        "commands started again continue the run (--resume auto)",
    ]
    if multinode["num_workers_per_rank"] is not None:
        workers = multinode["num_workers_per_rank"]
        notes.append(f"--num-workers is per rank: {workers} on each of {multinode['world_size']} ranks, "
                     f"{workers * multinode['world_size']} in all")
    if os.environ.get(system.ASSUME_ENV):
        notes.append(f"planned for the facts in {os.environ[system.ASSUME_ENV]}, on every node; the commands do not "
                     "carry them: on the nodes each script sees its real machine")
    return notes


def print_multinode(multinode: dict, facts: dict) -> None:
    mode = MODES[multinode["mode"]]
    gpus = len(facts["gpus"])
    print(f"Multi-node: {mode.name} ({mode.script}) on {multinode['nnodes']} nodes x "
          f"{multinode['nproc_per_node']} rank(s) = world size {multinode['world_size']}")
    print(f"  every node alike: {facts['usable_cores']} cores, {gpus} GPU{'s' * (gpus != 1)}, "
          f"{facts['ram_total_gib']} GiB RAM ({'assumed' if facts['assumed'] else 'this machine'})")
    print(f"  ranks per node: {multinode['nproc_reason']}")
    run_dir = multinode["output_dir"] or "the checkpoint's"
    print(f"  run directory: {run_dir} on node 0 (rank 0 alone writes it)")
    for node, command in enumerate(multinode["commands"]):
        role = " (start it first: it hosts the rendezvous and should be rank 0)" if node == 0 else ""
        print(f"  node {node}{role}:\n    {command}")
    for note in multinode["notes"]:
        print(f"  note: {note}")
    print("\nSLURM batch script (sbatch FILE; the same job, one torchrun per node):\n")
    print(multinode["slurm"], end="")


def multinode_main(report: dict, opts: argparse.Namespace, passthrough: list[str], refused: str | None) -> int:
    """``--nnodes``: print (never run) the commands for every node and the SLURM script; exit status as
    ``--check-only``'s, and 2 where the mode is refused on the nodes."""
    multinode = None if refused else build_multinode(report, opts, passthrough)
    if opts.json:
        print(json.dumps({**report, "command": None, "refused": refused, "multinode": multinode}, indent=2))
    elif refused:
        print(f"error: {refused}", file=sys.stderr)
    else:
        if opts.check_only:
            print_report(report)
            print()
        print_multinode(multinode, report["system"])
    if refused:
        return EXIT_USAGE
    if opts.slurm_script:
        Path(opts.slurm_script).write_text(multinode["slurm"])
        print(f"wrote {opts.slurm_script}", file=sys.stderr)
    return EXIT_MISSING if not report["ready"] else 0


def main(argv: list[str] | None = None) -> int:
    opts, passthrough = parse_args(sys.argv[1:] if argv is None else argv)
    check_usage(opts)
    report = build_report(load_machine(opts), opts.mode, _flag_value(passthrough, "--env-id"))
    mode = MODES[report["selected"]]
    refused = refusal(report["plans"][mode.name], opts.force)
    if opts.nnodes is not None:
        return multinode_main(report, opts, passthrough, refused)
    if opts.check_only or opts.json:
        if opts.json:
            command = None if refused else plan_command(report, opts, passthrough)[0]
            print(json.dumps({**report, "command": command, "refused": refused}, indent=2))
        else:
            print_report(report)
        return EXIT_MISSING if not report["ready"] else EXIT_USAGE if refused and opts.mode else 0
    if not report["ready"]:
        missing = report["dependencies"]["missing"]
        print(f"error: missing required packages: {', '.join(missing)} (pip install -r requirements.txt)",
              file=sys.stderr)
        return EXIT_MISSING
    if refused:
        print(f"error: {refused}", file=sys.stderr)
        return EXIT_USAGE
    if opts.tune:
        env_id = _flag_value(passthrough, "--env-id") or mode.default_env
        best = tune(mode, env_id, report["system"], passthrough, opts.trial_seconds)
        if not opts.run:
            return 0
        report["tuned"] = best
    elif report["tuned"]:
        cached = report["tuned"]
        print(f"using the tuned setting {' '.join(cached['args'])} ({cached['sps']:.0f} steps/s measured "
              f"{cached['measured']})")
    command, run_dir = plan_command(report, opts, passthrough)
    if opts.dry_run:
        print(shell_line(command))
        return 0
    print(f"mode {mode.name}: {mode.summary}" + (f"; results in {run_dir}" if run_dir else ""), flush=True)
    print(shell_line(command), flush=True)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    os.execv(sys.executable, command)
    return 0  # not reached


def _quote(arg: str) -> str:
    return arg if re.fullmatch(r"[\w@%+=:,./-]+", arg) else "'" + arg.replace("'", "'\\''") + "'"


if __name__ == "__main__":
    sys.exit(main())
