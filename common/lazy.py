"""Deferred imports, so ``--help`` and ``--validate-only`` answer before torch has loaded.

Importing torch takes about two seconds on a small machine, longer than everything else a
script does before its first environment step. ``torch = lazy_import("torch")`` binds the
name at once; the first attribute used (``torch.zeros``) imports the module, normally, and
every later use goes straight to it. The stand-in is a plain object, not an entry of
``sys.modules``: other code importing the module (``import torch.distributed``) gets the real
one, loaded once. (``importlib.util.LazyLoader`` puts a half-loaded module there instead, and
``import torch.distributed`` then executes torch's C extension twice.)

A script using it must not touch the module at import time: no ``@torch.inference_mode()``
decorators and no ``nn.Module`` base classes at module level.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any


class _Deferred:
    def __init__(self, name: str):
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_module", None)

    def _load(self) -> ModuleType:
        module = object.__getattribute__(self, "_module")
        if module is None:
            module = importlib.import_module(object.__getattribute__(self, "_name"))
            object.__setattr__(self, "_module", module)
        return module

    def __getattr__(self, attribute: str) -> Any:
        return getattr(self._load(), attribute)

    def __repr__(self) -> str:
        return f"<deferred module {object.__getattribute__(self, '_name')!r}>"


def lazy_import(name: str) -> Any:
    """A stand-in for module ``name`` that imports it on first attribute access."""
    return _Deferred(name)
