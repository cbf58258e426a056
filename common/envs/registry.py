"""Registration of the project's built-in environments with Gymnasium.

Each built-in lives in its own module of this package and is registered here by id,
with its single-env entry point and its numpy-vectorized entry point.
"""

from __future__ import annotations

import gymnasium as gym

BUILTIN_ENVS: dict[str, dict] = {
    "Market-v0": {"entry_point": "common.envs.market:MarketEnv",
                  "vector_entry_point": "common.envs.market:MarketVectorEnv"},
    "ConnectFour-v0": {"entry_point": "common.envs.connect_four:ConnectFourEnv",
                       "vector_entry_point": "common.envs.connect_four:ConnectFourVectorEnv"},
    "GridCoverage-v0": {"entry_point": "common.envs.grid_coverage:GridCoverageEnv",
                        "vector_entry_point": "common.envs.grid_coverage:GridCoverageVectorEnv"},
    "Catch-v0": {"entry_point": "common.envs.catch:CatchEnv", "vector_entry_point": "common.envs.catch:CatchVectorEnv",
                 "reward_threshold": 0.9},
    # Shogi on cshogi (an extra, imported when the env is made): seed 004's game and sizes
    "Shogi-v0": {"entry_point": "common.envs.shogi:ShogiEnv", "vector_entry_point": "common.envs.shogi:ShogiVectorEnv"},
    # PettingZoo's two-player classic games through one adapter (common/envs/pettingzoo_games.py), by their ids in
    # PettingZoo's registry (classic/tictactoe-v3 ...); PettingZoo itself is imported when one is made.
    **{f"pettingzoo/{game}": {"entry_point": f"common.envs.pettingzoo_games:{name}Env",
                              "vector_entry_point": f"common.envs.pettingzoo_games:{name}VectorEnv"}
       for game, name in (("tictactoe-v3", "TicTacToe"), ("connect_four-v3", "PettingZooConnectFour"),
                          ("go-v5", "Go"))},
}


def register_builtin_envs() -> None:
    for env_id, entry in BUILTIN_ENVS.items():
        if env_id not in gym.registry:
            gym.register(id=env_id, **entry)


def _mean(values) -> float:
    values = [float(v) for v in values]
    return sum(values) / len(values) if values else float("nan")


def builtin_scores(env_id: str) -> dict:
    """How good a policy is on a built-in env, beyond its return: name -> (env kwargs for the
    episodes it is measured on, {} = the evaluation episodes themselves; function of those episodes)."""
    if env_id in ("ConnectFour-v0", "Shogi-v0"):
        return {f"win_rate_vs_{name}": ({"opponent": name}, lambda eps: _mean(e["result"] == 1 for e in eps))
                for name in ("random", "heuristic")}
    if env_id.startswith("pettingzoo/"):  # win rates against the game's players a training mix may hold
        from common.envs.pettingzoo_games import GAMES

        game = GAMES[env_id]
        return {f"win_rate_vs_{name}": ({"opponent": name}, lambda eps: _mean(e["result"] == 1 for e in eps))
                for name in game.evaluation_opponents if name not in game.held_out}
    if env_id == "Catch-v0":
        return {"catch_rate": ({}, lambda eps: _mean(e["caught"] for e in eps))}
    if env_id == "GridCoverage-v0":
        return {"mean_coverage": ({}, lambda eps: _mean(e["coverage"] for e in eps))}
    if env_id == "Market-v0":  # the reward is the change of net worth in % of the initial cash
        return {"profit_percent": ({}, lambda eps: _mean(e["return"] for e in eps)),
                "mean_net_worth": ({}, lambda eps: _mean(e["net_worth"] for e in eps))}
    return {}


# Evaluation plays a built-in env with these settings over the training ones: the market's
# held-out part of the history, never seen in training.
EVALUATION_KWARGS = {"Market-v0": {"split": "eval"}}
