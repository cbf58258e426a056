"""A user's own models and act functions for ParallelManager, in a module its workers can import
(tests/ is on sys.path, which spawned workers inherit): tests/test_parallel_manager_models.py."""

from __future__ import annotations

import multiprocessing

import numpy as np
import torch
from torch import nn


class ActorCritic(nn.Module):
    """Seed 004's kind of model: one body, a policy head and a value head; returns ``(logits, value)``."""

    def __init__(self, obs_dim: int, n_actions: int, hidden: int = 32):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(obs_dim, hidden), nn.Tanh())
        self.policy = nn.Linear(hidden, n_actions)
        self.value = nn.Linear(hidden, 1)

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = self.body(obs)
        return self.policy(features), self.value(features).squeeze(-1)


def forcing(model: ActorCritic, action: int) -> ActorCritic:
    """Make ``model`` prefer ``action`` whatever it sees (a logit bias no feature can outweigh)."""
    with torch.no_grad():
        model.policy.weight.zero_()
        model.policy.bias.fill_(-5.0)
        model.policy.bias[action] = 5.0
    return model


def least_preferred(model: nn.Module, obs: np.ndarray, action_mask: np.ndarray | None, epsilon: float,
                    rng: np.random.Generator) -> np.ndarray:
    """An act function: the legal action with the lowest logit (the opposite of the convention's choice)."""
    with torch.no_grad():
        logits, _ = model(torch.as_tensor(obs, dtype=torch.float32))
    logits = logits.numpy()
    if action_mask is not None:
        logits = np.where(action_mask, logits, np.inf)
    return logits.argmin(axis=1)


class BreaksInWorker(ActorCritic):
    """Pickles fine here; rebuilding it in a worker process fails (as a class a worker cannot load would)."""

    def __setstate__(self, state):
        if multiprocessing.parent_process() is not None:
            raise RuntimeError("this model cannot be rebuilt in a worker")
        super().__setstate__(state)


class ReturnsDict(ActorCritic):
    """An output the convention cannot read (a dict) and no act function to read it."""

    def forward(self, obs: torch.Tensor) -> dict[str, torch.Tensor]:
        logits, value = super().forward(obs)
        return {"logits": logits, "value": value}
