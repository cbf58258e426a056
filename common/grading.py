"""Grading a two-player agent by a perfect player, in the games that have one.

Win rates against fixed players say how an agent fares against those players; a perfect player says how
far from strong play it is. A game with a perfect player offers its :class:`PerfectPlay`:

- ``move_values(obs, action_mask) -> (n, actions)``: the game-theoretic score of every move for the side
  to move, on the observations the env shows that side: > 0 the move wins, 0 it draws, < 0 it loses,
  both sides playing perfectly after it; where the solver knows how soon, a higher score is a quicker
  win or a later loss; ``-inf`` for an illegal move;
- ``ply_bands``: the plies to grade, in bands (``((0, 9), (10, 19), (20, 30))``: plies 0 to 30);
- ``name``: the perfect player, as reports name it.

:data:`SOLVED_GAMES` says where each game's is (``"module:function"``, imported only when grading, so a
solver stays an optional extra): ConnectFour-v0's is BitBully (common/envs/connect_four_solver.py).
Another game plugs in with one line there and a function that returns its ``PerfectPlay``.

:func:`grade` reports, for any agent with ``act(obs, action_mask) -> actions`` (a run's greedy policy,
a lookahead player):

- **Random positions by ply.** For each graded ply, ``per_ply`` positions reached by uniformly random moves
  of both sides with the game still going: random games played through the env itself from each seat,
  and the positions of each ply drawn from them without replacement (so the empty board is all of ply 0,
  and an early ply repeats the positions random play reaches most). For each, the agent's move is
  *optimal* when its score is the best there (the quickest win, a draw where a draw is the best, the
  latest loss), and a *blunder* when it lowers the position's game-theoretic value (a win to a draw or a
  loss, a draw to a loss). Per band and for all plies: the optimal-move rate, the blunder rate, and the
  share of positions won, drawn and lost for the side to move.
- **Games against the perfect player** from each seat (:class:`PerfectPlayer`: a move of the best
  score, ties broken at random, so its games vary), from the empty board: win, draw and loss rates.

The perfect player is for grading only, never a training opponent: it has no name a training mix could
use (common/envs/selfplay.py makes opponents by name), and the training scripts never import this
module or a solver (tests/test_grading.py runs one with the solver made unimportable).
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

SOLVED_GAMES = {"ConnectFour-v0": "common.envs.connect_four_solver:perfect_play",
                "pettingzoo/tictactoe-v3": "common.envs.tictactoe_players:perfect_play"}
SEATS = (("first", True), ("second", False))
RANDOM_GAMES = 256  # random games per seat and round when looking for positions
MAX_ROUNDS = 64  # rounds of random games before a ply that random play hardly reaches is graded on fewer
MATCH_ENVS = 100  # games against the perfect player are played this many at a time


@dataclass(frozen=True)
class PerfectPlay:
    """What a game with a perfect player offers for grading (see the module docstring)."""

    name: str
    move_values: Callable[[np.ndarray, np.ndarray | None], np.ndarray]
    ply_bands: tuple[tuple[int, int], ...]


def perfect_play(env_id: str) -> PerfectPlay:
    """The perfect play of ``env_id``; ValueError (one line) for a game without one or a solver missing."""
    where = SOLVED_GAMES.get(env_id)
    if where is None:
        raise ValueError(f"{env_id} has no perfect player to grade by (games with one: {', '.join(SOLVED_GAMES)})")
    module, function = where.split(":")
    return getattr(importlib.import_module(module), function)()


class PerfectPlayer:
    """Plays a move of the best perfect score, ties broken uniformly with ``seed``'s generator; as an env's
    opponent (``act(obs, action_mask, env_ids)``) or as an agent to grade."""

    def __init__(self, move_values: Callable, seed: int | None = None):
        self.move_values = move_values
        self.rng = np.random.default_rng(seed)

    def act(self, obs: np.ndarray, action_mask: np.ndarray, env_ids: np.ndarray | None = None) -> np.ndarray:
        values = self.move_values(obs, action_mask)
        best = values == values.max(axis=1, keepdims=True)
        return _uniform_choice(self.rng, best)


def _uniform_choice(rng: np.random.Generator, allowed: np.ndarray) -> np.ndarray:
    """One uniformly drawn column among the True ones of each row."""
    cumulative = np.cumsum(np.asarray(allowed, dtype=np.float64), axis=1)
    draws = rng.random(len(allowed)) * cumulative[:, -1]
    return (cumulative > draws[:, None]).argmax(axis=1)


def graded_plies(perfect: PerfectPlay) -> list[int]:
    return [ply for first, last in perfect.ply_bands for ply in range(first, last + 1)]


def random_positions(env_id: str, env_kwargs: dict, plies: Iterable[int], per_ply: int,
                     seed: int) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """``per_ply`` positions (observations of the side to move and their legal-move masks) for each ply
    in ``plies``, reached by uniformly random moves of both sides with the game still going.

    Random games are played through the env (its random player against uniformly random moves of the
    learner's seat) from each seat, in rounds, until every ply has ``per_ply`` positions or ``MAX_ROUNDS``
    rounds have passed (a ply random games hardly ever reach live then has fewer); each ply's positions are
    then drawn from those found without replacement.
    """
    from common.envs import make_vec_env, play_episodes

    rng = np.random.default_rng(seed)
    found: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {ply: [] for ply in plies}
    kwargs = {k: v for k, v in env_kwargs.items() if k != "random_opening"}  # plies count from the empty board

    def random_moves(obs, masks):
        return _uniform_choice(rng, masks)

    for rounds in range(MAX_ROUNDS):
        if all(len(seen) >= per_ply for seen in found.values()):
            break
        for k, (_, learner_first) in enumerate(SEATS):
            vec = make_vec_env(env_id, RANDOM_GAMES, seed + (2 * rounds + k) * RANDOM_GAMES,
                               **{**kwargs, "opponent": "random", "learner_first": learner_first})
            try:
                games, _ = play_episodes(vec, random_moves, RANDOM_GAMES, record=True)
            finally:
                vec.close()
            for game in games:
                for t in range(len(game["actions"])):  # every position the learner's seat moved on is live
                    ply = 2 * t + (0 if learner_first else 1)
                    if ply in found:
                        found[ply].append((game["obs"][t], game["masks"][t]))
    out = {}
    for ply, seen in found.items():
        if seen:
            picked = rng.choice(len(seen), size=min(per_ply, len(seen)), replace=False)
            out[ply] = (np.stack([seen[i][0] for i in picked]), np.stack([seen[i][1] for i in picked]).astype(bool))
    return out


def grade_moves(act: Callable, perfect: PerfectPlay,
                positions: dict[int, tuple[np.ndarray, np.ndarray]]) -> dict[str, dict]:
    """The agent's moves (``act(obs, action_mask) -> actions``) on ``positions`` graded by the perfect
    scores, per band of ``perfect.ply_bands`` and for ``all``: ``positions``, ``optimal`` and ``blunder``
    rates, and the shares of positions ``won``, ``drawn`` and ``lost`` for the side to move."""
    rows = {"optimal": [], "blunder": [], "value": [], "ply": []}
    for ply, (obs, masks) in sorted(positions.items()):
        actions = np.asarray(act(obs, masks), dtype=np.int64).reshape(len(obs))
        values = perfect.move_values(obs, masks)
        best = values.max(axis=1)
        chosen = values[np.arange(len(obs)), actions]  # -inf for an illegal move: a blunder unless all is lost
        rows["optimal"].append(chosen == best)
        rows["blunder"].append(np.sign(chosen) < np.sign(best))
        rows["value"].append(np.sign(best))
        rows["ply"].append(np.full(len(obs), ply))
    columns = {k: np.concatenate(v) if v else np.zeros(0) for k, v in rows.items()}
    bands = [(f"{first}-{last}", first, last) for first, last in perfect.ply_bands]
    out = {}
    for label, first, last in [*bands, ("all", -np.inf, np.inf)]:
        chosen = (columns["ply"] >= first) & (columns["ply"] <= last)
        rates = {name: float(column[chosen].mean()) if chosen.any() else float("nan") for name, column in
                 (("optimal", columns["optimal"]), ("blunder", columns["blunder"]), ("won", columns["value"] > 0),
                  ("drawn", columns["value"] == 0), ("lost", columns["value"] < 0))}
        out[label] = {"positions": int(chosen.sum()), **rates}
    return out


def play_perfect(act: Callable, perfect: PerfectPlay, env_id: str, env_kwargs: dict, games: int,
                 seed: int) -> dict[str, dict[str, float]]:
    """``games`` games of the agent against :class:`PerfectPlayer` from each seat, from the empty board:
    ``{"first"|"second"|"both": {"win", "draw", "loss"}}`` rates."""
    from common.envs import make_vec_env, play_episodes

    kwargs = {k: v for k, v in env_kwargs.items() if k != "random_opening"}
    results = {}
    for seat, learner_first in SEATS:
        opponent = PerfectPlayer(perfect.move_values, seed)
        vec = make_vec_env(env_id, min(games, MATCH_ENVS), seed,
                           **{**kwargs, "opponent": opponent, "learner_first": learner_first})
        try:
            played, _ = play_episodes(vec, act, games)
        finally:
            vec.close()
        results[seat] = np.array([game["result"] for game in played], dtype=np.float64)
    results["both"] = np.concatenate([results["first"], results["second"]])
    return {seat: {"win": float(np.mean(r == 1)), "draw": float(np.mean(r == 0)), "loss": float(np.mean(r == -1))}
            for seat, r in results.items()}


def grade(act: Callable, env_id: str, env_kwargs: dict, per_ply: int, games: int, seed: int,
          perfect: PerfectPlay | None = None) -> dict:
    """The whole graded report of an agent (``act(obs, action_mask) -> actions``): ``perfect_player``,
    ``positions_per_ply``, ``positions`` (per band and ``all``, :func:`grade_moves`), ``games_per_seat``,
    ``vs_perfect`` (:func:`play_perfect`) and the ``seconds`` it took."""
    started = time.monotonic()
    perfect = perfect or perfect_play(env_id)
    positions = random_positions(env_id, env_kwargs, graded_plies(perfect), per_ply, seed)
    return {"perfect_player": perfect.name, "positions_per_ply": per_ply,
            "positions": grade_moves(act, perfect, positions), "games_per_seat": games,
            "vs_perfect": play_perfect(act, perfect, env_id, env_kwargs, games, seed),
            "seconds": round(time.monotonic() - started, 1)}


def text(graded: dict) -> list[str]:
    """The graded report as lines for ``python -m common.evaluate``'s text output."""
    lines = [f"  graded by a perfect player ({graded['perfect_player']}), {graded['positions_per_ply']} random "
             "positions per ply:"]
    for band, r in graded["positions"].items():
        label = "all plies" if band == "all" else f"plies {band}"
        lines.append(f"    {label:<12} optimal {r['optimal']:6.1%}  blunder {r['blunder']:6.1%}  ({r['positions']} "
                     f"positions: won {r['won']:.0%} / drawn {r['drawn']:.0%} / lost {r['lost']:.0%})")
    lines.append(f"  vs the perfect player, win / draw / loss, {graded['games_per_seat']} games from each seat:")
    lines.append("    " + "  ".join(f"{seat} {r['win']:4.0%} / {r['draw']:4.0%} / {r['loss']:4.0%}"
                                    for seat, r in graded["vs_perfect"].items()))
    return lines
