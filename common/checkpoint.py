"""Atomic checkpoint writes, safe loads, and finding a run's checkpoints.

A checkpoint is a dict of ``state_dict``s and plain Python values. It is written to a
temporary file in the same directory and ``os.replace``d into place, so a kill at any
moment leaves either the old file or the new one, never a torn one. Loading uses
``weights_only=True``: a checkpoint can never execute code.
"""

from __future__ import annotations

import os
import random
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from common import torch_file

if TYPE_CHECKING:
    import torch

# torch is imported inside the functions that need it: finding a run's checkpoints needs none, and a script
# looks for them before it starts its workers, which then start while it imports torch.


class CheckpointError(ValueError):
    """The file is missing, unreadable or not a checkpoint of this project."""


def save_checkpoint(state: dict[str, Any], path: str | Path) -> Path:
    """Write ``state`` with ``torch.save``; its numpy arrays (a numpy learner's parameters) are stored as
    tensors, the only arrays a ``weights_only`` load accepts. A process that has not imported torch writes
    the same file without it (common/torch_file.py), so a run that never needed torch does not import it
    for its checkpoints."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            if "torch" in sys.modules:
                import torch

                torch.save(torch_file.plain(state, _tensor), f)
            else:
                torch_file.write(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def _tensor(array: np.ndarray):
    import torch

    return torch.from_numpy(array if array.flags.c_contiguous else array.copy(order="C"))


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu",
                    required: tuple[str, ...] = ("model",)) -> dict[str, Any]:
    """Load a checkpoint or raise CheckpointError with a one-line reason."""
    import torch

    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint file")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as err:  # torch raises many types for a non-checkpoint file
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(f"{path}: not a readable checkpoint ({reason[:120]})") from None
    if not isinstance(state, dict) or any(key not in state for key in required):
        raise CheckpointError(f"{path}: not a checkpoint of this project (missing {', '.join(required)})")
    return state


def latest_checkpoint(directory: str | Path, pattern: str = r".*\.pt") -> Path | None:
    """The checkpoint in ``directory`` matching ``pattern`` that was written last (by mtime).

    The time, not the step in the name, decides: many names carry no step (``latest.pt``,
    ``population.pt``, ``worker_3_final.pt``), and a run resumed from an older checkpoint leaves
    files of higher steps from the timeline it abandoned. Files of the same mtime (a coarse
    filesystem clock) go to a ``final`` or ``latest`` one, then to the higher number in the name.
    """
    directory = Path(directory)
    if not directory.is_dir():
        return None
    found = [p for p in directory.iterdir() if p.is_file() and re.fullmatch(pattern, p.name)]
    if not found:
        return None

    def order(p: Path):
        numbers = re.findall(r"\d+", p.stem)
        final = "final" in p.stem or "latest" in p.stem
        return (p.stat().st_mtime, final, int(numbers[-1]) if numbers else -1)

    return max(found, key=order)


def find_checkpoint(path: str | Path, pattern: str = r".*\.pt") -> Path | None:
    """The checkpoint a user's path names: the file itself, or in a run directory the latest of its
    ``checkpoints/`` matching ``pattern`` (:func:`latest_checkpoint`); None for a directory without one.

    Raises FileNotFoundError for a path that is neither a file nor a directory. ``--resume`` and
    ``common.evaluate`` both find what they load here, and word the refusal their own way.
    """
    path = Path(path)
    if path.is_file():
        return path
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such file or directory")
    return latest_checkpoint(path / "checkpoints", pattern)


def rng_state() -> dict[str, Any]:
    """Python, numpy-legacy and (once this process has imported torch) torch RNG states, in a form
    ``weights_only`` can load. A process that never imported torch has not drawn from its generators."""
    np_state = np.random.get_state()
    state = {"python": random.getstate(), "numpy": (np_state[0], np_state[1].astype(np.int64), *np_state[2:])}
    if "torch" in sys.modules:
        import torch

        state["torch"] = torch.get_rng_state()
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    python_state = state["python"]
    random.setstate((python_state[0], tuple(python_state[1]), python_state[2]))
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, np.asarray(keys).astype(np.uint32), *rest))
    if "torch" in state:  # saved by a process that had imported torch (and "cuda" only then)
        import torch

        torch.set_rng_state(state["torch"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])
