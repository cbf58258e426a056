"""Gymnasium's numpy CartPole vector env, switched to same-step autoreset.

Gymnasium's ``CartPoleVectorEnv`` steps every copy in one numpy call but resets a
finished copy on the *next* step, which wastes that step and makes the transition
after a done meaningless. Here the reset happens in the same step, and the final
observation is reported in ``info["final_obs"]`` as every other vector env does.
"""

from __future__ import annotations

import numpy as np
from gymnasium.envs.classic_control.cartpole import CartPoleVectorEnv
from gymnasium.vector import AutoresetMode


class CartPoleSameStepVectorEnv(CartPoleVectorEnv):
    metadata = {**CartPoleVectorEnv.metadata, "autoreset_mode": AutoresetMode.SAME_STEP}

    def step(self, action):
        obs, reward, terminated, truncated, info = super().step(np.asarray(action))
        done = terminated | truncated
        if done.any():
            info = {"final_obs": obs.copy(), "_final_obs": done}
            count = int(done.sum())
            self.state[:, done] = self.np_random.uniform(low=self.low, high=self.high, size=(4, count))
            self.steps[done] = 0
            obs = self.state.T.astype(np.float32)
        # The parent would reset these copies on the next call; they are reset already.
        self.prev_done[:] = False
        return obs, reward, terminated, truncated, info
