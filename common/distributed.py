"""Multi-process / multi-node training under ``torchrun`` (``torch.distributed``), and its
single-process stand-in, behind one small interface.

A script calls :func:`from_environment`; when torchrun started it (``WORLD_SIZE`` and
friends are set) it gets a :class:`TorchDistributed` (gloo on CPU, NCCL on GPU),
otherwise a :class:`SingleProcess` whose methods do nothing. Every collective is
wrapped so a dead peer surfaces as :class:`PeerFailure` with a clear message rather
than a hang or a raw backend error.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

# torch is imported inside the functions that use it: scripts import this module for PeerFailure and
# launched_by_torchrun while answering --help, which must not wait for torch.

COLLECTIVE_TIMEOUT_S = float(os.environ.get("PRL_COLLECTIVE_TIMEOUT_S", "120"))


class PeerFailure(RuntimeError):
    """Another rank died or stopped answering."""


class PeerRefused(RuntimeError):
    """This rank does not match rank 0 (other code, env or settings) and was turned away (exit 2)."""


class SingleProcess:
    rank, world_size, local_rank, is_main = 0, 1, 0, True
    allreduce_seconds, allreduce_bytes = 0.0, 0

    def gradient_hook(self, model: torch.nn.Module) -> None:
        return None  # nothing to average

    def total(self, values: np.ndarray) -> np.ndarray:
        return values

    def agree_on_path(self, path: Path) -> Path:
        return path

    def broadcast_object(self, obj: Any) -> Any:
        return obj

    def broadcast_model(self, model: torch.nn.Module) -> None:
        pass

    def gather_progress(self, steps: int, episodes: list[dict],
                        params_hash: str = "") -> tuple[int, list[dict], list[str]]:
        return steps, episodes, [params_hash]

    def agree_on_stop(self, reason: str | None) -> str | None:
        return reason

    def any_rank(self, flag: bool) -> bool:
        return flag

    def highest(self, value: int) -> int:
        return value

    def close(self, abort: bool = False) -> None:
        pass


def _store_of_this_attempt(dist, timeout: timedelta):
    """The rendezvous store under a prefix of its own for a restarted attempt of a one-node job, else None.

    By default torchrun's agent keeps one TCP store for the ranks across restarts, and the previous
    attempt's keys are still in it: a restarted rank can read a killed rank's address from them and fail
    with ``Gloo connectFullMesh ... Connection refused`` (pytorch/pytorch#135712). On one node a single
    agent numbers every attempt (``TORCHELASTIC_RESTART_COUNT``), so each attempt gets fresh keys. Across
    nodes the agents count restarts each for itself, so no prefix is agreed: there
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (set by ``python -m common.torchrun`` and the launcher's
    commands) gives every attempt a new store instead.
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if (attempt in ("", "0") or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
            or os.environ.get("GROUP_WORLD_SIZE", "1") != "1"):
        return None
    store, _, _ = next(dist.rendezvous("env://", timeout=timeout))
    return dist.PrefixStore(f"prl_attempt_{attempt}", store)


class TorchDistributed:
    """One rank of a torchrun job. Rank 0 decides (paths, when to stop); gradients are averaged."""

    def __init__(self, device: str):
        import torch
        import torch.distributed as dist

        self.dist = dist
        self.rank = int(os.environ["RANK"])
        self.world_size = int(os.environ["WORLD_SIZE"])
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.is_main = self.rank == 0
        use_cuda = device != "cpu" and torch.cuda.is_available()
        if use_cuda:
            torch.cuda.set_device(self.local_rank % torch.cuda.device_count())
        # NCCL refuses two ranks on one GPU ("Duplicate GPU detected"); ranks that share GPUs keep their
        # learners there and reduce over gloo, which copies through host memory.
        shares_gpus = use_cuda and int(os.environ.get("LOCAL_WORLD_SIZE", "1")) > torch.cuda.device_count()
        backend = "nccl" if use_cuda and not shares_gpus else "gloo"
        timeout = timedelta(seconds=COLLECTIVE_TIMEOUT_S)
        store = _store_of_this_attempt(dist, timeout)
        if store is None:
            dist.init_process_group(backend, timeout=timeout)
        else:
            dist.init_process_group(backend, store=store, rank=self.rank, world_size=self.world_size, timeout=timeout)
        self.backend = backend
        # NCCL reduces only tensors on this rank's own GPU: the learner lives there, and so does
        # every tensor a collective here reduces (gloo reduces CPU tensors).
        self.device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
        self.allreduce_seconds = 0.0  # time spent in gradient all-reduces (read and reset by the script)
        self.allreduce_bytes = 0
        self.lost_peers: set[int] = set()  # ranks known dead: no barrier waits for them at the end
        # The actor-learner modes (common.rank_exchange) end without a barrier: a peer may be gone.
        self.barrier_at_close = True
        self._p2p_group = None

    @property
    def p2p_group(self):
        """The group for point-to-point messages of CPU tensors (common.rank_exchange): gloo, a group of
        its own when the default one is NCCL."""
        if self.backend == "gloo":
            return None
        if self._p2p_group is None:
            self._p2p_group = self.dist.new_group(backend="gloo", timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        return self._p2p_group

    def peer_lost(self, rank: int) -> None:
        self.lost_peers.add(rank)

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order, on every rank."""
        gathered: list[Any] = [None] * self.world_size
        self._call("object gather", self.dist.all_gather_object, gathered, obj)
        return gathered

    def _call(self, what: str, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (RuntimeError, ConnectionError, OSError) as err:
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise PeerFailure(f"rank {self.rank}: {what} failed, another rank has probably died ({first[:160]})") \
                from None

    def broadcast_object(self, obj: Any) -> Any:
        box = [obj]
        self._call("broadcast", self.dist.broadcast_object_list, box, src=0)
        return box[0]

    def agree_on_path(self, path: Path) -> Path:
        return Path(self.broadcast_object(str(path)))

    def broadcast_model(self, model: torch.nn.Module) -> None:
        for tensor in model.state_dict().values():
            self._call("parameter broadcast", self.dist.broadcast, tensor, src=0)

    def total(self, values: np.ndarray) -> np.ndarray:
        """The sum of ``values`` over all ranks (e.g. the moments of the normalization statistics)."""
        import torch

        tensor = torch.as_tensor(np.asarray(values, dtype=np.float64), device=self.device)
        self._call("statistics all-reduce", self.dist.all_reduce, tensor)
        return tensor.cpu().numpy()

    def gradient_hook(self, model: torch.nn.Module):
        """A callable for ``ppo_update(after_backward=...)``: one flat all-reduce of every gradient."""
        import torch

        params = [p for p in model.parameters() if p.requires_grad]

        def hook() -> None:
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            flat = torch.cat([g.reshape(-1) for g in grads])
            started = time.perf_counter()
            self._call("gradient all-reduce", self.dist.all_reduce, flat)
            self.allreduce_seconds += time.perf_counter() - started
            self.allreduce_bytes += flat.numel() * flat.element_size()
            flat /= self.world_size
            offset = 0
            for p, g in zip(params, grads):
                count = g.numel()
                p.grad = flat[offset:offset + count].view_as(p).clone()
                offset += count

        return hook

    def gather_progress(self, steps: int, episodes: list[dict],
                        params_hash: str = "") -> tuple[int, list[dict], list[str]]:
        """Sum of env steps and all finished episodes over ranks, and every rank's parameter
        hash in rank order (they must all be equal after identical averaged updates)."""
        gathered: list[Any] = [None] * self.world_size
        self._call("progress gather", self.dist.all_gather_object, gathered, (steps, episodes, params_hash))
        return sum(s for s, _, _ in gathered), [e for _, eps, _ in gathered for e in eps], [h for _, _, h in gathered]

    def agree_on_stop(self, reason: str | None) -> str | None:
        """Rank 0's decision (deadline, target reached) holds for every rank."""
        return self.broadcast_object(reason)

    def any_rank(self, flag: bool) -> bool:
        """True on every rank if it is true on any (a signal that reached only some ranks)."""
        import torch

        tensor = torch.tensor([1.0 if flag else 0.0], device=self.device)
        self._call("flag all-reduce", self.dist.all_reduce, tensor, op=self.dist.ReduceOp.MAX)
        return bool(tensor.item() > 0)

    def highest(self, value: int) -> int:
        """The largest of every rank's ``value`` (a signal number, 0 for none), on every rank."""
        import torch

        tensor = torch.tensor([float(value)], device=self.device)
        self._call("max all-reduce", self.dist.all_reduce, tensor, op=self.dist.ReduceOp.MAX)
        return int(tensor.item())

    def close(self, abort: bool = False) -> None:
        if not self.dist.is_initialized():
            return
        if abort or self.lost_peers or not self.barrier_at_close:
            # A peer is gone: a barrier would wait for it until the timeout.
            self.dist.destroy_process_group()
            return
        try:
            self.dist.barrier()
        except RuntimeError:
            pass
        self.dist.destroy_process_group()


def launched_by_torchrun() -> bool:
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ and "MASTER_ADDR" in os.environ


def from_environment(device: str = "cpu") -> SingleProcess | TorchDistributed:
    if launched_by_torchrun() and int(os.environ["WORLD_SIZE"]) > 1:
        return TorchDistributed(device)
    return SingleProcess()


class StartRefused(RuntimeError):
    """A rank cannot start the run (its configuration, rank 0's run directory): every rank ends with that
    rank's exit status (2, or 3 for a locked run directory) and one line, instead of waiting for it."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


def start_together(dist: SingleProcess | TorchDistributed, restarted: bool) -> bool:
    """Every rank's first collective: whether any rank was restarted by torchrun; StartRefused if a rank
    sent the line of a configuration it refused instead (:func:`refuse_start`)."""
    if dist.world_size == 1:
        return False
    starts = dist.gather_objects(restarted)
    refusals = [f"rank {rank} cannot start: {start}" for rank, start in enumerate(starts) if isinstance(start, str)]
    if refusals:
        dist.close(abort=True)
        raise StartRefused("; ".join(refusals), 2)
    return any(starts)


def refuse_start(reason: str, device: str) -> None:
    """Under torchrun, a rank whose configuration is refused (it has said so in its own line) still meets
    the others once, at their first collective (:func:`start_together`), and hands them ``reason``: every
    rank then exits 2 at once, where they would wait PRL_COLLECTIVE_TIMEOUT_S for it and fail. ``device``
    picks the backend the other ranks use (gloo for a CPU learner or CPU-only exchanges)."""
    if not launched_by_torchrun() or int(os.environ["WORLD_SIZE"]) == 1:
        return
    import torch.distributed

    if torch.distributed.is_initialized():
        return  # it has met them already: they hear of it from rank_0_opened or at their next message
    try:
        dist = TorchDistributed(device)
        dist.gather_objects(reason)
        dist.close(abort=True)
    except (RuntimeError, ValueError, OSError):  # the others are gone: nobody to tell
        pass


def rank_0_opened(dist: SingleProcess | TorchDistributed, refused: BaseException | None = None) -> None:
    """Rank 0 tells every rank whether it could open the run directory: ``refused`` is why not (a
    ConfigError, exit 2: it holds another run's checkpoints; a SystemExit 3: another run holds its lock).
    The other ranks then raise StartRefused with that status, where they would fail at their first message
    to rank 0; rank 0 goes on to raise ``refused``."""
    if dist.world_size == 1:
        return
    status, reason = None, ""
    if isinstance(refused, SystemExit):
        status, reason = refused.code, "another run holds the lock on its run directory"
    elif refused is not None:
        status, reason = 2, str(refused)
    status, reason = dist.broadcast_object((status, reason))
    if status is not None:
        # Every rank leaves its process group before it exits: a group still up at exit can end the process
        # in std::terminate (exit -6, a failure to torchrun) instead of the status it exits with.
        dist.close(abort=True)
        if not dist.is_main:
            raise StartRefused(f"rank 0 cannot start: {reason}", status)


def log_to_stderr(rank: int) -> None:
    """A rank other than 0 writes no file: its log lines go to stderr, tagged with its rank."""
    root = logging.getLogger("prl")
    root.setLevel(logging.INFO)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"%(asctime)s [rank {rank}] %(message)s", "%H:%M:%S"))
    root.handlers[:] = [handler]
    root.propagate = False


def params_digest(model: torch.nn.Module) -> str:
    """A short hash of every parameter's bytes: equal on all ranks iff they are bit-identical."""
    import hashlib

    digest = hashlib.sha1()
    for param in model.parameters():
        digest.update(param.detach().cpu().numpy().tobytes())
    return digest.hexdigest()[:16]
