"""Worker processes on every rank, one coordinator on rank 0: a population past one machine.

On one machine a coordinator supervises its workers (:mod:`common.supervisor`): they report to it
over pipes and save their files into its run directory. Under torchrun every rank runs its own
share of the workers, numbered globally (rank r's local worker i is member ``r * per_rank + i``),
and rank 0's coordinator (:class:`common.population.Population`) follows all of them. This module
carries what crosses the network, over :mod:`common.rank_exchange`:

- A rank other than 0 (:class:`PopulationNode`, through :class:`MemberForwarder`) runs its members'
  workers and forwards every message of theirs to rank 0 under the member's global number, with
  the files the message names (checkpoints, logs) attached as bytes, and hands its workers what
  rank 0 sends them (a command with the files it needs, such as a PBT donor's checkpoint) and the
  order to stop.
- Rank 0 (:class:`RemoteMembers`) writes those files into its own run directory under their own
  names, rewrites the paths in the messages to its copies, and hands its coordinator the same
  :class:`~common.supervisor.Message` its local workers produce; a lost rank becomes one ``lost``
  message per member of it.

What holds, and why:

- **Rank 0 alone writes the run directory.** The other ranks keep their workers' files in a
  node-local scratch directory; every file a message names reaches rank 0 with that message, so
  rank 0's copy of a member's newest checkpoint is never older than what the member has reported.
- **One exchange carries everything since the last** (a :class:`Parcel`: messages and files).
  The hub serves the ranks in turn, one exchange each, so a rank with many workers is served as
  often as one with a single worker, and a rank exchanges at least every :data:`POLL_S` seconds even
  when idle: rank 0's answers and its stop reach every rank within that time.
- **A file lands only where its name says.** A received name must match one of the receiver's
  :class:`Place` patterns (plain names, no directory), and rank 0 accepts a file or a message from
  rank r only for r's own members: a broken peer cannot overwrite another member's checkpoint.
- **Nothing here blocks longer than one exchange.** A rank > 0 never waits for its workers
  without exchanging in between, so rank 0 never waits on it for long, and it notices a lost
  rank 0 at its next exchange (within ``PRL_COLLECTIVE_TIMEOUT_S``).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from common.checkpoint import latest_checkpoint
from common.distributed import PeerFailure
from common.population_member import member_checkpoints
from common.rank_exchange import Field, Hub, Schema, Spoke, code_digest, follow_stop, interrupt_from_peer
from common.run import config_dict
from common.shm import process_gone
from common.supervisor import Message, WorkerFailed

if TYPE_CHECKING:
    from common.population import Members

POLL_S = 0.1  # a rank > 0 exchanges at least this often; rank 0's answers wait at most this long
FILES = "files"  # the one array of a parcel: its files' bytes, one after the other


@dataclass(frozen=True)
class Place:
    """Where a received file whose name matches ``pattern`` goes: ``<base>/<directory>/<name>``."""

    pattern: str  # a full match, with a group (?P<member>\\d+): the member the file belongs to
    directory: str
    append: bool = False  # a log: each arrival is added to the end of the receiver's copy

    def member(self, name: str) -> int | None:
        match = re.fullmatch(self.pattern, name)
        return int(match.group("member")) if match else None


# Where the files a member's messages name land on the rank that receives them, what a rank's workers
# may report to rank 0, and what rank 0 may answer one.
FILE_PLACES = (Place(member_checkpoints(r"(?P<member>\d+)"), "checkpoints"),
               Place(r"worker_(?P<member>\d+)\.log", "logs", append=True))
REPORTS = ("ready", "update", "pbt_ready", "pbt_copied", "done", "diverged", "restarted", "given_up")
COMMANDS = ("pbt",)  # the stop reaches every rank at once (RemoteMembers.stop_members)
# Settings that may differ between nodes; every other one must equal rank 0's (the fingerprint).
NODE_LOCAL = ("output_dir", "resume", "data_source", "cache_dir", "device", "gpu_strategy", "num_gpus",
              "threads_per_worker", "tensorboard", "log_interval_s")


def fingerprint(run, data, script_file: str) -> dict:
    """What every rank must share with rank 0 to train members of one population: the code, the
    settings (but NODE_LOCAL), the env's spaces and the market history itself."""
    history = None
    if data is not None:
        digest = hashlib.sha1()
        for array in (data.prices, data.volumes):
            digest.update(memoryview(np.ascontiguousarray(array)).cast("B"))
        history = digest.hexdigest()[:12]
    settings = {k: v for k, v in config_dict(run.cfg).items() if k not in NODE_LOCAL}
    return {"script": Path(script_file).stem, "code": code_digest(script_file), "settings": settings,
            "spaces": [str(run.env.observation_space), str(run.env.action_space)], "market": history,
            "item_indices": run.env.extra.get("item_indices")}


def place_of(name: str, places: tuple[Place, ...]) -> tuple[Place, int] | None:
    for place in places:
        member = place.member(name)
        if member is not None:
            return place, member
    return None


def plain(value: Any) -> Any:
    """``value`` with numpy scalars and paths made plain JSON values (a message's payload)."""
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    return str(value) if isinstance(value, Path) else value


# ------------------------------------------------------------------------ one exchange's content

@dataclass
class Parcel:
    """Messages from or for members, with the files they name: what one exchange carries."""

    events: list[dict] = field(default_factory=list)  # {"member", "kind", "payload", "files": {key: name}}
    files: dict[str, bytes] = field(default_factory=dict)  # name -> content

    def add(self, member: int, kind: str, payload: Any = None, files: dict[str, Path] | None = None) -> None:
        """A message of ``member``; ``files`` maps keys to files to attach. A key that is a field of
        the payload holding a path is rewritten to the receiver's copy."""
        names = {}
        for key, path in (files or {}).items():
            if Path(path).is_file():
                names[key] = self.attach(Path(path))
        self.events.append({"member": int(member), "kind": kind, "payload": plain(payload), "files": names})

    def attach(self, path: Path) -> str:
        self.files[path.name] = path.read_bytes()
        return path.name

    def __bool__(self) -> bool:
        return bool(self.events or self.files)

    def wire(self) -> tuple[dict, dict[str, np.ndarray]]:
        """The hub message: JSON info and one uint8 array of every file's bytes."""
        if not self:
            return {}, {}
        blob = bytearray(b"".join(self.files.values()))  # writable: torch wraps it without a copy
        info = {"events": self.events, "files": [[name, len(data)] for name, data in self.files.items()]}
        return info, ({FILES: np.frombuffer(blob, dtype=np.uint8)} if blob else {})

    @classmethod
    def unwire(cls, info: dict, arrays: dict[str, np.ndarray]) -> Parcel:
        """The parcel of a message that :func:`check_parcel` accepted."""
        blob = arrays.get(FILES, np.zeros(0, np.uint8)).tobytes()
        files, offset = {}, 0
        for name, size in info.get("files", []):
            files[name] = blob[offset:offset + size]
            offset += size
        return cls(list(info.get("events", [])), files)

    def members(self, places: tuple[Place, ...]) -> set[int]:
        """Every member this parcel speaks for: its messages' and its files' (for the sender's check)."""
        return {e["member"] for e in self.events} | {place_of(name, places)[1] for name in self.files}

    def deliver(self, base: Path, places: tuple[Place, ...]) -> list[Message]:
        """Write the files under ``base`` (atomically; logs appended) and return the messages, with
        the paths in their payloads pointing at the copies here."""
        written = {}
        for name, data in self.files.items():
            place, _ = place_of(name, places)
            written[name] = target = base / place.directory / name
            if place.append:
                with open(target, "ab") as f:
                    f.write(data)
            else:
                tmp = target.with_name(f".{name}.tmp{os.getpid()}")
                tmp.write_bytes(data)
                os.replace(tmp, target)
        messages = []
        for event in self.events:
            payload = event["payload"]
            for key, name in event["files"].items():
                if isinstance(payload, dict) and key in payload:
                    payload[key] = str(written[name])
            messages.append(Message(event["member"], event["kind"], payload))
        return messages


def check_parcel(info: dict, arrays: dict[str, np.ndarray], places: tuple[Place, ...],
                 kinds: tuple[str, ...]) -> str | None:
    """Why a message is not a parcel of known kinds and well-named files (None when it is)."""
    events, files = info.get("events", []), info.get("files", [])
    if not isinstance(events, list) or not isinstance(files, list):
        return "events and files must be lists"
    sizes = 0
    for entry in files:
        if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str)
                and isinstance(entry[1], int) and entry[1] >= 0):
            return f"a file entry {str(entry)[:80]}"
        if place_of(entry[0], places) is None:
            return f"a file named {entry[0][:80]!r}, which no place here takes"
        sizes += entry[1]
    if sizes != len(arrays.get(FILES, ())):
        return f"files of {sizes} bytes in all, with {len(arrays.get(FILES, ()))} bytes attached"
    names = {entry[0] for entry in files}
    for event in events:
        if not (isinstance(event, dict) and isinstance(event.get("member"), int) and event["member"] >= 0
                and event.get("kind") in kinds and isinstance(event.get("files"), dict)):
            return f"a message {str(event)[:80]}"
        if not set(event["files"].values()) <= names:
            return f"a message naming files it does not carry: {sorted(event['files'].values())}"
    return None


def _schema(places: tuple[Place, ...], kinds: tuple[str, ...]) -> Schema:
    return Schema({FILES: Field("uint8")}, rule=partial(check_parcel, places=places, kinds=kinds))


# ------------------------------------------------------------------------ rank 0

class RemoteMembers:
    """Rank 0's side: the members that run on the other ranks, seen as supervisor messages.

    ``kinds`` are the message kinds their workers may send; ``places`` say where received files go
    under ``base`` (the run directory).
    """

    def __init__(self, run, fingerprint: dict, per_rank: int, places: tuple[Place, ...], kinds: tuple[str, ...],
                 base: Path):
        self.run, self.per_rank, self.places, self.base = run, per_rank, places, Path(base)
        self.hub = Hub(run.dist, _schema(places, kinds), run.log)
        self.hub.refuse_mismatched(fingerprint)
        self.hub.start()
        self.outgoing: dict[int, Parcel] = {}
        self.lost_seen = 0
        self.closed = False

    def rank_of(self, member: int) -> int:
        return member // self.per_rank

    def members_of(self, rank: int) -> range:
        return range(rank * self.per_rank, (rank + 1) * self.per_rank)

    @property
    def ranks(self) -> list[int]:
        return sorted(self.hub.peers)

    # -- towards the members
    def hand_over(self, rank: int, files: list[Path]) -> None:
        """The first message ``rank`` gets, whose files it needs before it starts its workers (on
        resume: its members' newest checkpoints)."""
        parcel = Parcel()
        for path in files:
            parcel.attach(path)
        info, arrays = parcel.wire()
        self.hub.send_to(rank, {**info, "start": True}, arrays)

    def send(self, member: int, kind: str, payload: Any = None, files: dict[str, Path] | None = None) -> None:
        """A command for one remote member (with the files it names); it leaves at the next :meth:`poll`."""
        self.outgoing.setdefault(self.rank_of(member), Parcel()).add(member, kind, payload, files)

    def stop_members(self, payload: Any, grace_s: float) -> None:
        """Every rank sends its workers ``("stop", payload)`` and kills those not done after ``grace_s``."""
        self.hub.publish(control={"stop_members": {"payload": plain(payload), "grace_s": grace_s}})

    # -- from the members
    def poll(self, timeout: float = 0.0) -> list[Message]:
        """Send what :meth:`send` queued; return what arrived: the members' messages, their files
        already written here, and a ``lost`` message for every member of a rank lost since."""
        for rank, parcel in self.outgoing.items():
            self.hub.send_to(rank, *parcel.wire())
        self.outgoing = {}
        messages = []
        for message in self.hub.drain(timeout):
            if "signal" in message.info:
                interrupt_from_peer(self.run, message.rank, int(message.info["signal"]))
            messages += self._receive(message.rank, message.info, message.arrays)
        for event in self.hub.lost_since(self.lost_seen):
            self.lost_seen += 1
            messages += [Message(m, "lost", f"rank {event['rank']} lost: {event['reason']}")
                         for m in self.members_of(event["rank"])]
        return messages

    def _receive(self, rank: int, info: dict, arrays: dict[str, np.ndarray]) -> list[Message]:
        parcel = Parcel.unwire(info, arrays)
        strangers = sorted(parcel.members(self.places) - set(self.members_of(rank)))
        if strangers:
            self.hub.refuse(rank, f"messages or files of member(s) {strangers}, which run elsewhere")
            return []
        return parcel.deliver(self.base, self.places)

    # -- the end
    def close(self, stop: dict) -> None:
        """The last reply of every rank: ``stop`` ({"reason", "exit_code"}); safe to call twice."""
        if not self.closed:
            self.closed = True
            self.hub.close(stop)

    def summary(self) -> dict:
        return self.hub.summary()


# ------------------------------------------------------------------------ ranks 1 .. N-1

class MemberForwarder:
    """A rank other than 0: forwards its workers' messages to rank 0 and hands them its answers.

    ``base`` is this node's scratch directory (the workers' ``checkpoints/`` and ``logs/``), where
    the files rank 0 sends land too.
    """

    def __init__(self, run, fingerprint: dict, per_rank: int, places: tuple[Place, ...], kinds: tuple[str, ...],
                 base: Path):
        self.run, self.places, self.kinds, self.base = run, places, kinds, Path(base)
        self.first = run.dist.rank * per_rank
        self.spoke = Spoke(run.dist)
        self.spoke.refuse_mismatched(fingerprint)
        self.stopped = False  # rank 0 has ended the run

    def receive_start(self) -> bool:
        """Wait for rank 0's first message and write its files here; False if rank 0 ended the run first."""
        while True:
            reply = self._exchange(Parcel())
            if reply.message is not None and reply.message.get("start"):
                self._unpack(reply)
                return True
            if self.stopped:
                return False
            time.sleep(POLL_S)

    def serve(self, supervisor, files_of, observe=None) -> None:
        """Until rank 0 ends the run: forward the workers' messages (with ``files_of(member, kind,
        payload)``, the files each names), deliver rank 0's commands, stop the workers when told.
        ``observe(member, kind, payload)`` sees every message first (this rank's own counters)."""
        stop_by, more = None, 0
        while not self.stopped:
            parcel = Parcel()
            messages = supervisor.poll(0.0 if more else POLL_S)
            if stop_by is not None and supervisor.live() and time.monotonic() >= stop_by:
                messages += supervisor.stop(0.0)  # rank 0's grace is over: kill what is left
            for message in messages:
                member = self.first + message.index
                if observe is not None:
                    observe(member, message.kind, message.payload)
                parcel.add(member, message.kind, message.payload, files_of(member, message.kind, message.payload))
            reply = self._exchange(parcel)
            more = reply.more
            for command in self._unpack(reply):
                supervisor.send(command.index - self.first, command.kind, command.payload)
            order = reply.control.get("stop_members")
            if order is not None and stop_by is None:
                supervisor.broadcast("stop", order["payload"])
                supervisor.request_stop()
                stop_by = time.monotonic() + float(order["grace_s"])

    def _exchange(self, parcel: Parcel):
        info, arrays = parcel.wire()
        if self.run.graceful.requested:  # rank 0 stops every rank; we go on until it says so
            info["signal"] = self.run.graceful.signum
        reply = self.spoke.exchange(info, arrays)
        if reply.stop is not None:
            self.stopped = True
            follow_stop(self.run, reply.stop)
            if int(reply.stop.get("exit_code", 0)) == 1:
                raise WorkerFailed(f"rank 0 ended the run: {reply.stop.get('reason')}")
        return reply

    def _unpack(self, reply) -> list[Message]:
        if reply.message is None:
            return []
        why = check_parcel(reply.message, reply.message_arrays, self.places, self.kinds)
        if why is not None:
            raise PeerFailure(f"rank {self.run.dist.rank}: rank 0 sent a message that does not fit: {why}")
        return Parcel.unwire(reply.message, reply.message_arrays).deliver(self.base, self.places)


SCRATCH_PREFIX = "prl-population-rank"  # a node's scratch directory: <tmp>/prl-population-rank<rank>-<pid>-<random>


def make_scratch(rank: int) -> Path:
    """A new scratch directory for the node of ``rank``, named with this process's pid. A node removes its own at
    the end, but one killed with kill -9 cannot: the next node to start on the machine removes every scratch
    directory whose process is gone (:func:`reclaim_stale_scratch`), as a run reclaims dead runs' shared memory."""
    reclaim_stale_scratch()
    return Path(tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{rank}-{os.getpid()}-"))


def reclaim_stale_scratch(base: Path | None = None) -> list[Path]:
    """Remove the scratch directories under ``base`` (the temporary directory) whose node process no longer exists."""
    removed = []
    for path in Path(base or tempfile.gettempdir()).glob(f"{SCRATCH_PREFIX}*"):
        match = re.fullmatch(rf"{SCRATCH_PREFIX}\d+-(\d+)-\w+", path.name)
        if match and path.is_dir() and process_gone(int(match.group(1))):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


class PopulationNode:
    """A rank other than 0 under torchrun: this node's members, coordinated by rank 0.

    It runs one worker per member here as the coordinator does (over this node's own shared copy of
    the market data), but decides nothing: every report goes to rank 0 with the checkpoints it names,
    and rank 0's answers (PBT, the stop) go to the workers. Their files live in a scratch directory of
    this node, removed at the end: rank 0 holds copies.
    """

    def __init__(self, run, members: Members):
        self.run, self.members, cfg = run, members, run.cfg
        self.first = run.dist.rank * cfg.num_workers
        run.counters.update(global_step=0, episodes=0, updates=0)  # this node's own, for its last log lines
        self.scratch = make_scratch(run.dist.rank)
        run.defer(shutil.rmtree, self.scratch, True)
        for sub in ("checkpoints", "logs"):
            (self.scratch / sub).mkdir()
        self.relay = MemberForwarder(run, members.fingerprint(run), cfg.num_workers, FILE_PLACES, COMMANDS,
                                     self.scratch)
        run.log.info("workers %d to %d of the population run here (local worker i is worker %d + i); their files "
                     "go to rank 0 as they report them, from %s", self.first, self.first + cfg.num_workers - 1,
                     self.first, self.scratch)
        self.supervisor = None
        if self.relay.receive_start():  # on resume, it brings our members' newest checkpoints
            self.supervisor = members.supervisor(run, self.args_for, name="local worker")
            self.supervisor.start()

    def args_for(self, index: int) -> tuple:
        member = self.first + index
        latest = latest_checkpoint(self.scratch / "checkpoints", member_checkpoints(member))
        return self.members.setup(member, self.members.hyper[member], self.scratch, latest)

    def train(self) -> None:
        if self.supervisor is not None:
            self.relay.serve(self.supervisor, self.files_of, self.count)

    def files_of(self, member: int, kind: str, payload: Any) -> dict[str, Path]:
        """What rank 0 must hold with this report: the checkpoint it names and, once the worker is
        through (done, diverged, given up), its log."""
        files = {key: Path(payload[key]) for key in ("checkpoint", "path")
                 if isinstance(payload, dict) and payload.get(key)}
        if kind in ("done", "diverged", "given_up"):
            files["log"] = self.scratch / "logs" / f"worker_{member}.log"
        return files

    def count(self, member: int, kind: str, payload: Any) -> None:
        if kind == "update":
            self.run.budget.mark_first_step(payload["started"])
            self.run.counters["global_step"] += payload["steps"]
            self.run.counters["updates"] += 1
            self.run.record_episodes(payload["episodes"])

    def state_dict(self) -> None:
        return None  # rank 0 saves the population
