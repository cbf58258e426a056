"""A replay buffer in shared memory that many actor processes write while a learner samples.

Layout: fixed-size arrays (``obs``, ``next_obs``, ``actions``, ``rewards``, ``dones``,
``discounts``, ``priorities``) in :mod:`common.shm` segments, split into one contiguous
partition per writer. Each actor owns its partition and its write cursor (PufferLib
style: every worker writes its own slice), so writers never contend and no lock is needed.

Torn reads are impossible by construction: every slot carries a sequence number
(a per-slot seqlock). A writer marks a slot odd (``2n + 1``, "being written"), writes the
fields, then marks it even (``2n + 2``, "committed"), and only then advances its cursor.
The reader copies the sequence numbers, the fields, and the sequence numbers again, and
keeps a sample only when both copies agree and are even. A slot that an actor killed
mid-write left odd is therefore never sampled, and the restarted actor, resuming at the
saved cursor, overwrites it. (Numpy stores and loads are separate C calls in program
order; x86 keeps stores in order and loads in order, which is all a seqlock needs.)

Prioritized replay (proportional, Schaul et al. 2016): actors store an initial priority
per slot with the transition; the :class:`SumTree` lives in the learner alone, which
pulls the priorities of newly committed slots into it before sampling, so no two
processes ever update the tree.

If shared memory cannot be created (a tiny ``/dev/shm``, no permission) the same buffer
lives in the learner's own memory and actors send it their transitions as messages on their
own pipe to the learner (:class:`MessageWriter`, backend ``"queue"``), which writes them in
with :meth:`SharedReplay.receive`: slower, but the run goes on. A pipe has one reader and one
writer, so an actor killed halfway through a message takes nothing down with it.
:func:`make_replay` decides, after checking the buffer against available RAM and ``/dev/shm``.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from common.replay import ReplaySample, describe_observations
from common.shm import ArraySpec, SharedArray, attach_all
from common.system import ram_shortfall, shm_shortfall

log = logging.getLogger("prl.replay")
MAX_RESAMPLE_ROUNDS = 8  # rounds of redrawing samples that were being overwritten
_buffer_numbers = itertools.count()


class ReplayTooLarge(ValueError):
    """The buffer does not fit into available memory; the message says by how much."""


class SharedMemoryUnavailable(OSError):
    """Shared memory cannot hold the buffer; the caller may fall back to a message-fed buffer."""


@dataclass(frozen=True)
class ReplayLayout:
    """Shape of a replay buffer: ``capacity`` slots split evenly among ``num_writers``."""

    capacity: int
    num_writers: int
    obs_shape: tuple[int, ...]
    obs_dtype: str = "float32"
    prioritized: bool = False

    @property
    def part_capacity(self) -> int:
        return self.capacity // self.num_writers

    @property
    def slots(self) -> int:
        return self.part_capacity * self.num_writers

    def fields(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """Every array of the buffer: name -> (shape, dtype)."""
        n = self.slots
        return {
            "obs": ((n, *self.obs_shape), self.obs_dtype),
            "next_obs": ((n, *self.obs_shape), self.obs_dtype),
            "actions": ((n,), "int64"),
            "rewards": ((n,), "float32"),
            "dones": ((n,), "float32"),
            "discounts": ((n,), "float32"),
            "priorities": ((n,), "float32"),
            "seq": ((n,), "int64"),
            "cursors": ((self.num_writers,), "int64"),
        }

    def nbytes(self) -> int:
        """Bytes the buffer of this layout allocates, every array included: the one formula its memory
        checks (and any plan made before the run) use."""
        return sum(int(np.prod(shape)) * np.dtype(dtype).itemsize for shape, dtype in self.fields().values())


DATA_FIELDS = ("obs", "next_obs", "actions", "rewards", "dones", "discounts")


def check_fits(nbytes: int, shared: bool) -> None:
    """Refuse a buffer bigger than the RAM at hand; for shared memory also check ``/dev/shm``.

    Raises ReplayTooLarge (RAM) or SharedMemoryUnavailable (``/dev/shm`` only).
    """
    shortfall = ram_shortfall(nbytes, "the replay buffer")
    if shortfall:
        raise ReplayTooLarge(f"{shortfall}; lower --buffer-size")
    shortfall = shm_shortfall(nbytes, "the replay buffer") if shared else None
    if shortfall:
        raise SharedMemoryUnavailable(shortfall)


# ------------------------------------------------------------------ writing

def write_batch(arrays: dict[str, np.ndarray], part_capacity: int, writer: int, batch: dict[str, np.ndarray]) -> int:
    """Append ``batch`` (dict of equal-length arrays) to ``writer``'s partition; returns its new cursor.

    The order of the three phases (mark odd, write, mark even + advance cursor) is what
    makes a reader never see a half-written slot; do not reorder them.
    """
    count = len(batch["actions"])
    if count > part_capacity:
        raise ValueError(f"batch of {count} transitions exceeds the partition size {part_capacity}")
    cursor = int(arrays["cursors"][writer])
    serial = cursor + np.arange(count, dtype=np.int64)
    slots = writer * part_capacity + serial % part_capacity
    arrays["seq"][slots] = 2 * serial + 1
    for name in DATA_FIELDS:
        arrays[name][slots] = batch[name]
    arrays["priorities"][slots] = batch.get("priorities", 1.0)
    arrays["seq"][slots] = 2 * serial + 2
    arrays["cursors"][writer] = cursor + count
    return cursor + count


class SharedWriter:
    """Actor side of the shared-memory buffer: writes straight into the shared arrays."""

    def __init__(self, spec: dict[str, Any], writer: int):
        self.layout: ReplayLayout = spec["layout"]
        self.writer = writer
        self.arrays, self._handles = attach_all(spec["arrays"])

    def add(self, batch: dict[str, np.ndarray]) -> None:
        write_batch(self.arrays, self.layout.part_capacity, self.writer, batch)

    def close(self) -> None:
        """Detach (shared writes are already visible to the learner)."""
        self.arrays = {}
        for handle in self._handles:
            handle.close()
        self._handles = []


class MessageWriter:
    """Actor side of the fallback buffer: sends transition batches to the learner on its pipe."""

    def __init__(self, spec: dict[str, Any], writer: int, link):
        self.layout: ReplayLayout = spec["layout"]
        self.writer, self.link = writer, link

    def add(self, batch: dict[str, np.ndarray]) -> None:
        self.link.send("transitions", {k: np.ascontiguousarray(v) for k, v in batch.items()})

    def close(self) -> None:
        """Nothing to release: the pipe is the worker's link."""


def open_writer(spec: dict[str, Any], writer: int, link=None):
    """The writer an actor uses, whichever backend the learner chose (``link``: its WorkerLink)."""
    if spec["backend"] == "shm":
        return SharedWriter(spec, writer)
    return MessageWriter(spec, writer, link)


# ------------------------------------------------------------------ sum tree

class SumTree:
    """Binary sum tree over ``capacity`` leaves: O(log n) vectorized update and proportional draw."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.size = 1
        while self.size < capacity:
            self.size *= 2
        self.tree = np.zeros(2 * self.size, dtype=np.float64)

    def total(self) -> float:
        return float(self.tree[1])

    def update(self, indices: np.ndarray, values: np.ndarray) -> None:
        nodes = np.asarray(indices, dtype=np.int64) + self.size
        self.tree[nodes] = values
        nodes = np.unique(nodes // 2)
        while nodes[0] >= 1:
            self.tree[nodes] = self.tree[2 * nodes] + self.tree[2 * nodes + 1]
            if nodes[0] == 1:
                break
            nodes = np.unique(nodes // 2)

    def leaves(self, indices: np.ndarray) -> np.ndarray:
        return self.tree[np.asarray(indices) + self.size]

    def find(self, prefix: np.ndarray) -> np.ndarray:
        """Leaf index for each prefix sum in ``[0, total)``."""
        nodes = np.ones(len(prefix), dtype=np.int64)
        prefix = np.array(prefix, dtype=np.float64)
        while nodes[0] < self.size:
            left = self.tree[2 * nodes]
            right = prefix >= left
            # Rounding can leave a prefix just above a subtree's sum; never step into an empty right child.
            right &= self.tree[2 * nodes + 1] > 0
            prefix -= np.where(right, left, 0.0)
            nodes = 2 * nodes + right
        return np.minimum(nodes - self.size, self.capacity - 1)


# ------------------------------------------------------------------ learner side

@dataclass
class SharedReplay:
    """The buffer many actors write and the learner samples: sampling, priorities and bookkeeping
    over shared arrays (or, with the message backend, the learner's own arrays).

    Build one with :func:`make_replay`. ``writer_spec`` is what actors pass to
    :func:`open_writer`. Call ``sync()`` before sampling: it pulls new priorities into the
    sum tree. With the message backend, hand every ``transitions`` message to :meth:`receive`.
    """

    layout: ReplayLayout
    arrays: dict[str, np.ndarray]
    backend: str  # "shm" or "queue"
    writer_spec: dict[str, Any]
    alpha: float = 0.6  # how strongly priorities skew sampling (0 = uniform)
    priority_eps: float = 1e-3  # keeps every transition drawable
    _owned: list[SharedArray] = field(default_factory=list)
    _seen: np.ndarray | None = None
    _tree: SumTree | None = None
    _rng: np.random.Generator = field(default_factory=np.random.default_rng)

    def __post_init__(self):
        self._seen = np.zeros(self.layout.num_writers, dtype=np.int64)
        if self.layout.prioritized:
            self._tree = SumTree(self.layout.slots)

    def seed(self, seed: int) -> None:
        self._rng = np.random.default_rng(seed)

    # -- bookkeeping
    def filled(self) -> np.ndarray:
        """Committed slots per writer partition."""
        return np.minimum(self.arrays["cursors"], self.layout.part_capacity)

    def __len__(self) -> int:
        return int(self.filled().sum())

    def describe(self) -> str:
        """How the observations are stored (dtype, shape, bytes, backend): one line for the run's log."""
        line = describe_observations("replay", [self.arrays["obs"], self.arrays["next_obs"]], self.layout.obs_shape)
        return f"{line} ({self.backend})"

    def inserted(self) -> int:
        """Transitions ever committed (including overwritten ones)."""
        return int(self.arrays["cursors"].sum())

    def receive(self, writer: int, batch: dict[str, np.ndarray]) -> None:
        """Write a batch an actor sent as a message (backend ``"queue"``) into its partition."""
        write_batch(self.arrays, self.layout.part_capacity, writer, batch)

    def sync(self) -> int:
        """Take in what actors committed since the last call; returns the number of new transitions."""
        cursors = self.arrays["cursors"].copy()
        new = int((cursors - self._seen).sum())
        if self._tree is not None and new:
            part = self.layout.part_capacity
            chunks = []
            for writer in np.flatnonzero(cursors > self._seen):
                start = max(int(self._seen[writer]), int(cursors[writer]) - part)
                chunks.append(writer * part + np.arange(start, cursors[writer]) % part)
            slots = np.concatenate(chunks)
            self._tree.update(slots, self._scaled(self.arrays["priorities"][slots]))
        self._seen = cursors
        return new

    def _scaled(self, priorities: np.ndarray) -> np.ndarray:
        return (np.abs(priorities.astype(np.float64)) + self.priority_eps) ** self.alpha

    # -- sampling
    def _draw(self, count: int) -> np.ndarray:
        if self._tree is not None and self._tree.total() > 0:
            bounds = np.linspace(0.0, self._tree.total(), count + 1)
            return self._tree.find(self._rng.uniform(bounds[:-1], bounds[1:]))  # stratified
        filled = self.filled()
        ends = np.cumsum(filled)
        draws = self._rng.integers(0, ends[-1], size=count)
        writer = np.searchsorted(ends, draws, side="right")
        return writer * self.layout.part_capacity + draws - (ends[writer] - filled[writer])

    def sample(self, batch_size: int, beta: float = 0.4) -> ReplaySample:
        """Draw ``batch_size`` fully written transitions (uniform, or proportional to priority)."""
        if len(self) == 0:
            raise ValueError("cannot sample from an empty replay buffer")
        indices = self._draw(batch_size)
        rejected = 0
        for _ in range(MAX_RESAMPLE_ROUNDS):
            seq_before = self.arrays["seq"][indices]
            data = {name: self.arrays[name][indices] for name in DATA_FIELDS}
            seq_after = self.arrays["seq"][indices]
            ok = (seq_before == seq_after) & (seq_before % 2 == 0) & (seq_before > 0)
            if ok.all():
                break
            rejected += int((~ok).sum())
            indices = np.where(ok, indices, self._draw(batch_size))
        else:  # still torn after every round: hand back only the consistent part
            data = {name: value[ok] for name, value in data.items()}
            indices, seq_before = indices[ok], seq_before[ok]
        weights = None
        if self._tree is not None:
            probs = self._tree.leaves(indices) / max(self._tree.total(), 1e-12)
            weights = (len(self) * np.maximum(probs, 1e-12)) ** (-beta)
            weights = (weights / weights.max()).astype(np.float32)
        return ReplaySample(indices=indices, seq=seq_before, weights=weights, rejected=rejected, **data)

    def update_priorities(self, sample: ReplaySample, td_abs: np.ndarray) -> None:
        """New priorities for a sample, skipping slots that were overwritten since it was drawn."""
        if self._tree is None:
            return
        still = self.arrays["seq"][sample.indices] == sample.seq
        self._tree.update(sample.indices[still], self._scaled(td_abs[still]))

    # -- checkpointing
    def state(self) -> dict[str, np.ndarray]:
        """A copy of every committed transition and cursor, for an optional replay checkpoint.

        Actors may go on writing while it is taken, so it reads as :meth:`sample` does: sequence numbers,
        then the fields, then the sequence numbers again; a slot written meanwhile, or half-written, is
        saved with sequence number 0 (empty), and is written again after a resume. The cursors are read
        first, so every slot below a saved cursor was committed before the copy began."""
        cursors = np.array(self.arrays["cursors"])
        seq_before = np.array(self.arrays["seq"])
        state = {name: np.array(value) for name, value in self.arrays.items() if name not in ("cursors", "seq")}
        seq_after = self.arrays["seq"]
        seq_before[(seq_before != seq_after) | (seq_before % 2 == 1)] = 0
        return {**state, "cursors": cursors, "seq": seq_before}

    def load_state(self, state: dict[str, np.ndarray]) -> None:
        """Restore what :meth:`state` saved, all of it or (ValueError) nothing: a buffer of another layout
        (capacity, writers, observation shape or dtype) would mix saved cursors with empty slots."""
        def kind(array: np.ndarray) -> str:
            return f"{array.dtype}{list(array.shape)}"

        differs = [f"{name} {kind(value)}, this buffer's {kind(self.arrays[name])}" for name, value in state.items()
                   if name in self.arrays and kind(value) != kind(self.arrays[name])]
        missing = sorted(set(self.arrays) - set(state))
        if differs or missing:
            what = "; ".join(differs) or "no " + ", ".join(missing)
            raise ValueError(f"saved by a buffer of another layout ({what})")
        for name in self.arrays:
            self.arrays[name][...] = state[name]
        self.arrays["seq"][self.arrays["seq"] % 2 == 1] = 0  # a slot half-written at save time stays invisible
        self._seen[:] = 0
        self.sync()

    def close(self) -> None:
        """Release shared memory (owner). Safe to call twice."""
        self.arrays = {}
        for handle in self._owned:
            handle.unlink()
        self._owned = []


def make_replay(layout: ReplayLayout, backend: str = "auto", alpha: float = 0.6) -> SharedReplay:
    """Allocate the buffer: shared memory if possible (``auto``/``shm``), else local, fed by messages.

    Raises ReplayTooLarge when it does not fit in RAM, SharedMemoryUnavailable when
    ``backend="shm"`` and shared memory cannot hold it. ``auto`` logs one line and falls back.
    """
    if backend not in ("auto", "shm", "queue"):
        raise ValueError(f"replay backend must be auto, shm or queue, not {backend!r}")
    if layout.part_capacity < 1:
        raise ReplayTooLarge(f"buffer of {layout.capacity} slots cannot be split among {layout.num_writers} writers")
    if backend != "queue":
        try:
            return _make_shared(layout, alpha)
        except SharedMemoryUnavailable as err:
            if backend == "shm":
                raise
            log.warning("shared memory unavailable (%s); falling back to a replay buffer in the learner, "
                        "fed with messages from the actors", err)
    check_fits(layout.nbytes(), shared=False)
    arrays = {name: np.zeros(shape, dtype=dtype) for name, (shape, dtype) in layout.fields().items()}
    return SharedReplay(layout, arrays, "queue", {"backend": "queue", "layout": layout}, alpha=alpha)


def _make_shared(layout: ReplayLayout, alpha: float) -> SharedReplay:
    check_fits(layout.nbytes(), shared=True)
    tag = next(_buffer_numbers)  # several buffers in one process get distinct segment names
    owned: dict[str, SharedArray] = {}
    try:
        for name, (shape, dtype) in layout.fields().items():
            owned[name] = SharedArray.create(f"replay{tag}_{name}", shape, dtype)
    except OSError as err:
        for handle in owned.values():
            handle.unlink()
        raise SharedMemoryUnavailable(str(err)) from err
    arrays = {name: h.array for name, h in owned.items()}
    specs: dict[str, ArraySpec] = {name: h.spec for name, h in owned.items()}
    return SharedReplay(layout, arrays, "shm", {"backend": "shm", "layout": layout, "arrays": specs},
                        alpha=alpha, _owned=list(owned.values()))
