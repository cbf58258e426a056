"""What a run is checked against before anything is written: its config, its env and the
checkpoint it continues.

:class:`RunConfig` holds the settings every script shares (a script's ``Config`` derives from
it), :class:`FlatConfig` one object over a grouped script's config dataclasses; :func:`probe_env`
makes one env and refuses, as a :class:`~common.config.ConfigError`, an id the mode cannot
train; :func:`load_resume` finds the checkpoint a ``--resume`` value names and refuses one of
another script, env or network width. :mod:`common.run` turns every refusal into one line and
exit status 2.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.config import ConfigError, require, require_env_id, require_positive, to_dict


@dataclass
class RunConfig:
    """Settings every script shares; each script's ``Config`` derives from this class."""

    output_dir: str | None = None  # run directory (default runs/<script>/<env>__<seed>__<time>)
    resume: str | None = None  # continue a run: a checkpoint file, a run directory, or auto (the newest here)
    checkpoint_interval_s: float = 60.0  # seconds between checkpoints (one more at the end)
    log_interval_s: float = 10.0  # seconds between progress lines when stderr is not a terminal
    tensorboard: bool = True  # also write TensorBoard events to tb/
    max_worker_restarts: int | None = 3  # restarts per worker before the run gives up (exit 1); None = no limit
    worker_timeout_s: float = 120.0  # a worker not started, or silent, this long is killed and restarted
    env_kwargs: list[str] = field(default_factory=list)  # KEY=VALUE keyword arguments for gymnasium.make
    track: str | None = None  # also log the run to mlflow or wandb (pip install -r requirements-tracking.txt)

    MIN_WORKERS = 1  # the fewest worker processes the mode can run with (0: in-process)

    def validate(self) -> None:
        """Checks of the shared fields; a script's ``validate`` calls this first."""
        if hasattr(self, "env_id"):
            require_env_id(self.env_id)
        if hasattr(self, "num_workers"):
            require(self.num_workers >= self.MIN_WORKERS, "num_workers", self.num_workers,
                    f"must be >= {self.MIN_WORKERS}" + (" (0 = in the main process)" if self.MIN_WORKERS == 0 else ""))
        require_positive(self, *[name for name in ("num_envs_per_worker", "total_timesteps", "total_episodes",
                                                   "duration", "learning_rate", "batch_size")
                                 if hasattr(self, name)])
        require_positive(self, "checkpoint_interval_s", "log_interval_s", "worker_timeout_s")
        require(self.max_worker_restarts is None or self.max_worker_restarts >= 0, "max_worker_restarts",
                self.max_worker_restarts, "must be >= 0 or none")
        if hasattr(self, "gamma"):
            require(0 <= self.gamma <= 1, "gamma", self.gamma, "must be in [0, 1]")
        if hasattr(self, "hidden_sizes"):
            require(len(self.hidden_sizes) > 0 and all(h > 0 for h in self.hidden_sizes), "hidden_sizes",
                    self.hidden_sizes, "widths must be > 0")
        if hasattr(self, "target_return"):
            parse_target(self.target_return)
        if hasattr(self, "device"):
            from common.system import resolve_device

            resolve_device(self.device)
        parse_env_kwargs(self.env_kwargs)
        from common.tracking import TRACKERS

        require(self.track is None or self.track in TRACKERS, "track", self.track,
                f"must be {' or '.join(TRACKERS)} or none")


def parse_env_kwargs(pairs: list[str]) -> dict[str, Any]:
    """``["size=8", "view=global"]`` -> ``{"size": 8, "view": "global"}`` (values read as YAML scalars)."""
    import yaml

    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = str(pair).partition("=")
        if not sep or not key.strip().isidentifier():
            raise ConfigError("env_kwargs", pair, "must be KEY=VALUE with KEY a Python identifier")
        try:
            out[key.strip()] = yaml.safe_load(value)
        except yaml.YAMLError:
            out[key.strip()] = value
    return out


def parse_target(value: str | None) -> float | str | None:
    """``target_return``: a number, ``auto`` (the env's own reward_threshold) or none."""
    if value is None or str(value).lower() in ("none", "null", "off"):
        return None
    if str(value).lower() == "auto":
        return "auto"
    try:
        return float(value)
    except ValueError:
        raise ConfigError("target_return", value, "must be a number, auto (the env's own threshold) or none") \
            from None


class FlatConfig:
    """One object over a script's config groups (field names are unique across groups)."""

    def __init__(self, groups: dict[str, Any]):
        self.__dict__["_groups"] = groups

    def __getattr__(self, name: str) -> Any:
        for group in self._groups.values():
            if hasattr(group, name):
                return getattr(group, name)
        raise AttributeError(name)

    def __setattr__(self, name: str, value: Any) -> None:
        for group in self._groups.values():
            if hasattr(group, name):
                setattr(group, name, value)
                return
        raise AttributeError(name)


def config_dict(cfg: Any) -> dict[str, Any]:
    """A config as one flat dict (grouped configs merged), as checkpoints store it."""
    if isinstance(cfg, FlatConfig):
        return {k: v for group in cfg._groups.values() for k, v in to_dict(group).items()}
    return to_dict(cfg)



def config_groups(cfg: Any) -> Any:
    """What a config file holds: a grouped config's dict of dataclasses, or the one dataclass."""
    return cfg._groups if isinstance(cfg, FlatConfig) else cfg


@dataclass
class EnvInfo:
    """What one probe of the env told: its spaces and what the mode must know about it."""

    env_id: str
    observation_space: Any
    action_space: Any
    action_mask: bool = False  # info["action_mask"] marks legal actions
    two_player: bool = False  # a built-in game with a pluggable opponent
    reward_threshold: float | None = None  # the env's own "solved" return, if it has one
    extra: dict = field(default_factory=dict)


def probe_env(env_id: str, env_kwargs: dict | None = None, actions: tuple[str, ...] = ("Discrete", "Box"),
              seed: int = 0) -> EnvInfo:
    """Make and reset one env; refuse (ConfigError) an id that fails, spaces the mode cannot train, or an
    action mask that is not one bool per action."""
    import gymnasium as gym
    import numpy as np

    from common.envs import make_env

    try:
        env = make_env(env_id, seed, **(env_kwargs or {}))()
        _, info = env.reset(seed=seed)
    except Exception as err:  # missing extras (Box2D, ALE), bad env kwargs and broken ids all land here
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError("env_id", env_id, f"cannot create it ({reason[:160]})") from None
    obs_space, act_space = env.observation_space, env.action_space
    two_player = hasattr(env.unwrapped, "set_opponent")
    threshold = env.spec.reward_threshold if env.spec is not None else None
    env.close()
    kind = type(act_space).__name__
    if kind not in actions:
        raise ConfigError("env_id", env_id, f"its action space {act_space} is not {' or '.join(actions)}, "
                                            "which this mode needs")
    if not isinstance(obs_space, gym.spaces.Box):
        raise ConfigError("env_id", env_id, f"its observation space {obs_space} is not a Box, which this mode needs")
    mask = info.get("action_mask")
    if mask is not None and (kind != "Discrete" or np.shape(mask) != (int(act_space.n),)):
        need = f"({int(act_space.n)},), one bool per action" if kind == "Discrete" else "a Discrete action space"
        raise ConfigError("env_id", env_id, f"its info['action_mask'] has shape {np.shape(mask)}; its action space "
                                            f"{act_space} needs {need}")
    return EnvInfo(env_id, obs_space, act_space, mask is not None, two_player, threshold)


# ------------------------------------------------------------------------ resume

def checkpoint_run_dir(path: Path) -> Path:
    """The run directory a checkpoint file belongs to (``<run>/checkpoints/x.pt`` or ``<run>/x.pt``)."""
    return path.parent.parent if path.parent.name == "checkpoints" else path.parent


def resume_checkpoint(resume: str, output_dir: str | None, script: str, env_id: str, seed: int,
                      pattern: str) -> Path | None:
    """The file a ``--resume`` value names; None for ``auto`` with nothing to continue (a fresh start).

    ``auto``: the newest checkpoint in ``output_dir`` or, without one, in the newest
    ``runs/<script>/<env>__<seed>__*`` directory that has one. A file or a run directory: as
    :func:`common.checkpoint.find_checkpoint` finds it.
    """
    from common.checkpoint import find_checkpoint, latest_checkpoint

    if resume == "auto":
        if output_dir:
            candidates = [Path(output_dir)]
        else:
            found = Path("runs", script).glob(f"{env_id.replace('/', '_')}__{seed}__*")
            candidates = sorted(found, key=os.path.getmtime, reverse=True)
        for run_dir in candidates:
            path = latest_checkpoint(run_dir / "checkpoints", pattern)
            if path is not None:
                return path
        return None
    try:
        path = find_checkpoint(resume, pattern)
    except FileNotFoundError:
        raise ConfigError("resume", resume, "no such checkpoint file or run directory") from None
    if path is None:
        raise ConfigError("resume", resume, "this run directory holds no checkpoint")
    return path


def load_resume(script: str, cfg: Any, pattern: str, required: tuple[str, ...],
                must_match: tuple[str, ...] = ()) -> tuple[Path | None, dict | None]:
    """Find and check the checkpoint to continue; ConfigError names what does not match (the env, the network
    widths, and the mode's own ``must_match`` settings)."""
    if cfg.resume is None:
        return None, None
    from common.checkpoint import CheckpointError, load_checkpoint

    path = resume_checkpoint(cfg.resume, cfg.output_dir, script, cfg.env_id, cfg.seed, pattern)
    if path is None:
        return None, None
    try:
        state = load_checkpoint(path, required=("script", "config", *required))
    except CheckpointError as err:
        raise ConfigError("resume", cfg.resume, str(err)) from None
    saved = state["config"]
    if state["script"] != script:
        raise ConfigError("resume", str(path), f"is a checkpoint of {state['script']}.py, not of {script}.py")
    for name in ("env_id", "hidden_sizes", *must_match):
        if hasattr(cfg, name) and name in saved and saved[name] != getattr(cfg, name):
            raise ConfigError("resume", str(path), f"was trained with {name} {saved[name]!r}, "
                                                   f"not {getattr(cfg, name)!r}")
    return path, state

