"""Write a checkpoint in ``torch.save``'s format from numpy arrays, without importing torch.

A run that learns in numpy (common/numpy_ppo.py) needs torch for nothing but its checkpoint file,
and importing torch costs 1.4 s of CPU on a 2-core machine: as much as the whole of a CartPole
run's training. This writes the file ``torch.save`` would write for the same state with every
array a CPU tensor, and ``torch.load(weights_only=True)`` reads it back as such (tests/test_common.py
compares the two, value for value): a zip archive, stored uncompressed, of the pickled object tree
(``data.pkl``, pickle protocol 2, each tensor a ``torch._utils._rebuild_tensor_v2`` call on a storage
named by a persistent id) and one record per storage (``data/<key>``, raw little-endian bytes,
64-byte aligned), with torch's version records.

What it writes: dicts, lists, tuples, strings, numbers, booleans, None and numpy arrays (as contiguous
tensors of the same dtype). numpy scalars are written as Python numbers.

It names private parts of pickle and torch (``pickle._Pickler``, ``torch._utils._rebuild_tensor_v2``,
torch's storage classes): requirements.txt admits torch from the version the tests ran it on, and
tests/test_torch_file.py fails on any torch whose ``weights_only`` loader stops reading these files
value for value.
"""

from __future__ import annotations

import collections
import io
import pickle
import zipfile
from collections.abc import Callable
from typing import Any

import numpy as np

ALIGNMENT = 64  # where every storage's bytes start in the file, as torch.save aligns them
STORAGE_TYPES = {np.dtype(np.float32): "FloatStorage", np.dtype(np.float64): "DoubleStorage",
                 np.dtype(np.float16): "HalfStorage", np.dtype(np.int64): "LongStorage",
                 np.dtype(np.int32): "IntStorage", np.dtype(np.int16): "ShortStorage",
                 np.dtype(np.int8): "CharStorage", np.dtype(np.uint8): "ByteStorage", np.dtype(np.bool_): "BoolStorage"}


class _Global:
    """A module attribute named, not imported: pickled as a reference to ``module.name``."""

    def __init__(self, module: str, name: str):
        self.module, self.name = module, name

    def __call__(self, *args):  # the pickler wants the function of a reduce to be callable; it is never called
        raise TypeError(f"{self.module}.{self.name} is only named here")


class _Storage:
    def __init__(self, key: str, array: np.ndarray):
        self.key, self.array = key, array


REBUILD_TENSOR = _Global("torch._utils", "_rebuild_tensor_v2")
STORAGE_GLOBALS = {dtype: _Global("torch", name) for dtype, name in STORAGE_TYPES.items()}


class _Pickler(pickle._Pickler):
    """The pure-Python pickler (it lets a subclass write a global by name) with numpy arrays as tensors."""

    dispatch = dict(pickle._Pickler.dispatch)

    def __init__(self, file):
        super().__init__(file, protocol=2)
        self.storages: list[_Storage] = []

    def save_torch_global(self, obj: _Global) -> None:
        self.write(pickle.GLOBAL + f"{obj.module}\n{obj.name}\n".encode())
        self.memoize(obj)

    dispatch[_Global] = save_torch_global

    def persistent_id(self, obj):
        if isinstance(obj, _Storage):
            return ("storage", STORAGE_GLOBALS[obj.array.dtype], obj.key, "cpu", obj.array.size)
        return None

    def reducer_override(self, obj):
        if isinstance(obj, np.ndarray):
            array = obj if obj.flags.c_contiguous else obj.copy(order="C")  # (ascontiguousarray makes 0-d 1-d)
            if array.dtype not in STORAGE_TYPES:
                raise TypeError(f"a checkpoint cannot hold a numpy array of {array.dtype}")
            storage = _Storage(str(len(self.storages)), array.astype(array.dtype.newbyteorder("<"), copy=False))
            self.storages.append(storage)
            strides = tuple(s // array.itemsize for s in array.strides) if array.size else (1,) * array.ndim
            return REBUILD_TENSOR, (storage, 0, array.shape, strides, False, collections.OrderedDict())
        return NotImplemented


def write(state: Any, file) -> None:
    """Write ``state`` to the binary file object ``file`` as ``torch.save(state, file)`` would, with every
    numpy array a CPU tensor."""
    data = io.BytesIO()
    pickler = _Pickler(data)
    pickler.dump(plain(state))
    records = [("data.pkl", data.getvalue()), (".format_version", b"1"),
               (".storage_alignment", str(ALIGNMENT).encode()), ("byteorder", b"little")]
    records += [(f"data/{s.key}", s.array.tobytes()) for s in pickler.storages]
    records += [("version", b"3\n")]
    with zipfile.ZipFile(file, "w", compression=zipfile.ZIP_STORED) as archive:
        for name, payload in records:
            info = zipfile.ZipInfo(f"archive/{name}", date_time=(1980, 1, 1, 0, 0, 0))  # (stored: the default)
            # Pad the local header's extra field (id "FB", as torch's writer does) so the payload is aligned.
            header = 30 + len(info.filename.encode())
            start = archive.fp.tell() + header + 4
            info.extra = b"FB" + ((-start) % ALIGNMENT).to_bytes(2, "little") + b"Z" * ((-start) % ALIGNMENT)
            archive.writestr(info, payload)


def plain(value: Any, array: Callable[[np.ndarray], Any] = lambda a: a) -> Any:
    """``value`` with numpy scalars as Python numbers (a weights_only load refuses numpy's own types) and
    every numpy array passed through ``array`` (``common.checkpoint`` makes them tensors for torch.save)."""
    if isinstance(value, np.ndarray):
        return array(value)
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return {key: plain(item, array) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(plain(item, array) for item in value)
    return value


def adam_param_group(group: dict, count: int) -> dict:
    """``group`` (its lr, betas, eps) as ``torch.optim.Adam(fused=True).state_dict()`` writes the parameter
    group of plain Adam over ``count`` parameters (by position): the one layout both of the project's Adams
    save (common/optim.py in torch, common/numpy_ppo.py in numpy), so that either loads the other's state."""
    return {**{k: v for k, v in group.items() if k != "params"}, "params": list(range(count)), "weight_decay": 0.0,
            "amsgrad": False, "maximize": False, "foreach": None, "capturable": False, "differentiable": False,
            "fused": True, "decoupled_weight_decay": False}


def load_adam_param_group(state_dict: dict, group: dict, count: int) -> list:
    """Take lr, betas and eps of a state saved in :func:`adam_param_group`'s layout into ``group``; returns the
    saved parameters' indices, in order. ValueError where it holds another number of parameters."""
    saved = state_dict["param_groups"][0]
    if len(saved["params"]) != count:
        raise ValueError(f"optimizer state for {len(saved['params'])} parameters, not {count}")
    group.update(lr=saved["lr"], betas=tuple(saved["betas"]), eps=saved["eps"])
    return saved["params"]
