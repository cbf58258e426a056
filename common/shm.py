"""Shared-memory numpy arrays with a single owner and guaranteed cleanup.

The coordinator creates every segment (named ``prl_<pid>_<what>``) and is the only
process that unlinks it; workers attach by name through a small picklable ``spec``.
Segments whose creating process has died (a coordinator killed with ``kill -9``) are
reclaimed by the next run via :func:`reclaim_stale_segments`.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from multiprocessing import shared_memory
from pathlib import Path

import numpy as np
import psutil

SHM_DIR = Path("/dev/shm")
PREFIX = "prl_"
log = logging.getLogger("prl.shm")


@dataclass(frozen=True)
class ArraySpec:
    """What a worker needs to attach to a shared array: pass this, never the array."""

    name: str
    shape: tuple[int, ...]
    dtype: str


class SharedArray:
    """A numpy array backed by a POSIX shared-memory segment.

    ``SharedArray.create`` makes an owning instance (call ``unlink()`` when done, or use
    it as a context manager); ``SharedArray.attach(spec)`` maps an existing one without
    copying. ``close()`` and ``unlink()`` are safe to call more than once.
    """

    def __init__(self, segment: shared_memory.SharedMemory, spec: ArraySpec, owner: bool):
        self._segment = segment
        self.spec = spec
        self.owner = owner
        self.array: np.ndarray = np.ndarray(spec.shape, dtype=np.dtype(spec.dtype), buffer=segment.buf)
        self._closed = False

    @classmethod
    def create(cls, what: str, shape, dtype, fill=0) -> SharedArray:
        if not re.fullmatch(r"[A-Za-z0-9_]+", what):
            raise ValueError(f"shared array name {what!r} must be letters, digits and _")
        shape = tuple(int(s) for s in np.atleast_1d(shape)) if not isinstance(shape, tuple) else shape
        dtype = np.dtype(dtype)
        nbytes = max(1, int(np.prod(shape, dtype=np.int64)) * dtype.itemsize)
        name = f"{PREFIX}{os.getpid()}_{what}"
        segment = shared_memory.SharedMemory(name=name, create=True, size=nbytes)
        shared = cls(segment, ArraySpec(name, shape, dtype.str), owner=True)
        if fill is not None:
            shared.array.fill(fill)
        return shared

    @classmethod
    def attach(cls, spec: ArraySpec) -> SharedArray:
        segment = shared_memory.SharedMemory(name=spec.name, create=False)
        return cls(segment, spec, owner=False)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.array = None  # drop the view before closing the mapping under it
        try:
            self._segment.close()
        except BufferError:
            # A caller still holds a view; the mapping goes away with the process.
            log.debug("segment %s still has exported views", self.spec.name)

    def unlink(self) -> None:
        """Close and remove the segment (owner only; later calls do nothing)."""
        self.close()
        if self.owner:
            self.owner = False
            try:
                self._segment.unlink()
            except FileNotFoundError:
                pass

    def __enter__(self) -> SharedArray:
        return self

    def __exit__(self, *exc) -> None:
        self.unlink() if self.owner else self.close()


class SharedArrays:
    """A named group of shared arrays created together and released together."""

    def __init__(self):
        self._arrays: dict[str, SharedArray] = {}

    def create(self, what: str, shape, dtype, fill=0) -> np.ndarray:
        self._arrays[what] = SharedArray.create(what, shape, dtype, fill)
        return self._arrays[what].array

    def specs(self) -> dict[str, ArraySpec]:
        return {what: shared.spec for what, shared in self._arrays.items()}

    def __getitem__(self, what: str) -> np.ndarray:
        return self._arrays[what].array

    def unlink_all(self) -> None:
        for shared in self._arrays.values():
            shared.unlink()
        self._arrays.clear()


class Seqlock:
    """Rows of a shared array under a version seqlock: one writer, many readers, and no lock a killed
    process could die holding.

    ``rows`` is ``[slots, n]`` and ``versions`` is ``[slots, 2]`` int64: writes begun and writes
    finished. The writer bumps "begun", writes the row, then sets "finished" to it; a reader copies
    the row and keeps the copy only if "begun" still equals the "finished" it read before, so it never
    keeps a half-written row. Version 0 means "never written". (Stores and loads of one process are
    seen in program order by the others on x86; the writer holds a row for microseconds.)
    """

    def __init__(self, rows: np.ndarray, versions: np.ndarray):
        self.rows, self.versions = rows, versions

    def version(self, slot: int = 0) -> int:
        """The version of the last finished write of ``slot``."""
        return int(self.versions[slot, 1])

    def write(self, fill, slot: int = 0) -> int:
        """``fill(row)`` writes the row of ``slot`` in place; returns the new version."""
        self.versions[slot, 0] += 1
        fill(self.rows[slot])
        self.versions[slot, 1] = self.versions[slot, 0]
        return int(self.versions[slot, 1])

    def read(self, out: np.ndarray, slot: int = 0) -> int | None:
        """Copy ``slot`` into ``out`` if no write overlapped the copy: its version, else None (retry later)."""
        finished = int(self.versions[slot, 1])
        if finished == 0:
            return None
        np.copyto(out, self.rows[slot])
        return finished if int(self.versions[slot, 0]) == finished else None


def attach_all(specs: dict[str, ArraySpec]) -> tuple[dict[str, np.ndarray], list[SharedArray]]:
    """Attach to every spec; returns the arrays and the handles to close later."""
    handles = {what: SharedArray.attach(spec) for what, spec in specs.items()}
    return {what: h.array for what, h in handles.items()}, list(handles.values())


def process_gone(pid: int) -> bool:
    """Whether process ``pid`` no longer runs: it does not exist, or it was killed and nobody has reaped
    it yet (a zombie holds no mappings and no open files, so what it owned can go)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def reclaim_stale_segments(shm_dir: Path = SHM_DIR) -> list[str]:
    """Unlink ``prl_<pid>_*`` segments whose creating process no longer exists."""
    reclaimed = []
    if not shm_dir.is_dir():
        return reclaimed
    for path in shm_dir.glob(f"{PREFIX}*"):
        match = re.match(rf"{PREFIX}(\d+)_", path.name)
        if not match or not process_gone(int(match.group(1))):
            continue
        try:
            path.unlink()
            reclaimed.append(path.name)
        except OSError:
            continue
    if reclaimed:
        log.info("reclaimed %d shared-memory segment(s) left by dead runs", len(reclaimed))
    return reclaimed


def segments_of(pid: int, shm_dir: Path = SHM_DIR) -> list[str]:
    """Names of the segments a given process created (for tests and diagnostics)."""
    return sorted(p.name for p in shm_dir.glob(f"{PREFIX}{pid}_*"))
