"""The DQN pieces shared by the two DQN scripts: the Double-DQN loss and epsilon schedules."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

MASKED_Q = -1e9  # stands in for -inf so masked actions never win a max and never make NaN


def masked_q(q_values: torch.Tensor, action_mask: torch.Tensor | None) -> torch.Tensor:
    """Q-values with illegal actions pushed far below every legal one."""
    if action_mask is None:
        return q_values
    return q_values.masked_fill(~action_mask.bool(), MASKED_Q)


def double_dqn_loss(q_net: nn.Module, target_net: nn.Module, obs: torch.Tensor, actions: torch.Tensor,
                    rewards: torch.Tensor, next_obs: torch.Tensor, dones: torch.Tensor,
                    discounts: torch.Tensor | float, next_action_mask: torch.Tensor | None = None,
                    weights: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Huber loss of Q(s, a) against r + discount * Q_target(s', argmax_a' Q(s', a')).

    ``dones`` marks terminal transitions (no bootstrap; a time-limit truncation is not
    terminal). ``discounts`` is gamma, or gamma**n per sample for n-step returns.
    ``next_action_mask`` keeps illegal next actions out of the argmax. ``weights`` are
    importance-sampling weights for prioritized replay. Returns (loss, |TD error|).
    """
    with torch.no_grad():
        next_actions = masked_q(q_net(next_obs), next_action_mask).argmax(dim=1, keepdim=True)
        next_q = target_net(next_obs).gather(1, next_actions).squeeze(1)
        target = rewards + discounts * next_q * (1.0 - dones.float())
    q = q_net(obs).gather(1, actions.long().unsqueeze(1)).squeeze(1)
    elementwise = F.smooth_l1_loss(q, target.to(q.dtype), reduction="none")
    loss = (elementwise * weights).mean() if weights is not None else elementwise.mean()
    return loss, (q - target).abs().detach()


def linear_schedule(start: float, end: float, duration: int, t: int) -> float:
    """Linearly anneal from ``start`` to ``end`` over ``duration`` steps, then hold ``end``."""
    slope = (end - start) / max(1, duration)
    return max(slope * t + start, end) if end <= start else min(slope * t + start, end)


@torch.no_grad()
def soft_update(target: nn.Module, source: nn.Module, tau: float) -> None:
    """target <- tau * source + (1 - tau) * target (tau = 1 is a hard copy)."""
    for t_param, s_param in zip(target.parameters(), source.parameters()):
        t_param.lerp_(s_param, tau)
