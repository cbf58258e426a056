"""The modes the launcher offers, each over its training script's own declaration.

A training script says what it is once, in ``MODE = common.run.Mode(...)``: its config
dataclass(es) with the defaults a user edits, the actions it trains, the kwargs its envs are
made with, the bytes of its big buffers (which :mod:`.plan` sizes runs with). The launcher reads
that declaration and adds only what is its own (:class:`LaunchMode`): the name a user picks the
mode by, a line about it, and the script's flags it translates its budgets into.

The scripts are imported on first use, when a plan is made: they import numpy and gymnasium
(never torch), which the dependency check must be able to report missing first.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from common import script_modes


@dataclass(frozen=True)
class LaunchMode:
    """What the launcher adds to a training script's declaration."""

    name: str  # what --mode takes
    script: str  # the file the launcher runs
    summary: str
    episodes_flag: str | None = "--total-episodes"  # the script's episode budget (None: translated into steps)
    envs_flag: str | None = "--num-envs-per-worker"  # what --tune varies besides the workers (None: nothing)
    workers_flag: str = "--num-workers"
    duration_flag: str = "--duration"

    @property
    def defaults(self) -> Any:
        """The script's config with every field at its default (imports the script on first use)."""
        return script_defaults(self.name)

    @property
    def default_env(self) -> str:
        return self.defaults.env_id


MODES = {mode.name: mode for mode in (
    LaunchMode("timed", "train_parallel_timed.py", "synchronous parallel PPO on a wall-clock budget"),
    LaunchMode("dqn", "parallel_train_dqn.py", "central DQN learner fed by rollout processes, self-play",
               envs_flag=None),
    LaunchMode("ultra", "ultra_parallel_train_dqn.py",
               "asynchronous actors -> shared-memory replay -> one learner (GPU where there is one)"),
    LaunchMode("ppo-multiprocess", "train_ppo_multiprocess.py",
               "population of independent PPO agents over a shared data cache", episodes_flag=None),
)}


def script_module(name: str) -> ModuleType:
    """The training script of mode ``name``, imported."""
    return script_modes.script_module(MODES[name].script)


@functools.cache
def script_defaults(name: str) -> Any:
    """The script's config as its dataclass(es) declare it, every field at its default and unvalidated
    (validation asks the machine; the plans only read the values). Shared: do not change it."""
    config = script_module(name).MODE.config
    if isinstance(config, dict):  # one dataclass per group (train_ppo_multiprocess.py)
        from common.run import FlatConfig

        return FlatConfig({group: cls() for group, cls in config.items()})
    return config()


def default_buffer(name: str) -> int:
    """The replay capacity a DQN script allocates when ``buffer_size`` is left unset (and RAM holds it)."""
    return script_defaults(name).buffer_size or script_module(name).DEFAULT_BUFFER


@functools.cache
def default_env(name: str) -> Any:
    """The script's default env as the script probes it (``common.run.EnvInfo``: its spaces, whether it
    masks actions), made with the env kwargs of the default config. ConfigError, one line, where it
    cannot be made here (an extra such as Box2D missing)."""
    from common import run

    mode, cfg = script_module(name).MODE, script_defaults(name)
    return run.probe_env(cfg.env_id, run.env_kwargs_of(mode, cfg), mode.actions, cfg.seed)
