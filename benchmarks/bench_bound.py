"""What this machine allows for a CartPole PPO run: the fastest such a run could possibly be.

    python benchmarks/bench_bound.py [--steps 80000] [--config configs/cartpole_fast.yaml]

Measures, each in a bare loop with no logging, no workers and no bookkeeping:

- the raw step rate of the config's vectorized env with random actions,
- one rollout step's policy inference on ``num_envs_per_worker`` observations (the numpy MLP the
  collector uses),
- one PPO minibatch of ``batch_size`` samples: forward, loss, backward, gradient clipping and the
  fused Adam step, in torch with the config's thread count,

and adds them up for a run of ``--steps`` env steps with the config's ``n_steps``, envs and
``n_epochs``: the time that run needs at the very least, on this machine. Compare it with the
training time (``time_budget`` of ``summary.json``) and the whole process of real runs, e.g.
``benchmarks/bench_vs_sb3.py cartpole``. Appends the table to benchmarks/results/bound.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import yaml  # noqa: E402

from common.envs import make_vec_env  # noqa: E402
from common.networks import ActorCritic  # noqa: E402
from common.optim import FusedAdam  # noqa: E402
from common.ppo import acting_for, ppo_update  # noqa: E402
from common.ppo_learner import PPOSettings  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "bound.md"


def best_of(repeats: int, measure) -> float:
    """The median of ``repeats`` measurements (seconds per unit)."""
    return statistics.median(measure() for _ in range(repeats))


def env_seconds_per_step(env_id: str, num_envs: int, vector_steps: int) -> float:
    envs = make_vec_env(env_id, num_envs, seed=0)
    envs.reset()
    space = envs.single_action_space
    actions = [np.array([space.sample() for _ in range(num_envs)]) for _ in range(64)]

    def measure() -> float:
        started = time.perf_counter()
        for i in range(vector_steps):
            envs.step(actions[i % 64])
        return (time.perf_counter() - started) / (vector_steps * num_envs)

    try:
        return best_of(5, measure)
    finally:
        envs.close()


def inference_seconds_per_call(agent: ActorCritic, obs: np.ndarray, calls: int) -> float:
    acting = acting_for(agent, seed=0)

    def measure() -> float:
        started = time.perf_counter()
        for _ in range(calls):
            acting.act(obs)
        return (time.perf_counter() - started) / calls

    return best_of(5, measure)


def update_seconds_per_minibatch(agent: ActorCritic, cfg: dict, obs: np.ndarray, rollouts: int) -> float:
    size = cfg["n_steps"] * cfg["num_envs_per_worker"]
    batch = {"obs": torch.as_tensor(obs[np.random.default_rng(0).integers(0, len(obs), size)]),
             "actions": torch.randint(0, 2, (size,)), "logprobs": torch.full((size,), -0.69),
             "advantages": torch.randn(size), "returns": torch.randn(size), "values": torch.randn(size)}
    optimizer = FusedAdam(agent.parameters(), lr=cfg["learning_rate"])
    settings = PPOSettings(cfg["n_epochs"], cfg["batch_size"], 0.2, False, 0.0, 0.5, 0.5)
    minibatches = cfg["n_epochs"] * (size // cfg["batch_size"])

    def measure() -> float:
        started = time.perf_counter()
        for _ in range(rollouts):
            ppo_update(agent, optimizer, batch, settings)
        return (time.perf_counter() - started) / (rollouts * minibatches)

    return best_of(5, measure)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "cartpole_fast.yaml"))
    parser.add_argument("--steps", type=int, default=80_000, help="env steps of the run to bound")
    args = parser.parse_args()
    cfg = yaml.safe_load(Path(args.config).read_text())
    torch.set_num_threads(cfg.get("torch_threads") or 1)
    env_id, num_envs = cfg["env_id"], cfg["num_envs_per_worker"]

    envs = make_vec_env(env_id, num_envs, seed=0)
    obs = [envs.reset()]
    for _ in range(255):
        obs.append(envs.step(np.array([envs.single_action_space.sample() for _ in range(num_envs)])).obs)
    agent = ActorCritic(envs.single_observation_space, envs.single_action_space)
    envs.close()
    observations = np.concatenate(obs).astype(np.float32)

    env_s = env_seconds_per_step(env_id, num_envs, 2000)
    infer_s = inference_seconds_per_call(agent, observations[:num_envs], 2000)
    update_s = update_seconds_per_minibatch(agent, cfg, observations, 3)

    rollout = cfg["n_steps"] * num_envs
    updates = args.steps / rollout
    parts = {"env steps (random actions)": args.steps * env_s,
             "policy inference (numpy MLP)": args.steps / num_envs * infer_s,
             "PPO update (forward + backward + Adam)": updates * cfg["n_epochs"] * (rollout // cfg["batch_size"])
             * update_s}
    rows = [f"| env step rate, {num_envs} envs, random actions | {1 / env_s:,.0f} steps/s |",
            f"| policy inference, {num_envs} observations | {infer_s * 1e6:.0f} us per rollout step |",
            f"| PPO minibatch of {cfg['batch_size']}: forward, backward, clip, Adam | {update_s * 1e3:.2f} ms |"]
    rows += [f"| {name}, {args.steps:,} steps | {seconds:.2f} s |" for name, seconds in parts.items()]
    rows.append(f"| **the least time a {args.steps:,}-step run can take** | **{sum(parts.values()):.2f} s** |")
    text = (f"## {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, {os.cpu_count()} cores, load average "
            f"{os.getloadavg()[0]:.2f}; {Path(args.config).name}: {num_envs} envs x {cfg['n_steps']} steps, "
            f"minibatch {cfg['batch_size']}, {cfg['n_epochs']} epochs, torch {torch.__version__}, "
            f"{torch.get_num_threads()} thread(s)\n\n| what | measured |\n|---|---|\n" + "\n".join(rows) + "\n")
    print(text)
    with open(RESULTS, "a") as f:
        f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
