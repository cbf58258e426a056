"""The four training scripts, by name, and their declarations of what their mode is (their ``MODE``, a
:class:`common.run.Mode`), for the tools that read them rather than keep copies: the launcher's plans and
``common.evaluate``.

A script imports no torch at module level (its ``--help`` answers before torch has loaded), so importing
one to read its ``MODE`` costs a fraction of a second.
"""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the scripts, and common.run, import numpy: the launcher reports it missing first
    from common.run import Mode

SCRIPTS = ("train_parallel_timed", "parallel_train_dqn", "ultra_parallel_train_dqn", "train_ppo_multiprocess")


def script_module(script: str) -> ModuleType:
    """The training script ``script`` (its file name, with or without ``.py``), imported."""
    match script.removesuffix(".py"):
        case "train_parallel_timed":
            import train_parallel_timed as module
        case "parallel_train_dqn":
            import parallel_train_dqn as module
        case "ultra_parallel_train_dqn":
            import ultra_parallel_train_dqn as module
        case "train_ppo_multiprocess":
            import train_ppo_multiprocess as module
        case _:
            raise KeyError(script)
    return module


def declared_modes() -> tuple[Mode, ...]:
    """The modes of the four training scripts."""
    return tuple(script_module(script).MODE for script in SCRIPTS)
