"""Where the learner should run: one update's time on the CPU and on a CUDA GPU, for the networks the
scripts train. Writes a markdown table to benchmarks/results/gpu_learners.md (CPU rows only without CUDA).

    python benchmarks/bench_gpu.py                 # every case, 3 s of updates each
    python benchmarks/bench_gpu.py --seconds 5

Cases, each with the update the scripts run (common/dqn.py's DQNLearner on a filled
common.replay.LocalReplay, common/ppo.py's ppo_update on a flat rollout), sampling and the
host-to-device copy included:

- DQN, Nature CNN on Atari frames (4 x 84 x 84 uint8, 6 actions), batch 32 (the Pong configs') and
  256: fp32 on the CPU; on the GPU in fp32, fp16 with a GradScaler (``mixed_precision: auto``) and bf16.
- DQN, 64 x 64 MLP on CartPole (batch 256): the CPU against the GPU.
- PPO, one update of configs/atari_breakout_ppo.yaml (1024 frames, minibatches of 256, 4 epochs)
  and of configs/cartpole_fast.yaml's torch learner (4096 steps, 32 x 32 MLP).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import gymnasium as gym  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from common import networks, ppo  # noqa: E402
from common.dqn import DQNLearner  # noqa: E402
from common.optim import FusedAdam  # noqa: E402
from common.ppo_learner import PPOSettings  # noqa: E402
from common.replay import LocalReplay  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
FRAMES = gym.spaces.Box(0, 255, (4, 84, 84), np.uint8)
CARTPOLE = gym.spaces.Box(-np.inf, np.inf, (4,), np.float32)


def timed(step, seconds: float, sync) -> tuple[float, int]:
    """Median seconds per call of ``step`` over ``seconds`` (after 5 warm-up calls), and the calls made."""
    for _ in range(5):
        step()
    sync()
    times, deadline = [], time.monotonic() + seconds
    while time.monotonic() < deadline or len(times) < 5:
        started = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - started)
    return statistics.median(times), len(times)


def sync_of(device: str):
    return torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)


def filled_replay(space: gym.Space, capacity: int, rng: np.random.Generator) -> LocalReplay:
    replay = LocalReplay(capacity, space.shape, obs_dtype=space.dtype)
    chunk = 1000
    for _ in range(capacity // chunk):
        if space.dtype == np.uint8:
            obs = rng.integers(0, 256, (chunk, *space.shape), dtype=np.uint8)
        else:
            obs = rng.standard_normal((chunk, *space.shape)).astype(space.dtype)
        replay.add_batch(obs, rng.integers(0, 2, chunk), rng.standard_normal(chunk).astype(np.float32), obs,
                         rng.random(chunk) < 0.01)
    return replay


def dqn_case(space, actions: int, hidden, batch: int, device: str, precision: str, replay, seconds: float):
    torch.manual_seed(0)
    q_net = networks.QNetwork(space, gym.spaces.Discrete(actions), hidden)
    learner = DQNLearner(q_net, torch.device(device), 1e-4, 10.0, 1000, precision=precision)
    return timed(lambda: learner.update(replay, batch), seconds, sync_of(device))


def ppo_case(space, action_space, hidden, rollout: int, minibatch: int, device: str, seconds: float):
    torch.manual_seed(0)
    agent = networks.ActorCritic(space, action_space, hidden, "tanh").to(device)
    optimizer = FusedAdam(agent.parameters(), lr=2.5e-4, eps=1e-5)
    rng = np.random.default_rng(0)
    if space.dtype == np.uint8:
        obs = rng.integers(0, 256, (rollout, *space.shape), dtype=np.uint8)
    else:
        obs = rng.standard_normal((rollout, *space.shape)).astype(np.float32)
    batch = {"obs": obs, "actions": rng.integers(0, action_space.n, rollout),
             "logprobs": np.full(rollout, -np.log(action_space.n), np.float32),
             "advantages": rng.standard_normal(rollout).astype(np.float32),
             "returns": rng.standard_normal(rollout).astype(np.float32),
             "values": rng.standard_normal(rollout).astype(np.float32)}
    settings = PPOSettings(4, minibatch, 0.1, True, 0.01, 0.5, 0.5, True, None)

    def step():
        tensors = {key: torch.as_tensor(array).to(device) for key, array in batch.items()}
        ppo.ppo_update(agent, optimizer, tensors, settings)

    return timed(step, seconds, sync_of(device))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="of timed updates per case")
    parser.add_argument("--only", default="", help="run only the cases whose name contains this (e.g. CNN)")
    parser.add_argument("--tf32", action="store_true", help="fp32 matrix products on TF32 tensor cores")
    parser.add_argument("--output", default="gpu_learners.md", help="file name under benchmarks/results/")
    args = parser.parse_args()
    if args.tf32:
        torch.backends.cuda.matmul.allow_tf32 = True
    cuda = torch.cuda.is_available()
    devices = ["cpu"] + (["cuda"] if cuda else [])
    rng = np.random.default_rng(0)
    rows = []

    def row(what: str, device: str, precision: str, samples: int, case) -> None:
        if args.only not in what:
            return
        seconds, calls = case()
        rows.append(f"| {what} | {device} | {precision} | {1000 * seconds:.2f} | {1 / seconds:,.0f} | "
                    f"{samples / seconds:,.0f} | {calls} |")
        print(rows[-1], flush=True)

    # the replays only for the cases that draw from them (20 000 frame pairs take 280 MB)
    frames = filled_replay(FRAMES, 20_000, rng) if any(args.only in f"DQN Nature CNN, batch {b}" for b in (32, 256)) \
        else None
    for batch in (32, 256):
        for device in devices:
            for precision in (("off",) if device == "cpu" else ("off", "fp16", "bf16")):
                row(f"DQN Nature CNN, batch {batch}", device, precision, batch,
                    partial(dqn_case, FRAMES, 6, (), batch, device, precision, frames, args.seconds))
    del frames
    vectors = filled_replay(CARTPOLE, 20_000, rng) if args.only in "DQN 64x64 MLP, batch 256" else None
    for device in devices:
        row("DQN 64x64 MLP, batch 256", device, "off", 256,
            partial(dqn_case, CARTPOLE, 2, (64, 64), 256, device, "off", vectors, args.seconds))
    for device in devices:
        row("PPO Nature CNN, 1024 frames, 4 epochs x 4 minibatches", device, "off", 1024,
            partial(ppo_case, FRAMES, gym.spaces.Discrete(4), (), 1024, 256, device, args.seconds))
        row("PPO 32x32 MLP, 4096 steps, 4 epochs x 2 minibatches", device, "off", 4096,
            partial(ppo_case, CARTPOLE, gym.spaces.Discrete(2), (32, 32), 4096, 2048, device, args.seconds))

    gpu = torch.cuda.get_device_name() if cuda else "none"
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    lines = [f"# Learner updates: CPU and GPU ({time.strftime('%Y-%m-%d')})", "",
             "`python benchmarks/bench_gpu.py` (medians of every timed update, after 5 warm-up updates).", "",
             f"Machine: {cpu}, {os.cpu_count()} logical cores (torch uses {torch.get_num_threads()} threads); "
             f"GPU: {gpu}; torch {torch.__version__}; TF32 matrix products {'on' if args.tf32 else 'off'}.", "",
             "| update | device | precision | ms per update | updates/s | samples/s | updates timed |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: |", *rows, ""]
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / args.output
    path.write_text("\n".join(lines))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
