"""The rollout worker of a :class:`~common.parallel_manager.ParallelManager`: the process that plays
whole episodes with the learner's model and sends them back.

:func:`rollout_worker` is the process's entry point (started and watched by
:class:`common.supervisor.Supervisor`); :class:`RolloutWorker` is its loop: apply the learner's
commands, play a batch of ``games_per_worker`` episodes while it has credit, send it as
:class:`ExperienceBatch` messages. It rebuilds the model from the bytes of
:func:`common.model_packing.pack_model` and reads the weights from shared memory (slot 0: the
learner's; further slots: self-play opponents). :class:`InferencePolicy` turns the model's output
into actions, by a convention or by the user's ``act_fn``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from torch import nn

from common.dqn import epsilon_greedy
from common.envs import make_vec_env, play_episodes
from common.manager_config import ManagerConfig, WorkerSpec
from common.model_packing import unpack_model
from common.networks import SharedParams
from common.shm import attach_all
from common.supervisor import WorkerConfigError, set_torch_threads


@dataclass
class ExperienceBatch:
    """Whole episodes from one worker, played with one model version and epsilon."""

    worker: int
    model_version: int
    epsilon: float
    episodes: list[dict[str, Any]]
    steps: int
    collect_seconds: float
    last: bool = True  # the final message of the batch (a big batch travels in several messages)
    env_resets: int = 0  # times this worker made fresh envs before playing the batch (worker_reset_interval, reset)


def action_scores(output: Any) -> np.ndarray:
    """The convention that turns a model's output into per-action scores: a tensor ``[n, actions]``
    is the scores; a tuple or list stands for its first element (``(logits, value)``)."""
    if isinstance(output, (tuple, list)) and output:
        output = output[0]
    if not isinstance(output, torch.Tensor) or output.dim() != 2:
        shape = f" of shape {tuple(output.shape)}" if isinstance(output, torch.Tensor) else ""
        raise TypeError(f"the model returned a {type(output).__name__}{shape}; the convention takes a tensor "
                        f"[n, actions] of per-action scores, or a tuple whose first element is one; else pass act_fn")
    return output.detach().float().cpu().numpy()


def sample_actions(model: nn.Module, obs: np.ndarray, action_mask: np.ndarray | None, epsilon: float,
                   rng: np.random.Generator) -> np.ndarray:
    """An ``act_fn`` for a policy model: sample from the softmax of its (legal) logits, the first
    output by the :func:`action_scores` convention; with probability ``epsilon``, a uniform legal action."""
    with torch.no_grad():
        logits = action_scores(model(torch.as_tensor(obs, dtype=torch.float32))).astype(np.float64)
    if action_mask is not None:
        logits = np.where(action_mask, logits, -np.inf)
    probs = np.exp(logits - logits.max(axis=1, keepdims=True))
    cumulative = np.cumsum(probs, axis=1)
    actions = (cumulative > rng.random(len(obs))[:, None] * cumulative[:, -1:]).argmax(axis=1)
    explore = rng.random(len(actions)) < epsilon
    if explore.any():
        actions[explore] = epsilon_greedy(np.zeros_like(logits[explore]), 1.0, rng,
                                          None if action_mask is None else action_mask[explore])
    return actions


class InferencePolicy:
    """The learner's model, for acting only (no gradients).

    Actions come from ``act_fn(model, obs, action_mask, epsilon, rng) -> actions`` when one is
    given (a module-level function, so workers can import it; ``obs`` is the numpy batch
    ``[n, *obs_shape]``, ``action_mask`` ``[n, actions]`` bool or None; :func:`sample_actions` is
    one). Otherwise by convention: the model's output on the float32 observations (its first
    element if a tuple, as ``(logits, value)``) is ``[n, actions]`` scores, and the action is
    epsilon-greedy over them, the argmax among legal actions (Q-values and logits alike).
    """

    def __init__(self, net: nn.Module, act_fn: Callable | None = None):
        self.net = net.eval()
        self.act_fn = act_fn
        self.version = 0

    def fetch(self, params: SharedParams, slot: int, alive=lambda: True) -> None:
        self.version = params.wait_fetch(self.net, slot, alive)

    def act(self, obs: np.ndarray, action_mask: np.ndarray | None, epsilon: float,
            rng: np.random.Generator) -> np.ndarray:
        if self.act_fn is not None:
            return np.asarray(self.act_fn(self.net, obs, action_mask, epsilon, rng))
        with torch.no_grad():
            output = self.net(torch.as_tensor(obs, dtype=torch.float32))
        return epsilon_greedy(action_scores(output), epsilon, rng, action_mask)


def check_actions(actions: np.ndarray, num_envs: int, action_space: gym.Space, mask: np.ndarray | None) -> None:
    """The act path's first answer must be one valid action per env (else no game can be played)."""
    actions = np.asarray(actions)
    if not isinstance(action_space, gym.spaces.Discrete):  # e.g. an act_fn for a Box space: one action per env
        if actions.shape != (num_envs, *action_space.shape):
            raise TypeError(f"got actions of shape {actions.shape}; need {(num_envs, *action_space.shape)}")
        return
    if actions.shape != (num_envs,) or not np.issubdtype(actions.dtype, np.integer):
        raise TypeError(f"got actions of shape {actions.shape} and dtype {actions.dtype} for {num_envs} envs; "
                        f"need {num_envs} integers")
    if ((actions < 0) | (actions >= action_space.n)).any():
        raise ValueError(f"actions {actions.tolist()} are outside 0..{action_space.n - 1}")
    if mask is not None and not mask[np.arange(num_envs), actions].all():
        raise ValueError(f"actions {actions.tolist()} include an illegal one under the action mask")


def split_by_transitions(episodes: list[dict[str, Any]], limit: int) -> list[list[dict[str, Any]]]:
    """Group whole episodes into chunks of at most ``limit`` transitions (an episode is never split)."""
    chunks, current, size = [], [], 0
    for episode in episodes:
        if current and size + episode["length"] > limit:
            chunks.append(current)
            current, size = [], 0
        current.append(episode)
        size += episode["length"]
    if current or not chunks:
        chunks.append(current)
    return chunks


class RolloutWorker:
    """The loop inside a worker process: apply commands; play a batch while it has credit; repeat."""

    def __init__(self, link, spec: WorkerSpec, config: ManagerConfig, param_specs: dict, state: dict[str, Any]):
        self.link, self.spec, self.config = link, spec, config
        arrays, self._handles = attach_all(param_specs)
        self.model_bytes = arrays.pop("model")
        self.params = SharedParams(arrays)
        self.seed = state["seed"]
        self.rng = np.random.default_rng(self.seed)
        self.epsilon, self.credits, self.opponents = state["epsilon"], state["credits"], state["opponents"]
        self.paused, self.paused_acked, self.reset_requested = state["paused"], False, False
        self.env_resets, self.games_since_reset = 0, 0
        self.evals: list[dict[str, Any]] = []
        self.policy = self._rebuild()
        self.policy.fetch(self.params, 0, link.parent_alive)
        self.vec = self._make_env(config.games_per_worker)
        self._check_act()
        self._install_opponents()

    def _rebuild(self) -> InferencePolicy:
        """A fresh copy of the learner's model (weights not loaded yet) with its act path."""
        try:
            return InferencePolicy(*unpack_model(self.model_bytes))
        except Exception as err:  # the same bytes fail the same way at every restart
            detail = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise WorkerConfigError(f"worker {self.link.index} cannot rebuild the model: {type(err).__name__}: "
                                    f"{detail} (its classes must be importable from a .py module)") from err

    def _check_act(self) -> None:
        obs = self.vec.reset()
        mask = self.vec.last_infos.get("action_mask")
        try:
            check_actions(self.policy.act(obs, mask, 0.0, self.rng), self.vec.num_envs,
                          self.vec.single_action_space, mask)
        except Exception as err:
            detail = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise WorkerConfigError(f"worker {self.link.index} cannot turn the model's output into actions for "
                                    f"{self.spec.env_id}: {type(err).__name__}: {detail}") from err

    def _make_env(self, games: int, **overrides):
        width = self.config.envs_per_worker or games
        kwargs = {**self.spec.env_kwargs, **overrides}
        try:
            return make_vec_env(self.spec.env_id, max(1, min(width, games)), self.seed, **kwargs)
        except Exception as err:  # a bad env id or keyword: no restart can fix it
            raise WorkerConfigError(f"cannot create {self.spec.env_id} with {kwargs}: {err}") from err

    def _install_opponents(self) -> None:
        """Two-player envs: the per-game opponent mixture of the latest policy, snapshots and fixed players."""
        if self.opponents is None or not hasattr(self.vec.env, "set_opponent"):
            return
        from common.envs.selfplay import opponent_mixture

        snapshots = []
        for slot in self.opponents["slots"]:
            snapshots.append(self._rebuild())
            snapshots[-1].fetch(self.params, slot, self.link.parent_alive)
        player = opponent_mixture(self.opponents, self.policy, snapshots, self.vec.num_envs, self.rng)
        if player is not None:
            self.vec.env.set_opponent(player)

    def apply(self, command: str, payload: Any) -> None:
        if command == "settings":
            self.epsilon = float(payload["epsilon"])
        elif command == "opponents":
            self.opponents = payload
            self._install_opponents()
        elif command == "credit":
            self.credits += int(payload)
        elif command in ("pause", "resume"):
            self.paused, self.paused_acked = command == "pause", False
        elif command == "reset":
            self.reset_requested = True
        elif command == "evaluate":
            self.evals.append(payload)
        elif command != "stop":
            raise ValueError(f"worker {self.link.index}: unknown command {command!r}")

    def run(self) -> None:
        link = self.link
        while not link.stop_requested:
            for command, payload in link.commands():
                self.apply(command, payload)
            if link.stop_requested:
                return
            if self.reset_requested:
                self.reset()
            elif self.evals:
                self.evaluate(self.evals.pop(0))
            elif self.paused or self.credits <= 0:
                if self.paused and not self.paused_acked:
                    link.send("paused")
                    self.paused_acked = True
                message = link.receive()  # idle until the learner says something (heartbeats meanwhile)
                if message is not None:
                    self.apply(*message)
            else:
                self.collect()

    def _act(self, epsilon: float):
        return lambda obs, masks: self.policy.act(obs, masks, epsilon, self.rng)

    def collect(self) -> None:
        if self.params.version(0) != self.policy.version:
            self.policy.fetch(self.params, 0, self.link.parent_alive)
        started = time.perf_counter()
        version, epsilon = self.policy.version, self.epsilon
        episodes, steps = play_episodes(self.vec, self._act(epsilon), self.config.games_per_worker,
                                        self.config.max_game_length, record=True,
                                        seed=int(self.rng.integers(2**31 - 1)))
        seconds = time.perf_counter() - started
        chunks = split_by_transitions(episodes, self.config.experience_batch_size)
        for k, chunk in enumerate(chunks):
            self.link.send("episodes", ExperienceBatch(self.link.index, version, epsilon, chunk,
                                                       steps if k == 0 else 0, seconds, last=k == len(chunks) - 1,
                                                       env_resets=self.env_resets))
        self.credits -= 1
        self.games_since_reset += len(episodes)
        interval = self.config.worker_reset_interval
        if interval and self.games_since_reset >= interval:  # episodes are whole: the reset waits for a batch's end
            self.new_envs()

    def evaluate(self, request: dict[str, Any]) -> None:
        vec = self._make_env(request["episodes"], **request["env_kwargs"])
        try:
            if request["opponent"] is not None:
                vec.env.set_opponent(request["opponent"])
            episodes, steps = play_episodes(vec, self._act(request["epsilon"]), request["episodes"],
                                            self.config.max_game_length, seed=int(self.rng.integers(2**31 - 1)))
        finally:
            vec.close()
        self.link.send("eval", {"request": request["request"], "episodes": episodes, "steps": steps})

    def new_envs(self) -> None:
        """Fresh environments with a new seed (weights and settings stay)."""
        self.vec.close()
        self.seed = int(self.rng.integers(2**31 - 1))
        self.vec = self._make_env(self.config.games_per_worker)
        self._install_opponents()
        self.env_resets += 1
        self.games_since_reset = 0

    def reset(self) -> None:
        self.reset_requested = False
        self.new_envs()
        self.link.send("reset_done")

    def close(self) -> None:
        self.vec.close()
        self.params = self.model_bytes = None
        for handle in self._handles:
            handle.close()


def rollout_worker(link, spec: WorkerSpec, config: ManagerConfig, param_specs: dict, state: dict[str, Any]) -> None:
    """Entry point of a rollout worker process (run by the supervisor, which reports a crash)."""
    set_torch_threads(spec.torch_threads)
    if spec.log_dir is not None:
        from common.runlog import setup_logging

        setup_logging(Path(spec.log_dir) / f"worker_{link.index}.log", "prl.manager")
    worker = RolloutWorker(link, spec, config, param_specs, state)
    try:
        link.ready()
        worker.run()
    finally:
        worker.close()
