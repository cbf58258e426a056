"""A trained policy, rebuilt from a checkpoint of any script, in plain PyTorch.

    from common.policy import load_policy
    policy = load_policy("runs/train_parallel_timed/CartPole-v1__1__.../checkpoints/latest.pt")
    action = policy.act(obs)          # numpy in, numpy out, greedy
    logits = policy(torch.as_tensor(obs[None]))   # an nn.Module: observation in, logits / Q-values out

Every checkpoint this project writes records the network's architecture under ``policy``
(class, observation and action spaces, widths, activation), its weights under ``model`` and,
where the run normalized observations, their statistics under ``obs_norm``; so nothing else
(not even the training script) is needed to act with it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from common.checkpoint import load_checkpoint
from common.network_spec import space_from_spec
from common.networks import build_network


class Policy(nn.Module):
    """Raw observation in, action logits (Discrete PPO), action means (Box PPO) or Q-values (DQN) out."""

    def __init__(self, network: nn.Module, spec: dict, obs_norm: dict | None = None):
        super().__init__()
        self.network, self.spec = network, spec
        self.observation_space = space_from_spec(spec["observation_space"])
        self.action_space = space_from_spec(spec["action_space"])
        self.discrete = spec["action_space"]["type"] == "Discrete"
        mean, var, clip = (obs_norm["mean"], obs_norm["var"], obs_norm["clip"]) if obs_norm else (0.0, 1.0, None)
        self.register_buffer("obs_mean", torch.as_tensor(mean, dtype=torch.float32))
        self.register_buffer("obs_std", torch.sqrt(torch.as_tensor(var, dtype=torch.float32) + 1e-8))
        self.obs_clip = clip

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        x = (obs.float() - self.obs_mean) / self.obs_std
        if self.obs_clip is not None:
            x = x.clamp(-self.obs_clip, self.obs_clip)
        return self.network(x) if self.spec["class"] == "QNetwork" else self.network.head(x)

    @torch.no_grad()
    def act(self, obs: np.ndarray, action_mask: np.ndarray | None = None) -> np.ndarray:
        """Greedy actions for a batch of raw observations (illegal actions, where masked, never chosen)."""
        out = self(torch.as_tensor(np.asarray(obs), device=self.obs_mean.device)).cpu().numpy()
        if not self.discrete:
            return np.clip(out, self.action_space.low, self.action_space.high)
        if action_mask is not None:
            out = np.where(action_mask, out, -np.inf)
        return out.argmax(axis=1)


def load_policy(path: str | Path, device: str = "cpu") -> Policy:
    """The policy a checkpoint file holds, ready to act (eval mode, on ``device``)."""
    return policy_from_state(load_checkpoint(path, map_location=device, required=("model", "policy")), device)


def policy_from_state(state: dict, device: str = "cpu"):
    """The policy of an already loaded checkpoint dict (its ``policy``, ``model`` and ``obs_norm`` entries):
    a :class:`Policy`, or for parallel_train_dqn.py's n-tuple learner the ``NTupleValue`` (common/ntuple.py),
    which acts the same way (``act(obs, action_mask)``) but is no network."""
    if state["policy"]["class"] == "NTupleValue":
        from common.ntuple import NTupleValue

        return NTupleValue(state["model"]["tuples"].numpy(), state["model"]["weights"].numpy().copy())
    network = build_network(state["policy"])
    network.load_state_dict(state["model"])
    return Policy(network, state["policy"], state.get("obs_norm")).to(device).eval()
