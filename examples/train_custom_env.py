"""Your own env, trained from Python without registering it: ``train(config, env_factory=...)``.

``Corridor`` below is a Gymnasium env of our own, defined in this file. ``env_factory=Corridor``
makes it the run's env: its id becomes ``"examples.train_custom_env:Corridor"`` (the module and
the name every worker process imports it by), which ``config.yaml``, ``summary.json`` and the
checkpoints keep, so ``--resume`` and ``python -m common.evaluate RUN_DIR`` find it again.
``env_kwargs`` reach ``Corridor(...)`` as keyword arguments. Any of the four training scripts
takes ``env_factory`` the same way; this one uses ``train_parallel_timed`` (PPO).

    python examples/train_custom_env.py                      # about 10 s on 2 cores
    python examples/train_custom_env.py --timesteps 2048     # a shorter run
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import gymnasium as gym
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from a fresh clone: the project's modules are in the repository root
    sys.path.insert(0, str(ROOT))

import train_parallel_timed  # noqa: E402  (needs the repository root on sys.path)


class Corridor(gym.Env):
    """Walk to the exit the observation points at: ``length`` cells, the agent starts in the middle.

    Observation: ``[position in -1..1, side of the exit: -1 or +1]``; actions: 0 = left, 1 = right.
    Reaching the exit pays +1, the wrong end -1, every step costs 0.01; an episode is cut after
    ``2 * length`` steps. A random walk earns about -0.12 on average; the best policy 0.96 (length 8).
    """

    def __init__(self, length: int = 8):
        self.length = length
        self.observation_space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
        self.action_space = gym.spaces.Discrete(2)

    def _obs(self) -> np.ndarray:
        return np.array([2 * self.position / self.length - 1, self.exit], dtype=np.float32)

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self.position, self.steps = self.length // 2, 0
        self.exit = float(self.np_random.choice([-1.0, 1.0]))
        return self._obs(), {}

    def step(self, action):
        self.position += 1 if int(action) == 1 else -1
        self.steps += 1
        at_end = self.position in (0, self.length)
        reward = -0.01
        if at_end:
            reward += 1.0 if (self.position == self.length) == (self.exit > 0) else -1.0
        return self._obs(), reward, at_end, self.steps >= 2 * self.length, {}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timesteps", type=int, default=24_576, help="environment steps to train for")
    parser.add_argument("--length", type=int, default=8, help="cells in the corridor (an env keyword argument)")
    parser.add_argument("--output-dir", default=None, help="run directory (default runs/train_parallel_timed/...)")
    args = parser.parse_args(argv)

    config = train_parallel_timed.Config(
        env_kwargs=[f"length={args.length}"], num_workers=2, num_envs_per_worker=4, n_steps=64, batch_size=128,
        total_timesteps=args.timesteps, duration=None, target_return="none", gamma=0.99, learning_rate=1e-3,
        hidden_sizes=[32], tensorboard=False, output_dir=args.output_dir)
    summary = train_parallel_timed.train(config, env_factory=Corridor)
    best = 1 - 0.01 * args.length / 2  # the straight walk to either exit, on average
    mean = summary["final_mean_return"]  # the mean of the last 100 returns: None before 100 episodes
    print(f"env {summary['env_id']}: {summary['episodes']} episodes in {summary['global_step']} steps, "
          f"{summary['wall_time_s']:.1f} s; mean return of the last 100 episodes "
          f"{'(fewer than 100 episodes)' if mean is None else f'{mean:.2f}'} (the best policy: {best:.2f})")
    print(f"run directory: {summary['run_dir']}")
    return summary["exit_code"]


if __name__ == "__main__":  # workers start with spawn and import this file again: the run starts here only
    sys.exit(main())
