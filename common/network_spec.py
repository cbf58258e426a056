"""What a checkpoint records to build its network again: its spaces as plain values, and the network's description.

Checkpoints hold only what ``torch.load(..., weights_only=True)`` accepts, so a space is stored as a dict
(:func:`space_spec`) and rebuilt from it (:func:`space_from_spec`); ``common.networks.build_network`` builds
the network a spec describes. gymnasium is imported by the functions that need it: a space to describe has
loaded it already, and a script's ``--help`` imports this module without paying for it.
"""

from __future__ import annotations

import numpy as np


def space_spec(space) -> dict:
    """A Discrete or Box space as plain values (what a checkpoint can hold under weights_only)."""
    import gymnasium as gym

    if isinstance(space, gym.spaces.Discrete):
        return {"type": "Discrete", "n": int(space.n)}
    low, high = np.asarray(space.low), np.asarray(space.high)
    uniform = low.size and (low == low.flat[0]).all() and (high == high.flat[0]).all()
    return {"type": "Box", "shape": list(space.shape), "dtype": str(space.dtype),
            "low": float(low.flat[0]) if uniform else low.tolist(),
            "high": float(high.flat[0]) if uniform else high.tolist()}


def space_from_spec(spec: dict):
    """The gymnasium space :func:`space_spec` described."""
    import gymnasium as gym

    if spec["type"] == "Discrete":
        return gym.spaces.Discrete(spec["n"])
    dtype = np.dtype(spec["dtype"])
    low = np.broadcast_to(np.asarray(spec["low"], dtype=np.float64), spec["shape"]).astype(dtype)
    high = np.broadcast_to(np.asarray(spec["high"], dtype=np.float64), spec["shape"]).astype(dtype)
    return gym.spaces.Box(low, high, dtype=dtype)


def actor_critic_spec(observation_space, action_space, hidden, activation: str, log_std_init: float) -> dict:
    """What a checkpoint stores under ``policy`` to build ``common.networks.ActorCritic`` (or the numpy
    ``common.numpy_actor_critic.MLPActorCritic``) again."""
    return {"class": "ActorCritic", "observation_space": space_spec(observation_space),
            "action_space": space_spec(action_space), "hidden_sizes": list(hidden), "activation": activation,
            "log_std_init": log_std_init}
