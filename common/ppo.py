"""The PPO pieces shared by the two PPO scripts: the rollout, GAE and the clipped-surrogate update.

A rollout lives in a dict of ``[n_steps, envs, ...]`` arrays (:func:`rollout_layout`): shared
memory that several workers fill column by column in ``train_parallel_timed.py``, a worker's
private arrays in ``train_ppo_multiprocess.py``. A :class:`RolloutCollector` fills it,
:func:`rollout_batch` turns it into the flat batch :func:`ppo_update` learns from.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from common.normalize import Normalizer
from common.replay import describe_observations


def rollout_layout(n_steps: int, num_envs: int, observation_space, action_space) -> dict[str, tuple]:
    """``{name: (shape, dtype)}`` of the arrays a :class:`RolloutCollector` fills for ``num_envs`` envs.

    Observations are stored as the env gives them (uint8 frames stay uint8: a quarter of float32).
    """
    continuous = not hasattr(action_space, "n")
    obs_dtype = np.uint8 if observation_space.dtype == np.uint8 else np.float32
    layout = {"obs": ((n_steps, num_envs, *observation_space.shape), obs_dtype),
              "actions": ((n_steps, num_envs, *action_space.shape), np.float32 if continuous else np.int64)}
    for key in ("logprobs", "values", "rewards", "final_values", "terminations", "truncations", "disc_returns"):
        layout[key] = ((n_steps, num_envs), np.float32)
    layout["next_values"] = ((num_envs,), np.float32)
    return layout


def describe_rollout(buf: dict[str, np.ndarray], observation_space) -> str:
    """How a rollout holds its observations (``rollout: 128 x 8 x (4, 84, 84) uint8 observations, 28.9 MB``)."""
    return describe_observations("rollout", [buf["obs"]], observation_space.shape)


class TorchActing:
    """The rollout step done by the torch network itself (images, and anything not an MLP)."""

    def __init__(self, agent):
        self.agent = agent

    def refresh(self) -> None:
        pass  # the network is the agent

    def act(self, obs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        action, logprob, value = self.agent.act(_tensor(obs))
        return action.numpy(), logprob.numpy(), value.numpy()

    def value(self, obs: np.ndarray) -> np.ndarray:
        return self.agent.get_value(_tensor(obs)).numpy()


class NumpyActing:
    """The rollout step of an MLP actor-critic in numpy, from a copy of its weights.

    A rollout step runs the network on a handful of observations, where torch's per-call
    overhead dominates: numpy's matmuls took a quarter of the time (16 CartPole envs: 122 vs
    511 us per step, measured). Actions are sampled from the same distributions as
    ``ActorCritic.act`` (categorical by the Gumbel-max trick, or the diagonal Gaussian), with
    this collector's own generator; the learner recomputes log-probabilities with torch.
    """

    def __init__(self, agent, seed: int):
        self.agent, self.rng = agent, np.random.default_rng(seed)
        self.activation = np.tanh if agent.spec["activation"] == "tanh" else (lambda x: np.maximum(x, 0.0))
        self.refresh()

    @staticmethod
    def supports(agent) -> bool:
        return isinstance(agent.trunk, nn.Flatten)

    def refresh(self) -> None:
        """Copy the agent's current weights (call after every parameter update)."""
        def layers(seq):
            return [(m.weight.detach().numpy().T.copy(), m.bias.detach().numpy().copy())
                    for m in seq if isinstance(m, nn.Linear)]

        self.actor, self.critic = layers(self.agent.actor), layers(self.agent.critic)
        self.log_std = None if self.agent.discrete else self.agent.actor_logstd.detach().numpy()[0].copy()

    def _mlp(self, x: np.ndarray, layers) -> np.ndarray:
        for weight, bias in layers[:-1]:
            x = self.activation(x @ weight + bias)
        weight, bias = layers[-1]
        return x @ weight + bias

    def value(self, obs: np.ndarray) -> np.ndarray:
        return self._mlp(_flat(obs), self.critic)[:, 0]

    def act(self, obs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        x = _flat(obs)
        out, value = self._mlp(x, self.actor), self._mlp(x, self.critic)[:, 0]
        if self.log_std is None:
            shifted = out - out.max(axis=1, keepdims=True)
            log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
            action = (log_probs + self.rng.gumbel(size=log_probs.shape)).argmax(axis=1)
            return action, log_probs[np.arange(len(action)), action].astype(np.float32), value
        noise = self.rng.standard_normal(out.shape).astype(np.float32)
        action = out + noise * np.exp(self.log_std)
        logprob = (-0.5 * noise ** 2 - self.log_std - 0.5 * np.log(2 * np.pi)).sum(axis=1)
        return action.astype(np.float32), logprob.astype(np.float32), value


def _tensor(obs: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(obs if obs.dtype in (np.float32, np.uint8) else obs.astype(np.float32))


def _flat(obs: np.ndarray) -> np.ndarray:
    return obs.reshape(len(obs), -1).astype(np.float32, copy=False)


class RolloutCollector:
    """Steps ``envs`` with ``agent`` (on the CPU), filling columns ``cols`` of a rollout ``buf``.

    It keeps what outlives one rollout: the observation to continue from and each env's
    discounted return so far (reward scaling learns its variance). The policy acts on
    observations normalized by ``normalizer``; the rollout stores them raw (common/normalize.py).
    MLP policies act in numpy (:class:`NumpyActing`), others with torch. ``buf`` may be another
    rollout of the same layout from one rollout to the next (train_parallel_timed.py alternates two
    when it collects while it learns).
    """

    def __init__(self, agent, envs, buf: dict[str, np.ndarray], cols: slice, normalizer: Normalizer, seed: int):
        self.agent, self.envs, self.buf, self.cols, self.normalizer = agent, envs, buf, cols, normalizer
        self.acting = NumpyActing(agent, seed) if NumpyActing.supports(agent) else TorchActing(agent)
        self.low, self.high = action_bounds(envs.single_action_space)
        self.next_obs = envs.reset()
        self.returns = np.zeros(envs.num_envs, dtype=np.float64)

    def collect(self, n_steps: int) -> list[dict]:
        """One rollout of ``n_steps`` steps per env with the agent's current weights; the episodes that finished."""
        buf, cols, acting, seen = self.buf, self.cols, self.acting, self.normalizer.observations
        acting.refresh()
        episodes = []
        with torch.inference_mode():
            for step in range(n_steps):
                action, logprob, value = acting.act(seen(self.next_obs))
                buf["obs"][step, cols] = self.next_obs
                buf["actions"][step, cols] = action
                buf["logprobs"][step, cols] = logprob
                buf["values"][step, cols] = value
                result = self.envs.step(action if self.low is None else np.clip(action, self.low, self.high))
                self.record(step, result)
                episodes.extend(result.episodes)
            buf["next_values"][cols] = acting.value(seen(self.next_obs))
        return episodes

    def record(self, step: int, result) -> None:
        buf, cols = self.buf, self.cols
        buf["rewards"][step, cols] = result.rewards
        buf["terminations"][step, cols] = result.terminations
        buf["truncations"][step, cols] = result.truncations
        self.returns = self.returns * self.normalizer.gamma + result.rewards
        buf["disc_returns"][step, cols] = self.returns
        done = result.terminations | result.truncations
        self.returns[done] = 0.0
        if result.truncations.any():
            # A time limit is not the end of the task: bootstrap from the final observation.
            final_values = self.acting.value(self.normalizer.observations(result.final_obs))
            buf["final_values"][step, cols] = np.where(result.truncations, final_values, 0.0)
        self.next_obs = result.obs


def make_normalizer(cfg, observation_space, action_space, gamma: float | None = None) -> Normalizer:
    """The run's normalizer from ``norm_obs``/``norm_reward`` (None = on for Box actions, off for Discrete)."""
    continuous = not hasattr(action_space, "n")
    norm_obs = continuous if cfg.norm_obs is None else cfg.norm_obs
    norm_reward = continuous if cfg.norm_reward is None else cfg.norm_reward
    return Normalizer(observation_space.shape, norm_obs, norm_reward, cfg.clip_obs, cfg.clip_reward,
                      cfg.gamma if gamma is None else gamma)


def action_bounds(space):
    """Box actions are clipped to the bounds when stepping the env (the log-prob is of the raw sample)."""
    return (space.low, space.high) if hasattr(space, "low") else (None, None)


def rollout_batch(buf: dict[str, np.ndarray], gamma: float, gae_lambda: float, device,
                  normalizer: Normalizer) -> dict[str, torch.Tensor]:
    """GAE over a filled rollout, then ``[T, N]`` flattened into one batch of samples on ``device``.

    Observations are normalized and rewards scaled with the statistics the rollout was collected with.
    ``logprobs`` and ``values`` stay those the rollout stored, the behaviour policy's: the PPO ratio is
    taken against them however far the learner has moved on since (a lagged rollout's is not 1 at first).
    """
    rewards = normalizer.rewards(buf["rewards"])
    advantages, returns = compute_gae(rewards, buf["values"], buf["terminations"], buf["truncations"],
                                      buf["final_values"], buf["next_values"], gamma, gae_lambda)
    samples = rewards.size

    def flat(array: np.ndarray):
        return torch.as_tensor(array.reshape(samples, *array.shape[2:])).to(device)

    return {"obs": flat(normalizer.observations(buf["obs"])), "actions": flat(buf["actions"]),
            "logprobs": flat(buf["logprobs"]), "values": flat(buf["values"]), "advantages": flat(advantages),
            "returns": flat(returns)}


def compute_gae(rewards: np.ndarray, values: np.ndarray, terminations: np.ndarray,
                truncations: np.ndarray, final_values: np.ndarray, next_values: np.ndarray,
                gamma: float, gae_lambda: float) -> tuple[np.ndarray, np.ndarray]:
    """Generalized advantage estimates and returns for a ``[T, N]`` rollout.

    ``values[t]`` is V(s_t); ``next_values`` is V of the observation after the last
    step. Episodes end with same-step autoreset, so at a done step ``t`` the successor
    state is the episode's final observation, whose value is ``final_values[t]``. A
    termination contributes no bootstrap; a truncation (time limit) bootstraps from
    ``final_values[t]``, because the episode could have gone on.
    """
    terminations = np.asarray(terminations, dtype=np.float32)
    truncations = np.asarray(truncations, dtype=np.float32)
    steps = rewards.shape[0]
    advantages = np.zeros_like(rewards, dtype=np.float32)
    last_gae = np.zeros(rewards.shape[1:], dtype=np.float32)
    for t in reversed(range(steps)):
        following = next_values if t == steps - 1 else values[t + 1]
        successor_value = np.where(truncations[t] > 0, final_values[t], following)
        successor_value = successor_value * (1.0 - terminations[t])
        delta = rewards[t] + gamma * successor_value - values[t]
        episode_continues = (1.0 - terminations[t]) * (1.0 - truncations[t])
        last_gae = delta + gamma * gae_lambda * episode_continues * last_gae
        advantages[t] = last_gae
    return advantages, advantages + values


@dataclass
class PPOSettings:
    n_epochs: int
    minibatch_size: int
    clip_coef: float
    clip_vloss: bool
    ent_coef: float
    vf_coef: float
    max_grad_norm: float
    norm_adv: bool = True
    target_kl: float | None = None


def ppo_update(agent: nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, torch.Tensor],
               settings: PPOSettings, generator: torch.Generator | None = None,
               after_backward: Callable[[], None] | None = None) -> dict[str, float]:
    """``n_epochs`` passes of minibatch PPO over a flat batch; returns the last epoch's statistics.

    ``batch`` holds ``obs, actions, logprobs, advantages, returns, values`` with the
    sample dimension first. ``after_backward`` runs between ``backward()`` and the
    optimizer step (distributed training averages gradients there).
    """
    size = batch["obs"].shape[0]
    clipped, minibatches = torch.zeros(()), 0  # summed on the device; read once at the end (no per-step sync)
    approx_kl = old_approx_kl = pg_loss = v_loss = entropy_loss = torch.zeros(())
    for _ in range(settings.n_epochs):
        order = torch.randperm(size, generator=generator)
        for start in range(0, size, settings.minibatch_size):
            mb_inds = order[start:start + settings.minibatch_size]
            _, newlogprob, entropy, newvalue = agent.get_action_and_value(
                batch["obs"][mb_inds], batch["actions"][mb_inds])
            logratio = newlogprob - batch["logprobs"][mb_inds]
            ratio = logratio.exp()
            with torch.no_grad():
                old_approx_kl = (-logratio).mean()
                approx_kl = ((ratio - 1) - logratio).mean()
                clipped += ((ratio - 1.0).abs() > settings.clip_coef).float().mean()
                minibatches += 1

            mb_advantages = batch["advantages"][mb_inds]
            if settings.norm_adv and mb_advantages.numel() > 1:
                mb_advantages = (mb_advantages - mb_advantages.mean()) / (mb_advantages.std() + 1e-8)
            pg_loss1 = -mb_advantages * ratio
            pg_loss2 = -mb_advantages * torch.clamp(ratio, 1 - settings.clip_coef, 1 + settings.clip_coef)
            pg_loss = torch.max(pg_loss1, pg_loss2).mean()

            mb_returns = batch["returns"][mb_inds]
            if settings.clip_vloss:
                mb_values = batch["values"][mb_inds]
                v_clipped = mb_values + torch.clamp(newvalue - mb_values, -settings.clip_coef, settings.clip_coef)
                v_loss = 0.5 * torch.max((newvalue - mb_returns) ** 2, (v_clipped - mb_returns) ** 2).mean()
            else:
                v_loss = 0.5 * ((newvalue - mb_returns) ** 2).mean()

            entropy_loss = entropy.mean()
            loss = pg_loss - settings.ent_coef * entropy_loss + settings.vf_coef * v_loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if after_backward is not None:
                after_backward()
            nn.utils.clip_grad_norm_(agent.parameters(), settings.max_grad_norm)
            optimizer.step()
        if settings.target_kl is not None and approx_kl.item() > settings.target_kl:
            break

    returns, values = batch["returns"], batch["values"]
    explained_var = float("nan")
    var_returns = returns.var().item()
    if var_returns > 0:
        explained_var = 1.0 - (returns - values).var().item() / var_returns
    return {"policy_loss": pg_loss.item(), "value_loss": v_loss.item(), "entropy": entropy_loss.item(),
            "approx_kl": approx_kl.item(), "old_approx_kl": old_approx_kl.item(),
            "clipfrac": clipped.item() / max(1, minibatches), "explained_variance": explained_var}
