"""Your own training loop on ParallelManager, with your own model and your own env (seed 004's example).

The env (``Nim``) and the model (``ActorCritic``) are defined in this file, as a user's own
would be in theirs. ``ParallelManager`` takes the env as it takes the model: ``env_factory=Nim``,
and ``env_config``'s keys (``heap_size``, ``max_take``) reach ``Nim(...)`` unchanged. The
workers play whole games with the model's latest weights, sampling from its legal logits; the
loop below is the user's: collect -> train -> sync, a policy-gradient update with a value baseline.

    python examples/parallel_training_example.py                   # 30-45 s on 2 cores
    python examples/parallel_training_example.py --iterations 3    # a shorter run
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import gymnasium as gym
import numpy as np
import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from a fresh clone: the project's modules are in the repository root
    sys.path.insert(0, str(ROOT))

from common.parallel_manager import ParallelManager  # noqa: E402  (needs the repository root on sys.path)
from common.rollout_worker import sample_actions  # noqa: E402


class Nim(gym.Env):
    """Take 1 to ``max_take`` stones from a heap of ``heap_size``; whoever takes the last stone wins.

    The learner moves first; the opponent, inside the env, takes a random legal number of stones.
    Observation: the stones left, one-hot; action ``a`` takes ``a + 1`` stones, and
    ``info["action_mask"]`` marks the legal ones (never more than are left). Reward +1 for a win,
    -1 for a loss. Whoever leaves a multiple of ``max_take + 1`` stones can always win.
    """

    def __init__(self, heap_size: int = 21, max_take: int = 3):
        self.heap_size, self.max_take = heap_size, max_take
        self.observation_space = gym.spaces.Box(0.0, 1.0, (heap_size + 1,), np.float32)
        self.action_space = gym.spaces.Discrete(max_take)

    def _observe(self) -> tuple[np.ndarray, dict]:
        obs = np.zeros(self.heap_size + 1, dtype=np.float32)
        obs[self.stones] = 1.0
        return obs, {"action_mask": np.arange(1, self.max_take + 1) <= self.stones}

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self.stones = self.heap_size
        return self._observe()

    def step(self, action):
        take = int(action) + 1
        if take > self.stones:
            raise ValueError(f"cannot take {take} stones, {self.stones} left")
        self.stones -= take
        if self.stones == 0:
            return *self._observe()[:1], 1.0, True, False, self._observe()[1]
        self.stones -= int(self.np_random.integers(1, min(self.max_take, self.stones) + 1))
        obs, info = self._observe()
        return obs, -1.0 if self.stones == 0 else 0.0, self.stones == 0, False, info


class ActorCritic(nn.Module):
    """Seed 004's kind of model: one body, a policy head and a value head; ``forward`` -> ``(logits, value)``."""

    def __init__(self, input_dim: int, hidden_dim: int, action_dim: int):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(input_dim, hidden_dim), nn.Tanh())
        self.policy = nn.Linear(hidden_dim, action_dim)
        self.value = nn.Linear(hidden_dim, 1)

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = self.body(obs)
        return self.policy(features), self.value(features).squeeze(-1)


def train_model(model: ActorCritic, optimizer: torch.optim.Optimizer, episodes: list[dict]) -> float:
    """One policy-gradient step on whole episodes: the return of each move (the game's result)
    against the value head's estimate, over the legal actions only."""
    obs = torch.as_tensor(np.concatenate([e["obs"][:-1] for e in episodes]))
    actions = torch.as_tensor(np.concatenate([e["actions"] for e in episodes]))
    legal = torch.as_tensor(np.concatenate([e["masks"][:-1] for e in episodes]))
    returns = torch.as_tensor(np.concatenate([np.cumsum(e["rewards"][::-1])[::-1] for e in episodes]).copy())
    logits, values = model(obs)
    log_probs = torch.log_softmax(logits.masked_fill(~legal, -1e9), dim=1)
    advantages = returns - values.detach()
    entropy = -(log_probs.exp() * log_probs).sum(dim=1).mean()
    loss = (-(log_probs.gather(1, actions[:, None]).squeeze(1) * advantages).mean()
            + 0.5 * (returns - values).pow(2).mean() - 0.01 * entropy)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return float(loss.detach())


def win_rate(manager: ParallelManager, games: int) -> float:
    """Games won by the current weights, played by the workers as they collect (sampling)."""
    return float(np.mean([episode["return"] > 0 for episode in manager.evaluate(games)]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=60, help="collect -> train -> sync rounds")
    parser.add_argument("--workers", type=int, default=2, help="rollout worker processes")
    parser.add_argument("--heap-size", type=int, default=21, help="stones at the start (an env_config key)")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    env_config = {"heap_size": args.heap_size, "max_take": 3}  # Nim's keyword arguments, as seed 004's board_size
    parallel_config = {"num_workers": args.workers, "games_per_worker": 32, "max_game_length": 50,
                       "model_sync_interval": 1, "timeout": 30.0}
    probe = Nim(**env_config)
    model = ActorCritic(int(np.prod(probe.observation_space.shape)), 64, int(probe.action_space.n))
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    started = time.monotonic()
    # epsilon=0: the workers sample from the policy itself (sample_actions), as a policy gradient needs
    with ParallelManager(env_config, parallel_config=parallel_config, model=model, env_factory=Nim,
                         act_fn=sample_actions, epsilon=0.0) as manager:
        print(f"env {manager.spec.env_id} {env_config}: observations {manager.observation_space.shape}, "
              f"{manager.action_space.n} actions, action mask: {manager.action_mask}")
        manager.start_workers(wait=True)
        before = win_rate(manager, 200)
        games = 0
        for step in range(1, args.iterations + 1):
            batches = manager.collect_experiences()
            episodes = [episode for batch in batches for episode in batch.episodes]
            if not episodes:
                continue
            loss = train_model(model, optimizer, episodes)
            games += len(episodes)
            if manager.synchronizer.should_sync(step):
                manager.sync_model_to_workers(learner_step=step)
            if step % 10 == 0 or step == args.iterations:
                wins = np.mean([episode["return"] > 0 for episode in episodes])
                print(f"iteration {step}: {games} games, won {wins:.2f} of this batch's, loss {loss:.3f}, "
                      f"model version {manager.model_version}")
        after = win_rate(manager, 200)
        status = manager.get_status()
    print(f"win rate against the random player: {before:.2f} before training, {after:.2f} after {games} games "
          f"({time.monotonic() - started:.1f} s, {len(status['workers'])} workers, "
          f"{status['total_restarts']} restarts)")
    return 0


if __name__ == "__main__":  # workers start with spawn and import this file again: the loop runs here only
    sys.exit(main())
