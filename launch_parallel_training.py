"""Inspect this machine, recommend a training mode, and run it.

    python launch_parallel_training.py --check-only        # dependencies, system, recommendation
    python launch_parallel_training.py --check-only --json # the same as one JSON object
    python launch_parallel_training.py                     # run the recommended mode (about 10 minutes)
    python launch_parallel_training.py --mode dqn --episodes 5000 --seed 3
    python launch_parallel_training.py --mode timed --dry-run --duration 1
    python launch_parallel_training.py --tune [--run]      # measure worker counts instead of guessing

Every flag the launcher does not know passes through untouched to the chosen script. The
launcher then replaces itself with the script (``os.execv``), so Ctrl+C, SIGTERM and the
exit status are the script's own. This file imports only the standard library at start,
so it can report missing packages instead of crashing on them.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import math
import multiprocessing
import os
import re
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent
EXIT_MISSING = 1
EXIT_USAGE = 2
GiB = 2**30
DEFAULT_DURATION_H = 0.16  # the no-argument run: about 10 minutes
TUNE_CACHE = Path(os.environ.get("PRL_TUNE_CACHE", Path.home() / ".cache" / "parallel-rl" / "tune.json"))


@dataclass(frozen=True)
class Mode:
    name: str
    script: str
    default_env: str
    episodes_flag: str | None  # the script's own episode budget flag
    duration_flag: str = "--duration"
    workers_flag: str = "--num-workers"
    envs_flag: str | None = "--num-envs-per-worker"
    needs_shm: bool = True  # big arrays travel through /dev/shm
    summary: str = ""


MODES = {
    "timed": Mode("timed", "train_parallel_timed.py", "LunarLander-v3", "--total-episodes",
                  summary="synchronous parallel PPO on a wall-clock budget"),
    "dqn": Mode("dqn", "parallel_train_dqn.py", "ConnectFour-v0", "--total-episodes", envs_flag=None,
                needs_shm=False, summary="central DQN learner fed by rollout processes, self-play"),
    "ultra": Mode("ultra", "ultra_parallel_train_dqn.py", "GridCoverage-v0", "--n-episodes",
                  workers_flag="--n-workers", envs_flag="--envs-per-worker",
                  summary="asynchronous actors -> shared-memory replay -> mixed-precision learner"),
    "ppo-multiprocess": Mode("ppo-multiprocess", "train_ppo_multiprocess.py", "Market-v0", None,
                             summary="population of independent PPO agents over a shared data cache"),
}
ULTRA_MIN_CORES = 8
ULTRA_REPLAY_BYTES = 200_000 * 2 * (2 * 11 * 11 + 8) * 4  # default buffer: GridCoverage egocentric obs + next_obs
MIN_SHM_BYTES = 64 * 2**20


# --------------------------------------------------------------------------- facts

def dependency_report() -> dict:
    """Each requirement: installed version or missing, and whether it satisfies the pin."""
    entries, missing = [], []
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
        entries.append({"package": name, "required": spec or "any", "installed": version, "ok": ok})
        if not ok:
            missing.append(name)
    torch_build = None
    if importlib.util.find_spec("torch") is not None:
        import torch

        torch_build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU only"
    extras = [
        {"extra": "Box2D", "module": "Box2D", "enables": "LunarLander-v3, BipedalWalker-v3, CarRacing-v3"},
        {"extra": "ale-py", "module": "ale_py", "enables": "Atari ids such as ALE/Pong-v5 (pip install ale-py)"},
    ]
    for extra in extras:
        extra["installed"] = importlib.util.find_spec(extra["module"]) is not None
    return {"packages": entries, "missing": missing, "torch_build": torch_build, "extras": extras,
            "install_hint": "pip install -r requirements.txt" if missing else None}


def _satisfies(version: str, spec: str) -> bool:
    if not spec:
        return True
    try:
        from packaging.specifiers import SpecifierSet

        return SpecifierSet(spec).contains(version.split("+")[0], prereleases=True)
    except ImportError:  # packaging is nearly always present; fall back to exact pins
        return all(version.split("+")[0] == s.strip()[2:] for s in spec.split(",") if s.strip().startswith("=="))


def system_facts() -> dict:
    try:
        import psutil

        physical = psutil.cpu_count(logical=False) or os.cpu_count()
        vm = psutil.virtual_memory()
        ram_total, ram_available = vm.total, vm.available
    except ImportError:
        physical = os.cpu_count()
        pages, page = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        ram_total = ram_available = pages * page
    try:
        shm = shutil.disk_usage("/dev/shm")
        shm_total, shm_free = shm.total, shm.free
    except OSError:
        shm_total = shm_free = 0
    gpus = []
    if importlib.util.find_spec("torch") is not None:
        import torch

        if torch.cuda.is_available():
            for i in range(torch.cuda.device_count()):
                props = torch.cuda.get_device_properties(i)
                gpus.append({"index": i, "name": props.name, "memory_gib": round(props.total_memory / GiB, 1),
                             "capability": f"{props.major}.{props.minor}"})
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    return {"physical_cores": physical, "logical_cores": os.cpu_count(), "usable_cores": usable,
            "ram_total_gib": round(ram_total / GiB, 1), "ram_available_gib": round(ram_available / GiB, 1),
            "gpus": gpus, "shm_total_gib": round(shm_total / GiB, 2), "shm_free_gib": round(shm_free / GiB, 2),
            "open_files_limit": resource.getrlimit(resource.RLIMIT_NOFILE)[0],
            "start_method": "spawn (set by every script; the platform default is "
                            f"{multiprocessing.get_start_method(allow_none=True) or 'fork'})",
            "hostname": socket.gethostname()}


# --------------------------------------------------------------------------- recommendation

@dataclass
class Recommendation:
    mode: str
    args: list[str]
    reason: str
    settings: dict
    refused: dict[str, str] = field(default_factory=dict)  # mode -> why it is not recommended here
    warnings: list[str] = field(default_factory=list)


def recommend(facts: dict) -> Recommendation:
    """Pick a mode and its settings from cores, RAM, GPUs and /dev/shm. A pure function."""
    cores = facts["usable_cores"]
    gpus = facts["gpus"]
    shm_free = facts["shm_free_gib"] * GiB
    ram_gib = facts["ram_available_gib"]
    warnings, refused = [], {}
    if cores < ULTRA_MIN_CORES:
        refused["ultra"] = (f"{cores} cores: asynchronous actors and a learner need at least {ULTRA_MIN_CORES} "
                            "cores, or the learner starves the actors")
    if shm_free < ULTRA_REPLAY_BYTES:
        refused.setdefault("ultra", f"/dev/shm has {shm_free / 2**20:.0f} MiB free, less than the default "
                                    f"replay buffer ({ULTRA_REPLAY_BYTES / 2**20:.0f} MiB)")
        warnings.append(f"/dev/shm has only {shm_free / 2**20:.0f} MiB free: too small for the ultra mode's "
                        "default replay buffer (docker: --shm-size=8g)")
    if shm_free < MIN_SHM_BYTES:
        for name, mode in MODES.items():
            if mode.needs_shm:
                refused.setdefault(name, f"/dev/shm has {shm_free / 2**20:.0f} MiB free; this mode shares "
                                         "its arrays through it")
    if not gpus:
        warnings.append("no CUDA GPU: learners run on the CPU (the ultra mode prefers a GPU)")
    workers = max(1, cores - 2)
    if facts["open_files_limit"] < 64 * workers:
        warnings.append(f"open-files limit {facts['open_files_limit']} is low for {workers} workers "
                        f"(ulimit -n {max(4096, 64 * workers)})")

    if "timed" in refused:  # tiny /dev/shm: only the queue-based central learner works
        return Recommendation("dqn", ["--num-workers", str(workers), "--device", "cuda" if gpus else "cpu"],
                              "/dev/shm is too small for shared-memory modes; the central DQN learner passes "
                              "episodes through queues", {"num_workers": workers}, refused, warnings)
    if len(gpus) >= 2:
        pop = max(len(gpus), min(cores - 1, 4 * len(gpus)))
        return Recommendation("ppo-multiprocess", ["--num-workers", str(pop), "--device", "cuda",
                                                   "--gpu-strategy", "round-robin"],
                              f"{len(gpus)} GPUs: a population of {pop} independent agents, spread round-robin, "
                              "keeps every GPU busy", {"num_workers": pop, "device": "round-robin over GPUs"},
                              refused, warnings)
    if gpus and "ultra" not in refused:
        actors = max(1, cores - 2)
        envs = 32 if ram_gib >= 16 else 16
        return Recommendation("ultra", ["--n-workers", str(actors), "--envs-per-worker", str(envs),
                                        "--batch-size", "1024", "--device", "cuda:0"],
                              f"{cores} cores and a GPU: {actors} asynchronous actors keep the replay full while "
                              "the GPU learner trains with mixed precision",
                              {"n_workers": actors, "envs_per_worker": envs, "batch_size": 1024, "device": "cuda:0"},
                              refused, warnings)
    if gpus:
        return Recommendation("dqn", ["--num-workers", str(workers), "--device", "cuda:0", "--batch-size", "256"],
                              f"{cores} cores and a GPU: too few cores for asynchronous actors, so rollout "
                              "processes feed one GPU learner",
                              {"num_workers": workers, "device": "cuda:0", "batch_size": 256}, refused, warnings)
    sync_workers = max(1, cores)
    envs = 8
    batch = 256  # the script's tuned minibatch; it divides every rollout of 8 envs x 256 steps
    why = ("few cores and no GPU: synchronous PPO" if cores < 8 else f"{cores} cores and no GPU: synchronous PPO")
    return Recommendation("timed", ["--num-workers", str(sync_workers), "--num-envs-per-worker", str(envs),
                                    "--batch-size", str(batch), "--device", "cpu"],
                          f"{why} steps {sync_workers} worker processes in lockstep and updates on the CPU, "
                          "where a small network learns fastest",
                          {"num_workers": sync_workers, "num_envs_per_worker": envs, "batch_size": batch,
                           "device": "cpu"}, refused, warnings)


# --------------------------------------------------------------------------- report

def build_report() -> dict:
    deps = dependency_report()
    facts = system_facts()
    rec = recommend(facts)
    cached = tuned_choice(facts, rec.mode, MODES[rec.mode].default_env)
    return {"dependencies": deps, "system": facts, "recommendation": asdict(rec), "tuned": cached,
            "ready": not deps["missing"]}


def print_report(report: dict) -> None:
    deps, facts, rec = report["dependencies"], report["system"], report["recommendation"]
    print("Dependencies")
    for p in deps["packages"]:
        state = p["installed"] or "MISSING"
        print(f"  {'ok ' if p['ok'] else 'BAD'} {p['package']:<15} {state:<14} (requires {p['required']})")
    print(f"  torch build: {deps['torch_build'] or 'torch not installed'}")
    for extra in deps["extras"]:
        print(f"  extra {extra['extra']:<7} {'installed' if extra['installed'] else 'not installed':<14} "
              f"-> {extra['enables']}")
    if deps["missing"]:
        print(f"  missing or wrong version: {', '.join(deps['missing'])} -> {deps['install_hint']}")
    print("\nSystem")
    print(f"  cores: {facts['physical_cores']} physical, {facts['logical_cores']} logical "
          f"({facts['usable_cores']} usable by this process)")
    print(f"  RAM: {facts['ram_total_gib']} GiB total, {facts['ram_available_gib']} GiB available")
    if facts["gpus"]:
        for gpu in facts["gpus"]:
            print(f"  GPU {gpu['index']}: {gpu['name']}, {gpu['memory_gib']} GiB, compute capability "
                  f"{gpu['capability']}")
    else:
        print("  GPUs: none")
    print(f"  /dev/shm: {facts['shm_total_gib']} GiB, {facts['shm_free_gib']} GiB free")
    print(f"  open-files limit: {facts['open_files_limit']}")
    print(f"  start method: {facts['start_method']}")
    for warning in rec["warnings"]:
        print(f"  warning: {warning}")
    print("\nRecommendation")
    print(f"  mode: {rec['mode']} ({MODES[rec['mode']].script}: {MODES[rec['mode']].summary})")
    print(f"  settings: {', '.join(f'{k}={v}' for k, v in rec['settings'].items())}")
    print(f"  why: {rec['reason']}")
    if report["tuned"]:
        print(f"  measured by --tune: {report['tuned']['args']} ({report['tuned']['sps']:.0f} steps/s), "
              "used instead of the guess")
    for mode, why in rec["refused"].items():
        print(f"  not recommended here: {mode} ({why})")


# --------------------------------------------------------------------------- tuning

def _cache_key(facts: dict, mode: str, env_id: str) -> str:
    return f"{facts['hostname']}|{facts['usable_cores']}|{len(facts['gpus'])}|{mode}|{env_id}"


def tuned_choice(facts: dict, mode: str, env_id: str) -> dict | None:
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
        return _steps_per_second(Path(tmp) / "metrics.csv")


def _steps_per_second(metrics: Path) -> float:
    """Steps/s between the first and last metrics rows (start-up excluded); every mode has these columns."""
    import csv

    try:
        with open(metrics, newline="") as f:
            rows = [r for r in csv.DictReader(f) if r.get("global_step") and r.get("wall_time")]
    except OSError:
        return math.nan
    if len(rows) < 2:
        return math.nan
    first, last = rows[0], rows[-1]
    seconds = float(last["wall_time"]) - float(first["wall_time"])
    return (float(last["global_step"]) - float(first["global_step"])) / seconds if seconds > 0 else math.nan


# --------------------------------------------------------------------------- command line

def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--check-only", action="store_true", help="report dependencies, system and recommendation")
    parser.add_argument("--json", action="store_true", help="with --check-only: print the report as JSON")
    parser.add_argument("--mode", help=f"run this mode instead of the recommended one: {', '.join(MODES)}")
    parser.add_argument("--force", action="store_true", help="run a mode the check does not recommend here")
    parser.add_argument("--episodes", type=int, help="episode budget, translated into the script's own flag")
    parser.add_argument("--duration", type=float, help="hours of wall time, passed to the script")
    parser.add_argument("--dry-run", action="store_true", help="print the exact command instead of running it")
    parser.add_argument("--tune", action="store_true", help="measure worker counts and envs per worker")
    parser.add_argument("--run", action="store_true", help="with --tune: run the fastest setting afterwards")
    parser.add_argument("--trial-seconds", type=float, default=8.0, help="--tune: seconds per trial")
    parser.error = lambda message: _usage_error(message)
    return parser.parse_known_args(argv)


def _usage_error(message: str):
    print(f"error: {message}", file=sys.stderr)
    sys.exit(EXIT_USAGE)


def has_flag(args: list[str], *flags: str) -> bool:
    return any(a == f or a.startswith(f + "=") for a in args for f in flags)


def build_command(mode: Mode, rec_args: list[str], opts: argparse.Namespace, passthrough: list[str],
                  run_dir: Path | None) -> list[str]:
    """The script's command line: recommended settings, translated budgets, then the user's flags."""
    command = [sys.executable, str(ROOT / mode.script)]
    user_flags = {a.split("=", 1)[0] for a in passthrough if a.startswith("--")}
    i = 0
    while i < len(rec_args):  # the user's own flags win over the recommendation
        flag, value = rec_args[i], rec_args[i + 1]
        if flag not in user_flags:
            command += [flag, value]
        i += 2
    if opts.episodes is not None:
        command += translate_episodes(mode, opts.episodes, passthrough)
    if opts.duration is not None:
        command += [mode.duration_flag, str(opts.duration)]
    elif opts.episodes is None and not has_flag(passthrough, mode.duration_flag):
        command += [mode.duration_flag, str(DEFAULT_DURATION_H)]
    if run_dir is not None:
        command += ["--output-dir", str(run_dir)]
    return command + passthrough


def translate_episodes(mode: Mode, episodes: int, passthrough: list[str]) -> list[str]:
    if mode.episodes_flag:
        return [mode.episodes_flag, str(episodes)]
    # The population trains fixed-length Market episodes per worker: convert to steps per worker.
    episode_length = int(_flag_value(passthrough, "--episode-length") or 256)
    workers = int(_flag_value(passthrough, "--num-workers") or 4)
    return ["--max-steps-per-worker", str(math.ceil(episodes / workers) * episode_length)]


def merge_flags(base: list[str], overrides: list[str]) -> list[str]:
    """``--flag value`` pairs of ``base`` with those of ``overrides`` replacing or added."""
    merged = dict(zip(base[::2], base[1::2]))
    merged.update(zip(overrides[::2], overrides[1::2]))
    return [item for pair in merged.items() for item in pair]


def _flag_value(args: list[str], flag: str) -> str | None:
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def main(argv: list[str] | None = None) -> int:
    opts, passthrough = parse_args(sys.argv[1:] if argv is None else argv)
    if opts.episodes is not None and opts.episodes <= 0:
        _usage_error(f"--episodes {opts.episodes}: must be > 0")
    if opts.duration is not None and opts.duration <= 0:
        _usage_error(f"--duration {opts.duration}: must be > 0")
    if opts.mode is not None and opts.mode not in MODES:
        _usage_error(f"--mode {opts.mode!r}: must be one of {', '.join(MODES)}")

    report = build_report()
    if opts.check_only:
        print(json.dumps(report, indent=2)) if opts.json else print_report(report)
        return 0 if report["ready"] else EXIT_MISSING
    if not report["ready"]:
        missing = report["dependencies"]["missing"]
        print(f"error: missing required packages: {', '.join(missing)} (pip install -r requirements.txt)",
              file=sys.stderr)
        return EXIT_MISSING

    rec = report["recommendation"]
    mode = MODES[opts.mode or rec["mode"]]
    if mode.name in rec["refused"] and not opts.force:
        print(f"error: mode {mode.name} is not recommended on this machine: {rec['refused'][mode.name]} "
              "(add --force to run it anyway)", file=sys.stderr)
        return EXIT_USAGE
    rec_args = rec["args"] if mode.name == rec["mode"] else []
    env_id = _flag_value(passthrough, "--env-id") or mode.default_env
    if opts.tune:
        best = tune(mode, env_id, report["system"], passthrough, opts.trial_seconds)
        if not opts.run:
            return 0
        rec_args = best["args"]
    else:
        cached = tuned_choice(report["system"], mode.name, env_id)
        if cached:
            rec_args = merge_flags(rec_args, cached["args"])
            print(f"using the tuned setting {' '.join(cached['args'])} ({cached['sps']:.0f} steps/s measured "
                  f"{cached['measured']})")

    run_dir = None
    if not has_flag(passthrough, "--output-dir") and not has_flag(passthrough, "--resume"):
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        seed = _flag_value(passthrough, "--seed") or "1"
        run_dir = Path("runs") / Path(mode.script).stem / f"{env_id.replace('/', '_')}__{seed}__{stamp}"
    # A flag the script does not know is left for the script's own parser to refuse (exit 2),
    # before it starts anything.
    command = build_command(mode, rec_args, opts, passthrough, run_dir)
    if opts.dry_run:
        print(" ".join(_quote(c) for c in command))
        return 0
    print(f"mode {mode.name}: {mode.summary}" + (f"; results in {run_dir}" if run_dir else ""), flush=True)
    print(" ".join(_quote(c) for c in command), flush=True)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    os.execv(sys.executable, command)
    return 0  # not reached


def _quote(arg: str) -> str:
    return arg if re.fullmatch(r"[\w@%+=:,./-]+", arg) else "'" + arg.replace("'", "'\\''") + "'"


if __name__ == "__main__":
    sys.exit(main())
