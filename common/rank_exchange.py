"""Rank 0 and the other ranks of a torchrun job, exchanging messages point to point: the
actor-learner modes past one machine.

In the data-parallel mode (DD-PPO) every rank does the same work and meets the others in
collectives. In the actor-learner modes the ranks differ: rank 0 learns, the others only act,
and one lost actor node must cost throughput, not the run. So after the start-up handshake no
collective is used again: each rank other than 0 (a :class:`Spoke`) repeatedly sends rank 0 (the
:class:`Hub`) a message and waits for its reply, over ``torch.distributed`` point-to-point
``send``/``recv``. A dead peer then breaks only its own pair of sockets: the hub logs it, counts it
and goes on with the rest.

A message is a small JSON dict (``info``) plus named numpy arrays (transitions, episodes,
checkpoint bytes, parameters), each sent as a tensor of its own dtype (uint8 frames stay uint8 on
the wire) after an int64 header that says what follows. Messages are never pickled: a peer running
other code can send wrong numbers, never code. What arrives is checked against a :class:`Schema`
(names, dtypes, row shapes, value ranges) before anything uses it, and a peer whose message does
not fit is refused, in one line, and dropped. At the start every rank shows rank 0 a
*fingerprint* (the script, a digest of the code, the env, its spaces, the settings that shape
the data); a rank that differs is refused before it sends a single transition.

What is pickled: the handshake (every rank's fingerprint, and rank 0's answer naming the refused
ranks) and, before it, what :mod:`common.run` settles at the start (whether torchrun restarted
the job; a resumed run's checkpoint, broadcast from rank 0) travel through torch.distributed's
object collectives (``all_gather_object``, ``broadcast_object_list``), which pickle. They run
once, at the start, among the ranks of the job's own rendezvous.

The hub serves its spokes from one thread, one message at a time in turn: each spoke paces
itself by waiting for the reply, and a hub whose inbox is full stops answering for a moment
(back-pressure), so a slow learner slows the actors instead of piling up memory. The learner's
thread only touches the hub through :meth:`Hub.publish` (what the replies carry: control values,
parameters with a version), :meth:`Hub.send_to` (a message for one rank alone, riding on its next
reply) and :meth:`Hub.drain` (what arrived).

Trust: like every torch.distributed job, the rendezvous endpoint and the ranks' ports must be
reachable only from the job's own nodes: whoever can join the rendezvous takes part in the
pickled collectives above, and unpickling runs code.
"""

from __future__ import annotations

import hashlib
import json
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from common.distributed import COLLECTIVE_TIMEOUT_S, PeerFailure, PeerRefused

MAX_MESSAGE_BYTES = 1 << 30  # a header announcing more than this is a broken peer, not a big batch
ROOT = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------------ what may arrive

@dataclass(frozen=True)
class Field:
    """One array a peer may send: its dtype, the shape of one row, and the range of its values."""

    dtype: str
    row_shape: tuple[int, ...] = ()
    low: float | None = None
    high: float | None = None
    integral: bool = False  # values must be whole numbers (actions, indices)


@dataclass(frozen=True)
class Schema:
    """The arrays a message may carry; every array of one message has the same number of rows."""

    fields: dict[str, Field]
    # What the fields cannot say (where episodes begin and end, the info's numbers): (info, arrays) ->
    # why the message does not fit, or None. Runs after the field checks, on every message.
    rule: Callable[[dict, dict[str, np.ndarray]], str | None] | None = None

    def check(self, arrays: dict[str, np.ndarray], info: dict | None = None) -> str | None:
        """Why ``arrays`` (and ``info``, for the rule) do not fit (None when they do)."""
        why = self._check_fields(arrays)
        if why is not None or self.rule is None:
            return why
        try:
            return self.rule(info or {}, arrays)
        except Exception as err:  # a rule tripping over a malformed message refuses it, never the hub
            return f"a message the rule cannot read ({type(err).__name__}: {err})"

    def _check_fields(self, arrays: dict[str, np.ndarray]) -> str | None:
        unknown = set(arrays) - set(self.fields)
        if unknown:
            return f"unknown array(s) {sorted(unknown)}"
        rows = {len(a) for a in arrays.values()}
        if len(rows) > 1:
            return f"arrays of different lengths {sorted(rows)}"
        for name, array in arrays.items():
            spec = self.fields[name]
            if array.dtype != np.dtype(spec.dtype) or array.shape[1:] != tuple(spec.row_shape):
                return (f"{name} is {array.dtype}{list(array.shape[1:])}, expected "
                        f"{np.dtype(spec.dtype)}{list(spec.row_shape)}")
            if array.size == 0 or array.dtype == np.uint8 and spec.low is None:
                continue
            if array.dtype.kind == "f" and not np.isfinite(array).all():
                return f"{name} holds NaN or infinite values"
            if spec.low is not None and array.min() < spec.low or spec.high is not None and array.max() > spec.high:
                return f"{name} out of range [{spec.low}, {spec.high}]: [{array.min()}, {array.max()}]"
            if spec.integral and array.dtype.kind == "f" and not np.array_equal(array, np.round(array)):
                return f"{name} holds non-integral values"
        return None


def code_digest(script: str | Path) -> str:
    """A short digest of the script and the whole ``common`` package: equal iff the code is equal."""
    digest = hashlib.sha1()
    for path in [Path(script), *sorted((ROOT / "common").rglob("*.py"))]:
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


# ------------------------------------------------------------------------ one message on the wire
# header: int64 [json bytes, number of arrays]; then the JSON (uint8); then per array an int64
# descriptor [dtype code, ndim, *shape] (fixed length) and its data, as a tensor of its own dtype.

_DTYPES = ["uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64", "bool"]
_MAX_DIMS = 6


def _send(dist, group, dst: int, info: dict, arrays: dict[str, np.ndarray]) -> int:
    import torch  # here, not at the top: the scripts import this module while answering --help

    names = list(arrays)
    payload = json.dumps({**info, "_arrays": names}).encode()
    dist.send(torch.tensor([len(payload), len(names)], dtype=torch.int64), dst, group=group)
    dist.send(torch.frombuffer(bytearray(payload), dtype=torch.uint8), dst, group=group)
    sent = len(payload)
    for name in names:
        array = np.ascontiguousarray(arrays[name])
        if array.dtype.name not in _DTYPES or array.ndim > _MAX_DIMS:
            raise ValueError(f"cannot send {name}: {array.dtype}{list(array.shape)}")
        shape = list(array.shape) + [0] * (_MAX_DIMS - array.ndim)
        dist.send(torch.tensor([_DTYPES.index(array.dtype.name), array.ndim, *shape], dtype=torch.int64), dst,
                  group=group)
        if array.size:
            dist.send(torch.from_numpy(array.view(np.uint8) if array.dtype == bool else array), dst, group=group)
        sent += array.nbytes
    return sent


def _recv(dist, group, src: int) -> tuple[dict, dict[str, np.ndarray], int]:
    import torch

    header = torch.zeros(2, dtype=torch.int64)
    dist.recv(header, src, group=group)
    size, count = (int(v) for v in header)
    if not 0 < size <= MAX_MESSAGE_BYTES or not 0 <= count <= 64:
        raise _Broken(f"a message header announcing {size} bytes and {count} arrays")
    raw = torch.zeros(size, dtype=torch.uint8)
    dist.recv(raw, src, group=group)
    try:
        info = json.loads(raw.numpy().tobytes())
        names = info.pop("_arrays")
    except (ValueError, KeyError) as err:
        raise _Broken(f"a message that is not this project's ({err})") from None
    if not isinstance(names, list) or len(names) != count:
        raise _Broken("a message whose array list does not match its header")
    arrays, received = {}, size
    for name in names:
        desc = torch.zeros(2 + _MAX_DIMS, dtype=torch.int64)
        dist.recv(desc, src, group=group)
        code, ndim, *shape = (int(v) for v in desc)
        if not (0 <= code < len(_DTYPES) and 0 <= ndim <= _MAX_DIMS and all(s >= 0 for s in shape)):
            raise _Broken(f"an array descriptor {desc.tolist()}")
        dtype, shape = np.dtype(_DTYPES[code]), tuple(shape[:ndim])
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if nbytes > MAX_MESSAGE_BYTES:
            raise _Broken(f"an array of {nbytes} bytes")
        array = np.empty(shape, dtype=np.uint8 if dtype.kind == "b" else dtype)
        if array.size:
            dist.recv(torch.from_numpy(array), src, group=group)
        arrays[str(name)] = array.view(bool) if dtype.kind == "b" else array
        received += nbytes
    return info, arrays, received


class _Broken(RuntimeError):
    """A peer sent something that is not a message of this protocol."""


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return (text.splitlines()[0] if text else type(err).__name__)[:200]


# ------------------------------------------------------------------------ rank 0

@dataclass
class PeerMessage:
    """What one spoke sent: its rank, its JSON info and its arrays (already checked)."""

    rank: int
    info: dict
    arrays: dict[str, np.ndarray]


@dataclass
class PeerStats:
    rank: int
    messages: int = 0
    bytes: int = 0
    rows: int = 0
    last_seen: float = field(default_factory=time.monotonic)
    lost: str | None = None  # why the hub stopped talking to this rank
    params_version: int = -1  # the newest parameters this rank was sent
    arrays_version: int = -1  # the newest published arrays (see Hub.publish) this rank was sent
    stopped: bool = False  # it got the final reply
    sent_bytes: int = 0  # what the replies carried to this rank
    outbox: deque = field(default_factory=deque)  # (info, arrays) for this rank alone (Hub.send_to)


class Hub:
    """Rank 0's side: receives from every other rank in turn, answers with what :meth:`publish` set."""

    def __init__(self, dist, schema: Schema, log: logging.Logger, inbox_size: int = 64):
        self.dist, self.schema, self.log = dist, schema, log
        self.group = dist.p2p_group
        dist.barrier_at_close = False
        self.peers = {rank: PeerStats(rank) for rank in range(1, dist.world_size)}
        self.inbox: queue.Queue[PeerMessage] = queue.Queue(maxsize=inbox_size)
        self._lock = threading.Lock()
        self._control: dict[str, Any] = {}
        self._params: np.ndarray | None = None
        self._version = -1
        self._arrays: dict[str, np.ndarray] = {}
        self._arrays_version = -1
        self._final: dict | None = None
        self._thread: threading.Thread | None = None
        self.lost_events: list[dict] = []  # [{"rank", "reason", "wall"}], read by the trainer for the summary

    def refuse_mismatched(self, fingerprint: dict) -> list[int]:
        """The handshake (a collective, called by every rank): rank 0 refuses ranks whose fingerprint
        differs from its own; returns the refused ranks (they exit at once)."""
        prints = self.dist.gather_objects(fingerprint)
        refused = {}
        for rank, theirs in enumerate(prints):
            if rank and theirs != fingerprint:
                diff = [f"{k} {theirs.get(k)!r} vs {fingerprint.get(k)!r}"
                        for k in sorted(set(fingerprint) | set(theirs))
                        if theirs.get(k) != fingerprint.get(k)]
                refused[rank] = "; ".join(diff)
        self.dist.broadcast_object(refused)
        for rank, why in refused.items():
            self.log.error("rank %d refused: it does not run what rank 0 runs (%s)", rank, why)
            self._lose(rank, f"refused: {why}", log=False)
        return sorted(refused)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._serve, name="prl-hub", daemon=True)
        self._thread.start()

    # -- the learner's side
    def publish(self, control: dict | None = None, params: np.ndarray | None = None,
                arrays: dict[str, np.ndarray] | None = None) -> None:
        """What the next replies carry: ``control`` (merged) and, when given, new parameters; ``arrays``
        (e.g. self-play snapshots) replace the last ones as a version of their own, which each spoke
        is sent once. Given in one call, control and arrays reach a spoke in the same reply."""
        with self._lock:
            if control:
                self._control.update(control)
            if params is not None:
                self._params = np.array(params, dtype=np.float32, copy=True)
                self._version += 1
            if arrays is not None:
                if "params" in arrays:
                    raise ValueError("'params' is published as params=, not among arrays=")
                self._arrays = {name: np.array(a, copy=True) for name, a in arrays.items()}
                self._arrays_version += 1

    def send_to(self, rank: int, info: dict, arrays: dict[str, np.ndarray] | None = None) -> None:
        """A message for ``rank`` alone (files, a command for one of its workers): it rides on that
        rank's next reply, one message per reply, in the order sent (:attr:`Reply.message`)."""
        with self._lock:
            self.peers[rank].outbox.append((dict(info), dict(arrays or {})))

    def refuse(self, rank: int, reason: str) -> None:
        """Stop talking to ``rank``: its message passed the schema but not the trainer's own checks."""
        self._lose(rank, f"sent data that does not fit: {reason}")

    def drain(self, timeout: float = 0.0) -> list[PeerMessage]:
        """Every message that arrived (waiting up to ``timeout`` for the first)."""
        out = []
        try:
            out.append(self.inbox.get(timeout=timeout) if timeout > 0 else self.inbox.get_nowait())
            while True:
                out.append(self.inbox.get_nowait())
        except queue.Empty:
            pass
        return out

    @property
    def live(self) -> list[int]:
        return [rank for rank, peer in self.peers.items() if peer.lost is None]

    def lost_since(self, seen: int) -> list[dict]:
        with self._lock:
            return self.lost_events[seen:]

    def close(self, stop: dict, timeout: float = 30.0) -> None:
        """Tell every live spoke to stop (``stop`` goes in its last reply) and wait until each has it."""
        with self._lock:
            self._final = dict(stop)
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                self.log.warning("rank(s) %s did not collect the stop within %.0f s", self.live, timeout)

    # -- the serving thread
    def _serve(self) -> None:
        while True:
            live = [p for p in self.peers.values() if p.lost is None and not p.stopped]
            if not live:
                return
            for peer in live:
                self._serve_one(peer)

    def _serve_one(self, peer: PeerStats) -> None:
        try:
            info, arrays, nbytes = _recv(self.dist.dist, self.group, peer.rank)
        except _Broken as err:
            self._lose(peer.rank, f"sent {err}")
            return
        except Exception as err:
            self._lose(peer.rank, _first_line(err))
            return
        why = self.schema.check(arrays, info)
        if why is not None:
            why = f"sent data that does not fit: {why}"
            try:  # tell it, so that it ends now with this line rather than at the timeout
                _send(self.dist.dist, self.group, peer.rank, {"refused": why}, {})
            except Exception:
                pass
            self._lose(peer.rank, why)
            return
        peer.messages, peer.bytes, peer.last_seen = peer.messages + 1, peer.bytes + nbytes, time.monotonic()
        peer.rows += len(next(iter(arrays.values()))) if arrays else 0
        if info or arrays:
            self._put(PeerMessage(peer.rank, info, arrays))
        with self._lock:
            reply = {"control": dict(self._control), "version": self._version}
            final = self._final
            params = self._params if self._version > peer.params_version else None
            extra = self._arrays if self._arrays_version > peer.arrays_version else None
            if extra is not None:
                reply["arrays_version"] = self._arrays_version
            letter = peer.outbox.popleft() if peer.outbox else None
        arrays = dict(extra or {})
        if letter is not None:  # its arrays get a prefix of their own: no name of the published ones clashes
            reply["message"] = {"info": letter[0], "arrays": list(letter[1]), "more": len(peer.outbox)}
            arrays.update({f"message.{name}": array for name, array in letter[1].items()})
        if params is not None:
            arrays["params"] = params
        if final is not None:
            reply["stop"] = final
        try:
            peer.sent_bytes += _send(self.dist.dist, self.group, peer.rank, reply, arrays)
        except Exception as err:
            self._lose(peer.rank, _first_line(err))
            return
        if params is not None:
            peer.params_version = reply["version"]
        if extra is not None:
            peer.arrays_version = reply["arrays_version"]
        peer.stopped = final is not None

    def _put(self, message: PeerMessage) -> None:
        while True:
            try:
                self.inbox.put(message, timeout=1.0)
                return
            except queue.Full:
                with self._lock:
                    if self._final is not None:
                        return  # the learner has stopped reading; the run is ending

    def _lose(self, rank: int, reason: str, log: bool = True) -> None:
        peer = self.peers[rank]
        if peer.lost is not None:
            return
        peer.lost = reason
        with self._lock:
            self.lost_events.append({"rank": rank, "reason": reason, "wall": time.time()})
        self.dist.peer_lost(rank)
        if log:
            self.log.error("rank %d lost: %s; going on with rank(s) %s", rank, reason, self.live or "0 alone")

    def summary(self) -> dict:
        """Per-rank traffic and losses, for summary.json."""
        return {"ranks_lost": len(self.lost_events), "lost_ranks": list(self.lost_events),
                "rank_traffic": {str(r): {"messages": p.messages, "rows": p.rows, "mib": round(p.bytes / 2**20, 3),
                                          "sent_mib": round(p.sent_bytes / 2**20, 3)}
                                 for r, p in self.peers.items()}}


# ------------------------------------------------------------------------ ranks 1 .. N-1

@dataclass
class Reply:
    control: dict
    params: np.ndarray | None
    version: int
    stop: dict | None  # rank 0 has stopped the run: {"reason", "exit_code"}
    arrays: dict[str, np.ndarray] | None = None  # the arrays rank 0 published, when newer than the last ones
    arrays_version: int = -1  # their version (-1: this reply carries none)
    message: dict | None = None  # what rank 0 sent this rank alone (Hub.send_to) ...
    message_arrays: dict[str, np.ndarray] = field(default_factory=dict)  # ... with its arrays
    more: int = 0  # further messages for this rank alone wait at rank 0: exchange again soon


class Spoke:
    """A rank other than 0: sends rank 0 a message, waits for its reply."""

    def __init__(self, dist):
        self.dist = dist
        self.group = dist.p2p_group
        dist.barrier_at_close = False
        self.sent_bytes = 0

    def refuse_mismatched(self, fingerprint: dict) -> None:
        """The handshake (see :meth:`Hub.refuse_mismatched`); raises PeerRefused if rank 0 turns us away."""
        self.dist.gather_objects(fingerprint)
        refused = self.dist.broadcast_object(None)
        if self.dist.rank in refused:
            raise PeerRefused(f"rank {self.dist.rank} refused by rank 0: it runs something else "
                              f"({refused[self.dist.rank]})")

    def exchange(self, info: dict | None = None, arrays: dict[str, np.ndarray] | None = None) -> Reply:
        """Send ``info`` and ``arrays`` to rank 0; its reply (new parameters only when they changed)."""
        try:
            self.sent_bytes += _send(self.dist.dist, self.group, 0, info or {}, arrays or {})
            reply, got, _ = _recv(self.dist.dist, self.group, 0)
        except Exception as err:
            raise PeerFailure(f"rank {self.dist.rank}: rank 0 (the learner) is gone or silent for "
                              f"{COLLECTIVE_TIMEOUT_S:.0f} s ({_first_line(err)})") from None
        if "refused" in reply:
            raise PeerRefused(f"rank {self.dist.rank} refused by rank 0: it {reply['refused']}")
        arrays_version = int(reply.get("arrays_version", -1))
        letter = reply.get("message") or {"info": None, "arrays": [], "more": 0}
        mine = {name: got.pop(f"message.{name}") for name in letter["arrays"]}
        return Reply(reply.get("control", {}), got.pop("params", None), int(reply.get("version", -1)),
                     reply.get("stop"), got if arrays_version >= 0 else None, arrays_version, letter["info"], mine,
                     int(letter["more"]))


# ------------------------------------------------------------------------ stopping together

def stop_message(run) -> dict:
    """What rank 0's last reply tells every spoke: why the run stopped and the exit status to share."""
    code = run.graceful.exit_code if run.graceful.requested else 0
    return {"reason": run.stop_reason() or "finished", "exit_code": code}


def follow_stop(run, stop: dict) -> None:
    """A spoke ends as rank 0 did: a signal anywhere makes every rank exit 130 / 143."""
    code = int(stop.get("exit_code", 0))
    if code in (130, 143) and not run.graceful.requested:
        run.graceful.signum = code - 128
    run.request_stop(f"rank 0 stopped the run: {stop.get('reason', 'finished')}")


def interrupt_from_peer(run, rank: int, signum: int) -> None:
    """A spoke caught Ctrl+C or SIGTERM (it sends ``info["signal"]``): rank 0 stops the run as if it had."""
    if not run.graceful.requested and signum in (2, 15):
        run.log.warning("rank %d received signal %d: stopping every rank", rank, signum)
        run.graceful.signum = signum
