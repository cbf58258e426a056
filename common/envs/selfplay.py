"""Opponents for self-play in the two-player envs (ConnectFour-v0, Shogi-v0, PettingZoo's games), per game.

A two-player built-in takes its opponent through ``env.set_opponent(player)``: any object with
``act(obs, action_mask, env_ids) -> actions`` that sees the board from its own side, and,
optionally, ``start_games(env_ids)`` (called when games begin). :func:`opponent_mixture`
builds the self-play opponent from an *opponent payload*, a plain dict the learner sends:

    {"probs": {"latest": p, "snapshot": p, "random": p, "heuristic": p}, "epsilon": eps,
     "snapshot_weights": [w, ...], "snapshot_ids": [id, ...]}

Each game draws one player: the learner's latest policy, one of the past snapshots (the
share of "snapshot" split among them in proportion to ``snapshot_weights``, evenly without
them), or a fixed player by name (``random``, ``heuristic``). Policy players act
epsilon-greedily over legal moves, so games do not repeat. A game against a snapshot ends
with that snapshot's id in the env's episode info (``opponent``; -1 for any other player),
which is how the learner learns which snapshots still beat it (prioritized fictitious self-play).
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


NOT_A_SNAPSHOT = -1  # the ``opponent`` of a game against the latest policy or a fixed player


class MixturePlayer:
    """Draws one player per game from ``players`` with ``probs``, and plays it for that game;
    ``labels`` (one number per player) name the player of a game (:meth:`game_labels`); ``names`` the
    fixed players by name (None for a policy), which a game with players of its own makes again
    (:meth:`remake_fixed_players`)."""

    def __init__(self, players: list, probs: list[float], num_envs: int, rng: np.random.Generator,
                 labels: list[float] | None = None, names: list[str | None] | None = None):
        self.players = players
        self.names = list(names) if names is not None else [None] * len(players)
        self.probs = np.asarray(probs, dtype=np.float64) / np.sum(probs)
        self.labels = np.asarray(labels if labels is not None else [NOT_A_SNAPSHOT] * len(players), dtype=np.float64)
        self.rng = rng
        self.assigned = self.rng.choice(len(players), size=num_envs, p=self.probs)

    def remake_fixed_players(self, make_player) -> None:
        """The fixed players made again by ``make_player(name, seed)``: a game that is not ConnectFour-v0 plays
        ``random`` and ``heuristic`` by its own rules (common/envs/pettingzoo_games.py and common/envs/shogi.py
        call this when the mixture becomes their opponent)."""
        for k, name in enumerate(self.names):
            if name is not None:
                self.players[k] = make_player(name, int(self.rng.integers(2**31 - 1)))

    def game_labels(self, env_ids: np.ndarray) -> np.ndarray:
        """The label of the player each of the games ``env_ids`` is against (read before they restart)."""
        return self.labels[self.assigned[env_ids]]

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
    players, probs, labels, names = [], [], [], []
    for name, prob in payload.get("probs", {}).items():
        if prob <= 0 or (name == "snapshot" and not snapshots):
            continue
        if name == "latest":
            players.append(PolicyPlayer(latest, epsilon, rng))
        elif name == "snapshot":
            weights = np.asarray(payload.get("snapshot_weights") or [1.0] * len(snapshots), dtype=np.float64)
            ids = payload.get("snapshot_ids") or [NOT_A_SNAPSHOT] * len(snapshots)
            players += [PolicyPlayer(policy, epsilon, rng) for policy in snapshots]
            probs += list(prob * weights / weights.sum())
            labels += list(ids)
            names += [None] * len(snapshots)
            continue
        else:
            players.append(make_player(name, int(rng.integers(2**31 - 1))))
        probs.append(prob)
        labels.append(NOT_A_SNAPSHOT)
        names.append(None if name == "latest" else name)
    return MixturePlayer(players, probs, num_envs, rng, labels, names) if players else None
