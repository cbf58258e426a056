"""Machine facts (cores, RAM, GPUs, /dev/shm), thread counts and device assignment."""

from __future__ import annotations

import os
import resource
import shutil
import time
from dataclasses import dataclass

import psutil

from common.config import ConfigError


def physical_cores() -> int:
    return psutil.cpu_count(logical=False) or os.cpu_count() or 1


def logical_cores() -> int:
    return os.cpu_count() or 1


def usable_cores() -> int:
    """Cores this process may run on (respects taskset / cgroup CPU affinity)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return logical_cores()


def memory() -> dict[str, int]:
    vm = psutil.virtual_memory()
    return {"total": vm.total, "available": vm.available}


def shm_space(path: str = "/dev/shm") -> dict[str, int]:
    """Size and free bytes of the shared-memory filesystem (zeros where there is none)."""
    try:
        usage = shutil.disk_usage(path)
        return {"total": usage.total, "free": usage.free}
    except OSError:
        return {"total": 0, "free": 0}


def open_files_limit() -> int:
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def gpus() -> list[dict]:
    """Every visible CUDA GPU: index, name, memory in bytes, compute capability."""
    import torch

    if not torch.cuda.is_available():
        return []
    found = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        found.append({"index": index, "name": props.name, "memory": props.total_memory,
                      "capability": f"{props.major}.{props.minor}"})
    return found


def threads_per_process(num_processes: int) -> int:
    """Torch threads for each of ``num_processes`` busy processes so they never oversubscribe.

    Under torchrun, the ranks on this machine (``LOCAL_WORLD_SIZE``) share the cores too.
    """
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, usable_cores() // max(1, num_processes * local_ranks))


def resolve_device(spec: str, field: str = "device") -> str:
    """Turn ``auto|cpu|cuda|cuda:N`` into a concrete device string, or raise ConfigError."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if spec == "auto":
        return "cuda" if count else "cpu"
    if spec == "cpu":
        return "cpu"
    if spec == "cuda" or spec.startswith("cuda:"):
        index = 0 if spec == "cuda" else spec.split(":", 1)[1]
        if not str(index).isdigit():
            raise ConfigError(field, spec, "must be auto, cpu, cuda or cuda:N")
        if int(index) >= count:
            raise ConfigError(field, spec, f"this machine has {count} CUDA GPU(s)")
        return spec
    raise ConfigError(field, spec, "must be auto, cpu, cuda or cuda:N")


def assign_devices(num_workers: int, device: str, strategy: str = "round-robin") -> list[str]:
    """Device for each worker: round-robin over all GPUs, all on one GPU, or all on CPU."""
    resolved = resolve_device(device)
    if resolved == "cpu":
        return ["cpu"] * num_workers
    if strategy not in ("round-robin", "single"):
        raise ConfigError("gpu_strategy", strategy, "must be round-robin or single")
    import torch

    if strategy == "single" or resolved.startswith("cuda:"):
        single = resolved if resolved.startswith("cuda:") else "cuda:0"
        return [single] * num_workers
    count = torch.cuda.device_count()
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
    platform does not report it.
    """

    def __init__(self, root_pid: int | None = None):
        self.root = psutil.Process(root_pid or os.getpid())
        self._known: dict[int, psutil.Process] = {}
        self.peak_rss = 0
        self.peak_pss = 0
        self.sample()  # prime cpu_percent, whose first reading is always 0

    def _tree(self) -> list[psutil.Process]:
        try:
            members = [self.root, *self.root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []
        alive = {p.pid: self._known.get(p.pid, p) for p in members}
        self._known = alive
        return list(alive.values())

    def sample(self) -> ResourceSample:
        cpu = rss = pss = 0.0
        for proc in self._tree():
            try:
                cpu += proc.cpu_percent(None)
                try:
                    info = proc.memory_full_info()
                    rss += info.rss
                    pss += getattr(info, "pss", info.rss)
                except psutil.AccessDenied:
                    mem = proc.memory_info().rss
                    rss += mem
                    pss += mem
            except (psutil.NoSuchProcess, psutil.ZombieProcess):
                continue
        self.peak_rss = max(self.peak_rss, int(rss))
        self.peak_pss = max(self.peak_pss, int(pss))
        return ResourceSample(cpu, int(rss), int(pss))


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def wait_for(predicate, timeout: float, interval: float = 0.05) -> bool:
    """Poll ``predicate`` until it is true or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())
