"""The machine: cores, RAM, /dev/shm, GPUs, open files; device assignment and thread counts.

Every script and the launcher learn about the machine through :func:`machine` and nothing
else. A JSON file named by the environment variable ``PRL_ASSUME_FACTS`` (the launcher's
``--assume-facts``) replaces any of the measured facts, so a test, or a user planning for a
bigger machine, sees the same validation and advice as that machine would give. Keys are the
fields of :class:`Machine`; byte counts may be given in GiB with a ``_gib`` suffix
(``"ram_total_gib": 512``), GPUs as ``[{"name": ..., "memory_gib": 80, "capability": "9.0"}]``.

Measuring costs milliseconds: torch is imported only where an NVIDIA driver is present.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import resource
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields, replace
from pathlib import Path

from common.config import ConfigError

ASSUME_ENV = "PRL_ASSUME_FACTS"
GiB = 2**30


@dataclass(frozen=True)
class GPU:
    index: int
    name: str
    memory: int  # bytes
    capability: str  # compute capability, e.g. "9.0"


@dataclass(frozen=True)
class Machine:
    physical_cores: int
    logical_cores: int
    usable_cores: int  # cores this process may run on (taskset, cgroup affinity)
    ram_total: int  # bytes
    ram_available: int
    shm_total: int  # /dev/shm, bytes (0 where there is none)
    shm_free: int
    gpus: tuple[GPU, ...]
    open_files_limit: int
    start_method: str  # what the scripts use; always spawn (CUDA-safe)
    assumed: tuple[str, ...] = ()  # facts taken from PRL_ASSUME_FACTS instead of measured

    def as_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["gpus"] = [vars(g) for g in self.gpus]
        out["assumed"] = list(self.assumed)
        return out


def _measure_gpus() -> tuple[GPU, ...]:
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return ()
    if not (Path("/proc/driver/nvidia/gpus").is_dir() or Path("/dev/nvidia0").exists()):
        return ()
    import torch

    if not torch.cuda.is_available():
        return ()
    found = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        found.append(GPU(index, props.name, int(props.total_memory), f"{props.major}.{props.minor}"))
    return tuple(found)


def measure() -> Machine:
    """What this machine has, now."""
    try:
        import psutil

        physical = psutil.cpu_count(logical=False) or os.cpu_count() or 1
        vm = psutil.virtual_memory()
        ram_total, ram_available = int(vm.total), int(vm.available)
    except ImportError:  # the launcher must still report, and say psutil is missing
        physical = os.cpu_count() or 1
        ram_total = ram_available = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        usable = os.cpu_count() or 1
    try:
        shm = shutil.disk_usage("/dev/shm")
        shm_total, shm_free = int(shm.total), int(shm.free)
    except OSError:
        shm_total = shm_free = 0
    return Machine(physical, os.cpu_count() or 1, usable, ram_total, ram_available, shm_total, shm_free,
                   _measure_gpus(), resource.getrlimit(resource.RLIMIT_NOFILE)[0], "spawn")


def _gpu_from(entry: dict, index: int) -> GPU:
    memory = entry["memory"] if "memory" in entry else float(entry.get("memory_gib", 16)) * GiB
    return GPU(int(entry.get("index", index)), str(entry.get("name", f"assumed GPU {index}")), int(memory),
               str(entry.get("capability", "8.0")))


def with_facts(base: Machine, facts: dict) -> Machine:
    """``base`` with some facts replaced (see the module docstring for the keys)."""
    known = {f.name for f in fields(Machine)} - {"assumed"}
    changes: dict = {}
    for key, value in facts.items():
        if key.startswith("_"):  # "_comment": what machine a facts file describes
            continue
        name = key[:-4] if key.endswith("_gib") else key
        if name not in known:
            raise ConfigError("assume_facts", key, f"unknown fact; known: {', '.join(sorted(known))}")
        if name == "gpus":
            value = tuple(_gpu_from(g, i) for i, g in enumerate(value))
        elif key.endswith("_gib"):
            value = int(float(value) * GiB)
        elif name != "start_method":
            value = int(value)
        changes[name] = value
    if "logical_cores" in changes:  # a machine with more cores lets a process use them all
        changes.setdefault("usable_cores", changes["logical_cores"])
        changes.setdefault("physical_cores", changes["logical_cores"])
    if "ram_total" in changes:
        changes.setdefault("ram_available", int(changes["ram_total"] * 0.9))
    if "shm_total" in changes:
        changes.setdefault("shm_free", changes["shm_total"])
    return replace(base, **changes, assumed=tuple(sorted(set(base.assumed) | set(changes))))


def read_facts_file(path: str | Path) -> dict:
    try:
        facts = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise ConfigError("assume_facts", str(path), f"not a readable JSON file ({err})") from None
    if not isinstance(facts, dict):
        raise ConfigError("assume_facts", str(path), "must hold a JSON object of fact: value")
    return facts


_cached: Machine | None = None


def machine() -> Machine:
    """The machine's facts, measured once per process, with ``PRL_ASSUME_FACTS`` applied."""
    global _cached
    if _cached is None:
        facts = measure()
        if os.environ.get(ASSUME_ENV):
            facts = with_facts(facts, read_facts_file(os.environ[ASSUME_ENV]))
        _cached = facts
    return _cached


def forget_machine() -> None:
    """Measure again on the next call (after the environment or the machine changed)."""
    global _cached
    _cached = None


@contextmanager
def assumed_machine(facts: Machine | dict) -> Iterator[Machine]:
    """Within the block, :func:`machine` answers ``facts``: a Machine, or a dict of facts applied
    over the measured ones as ``PRL_ASSUME_FACTS`` would be (for tests and planning tools)."""
    global _cached
    previous = _cached
    _cached = facts if isinstance(facts, Machine) else with_facts(measure(), facts)
    try:
        yield _cached
    finally:
        _cached = previous


def usable_cores() -> int:
    return machine().usable_cores


def platform_start_method() -> str:
    return multiprocessing.get_start_method(allow_none=True) or "fork"


def threads_per_process(num_processes: int) -> int:
    """Torch threads for each of ``num_processes`` busy processes so they never oversubscribe.

    Under torchrun, the ranks on this machine (``LOCAL_WORLD_SIZE``) share the cores too.
    """
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, usable_cores() // max(1, num_processes * local_ranks))


def resolve_device(spec: str, field: str = "device") -> str:
    """Turn ``auto|cpu|cuda|cuda:N`` into a concrete device string, or raise ConfigError."""
    count = len(machine().gpus)
    if spec == "auto":
        return "cuda" if count else "cpu"
    if spec == "cpu":
        return "cpu"
    if spec == "cuda" or spec.startswith("cuda:"):
        index = "0" if spec == "cuda" else spec.split(":", 1)[1]
        if not index.isdigit():
            raise ConfigError(field, spec, "must be auto, cpu, cuda or cuda:N")
        if int(index) >= count:
            raise ConfigError(field, spec, f"this machine has {count} CUDA GPU(s)")
        return spec
    raise ConfigError(field, spec, "must be auto, cpu, cuda or cuda:N")


def assign_devices(num_workers: int, device: str, strategy: str = "round-robin",
                   num_gpus: int | None = None, gpu_pays: bool = True) -> list[str]:
    """Device for each worker: round-robin over the first ``num_gpus`` GPUs, all on one GPU, or all on CPU.

    ``gpu_pays=False`` (workers that learn an MLP policy) keeps ``auto`` on the CPU: each worker's updates
    are small and end in host syncs, and on an H200 with 16 cores 14 such workers trained 79k steps/s on
    the GPU against 146k on the CPU (docs/performance.md). An explicit ``cuda`` still puts them there.
    """
    resolved = resolve_device(device)
    if device == "auto" and not gpu_pays:
        resolved = "cpu"
    if strategy not in ("round-robin", "single"):
        raise ConfigError("gpu_strategy", strategy, "must be round-robin or single")
    available = len(machine().gpus)
    if num_gpus is not None and not 1 <= num_gpus <= available:
        raise ConfigError("num_gpus", num_gpus, f"this machine has {available} CUDA GPU(s)")
    if resolved == "cpu":
        return ["cpu"] * num_workers
    if strategy == "single" or resolved.startswith("cuda:"):
        single = resolved if resolved.startswith("cuda:") else "cuda:0"
        return [single] * num_workers
    count = num_gpus or available
    return [f"cuda:{i % count}" for i in range(num_workers)]


@dataclass
class ResourceSample:
    cpu_percent: float  # summed over the process tree; 100 = one core busy
    rss_bytes: int
    pss_bytes: int


class ProcessTreeSampler:
    """Samples CPU and memory of this process and all its descendants.

    PSS (proportional set size) counts a shared page once across the tree, so shared
    memory shows up once rather than once per worker; it falls back to RSS where the
    platform does not report it. Samples closer together than ``min_interval_s`` return
    the previous one: reading every process's memory map costs milliseconds.
    """

    def __init__(self, root_pid: int | None = None, min_interval_s: float = 1.0):
        import psutil

        self._psutil = psutil
        self.root = psutil.Process(root_pid or os.getpid())
        self.min_interval_s = min_interval_s
        self._known: dict[int, psutil.Process] = {}
        self._last: ResourceSample | None = None
        self._last_time = -math.inf
        self.peak_rss = 0
        self.peak_pss = 0
        self.sample(force=True)  # prime cpu_percent, whose first reading is always 0

    def _tree(self) -> list:
        try:
            members = [self.root, *self.root.children(recursive=True)]
        except self._psutil.NoSuchProcess:
            return []
        alive = {p.pid: self._known.get(p.pid, p) for p in members}
        self._known = alive
        return list(alive.values())

    def sample(self, force: bool = False) -> ResourceSample:
        now = time.monotonic()
        if not force and self._last is not None and now - self._last_time < self.min_interval_s:
            return self._last
        cpu = rss = pss = 0.0
        for proc in self._tree():
            try:
                cpu += proc.cpu_percent(None)
                try:
                    info = proc.memory_full_info()
                    rss += info.rss
                    pss += getattr(info, "pss", info.rss)
                except self._psutil.AccessDenied:
                    mem = proc.memory_info().rss
                    rss += mem
                    pss += mem
            except (self._psutil.NoSuchProcess, self._psutil.ZombieProcess):
                continue
        self.peak_rss = max(self.peak_rss, int(rss))
        self.peak_pss = max(self.peak_pss, int(pss))
        self._last, self._last_time = ResourceSample(cpu, int(rss), int(pss)), now
        return self._last


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


RAM_HEADROOM = 0.8  # never plan to use more than this share of the RAM available now


def ram_shortfall(nbytes: int, what: str) -> str | None:
    """Why ``nbytes`` of ``what`` would not fit in the available RAM, or None when it fits."""
    available = machine().ram_available
    if nbytes <= RAM_HEADROOM * available:
        return None
    return (f"{what} needs {format_bytes(nbytes)}, but only {format_bytes(available)} of RAM is available "
            f"(at most {RAM_HEADROOM:.0%} of it may be used)")


def shm_shortfall(nbytes: int, what: str) -> str | None:
    """Why ``nbytes`` of ``what`` would not fit in /dev/shm, or None when it fits."""
    free = machine().shm_free
    if nbytes <= free:
        return None
    return f"{what} needs {format_bytes(nbytes)} of shared memory, but /dev/shm has {format_bytes(free)} free"
