"""The DQN both DQN scripts run: acting, the Double-DQN loss and the learner.

:class:`DQNLearner` is the one learner of both scripts, which differ only in how experience
reaches it (whole episodes from rollout workers, or transitions that actors write into a
shared replay). Its optimizer step: micro-batches drawn from any replay buffer
(``sample(batch_size, beta)`` -> :class:`common.replay.ReplaySample`,
``update_priorities(sample, td_abs)``), gradient accumulation, mixed precision where it is
safe (bf16 autocast, or fp16 with a GradScaler on CUDA), illegal next actions masked out of
the target's argmax, gradient-norm clipping, a target network updated every
``target_update_interval`` steps (hard copy, or Polyak averaging with ``tau`` < 1), new
priorities for prioritized replay, and a stop (:class:`common.training_run.TrainingDiverged`) rather
than a step when the loss is not finite. Around the step it owns what a run needs of a
learner: seeding, resuming from a checkpoint and the checkpoint's learner part
(:meth:`DQNLearner.for_run`, :meth:`DQNLearner.state_dict`), and the learning rate annealed
over the run's budget (:meth:`DQNLearner.anneal`).
"""

from __future__ import annotations

import contextlib
import copy
import math
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from common.optim import FusedAdam
from common.training_run import TrainingDiverged

MASKED_Q = -1e9  # stands in for -inf so masked actions never win a max and never make NaN
PRECISIONS = ("auto", "bf16", "fp16", "off")


def masked_q(q_values: torch.Tensor, action_mask: torch.Tensor | None) -> torch.Tensor:
    """Q-values with illegal actions pushed far below every legal one."""
    if action_mask is None:
        return q_values
    return q_values.masked_fill(~action_mask.bool(), MASKED_Q)


def epsilon_greedy(q_values: np.ndarray, epsilon: float, rng: np.random.Generator,
                   action_mask: np.ndarray | None = None) -> np.ndarray:
    """Greedy actions from ``[n, actions]`` Q-values, each replaced with probability ``epsilon``
    by a uniformly drawn action (a legal one, where ``action_mask`` says which are)."""
    if action_mask is not None:
        q_values = np.where(action_mask, q_values, -np.inf)
    actions = q_values.argmax(axis=1)
    explore = rng.random(len(actions)) < epsilon
    if explore.any():
        if action_mask is None:
            actions[explore] = rng.integers(0, q_values.shape[1], int(explore.sum()))
        else:
            cumulative = np.cumsum(action_mask[explore].astype(np.float64), axis=1)
            draws = rng.random(len(cumulative)) * cumulative[:, -1]
            actions[explore] = (cumulative > draws[:, None]).argmax(axis=1)
    return actions


class DQNLoss(NamedTuple):
    loss: torch.Tensor
    td_abs: torch.Tensor  # |TD error| per sample (new priorities), detached
    q: torch.Tensor  # Q(s, a) of the samples, detached (for monitoring)


def double_dqn_loss(q_net: nn.Module, target_net: nn.Module, obs: torch.Tensor, actions: torch.Tensor,
                    rewards: torch.Tensor, next_obs: torch.Tensor, dones: torch.Tensor,
                    discounts: torch.Tensor | float, next_action_mask: torch.Tensor | None = None,
                    weights: torch.Tensor | None = None) -> DQNLoss:
    """Huber loss of Q(s, a) against r + discount * Q_target(s', argmax_a' Q(s', a')).

    ``dones`` marks terminal transitions (no bootstrap; a time-limit truncation is not
    terminal). ``discounts`` is gamma, or gamma**n per sample for n-step returns.
    ``next_action_mask`` keeps illegal next actions out of the argmax. ``weights`` are
    importance-sampling weights for prioritized replay.
    """
    with torch.no_grad():
        next_actions = masked_q(q_net(next_obs), next_action_mask).argmax(dim=1, keepdim=True)
        next_q = target_net(next_obs).gather(1, next_actions).squeeze(1)
        target = rewards + discounts * next_q * (1.0 - dones.float())
    q = q_net(obs).gather(1, actions.long().unsqueeze(1)).squeeze(1)
    elementwise = F.smooth_l1_loss(q, target.to(q.dtype), reduction="none")
    loss = (elementwise * weights).mean() if weights is not None else elementwise.mean()
    return DQNLoss(loss, (q - target).abs().detach(), q.detach())


@torch.inference_mode()
def initial_priorities(q_net: nn.Module, batch: dict[str, np.ndarray]) -> np.ndarray:
    """|TD error| of n-step transitions under the actor's own network, as Ape-X actors compute it on insertion."""
    q = q_net(torch.as_tensor(batch["obs"])).gather(1, torch.as_tensor(batch["actions"])[:, None]).squeeze(1)
    next_q = q_net(torch.as_tensor(batch["next_obs"])).max(dim=1).values
    target = torch.as_tensor(batch["rewards"]) + torch.as_tensor(batch["discounts"]) * next_q * \
        (1 - torch.as_tensor(batch["dones"]))
    return (target - q).abs().numpy()


def linear_schedule(start: float, end: float, duration: int, t: int) -> float:
    """Linearly anneal from ``start`` to ``end`` over ``duration`` steps, then hold ``end``."""
    slope = (end - start) / max(1, duration)
    return max(slope * t + start, end) if end <= start else min(slope * t + start, end)


@torch.no_grad()
def soft_update(target: nn.Module, source: nn.Module, tau: float) -> None:
    """target <- tau * source + (1 - tau) * target (tau = 1 is a hard copy)."""
    for t_param, s_param in zip(target.parameters(), source.parameters()):
        t_param.lerp_(s_param, tau)


def resolve_precision(precision: str) -> str:
    """``auto``: full precision, on the CPU (where bf16 rarely pays) and on CUDA alike. On an H200 an update
    of the Nature CNN took 4.5 ms in fp32 against 6.3 ms in fp16 with a GradScaler and 5.6 ms in bf16 at
    batch 32, and 7.5 against 8.8 and 9.0 ms at batch 256 (benchmarks/bench_gpu.py): networks this small
    are bound by kernel launches and host syncs, which autocast's casts and the scaler's checks add to.
    bf16 and fp16 stay a choice for larger networks and batches."""
    return "off" if precision == "auto" else precision


class DQNLearner:
    """Double DQN on replay samples; see the module docstring. ``updates`` counts optimizer steps.

    ``anneal_lr``: :meth:`anneal` lowers the rate from ``learning_rate`` to 0 over the run."""

    def __init__(self, q_net: nn.Module, device: torch.device, learning_rate: float, max_grad_norm: float,
                 target_update_interval: int, tau: float = 1.0, grad_accum_steps: int = 1, precision: str = "auto",
                 anneal_lr: bool = False):
        self.device = device
        self.base_rate, self.anneal_lr = learning_rate, anneal_lr
        self.q_net = q_net.to(device)
        self.target_net = copy.deepcopy(self.q_net).requires_grad_(False)
        self.max_grad_norm, self.grad_accum_steps = max_grad_norm, grad_accum_steps
        self.target_update_interval, self.tau = target_update_interval, tau
        self.precision = resolve_precision(precision)
        self.amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.precision)
        # fp16 gradients underflow without loss scaling; bf16 has fp32's range and needs none.
        self.scaler = torch.amp.GradScaler("cuda", enabled=self.precision == "fp16")
        # The scaler needs a torch.optim optimizer; without it, the same fused Adam kernel without
        # torch.optim's 1.6 s import of the compiler (common/optim.py).
        self.optimizer = (torch.optim.Adam(self.q_net.parameters(), lr=learning_rate) if self.scaler.is_enabled()
                          else FusedAdam(self.q_net.parameters(), lr=learning_rate))
        self.updates = 0

    @classmethod
    def for_run(cls, run) -> DQNLearner:
        """The learner of a DQN script's run (common.run.Run): seeded, sized to the cores the workers
        leave, and continuing the checkpoint the run resumes, if any."""
        from common.networks import QNetwork
        from common.system import resolve_device, usable_cores

        cfg, env = run.cfg, run.env
        torch.manual_seed(cfg.seed)
        np.random.seed(cfg.seed)
        # Also when the workers wait for the learner (sync modes): torch's idle threads spin-wait, and
        # next to polling workers a second learner thread made updates several times slower, not faster.
        torch.set_num_threads(max(1, usable_cores() - cfg.num_workers))
        q_net = QNetwork(env.observation_space, env.action_space, tuple(cfg.hidden_sizes),
                         tuple(getattr(cfg, "conv_channels", None) or ()))
        learner = cls(q_net, torch.device(resolve_device(cfg.device)), cfg.learning_rate, cfg.max_grad_norm,
                      cfg.target_update_interval, cfg.tau, getattr(cfg, "grad_accum_steps", 1), cfg.mixed_precision,
                      cfg.anneal_lr)
        if run.resumed is not None:
            learner.load_state_dict(run.resumed, run.counters["updates"])
            learner.set_learning_rate(cfg.learning_rate)  # the config's rate, not the one the checkpoint ended on
        return learner

    @property
    def learning_rate(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def set_learning_rate(self, rate: float) -> None:
        self.optimizer.param_groups[0]["lr"] = rate

    def anneal(self, budget_used: float) -> None:
        """Under ``anneal_lr`` the rate falls linearly from ``learning_rate`` to 0 over the run's budget
        (``budget_used``, from ``Run.budget_used``), so the last updates only fine-tune the weights the run
        ends with; otherwise nothing changes."""
        if self.anneal_lr:
            self.set_learning_rate(self.base_rate * (1.0 - budget_used))

    def _batch(self, sample) -> dict[str, torch.Tensor | None]:
        def tensor(array):
            return None if array is None else torch.as_tensor(array).to(self.device, non_blocking=True)

        return {"obs": tensor(sample.obs), "actions": tensor(sample.actions), "rewards": tensor(sample.rewards),
                "next_obs": tensor(sample.next_obs), "dones": tensor(sample.dones),
                "discounts": tensor(sample.discounts), "next_action_mask": tensor(sample.next_masks),
                "weights": tensor(sample.weights)}

    def update(self, replay, batch_size: int, beta: float = 0.4) -> dict[str, float]:
        """One optimizer step over ``grad_accum_steps`` micro-batches of ``batch_size`` from ``replay``.

        Returns ``loss`` (mean over the micro-batches), ``q_mean`` and ``rejected`` (torn draws).
        A loss or gradient that is not finite leaves the weights untouched and raises
        :class:`common.training_run.TrainingDiverged`: the run stops with the last good weights.
        """
        self.optimizer.zero_grad(set_to_none=True)
        losses, q_means, rejected = [], [], 0
        for _ in range(self.grad_accum_steps):
            sample = replay.sample(batch_size, beta)
            rejected += sample.rejected
            with self._autocast():
                out = double_dqn_loss(self.q_net, self.target_net, **self._batch(sample))
            losses.append(out.loss.item())
            q_means.append(out.q.float().mean().item())
            if not math.isfinite(losses[-1]):
                raise TrainingDiverged(f"loss became {losses[-1]} at update {self.updates + 1}")
            loss = out.loss.float() if self.grad_accum_steps == 1 else out.loss.float() / self.grad_accum_steps
            self.scaler.scale(loss).backward()
            if sample.weights is not None:  # prioritized replay: the new |TD errors| are the priorities
                replay.update_priorities(sample, out.td_abs.float().cpu().numpy())
        self.scaler.unscale_(self.optimizer)
        norm = torch.nn.utils.clip_grad_norm_(self.q_net.parameters(), self.max_grad_norm)
        if not self.scaler.is_enabled() and not math.isfinite(norm):  # the scaler skips such steps itself
            raise TrainingDiverged(f"loss became inf at update {self.updates + 1}")
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.updates += 1
        if self.updates % self.target_update_interval == 0:
            soft_update(self.target_net, self.q_net, self.tau)
        return {"loss": sum(losses) / len(losses), "q_mean": sum(q_means) / len(q_means), "rejected": rejected}

    def _autocast(self):
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype)

    def state_dict(self) -> dict[str, Any]:
        """A checkpoint's learner part: the acting network (``model`` and its ``policy`` spec) and the rest."""
        return {"model": self.q_net.state_dict(), "policy": self.q_net.spec, "target": self.target_net.state_dict(),
                "optimizer": self.optimizer.state_dict(), "scaler": self.scaler.state_dict()}

    def load_state_dict(self, state: dict[str, Any], updates: int = 0) -> None:
        self.q_net.load_state_dict(state["model"])
        self.target_net.load_state_dict(state["target"])
        self.optimizer.load_state_dict(state["optimizer"])
        if state.get("scaler") and self.scaler.is_enabled():  # empty when saved without fp16
            self.scaler.load_state_dict(state["scaler"])
        self.updates = updates
