"""Opponents for self-play in the two-player built-ins (ConnectFour-v0), per game.

A two-player built-in takes its opponent through ``env.set_opponent(player)``: any object with
``act(obs, action_mask, env_ids) -> actions`` that sees the board from its own side, and,
optionally, ``start_games(env_ids)`` (called when games begin). :func:`opponent_mixture`
builds the self-play opponent from an *opponent payload*, a plain dict the learner sends:

    {"probs": {"latest": p, "snapshot": p, "random": p, "heuristic": p}, "epsilon": eps, ...}

Each game draws one player: the learner's latest policy, one of the past snapshots (the
share of "snapshot" split evenly among them), or a fixed player by name (``random``,
``heuristic``). Policy players act epsilon-greedily over legal moves, so games do not repeat.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from common.envs.connect_four import check_training_opponents, make_player


class PolicyPlayer:
    """An opponent that plays a Q-network's (nearly) greedy moves from its own point of view.

    ``policy`` is anything with ``act(obs, action_mask, epsilon, rng)`` (e.g. the rollout
    workers' inference policy); the player follows its weights as they change.
    """

    def __init__(self, policy: Any, epsilon: float, rng: np.random.Generator):
        self.policy, self.epsilon, self.rng = policy, epsilon, rng

    def act(self, obs: np.ndarray, action_mask: np.ndarray, env_ids: np.ndarray) -> np.ndarray:
        return self.policy.act(obs, action_mask, self.epsilon, self.rng)


class MixturePlayer:
    """Draws one player per game from ``players`` with ``probs``, and plays it for that game."""

    def __init__(self, players: list, probs: list[float], num_envs: int, rng: np.random.Generator):
        self.players = players
        self.probs = np.asarray(probs, dtype=np.float64) / np.sum(probs)
        self.rng = rng
        self.assigned = self.rng.choice(len(players), size=num_envs, p=self.probs)

    def start_games(self, env_ids: np.ndarray) -> None:
        self.assigned[env_ids] = self.rng.choice(len(self.players), size=len(env_ids), p=self.probs)

    def act(self, obs: np.ndarray, action_mask: np.ndarray, env_ids: np.ndarray) -> np.ndarray:
        actions = np.zeros(len(env_ids), dtype=np.int64)
        owners = self.assigned[env_ids]
        for k in np.unique(owners):
            rows = np.flatnonzero(owners == k)
            actions[rows] = self.players[k].act(obs[rows], action_mask[rows], env_ids[rows])
        return actions


def opponent_mixture(payload: dict[str, Any], latest: Any, snapshots: list[Any], num_envs: int,
                     rng: np.random.Generator) -> MixturePlayer | None:
    """The per-game opponent an opponent payload describes (see the module docstring), or None.

    ``latest`` is the learner's current policy, ``snapshots`` the past ones, as policies for
    :class:`PolicyPlayer`.
    """
    check_training_opponents(payload.get("probs", {}))  # the search players judge training, never take part
    epsilon = float(payload.get("epsilon", 0.0))
    players, probs = [], []
    for name, prob in payload.get("probs", {}).items():
        if prob <= 0:
            continue
        if name == "latest":
            players.append(PolicyPlayer(latest, epsilon, rng))
            probs.append(prob)
        elif name == "snapshot":
            players += [PolicyPlayer(policy, epsilon, rng) for policy in snapshots]
            probs += [prob / len(snapshots)] * len(snapshots)
        else:
            players.append(make_player(name, int(rng.integers(2**31 - 1))))
            probs.append(prob)
    return MixturePlayer(players, probs, num_envs, rng) if players else None
