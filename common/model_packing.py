"""The learner's model as bytes a rollout worker rebuilds it from: :func:`pack_model`, :func:`unpack_model`.

The module is pickled once, by reference to its class (and to the classes of its submodules),
with every parameter left out (shape and dtype only) and its buffers copied to the CPU; a worker
unpickles a fresh copy with zero weights and loads the parameters from shared memory. A class or
function a worker could not import (defined in an interactive ``__main__`` or inside a function)
is refused here, in one line, rather than in every worker.
"""

from __future__ import annotations

import copy
import importlib.util
import io
import pickle
import sys
import types
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn


def _unknown_global(obj: Any, main_file: bool) -> str | None:
    """Why a worker could not import the class or function ``obj`` (pickled by reference), or None."""
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", "?")
    where = f"{module}.{qualname}"
    if "<locals>" in qualname or "<lambda>" in qualname:
        return f"{where} is defined inside a function (or is a lambda); a worker can import only module-level names"
    if module == "__main__":
        return None if main_file else (f"{where} is defined in an interactive __main__ (a notebook, the REPL, "
                                        f"python -c), which a worker cannot import; move it into a .py module")
    if module is None or module == "builtins":
        return None
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    return None if found else f"{where}: module {module!r} is not importable (no file a worker could import)"


def _rebuild_parameter(shape: tuple[int, ...], dtype: str, requires_grad: bool, is_parameter: bool) -> torch.Tensor:
    """A parameter's stand-in in a worker's copy of the model; the weights slot fills it before first use."""
    tensor = torch.zeros(shape, dtype=getattr(torch, dtype.removeprefix("torch.")))
    return nn.Parameter(tensor, requires_grad=requires_grad) if is_parameter else tensor


class _ModelPickler(pickle.Pickler):
    """Pickles a model by reference to its classes, its parameters left out (shape and dtype only) and
    its buffers copied to the CPU; notes every class or function a worker could not import."""

    def __init__(self, file, model: nn.Module):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.parameters = {id(p) for p in model.parameters()}
        self.buffers = {id(b) for b in model.buffers()}
        self.main_file = any(getattr(sys.modules.get("__main__"), attr, None) for attr in ("__file__", "__spec__"))
        self.problems: list[str] = []
        self._checked: set[int] = set()

    def reducer_override(self, obj: Any):
        if isinstance(obj, torch.Tensor):
            if id(obj) in self.parameters:
                return _rebuild_parameter, (tuple(obj.shape), str(obj.dtype), obj.requires_grad,
                                            isinstance(obj, nn.Parameter))
            if id(obj) in self.buffers and obj.device.type != "cpu":
                return copy.copy, (obj.detach().cpu(),)
        elif isinstance(obj, (type, types.FunctionType)) and id(obj) not in self._checked:
            self._checked.add(id(obj))
            problem = _unknown_global(obj, self.main_file)
            if problem:
                self.problems.append(problem)
        return NotImplemented


def _checked_pickle(obj: Any, model: nn.Module, what: str) -> bytes:
    buffer = io.BytesIO()
    pickler = _ModelPickler(buffer, model)
    try:
        pickler.dump(obj)
    except Exception as err:  # pickling runs the model's own code: any error means "cannot be sent"
        if not pickler.problems:
            pickler.problems.append(str(err).splitlines()[0] if str(err) else type(err).__name__)
    if pickler.problems:
        raise ValueError(f"{what} cannot be sent to a worker: {pickler.problems[0]}")
    return buffer.getvalue()


def pack_model(model: nn.Module, act_fn: Callable | None = None) -> bytes:
    """``(model, act_fn)`` as bytes a worker unpickles (:func:`unpack_model`), parameters left out.

    Raises a one-line ValueError if a worker could not rebuild them: a class or function defined
    in an interactive ``__main__`` or inside a function, or something that cannot be pickled."""
    if act_fn is not None:
        _checked_pickle(act_fn, model, f"act_fn: {getattr(act_fn, '__qualname__', type(act_fn).__name__)}")
    return _checked_pickle((model, act_fn), model, f"model: {type(model).__name__}")


def unpack_model(data: bytes | np.ndarray) -> tuple[nn.Module, Callable | None]:
    """The worker's side of :func:`pack_model`: a fresh copy of the model (zero weights) and the act_fn."""
    model, act_fn = pickle.loads(bytes(data))
    return model.eval(), act_fn


def parameter_shapes(model: nn.Module) -> list[tuple[int, ...]]:
    return [tuple(p.shape) for p in model.parameters()]
