"""A population member's side: what its process gets, runs, hears from the coordinator, and evaluates.

The training script defines the member's agent (its algorithm); :func:`member_process` is the
process around it, started and restarted by the coordinator (:mod:`common.population`) or, under
torchrun, by the node of its rank (:mod:`common.population_relay`).

The protocol between a member and the coordinator, over :mod:`common.supervisor`'s pipes:

- the member reports ``update`` after every update (with the checkpoint it saved, if any),
  ``pbt_ready`` at a PBT step (its score and a fresh checkpoint), ``pbt_copied`` once it copied a
  donor, ``diverged``, and ``done`` with its final result and evaluation;
- the coordinator answers ``pbt`` (naming the step it answers, and a donor or none) and sends
  ``stop`` once, with ``{"evaluate": bool, "report_by": time.time() deadline}``; :class:`Orders`
  reads both in the member's process.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from common.runlog import setup_logging
from common.supervisor import set_torch_threads

# The population's file names (the training script's MODE declares them for common.evaluate; the members, the
# coordinator and the relay write and match them from here): a member's checkpoints, {member} standing for its
# index in the whole population, and the best final agent the leaderboard copies into the run directory.
MEMBER_CHECKPOINTS = r"worker_{member}_(step_\d+|final)\.pt"
BEST_AGENT = "best.pt"


def member_checkpoint(member: int, step: int | None = None) -> str:
    """The file name of member ``member``'s checkpoint at ``step``, or of its final one (``step`` None)."""
    return f"worker_{member}_final.pt" if step is None else f"worker_{member}_step_{step}.pt"


def member_checkpoints(member: int | str = r"\d+") -> str:
    """The regex of member ``member``'s checkpoint names (any member's by default; a regex group fits too)."""
    return MEMBER_CHECKPOINTS.replace("{member}", str(member))


def split_kwargs(env_kwargs: dict[str, Any], split: str, data, item_indices) -> dict[str, Any]:
    """A process's env kwargs: Market-v0 attaches to the shared cache, on the train or the held-out windows."""
    return {**env_kwargs, "split": split, "data": data, "item_indices": item_indices} if data is not None \
        else env_kwargs


@dataclass
class MemberSetup:
    """What a member's process gets, small and picklable: the config, shared-memory specs, its device and seeds."""

    member: int  # the worker's number in the whole population (its local index plus its rank's first)
    config: dict[str, Any]  # flat
    env_kwargs: dict[str, Any]  # gymnasium.make kwargs, plain values
    run_dir: str  # where it writes checkpoints/ and logs/ (a rank > 0: its node's scratch directory)
    data_specs: dict | None  # the shared market cache (None for other envs)
    item_indices: list[int] | None
    device: str
    threads: int
    hyper: dict[str, float]
    target: float | None  # the worker is done once the mean of its last 100 returns reaches this
    checkpoint: str | None  # continue from this checkpoint of this worker (its newest)


def member_process(link, agent_class, setup: MemberSetup) -> None:
    """A member's process: one agent, from its newest checkpoint until its budget, its target or a stop.

    ``agent_class(link, setup, data, log)`` is the training script's agent: ``counters["global_step"]``
    and ``hyper`` as it starts, ``train()`` (False if it diverged) and ``finish()``."""
    from common.envs.market import attach_market_data

    set_torch_threads(setup.threads)
    log = setup_logging(Path(setup.run_dir) / "logs" / f"worker_{setup.member}.log", f"prl.worker{setup.member}")
    data, handles = attach_market_data(setup.data_specs) if setup.data_specs else (None, [])
    try:
        agent = agent_class(link, setup, data, log)
        link.ready(step=agent.counters["global_step"], hyper=agent.hyper)
        if agent.train():
            agent.finish()
    except Exception:
        log.exception("worker %d failed", setup.member)
        raise
    finally:
        for handle in handles:
            handle.close()


class Orders:
    """What the coordinator tells one member, read in the member's process from its supervisor link.

    The stop order may come at any time (with a PBT answer awaited, during the evaluation) and is kept;
    a PBT answer names the step it answers, so one that comes after the member stopped waiting for it
    is recognised as out of date and skipped.
    """

    def __init__(self, link, member: int, log):
        self.link, self.member, self.log = link, member, log
        self.stop_order: dict = {}  # the stop order: {"evaluate": bool, "report_by": time.time() deadline}

    @property
    def stopped(self) -> bool:
        return self.link.stop_requested

    @property
    def finishes(self) -> bool:
        """Whether the member ends with its final checkpoint and evaluation (not stopped, or stopped by the
        time budget), rather than a checkpoint to continue from."""
        return not self.link.stop_requested or bool(self.stop_order.get("evaluate"))

    def keep_stop(self, payload: Any) -> None:
        self.stop_order = self.stop_order or payload or {"evaluate": False}

    def read(self) -> None:
        """The commands that came during training: a stop is kept; a PBT answer here is late, and skipped."""
        for command, payload in self.link.commands():
            if command == "stop":
                self.keep_stop(payload)
            elif command != "pbt":
                raise ValueError(f"worker {self.member}: unknown command {command!r}")

    def pbt_answer(self, step: int, timeout: float) -> dict | None:
        """The coordinator's answer to this step's ``pbt_ready`` if it names a donor; None if it names none,
        if none came within ``timeout`` (the coordinator answers once every running worker waits: the slowest
        may be far behind), or if a stop came instead. An answer to an earlier step, which came after this
        worker had stopped waiting for it, is out of date and skipped."""
        deadline = time.monotonic() + timeout
        while (message := self.link.receive(timeout=max(0.0, deadline - time.monotonic()))) is not None:
            command, payload = message
            if command == "stop":
                self.keep_stop(payload)
                return None
            if command != "pbt":
                raise ValueError(f"worker {self.member}: unknown command {command!r} during PBT")
            if payload.get("step") == step:
                return payload if payload.get("donor") is not None else None
        self.log.warning("PBT: no answer from the coordinator within %.0f s; continuing unchanged", timeout)
        return None

    def past_report_by(self) -> bool:
        """Past the stop order's ``report_by`` (a stop may also come while a worker done by itself evaluates)."""
        for command, payload in self.link.commands():
            if command == "stop":
                self.keep_stop(payload)
        report_by = self.stop_order.get("report_by")
        return report_by is not None and time.time() >= report_by


# ------------------------------------------------------------------------ evaluation

def policy_actions(agent, action_space, deterministic: bool, normalizer):
    """``act(obs, masks)`` of a torch actor-critic for play_episodes: greedy (argmax, or a Box action's mean)
    or sampled, on observations normalized as in training."""
    import torch

    from common.rollout import action_bounds

    low, high = action_bounds(action_space)

    def act(obs: np.ndarray, _masks) -> np.ndarray:
        with torch.inference_mode():
            seen = normalizer.observations(obs)
            obs_t = torch.from_numpy(seen if seen.dtype == np.uint8 else seen.astype(np.float32, copy=False))
            if not deterministic:
                action = agent.act(obs_t)[0]
            else:
                out = agent.head(obs_t)
                action = out.argmax(-1) if agent.discrete else out
        action = action.numpy()
        return action if low is None else np.clip(action, low, high)

    return act


def random_actions(action_space, seed: int):
    """``act(obs, masks)`` of a uniformly random policy, the leaderboard's baseline."""
    rng = np.random.default_rng(seed)
    if hasattr(action_space, "n"):
        return lambda obs, _masks: rng.integers(0, action_space.n, len(obs))
    return lambda obs, _masks: rng.uniform(action_space.low, action_space.high,
                                           (len(obs), *action_space.shape)).astype(action_space.dtype)


def evaluate_policy(envs, act, episodes: int, seed: int, stop=None) -> dict[str, float] | None:
    """Play whole episodes on ``envs`` (held-out windows for Market-v0); their mean return and episode info.
    ``stop()`` true ends it early with the episodes finished so far (``episodes`` says how many; None if none)."""
    from common.envs import play_episodes

    try:
        done, _ = play_episodes(envs, act, episodes, seed=seed, stop=stop)
    finally:
        envs.close()
    if not done:
        return None
    returns = np.array([e["return"] for e in done])
    out = {"mean_return": float(returns.mean()), "std_return": float(returns.std()), "episodes": len(done)}
    for key, value in done[0].items():  # the env's own episode info: net worth, trades, fees ...
        if key not in ("return", "length", "terminated") and isinstance(value, float):
            out[f"mean_{key}"] = float(np.mean([e[key] for e in done]))
    return out
