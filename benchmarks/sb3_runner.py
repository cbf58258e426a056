"""Stable-Baselines3 with rl-baselines3-zoo's settings, for side-by-side benchmarks (not part of the project).

    python benchmarks/sb3_runner.py ppo CartPole-v1 --seed 1 --target 475 --max-steps 300000 --out run.csv

Installed from requirements-bench.txt; only the benchmarks run it, in its own process, so that its
whole-process time (Python, torch and SB3 start-up included) is measured the same way as the
project's scripts. It stops when the mean return of the last 100 training episodes (SB3's own
``ep_info_buffer``) reaches ``--target``, after ``--max-steps`` env steps or after ``--seconds`` of
training, and writes a row ``wall_time, global_step, episodes, return_mean100`` every
``--log-every`` seconds, plus a last one.
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
import time

# rl-baselines3-zoo, hyperparams/ppo.yml and dqn.yml (HalfCheetah-v3's tuned settings, used for v5).
ZOO = {
    ("ppo", "CartPole-v1"): {"n_envs": 8, "policy": "MlpPolicy", "n_steps": 32, "batch_size": 256,
                             "gae_lambda": 0.8, "gamma": 0.98, "n_epochs": 20, "ent_coef": 0.0,
                             "learning_rate": "lin_0.001", "clip_range": "lin_0.2"},
    ("ppo", "Pendulum-v1"): {"n_envs": 4, "policy": "MlpPolicy", "n_steps": 1024, "gae_lambda": 0.95,
                             "gamma": 0.9, "n_epochs": 10, "ent_coef": 0.0, "learning_rate": 1e-3,
                             "clip_range": 0.2, "use_sde": True, "sde_sample_freq": 4},
    ("ppo", "HalfCheetah-v5"): {"normalize": True, "n_envs": 1, "policy": "MlpPolicy", "batch_size": 64,
                                "n_steps": 512, "gamma": 0.98, "learning_rate": 2.0633e-05,
                                "ent_coef": 0.000401762, "clip_range": 0.1, "n_epochs": 20, "gae_lambda": 0.92,
                                "max_grad_norm": 0.8, "vf_coef": 0.58096,
                                "policy_kwargs": "dict(log_std_init=-2, ortho_init=False, activation_fn=nn.ReLU, "
                                                 "net_arch=dict(pi=[256, 256], vf=[256, 256]))"},
    ("dqn", "CartPole-v1"): {"policy": "MlpPolicy", "learning_rate": 2.3e-3, "batch_size": 64, "buffer_size": 100000,
                             "learning_starts": 1000, "gamma": 0.99, "target_update_interval": 10, "train_freq": 256,
                             "gradient_steps": 128, "exploration_fraction": 0.16, "exploration_final_eps": 0.04,
                             "policy_kwargs": "dict(net_arch=[256, 256])"},
}


def schedule(value):
    """rl-zoo's ``lin_X``: linearly from X to 0 over training."""
    if isinstance(value, str) and value.startswith("lin_"):
        start = float(value[4:])
        return lambda progress_remaining: progress_remaining * start
    return value


def build(algo: str, env_id: str, seed: int):
    import torch.nn as nn  # noqa: F401  (policy_kwargs strings name it)
    from stable_baselines3 import DQN, PPO
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.vec_env import VecNormalize

    settings = dict(ZOO[(algo, env_id)])
    n_envs, normalize = settings.pop("n_envs", 1), settings.pop("normalize", False)
    policy = settings.pop("policy")
    env = make_vec_env(env_id, n_envs=n_envs, seed=seed)
    if normalize:
        env = VecNormalize(env)
    for key in ("learning_rate", "clip_range"):
        if key in settings:
            settings[key] = schedule(settings[key])
    if "policy_kwargs" in settings:
        settings["policy_kwargs"] = eval(settings["policy_kwargs"])  # the zoo writes them as Python
    cls = {"ppo": PPO, "dqn": DQN}[algo]
    return cls(policy, env, seed=seed, device="cpu", verbose=0, **settings)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("algo", choices=["ppo", "dqn"])
    parser.add_argument("env_id")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--target", type=float, default=math.inf)
    parser.add_argument("--max-steps", type=int, default=10**9)
    parser.add_argument("--seconds", type=float, default=math.inf)
    parser.add_argument("--log-every", type=float, default=5.0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    import torch
    from stable_baselines3.common.callbacks import BaseCallback

    torch.set_num_threads(1)  # as the project's learners; SB3's small MLPs gain nothing from more
    model = build(args.algo, args.env_id, args.seed)
    rows: list[dict] = []
    started = time.monotonic()

    class Watch(BaseCallback):
        last = -math.inf

        def _on_step(self) -> bool:
            now = time.monotonic() - started
            buffer = self.model.ep_info_buffer
            mean = float(sum(e["r"] for e in buffer) / len(buffer)) if len(buffer) == 100 else math.nan
            solved = mean >= args.target
            if now - self.last >= args.log_every or solved or now >= args.seconds:
                self.last = now
                rows.append({"wall_time": round(now, 3), "global_step": self.num_timesteps,
                             "episodes": self.model._episode_num, "return_mean100": mean})
            return not solved and now < args.seconds

    model.learn(total_timesteps=args.max_steps, callback=Watch())
    with open(args.out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["wall_time", "global_step", "episodes", "return_mean100"])
        writer.writeheader()
        writer.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
