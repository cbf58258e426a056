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
}


def register_builtin_envs() -> None:
    for env_id, entry in BUILTIN_ENVS.items():
        if env_id not in gym.registry:
            gym.register(id=env_id, **entry)
