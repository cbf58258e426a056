"""A worker's collection against the env's own rate: steps/s of train_parallel_timed.py's rollout, over a
Gymnasium ``SyncVectorEnv`` of the same envs stepped with random actions, in one process, measured in turns.

    python benchmarks/bench_collection.py                      # lunar and halfcheetah, the scripts' settings
    python benchmarks/bench_collection.py lunar --repeats 9 --envs-per-worker 8 16
    benchmarks/prioritized.sh .venv/bin/python benchmarks/bench_collection.py

For each env (``lunar``: train_parallel_timed.py's defaults, LunarLander-v3; ``halfcheetah``:
``configs/halfcheetah.yaml``, HalfCheetah-v5) and each envs-per-worker count (default: the config's; another
count keeps the rollout's size, with ``n_steps`` scaled to it):

- **env**: a ``SyncVectorEnv`` of ``num_envs_per_worker`` copies (same-step autoreset, as the scripts
  make them), stepped with ``action_space.sample()`` of the whole batch: the env's own rate.
- **collect**: what a rollout worker runs (``train_parallel_timed.make_collector`` and
  ``collect_published``): the numpy actor-critic acting from parameters published under the seqlock, the
  normalizer with the published statistics, the rollout written into shared memory. A fresh policy.

The two alternate, ``--repeats`` times each (``--rollouts`` rollouts of ``n_steps`` per turn), so a change in
the machine's load falls on both (in the order env, collect, collect, env, ...); reported are the medians of the
rates and the median of the ratios of neighbouring turns, by the wall clock and by the process's CPU time
(which differ where other processes take the core from the benchmark). Then one more run with
a stopwatch on each part of a vector step gives microseconds per vector step: the gym env's own step, the
VecEnv's bookkeeping around it, the policy (and of that, the forward pass; the rest is sampling),
normalization, the values of truncated episodes' final observations and of the last one, and the rest
(writing the rollout, the parameter check, the loop); the gym env's step over the total is the ratio again,
from one run (less disturbed by other processes than the turns, on a shared machine). Appends the tables to
benchmarks/results/collection_ratio.md.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import time
from collections import defaultdict
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import common  # noqa: E402,F401,I001 (first: one BLAS thread, as in the scripts' processes)
from gymnasium.vector import AutoresetMode, SyncVectorEnv  # noqa: E402

import train_parallel_timed as timed  # noqa: E402
from common.config import parse_config  # noqa: E402
from common.envs import make_env, make_vec_env  # noqa: E402
from common.network_spec import actor_critic_spec  # noqa: E402
from common.numpy_actor_critic import MLPActorCritic  # noqa: E402
from common.rollout import make_normalizer  # noqa: E402
from common.shm import SharedArrays, attach_all  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "collection_ratio.md"
CONFIGS = {"lunar": [], "halfcheetah": ["--config", str(ROOT / "configs" / "halfcheetah.yaml")]}


def env_only(cfg, num_envs: int, seed: int):
    """The env's own rate: a function stepping a SyncVectorEnv ``steps`` vector steps with random actions."""
    envs = SyncVectorEnv([make_env(cfg.env_id, seed, i) for i in range(num_envs)],
                         autoreset_mode=AutoresetMode.SAME_STEP)
    envs.reset(seed=seed)
    envs.action_space.seed(seed)

    def run(steps: int) -> tuple[float, float]:
        started, cpu = time.perf_counter(), time.process_time()
        for _ in range(steps):
            envs.step(envs.action_space.sample())
        return time.perf_counter() - started, time.process_time() - cpu

    return run, envs.close


class Worker:
    """A rollout worker's collector over ``num_envs`` envs, in this process, with its shared memory."""

    def __init__(self, cfg, seed: int):
        self.cfg = cfg
        probe = make_vec_env(cfg.env_id, 1, seed)
        spaces = probe.single_observation_space, probe.single_action_space
        probe.close()
        net = MLPActorCritic(actor_critic_spec(*spaces, cfg.hidden_sizes, cfg.activation, cfg.log_std_init),
                             *spaces, seed)
        normalizer = make_normalizer(cfg, *spaces)
        self.arrays = SharedArrays()
        timed.rollout_arrays(self.arrays, cfg, *spaces, net.params.size, normalizer.size())
        self.shared, self.handles = attach_all(self.arrays.specs())  # as a worker attaches
        timed.shared_params(self.shared).write(lambda row: row.__setitem__(slice(None), net.params))
        normalizer.publish(self.shared["norm"])
        self.rollout = timed.split_rollouts(self.shared)[0]
        self.envs = make_vec_env(cfg.env_id, cfg.num_envs_per_worker, seed)
        self.collector = timed.make_collector(cfg, self.envs, self.rollout, 0, seed, self.shared)

    def run(self, rollouts: int) -> tuple[float, float]:
        """Wall and CPU seconds of ``rollouts`` rollouts."""
        started, cpu = time.perf_counter(), time.process_time()
        for _ in range(rollouts):
            timed.collect_published(self.collector, self.shared, self.rollout, self.cfg.n_steps)
        return time.perf_counter() - started, time.process_time() - cpu

    def close(self) -> None:
        self.envs.close()
        self.rollout = self.collector = None
        for name in list(self.shared):
            self.shared[name] = None
        for handle in self.handles:
            handle.close()
        self.arrays.unlink_all()


def stopwatch(owner, name: str, totals: dict, key: str) -> None:
    """Replace ``owner.name`` by the same call that adds its seconds to ``totals[key]``."""
    inner = getattr(owner, name)

    def timed_call(*args, **kwargs):
        started = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            totals[key] += time.perf_counter() - started

    setattr(owner, name, timed_call)


def breakdown(cfg, seed: int, rollouts: int) -> dict[str, float]:
    """Microseconds per vector step of each part of collection (one extra run with stopwatches)."""
    worker = Worker(cfg, seed)
    try:
        worker.run(1)  # warm
        collector, totals = worker.collector, defaultdict(float)
        acting, normalizer = collector.acting, collector.normalizer
        stopwatch(worker.envs.env, "step", totals, "env step (gym)")
        stopwatch(worker.envs, "step", totals, "vec")
        stopwatch(acting, "act", totals, "policy: forward pass and sampling")
        if hasattr(acting, "heads"):  # (an older revision's acting has no separate forward pass to time)
            stopwatch(acting, "heads", totals, "  of which the forward pass")
        stopwatch(acting, "value", totals, "values (truncations, rollout end)")
        if hasattr(normalizer, "observations_now"):
            observations_now = normalizer.observations_now

            def timed_normalization():  # the function a rollout normalizes with, timed
                holder = type("Holder", (), {"normalize": staticmethod(observations_now())})
                stopwatch(holder, "normalize", totals, "normalization")
                return holder.normalize

            normalizer.observations_now = timed_normalization
        else:
            stopwatch(normalizer, "observations", totals, "normalization")
        elapsed = worker.run(rollouts)[0]
        vector_steps = rollouts * cfg.n_steps
        # what runs inside another part counts there alone
        totals["VecEnv bookkeeping"] = totals.pop("vec") - totals["env step (gym)"]
        out = {key: seconds / vector_steps * 1e6 for key, seconds in totals.items()}
        inside = sum(seconds for key, seconds in totals.items() if not key.startswith(" "))
        out["rest (rollout writes, parameter check, loop)"] = (elapsed - inside) / vector_steps * 1e6
        out["total"] = elapsed / vector_steps * 1e6
        return out
    finally:
        worker.close()


def measure(name: str, envs_per_worker: int | None, repeats: int, rollouts: int, seed: int) -> dict:
    cfg = parse_config(timed.Config, CONFIGS[name])
    if envs_per_worker:  # the same rollout per worker: n_steps scaled to the envs
        cfg = parse_config(timed.Config, CONFIGS[name] + [
            "--num-envs-per-worker", str(envs_per_worker),
            "--n-steps", str(max(1, cfg.n_steps * cfg.num_envs_per_worker // envs_per_worker))])
    steps = rollouts * cfg.n_steps
    env_run, env_close = env_only(cfg, cfg.num_envs_per_worker, seed)
    worker = Worker(cfg, seed)
    wall: dict[str, list[float]] = {"env": [], "collect": []}
    cpu: dict[str, list[float]] = {"env": [], "collect": []}
    turns = {"env": lambda: env_run(steps), "collect": lambda: worker.run(rollouts)}
    try:
        env_run(cfg.n_steps)
        worker.run(1)  # warm both
        for repeat in range(repeats):
            # env, collect, then collect, env: a drift in the machine's speed falls on both alike
            for key in ("env", "collect") if repeat % 2 == 0 else ("collect", "env"):
                seconds = turns[key]()
                wall[key].append(steps * cfg.num_envs_per_worker / seconds[0])
                cpu[key].append(steps * cfg.num_envs_per_worker / seconds[1])
    finally:
        env_close()
        worker.close()
    result = {"name": name, "cfg": cfg, "parts": breakdown(cfg, seed, rollouts)}
    for clock, rates in (("wall", wall), ("cpu", cpu)):
        paired = [c / e for c, e in zip(rates["collect"], rates["env"])]  # each turn against its neighbour
        result[clock] = {"env": statistics.median(rates["env"]), "collect": statistics.median(rates["collect"]),
                         "ratio": statistics.median(paired), "spread": (min(paired), max(paired))}
    return result


def describe(result: dict) -> str:
    cfg = result["cfg"]
    return (f"{cfg.env_id}, {cfg.num_envs_per_worker} envs x {cfg.n_steps} steps, "
            f"MLP {'x'.join(map(str, cfg.hidden_sizes))} {cfg.activation}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("envs", nargs="*", help=f"of {', '.join(CONFIGS)} (default: all)")
    parser.add_argument("--envs-per-worker", type=int, nargs="+", default=[0],
                        help="envs per worker, one row each (0: the config's)")
    parser.add_argument("--repeats", type=int, default=7, help="turns of each, alternating")
    parser.add_argument("--rollouts", type=int, default=2, help="rollouts of n_steps per turn")
    parser.add_argument("--seed", type=int, default=1)
    opts = parser.parse_args()
    names = opts.envs or list(CONFIGS)
    if set(names) - set(CONFIGS):
        parser.error(f"unknown env {sorted(set(names) - set(CONFIGS))[0]!r}: choose from {', '.join(CONFIGS)}")
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    results = []
    for name in names:
        for count in opts.envs_per_worker:
            results.append(measure(name, count or None, opts.repeats, opts.rollouts, opts.seed))
            r = results[-1]
            print(f"{describe(r)}: env {r['wall']['env']:,.0f} steps/s, collect {r['wall']['collect']:,.0f} steps/s, "
                  f"ratio {r['wall']['ratio']:.1%} (CPU time: {r['cpu']['ratio']:.1%})", file=sys.stderr, flush=True)
    rows = ["| env | clock | env steps/s (random actions) | collect steps/s | collect / env | per pair, low-high |",
            "|---|---|---|---|---|---|"]
    for r in results:
        for clock in ("wall", "cpu"):
            m = r[clock]
            low, high = m["spread"]
            rows.append(f"| {describe(r)} | {clock} | {m['env']:,.0f} | {m['collect']:,.0f} | **{m['ratio']:.1%}** | "
                        f"{low:.0%}-{high:.0%} |")
    parts = list(dict.fromkeys(key for r in results for key in r["parts"]))
    rows += ["", "| µs per vector step | " + " | ".join(describe(r) for r in results),
             "|---|" + "---|" * len(results)]
    for key in parts:
        rows.append(f"| {key} | " + " | ".join(f"{r['parts'].get(key, 0.0):.1f}" for r in results) + " |")
    # the same ratio from within one run: steadier than the turns' where other processes come and go
    rows.append("| **gym env step / total** | " + " | ".join(
        f"**{r['parts']['env step (gym)'] / r['parts']['total']:.1%}**" for r in results) + " |")
    argv = shlex.join(sys.argv[1:])
    section = "\n".join([
        f"## {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, load {load}",
        "", f"`python benchmarks/bench_collection.py {argv}`".replace(" `", "`"),
        f"({opts.repeats} turns of each, alternating, {opts.rollouts} rollout(s) per turn; medians of the rates "
        "and of the paired ratios)", "", *rows, ""])
    print(section)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    with open(RESULTS, "a") as f:
        f.write(section + "\n")


if __name__ == "__main__":
    main()
