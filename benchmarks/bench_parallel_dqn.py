"""Benchmarks of parallel_train_dqn.py: time to solve CartPole, Connect Four win rates, throughput.

    python benchmarks/bench_parallel_dqn.py throughput             # episodes/s with 1 and 2 workers, updates/s
    python benchmarks/bench_parallel_dqn.py cartpole --seeds 1 2 3 4 5
    python benchmarks/bench_parallel_dqn.py connect-four --minutes 15 --seeds 1 2 3   # the defaults
    python benchmarks/bench_parallel_dqn.py connect-four --runs RUN... --search-depth 0 2   # + lookahead at evaluation
    python benchmarks/bench_parallel_dqn.py connect-four --runs RUN... --grade          # + graded by a perfect player

Each writes a Markdown table to benchmarks/results/parallel_dqn_<name>.md together with
the machine's core count and load average, since timings on a shared machine move with
whatever else runs on it.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results"
SCRIPT = ROOT / "parallel_train_dqn.py"


def machine_line() -> str:
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return (f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC, {os.cpu_count()} logical cores, "
            f"load average (1, 5, 15 min) {load}")


def run_training(args: list[str], output_dir: Path, timeout: float, keep_at_s: tuple[float, ...] = ()) -> dict:
    """Run parallel_train_dqn.py to its end; ``keep_at_s``: copy the run's newest checkpoint once that many
    seconds have passed, to ``checkpoints/at_<seconds>s.pt`` (a training curve to grade afterwards)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    stderr_path = output_dir.parent / f"{output_dir.name}.stderr"
    started = time.monotonic()
    with open(stderr_path, "w") as stderr:  # a file, not a pipe: nobody reads a pipe while the run goes on
        proc = subprocess.Popen([sys.executable, str(SCRIPT), *args, "--output-dir", str(output_dir)], env=env,
                                stdout=subprocess.DEVNULL, stderr=stderr)
        pending = sorted(keep_at_s)
        while proc.poll() is None and time.monotonic() - started < timeout:
            time.sleep(0.05)  # the process's wall time is measured to this
            latest = output_dir / "checkpoints" / "latest.pt"
            if pending and time.monotonic() - started >= pending[0] and latest.exists():
                shutil.copyfile(latest, output_dir / "checkpoints" / f"at_{pending.pop(0):g}s.pt")
        if proc.poll() is None:
            proc.kill()
        returncode = proc.wait()
    wall = time.monotonic() - started
    tail = stderr_path.read_text()[-500:]
    stderr_path.unlink()
    summary_path = output_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    return {"returncode": returncode, "process_wall_s": wall, **summary, "stderr_tail": tail if returncode else ""}


def bench_cartpole(opts) -> None:
    rows = []
    load_before = machine_line()
    for seed in opts.seeds:
        out = Path(opts.work_dir) / f"cartpole_{seed}_{int(time.time())}"
        result = run_training(["--config", str(ROOT / "configs" / "parallel_dqn_cartpole.yaml"), "--seed", str(seed),
                               "--num-workers", str(opts.workers), "--no-tensorboard",
                               *(opts.extra.split() if opts.extra else [])], out, opts.timeout)
        result["solved_at_s"] = result["wall_time_s"] if result.get("stop_reason", "").startswith("target") else None
        rows.append((seed, result))
        print(f"seed {seed}: solved_at_s={result['solved_at_s']} wall={result['process_wall_s']:.1f}s "
              f"mean100={result.get('final_mean_return')}", flush=True)
    solved = [r["solved_at_s"] for _, r in rows]
    times = [t if t is not None else float("inf") for t in solved]
    median = statistics.median(times)
    lines = ["# parallel_train_dqn.py: CartPole-v1 time to solve", "",
             f"Solved = mean of the last 100 training-episode returns >= 475. "
             f"Config `configs/parallel_dqn_cartpole.yaml`{' + ' + opts.extra if opts.extra else ''}, "
             f"{opts.workers} rollout worker(s).", "",
             f"- before: {load_before}", f"- after: {machine_line()}",
             f"- command: `python benchmarks/bench_parallel_dqn.py cartpole --seeds {' '.join(map(str, opts.seeds))} "
             f"--workers {opts.workers}{' --extra=' + shlex.quote(opts.extra) if opts.extra else ''}`", "",
             "| seed | solved at (s, training time) | process wall (s) | env steps | episodes | gradient updates |",
             "|---|---|---|---|---|---|"]
    for seed, r in rows:
        at = f"{r['solved_at_s']:.1f}" if r.get("solved_at_s") is not None else "not solved"
        lines.append(f"| {seed} | {at} | {r['process_wall_s']:.1f} | {r.get('global_step')} | {r.get('episodes')} | "
                     f"{r.get('updates')} |")
    shown = f"{median:.1f} s" if median != float("inf") else "not solved"
    lines += ["", f"**Median time to solve: {shown}** "
              f"(target: at most 30 s on 2 cores)"]
    write(f"parallel_dqn_cartpole_{opts.workers}w.md", lines)


CONNECT_FOUR_OPPONENTS = ("random", "heuristic", "search1", "search2", "search3", "search4")
# The targets of the defaults (15 min, 2 cores, median of 3 seeds): win rates, both seats together.
CONNECT_FOUR_TARGETS = {"random": 0.99, "heuristic": 0.90, "search1": 0.90, "search2": 0.60, "search4": 0.30}


def bench_connect_four(opts) -> None:
    """The script's defaults (no flags but the seed, the duration and --games evaluation games per
    opponent), trained for --minutes per seed, one seed after another; or, with --runs, the report
    of runs made before (their summary.json and metrics.csv)."""
    import yaml

    load_before = machine_line()
    runs, trained_games = [], opts.games  # the final evaluation's games per opponent, in training
    if opts.runs:
        for out in map(Path, opts.runs):
            summary = json.loads((out / "summary.json").read_text())
            runs.append((summary["seed"], out, {"returncode": summary.get("exit_code"), **summary}))
        started = min((out / "config.yaml").stat().st_mtime for _, out, _ in runs)
        ended = max((out / "summary.json").stat().st_mtime for _, out, _ in runs)
        trained_games = 2 * yaml.safe_load((runs[0][1] / "config.yaml").read_text())["eval_episodes"]
        load_before = (f"trained {datetime.fromtimestamp(started, UTC):%Y-%m-%d %H:%M} to "
                       f"{datetime.fromtimestamp(ended, UTC):%H:%M} UTC; this report rebuilt from their run "
                       f"directories with --runs")
    for seed in [] if opts.runs else opts.seeds:
        out = Path(opts.work_dir) / f"connect_four_{seed}_{int(time.time())}"
        result = run_training(["--seed", str(seed), "--duration", str(opts.minutes / 60), "--eval-episodes",
                               str(opts.games // 2), "--no-tensorboard", *opts.extra.split()], out,
                              opts.minutes * 60 + 600)
        runs.append((seed, out, result))
        final = result.get("final_eval") or {}
        print(f"seed {seed}: exit {result['returncode']} " + " ".join(
            f"{o} {final.get(f'eval_win_{o}', float('nan')):.0%}" for o in CONNECT_FOUR_OPPONENTS), flush=True)
    seeds = " ".join(str(seed) for seed, _, _ in runs)
    command = (f"python benchmarks/bench_parallel_dqn.py connect-four --minutes {opts.minutes:g} --seeds {seeds} "
               f"--games {trained_games}{' --extra=' + shlex.quote(opts.extra) if opts.extra else ''}"
               f"{' --search-depth ' + ' '.join(map(str, opts.search_depth)) if opts.search_depth else ''}"
               f"{' --random-opening ' + str(opts.random_opening) if opts.random_opening else ''}"
               f"{' --tag ' + opts.tag if opts.tag else ''}")
    learner = yaml.safe_load((runs[0][1] / "config.yaml").read_text())["learner"] if runs else "?"
    how = ("the n-tuple learner: TD self-play of every process over one table in shared memory"
           if learner == "ntuple" else
           "the Q-network: negamax targets from both players' moves; self-play against the latest policy, past "
           "snapshots drawn by prioritized fictitious self-play and a random player")
    lines = ["# parallel_train_dqn.py: ConnectFour-v0 self-play against players it never met", "",
             f"`python parallel_train_dqn.py`{' ' + opts.extra if opts.extra else ''} ({how}; "
             f"neither the heuristic nor the search players take part in training), {opts.minutes:g} min of "
             f"training per seed, {len(runs)} seed(s) one after another. Final evaluation: the greedy policy, "
             f"{trained_games} games per opponent ({trained_games // 2} from each seat).", "",
             f"- before: {load_before}", f"- after: {machine_line()}", f"- command: `{command}`", "",
             "| seed | exit | stop reason | episodes | env steps | gradient updates | run |",
             "|---|---|---|---|---|---|---|"]
    for seed, out, r in runs:
        lines.append(f"| {seed} | {r['returncode']} | {r.get('stop_reason')} | {r.get('episodes')} | "
                     f"{r.get('global_step')} | {r.get('updates')} | `{out.name}` |")
    lines += connect_four_table(runs) + connect_four_curve(runs)
    if opts.search_depth:
        lines += connect_four_lookahead(runs, opts.search_depth, opts.games, opts.random_opening, opts.tag)
    if opts.grade:  # the optimal-move and blunder rates by ply band, and games against the perfect player
        from grade_selfplay import graded_section

        lines += graded_section([(seed, out) for seed, out, _ in runs], opts.search_depth or [0], opts.grade, 50,
                                opts.tag)
    suffix = ("_lookahead" if opts.search_depth else "") + (f"_opening{opts.random_opening}" if opts.random_opening
                                                            else "") + (f"_{opts.tag}" if opts.tag else "")
    write(f"parallel_dqn_connect_four_{opts.minutes:g}min{suffix}.md", lines)


def connect_four_lookahead(runs: list, depths: list[int], games: int, opening: int = 0, tag: str = "") -> list[str]:
    """Each run's final checkpoint scored by ``python -m common.evaluate --search-depth D`` for every
    depth, on the same evaluation seeds: the greedy policy (depth 0) and the lookahead over its
    Q-network side by side; every game opened by ``opening`` random plies (``--random-opening``)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    scored = {}  # (seed, depth) -> (report, seconds)
    for seed, out, _ in runs:
        for depth in depths:
            started = time.monotonic()
            proc = subprocess.run([sys.executable, "-m", "common.evaluate", str(out), "--episodes", str(games // 2),
                                   "--search-depth", str(depth), "--random-opening", str(opening), "--json"],
                                  cwd=ROOT, env=env, capture_output=True, text=True)
            if proc.returncode:
                raise SystemExit(f"common.evaluate failed on {out} at depth {depth}: {proc.stderr.strip()[-500:]}")
            scored[seed, depth] = json.loads(proc.stdout), time.monotonic() - started
            print(f"seed {seed} depth {depth}: " + " ".join(
                f"{o} {scored[seed, depth][0]['opponents'][o]['both']['win']:.0%}" for o in CONNECT_FOUR_OPPONENTS)
                  + f" ({scored[seed, depth][1]:.0f} s)", flush=True)
    seeds = [seed for seed, _, _ in runs]
    run_dirs = " ".join(str(out) for _, out, _ in runs)
    command = (f"python benchmarks/bench_parallel_dqn.py connect-four --runs {run_dirs} "
               f"--games {games} --search-depth {' '.join(map(str, depths))}"
               + (f" --random-opening {opening}" if opening else "") + (f" --tag {tag}" if tag else ""))
    lines = ["", "Decision-time lookahead over the learned Q-network (common/envs/connect_four.py "
             "`LookaheadPlayer`: negamax with the rules' wins and draws, the network's best value for the side to "
             "move at the leaves; depth 0 = the greedy policy): each final checkpoint scored by "
             f"`python -m common.evaluate RUN --search-depth D --episodes {games // 2}"
             + (f" --random-opening {opening}" if opening else "") + f"`, {games} games per opponent "
             f"({games // 2} from each seat), the same evaluation seeds at every depth"
             + (f"; every game opened by {opening} uniformly random plies of both sides" if opening else "") + ".",
             "",
             f"- command: `{command}`", f"- machine: {machine_line()}", "",
             "Win / draw / loss, both seats together (per seed, then the median of the win rates):", "",
             "| opponent | depth | " + " | ".join(f"seed {seed}" for seed in seeds) + " | median win |",
             "|---|---|" + "---|" * len(seeds) + "---|"]
    for opponent in CONNECT_FOUR_OPPONENTS:
        for depth in depths:
            rates = [scored[seed, depth][0]["opponents"][opponent]["both"] for seed in seeds]
            median = statistics.median(r["win"] for r in rates)
            lines.append(f"| {opponent} | {depth} | " + " | ".join(
                " / ".join(f"{r[what]:.1%}" for what in ("win", "draw", "loss")) for r in rates)
                + f" | **{median:.1%}** |")
    lines += ["", "Seconds per evaluation (every opponent from both seats, plus the built-in scores' games):", "",
              "| depth | " + " | ".join(f"seed {seed}" for seed in seeds) + " |", "|---|" + "---|" * len(seeds)]
    for depth in depths:
        lines.append(f"| {depth} | " + " | ".join(f"{scored[seed, depth][1]:.0f}" for seed in seeds) + " |")
    return lines


def connect_four_table(runs: list) -> list[str]:
    """Win / draw / loss of the final evaluation per seed and opponent, the median win rate, the target."""
    header = " | ".join(f"seed {seed}" for seed, _, _ in runs)
    lines = ["", "Win / draw / loss against each opponent, both seats together (per seed, then the median of the "
             "win rates):", "", f"| opponent | {header} | median win | target |",
             "|---|" + "---|" * len(runs) + "---|---|"]
    for opponent in CONNECT_FOUR_OPPONENTS:
        cells, wins = [], []
        for _, _, r in runs:
            final = r.get("final_eval") or {}
            if f"eval_win_{opponent}" in final:
                wins.append(final[f"eval_win_{opponent}"])
                cells.append(" / ".join(f"{final[f'eval_{what}_{opponent}']:.1%}" for what in ("win", "draw", "loss")))
            else:
                cells.append("-")
        median = f"{statistics.median(wins):.1%}" if wins else "-"
        target = CONNECT_FOUR_TARGETS.get(opponent)
        goal = f">= {target:.0%}" if target else "-"
        lines.append(f"| {opponent} | " + " | ".join(cells) + f" | **{median}** | {goal} |")
    lines += ["", "Win rate as first / as second player:", "", f"| opponent | {header} |", "|---|" + "---|" * len(runs)]
    for opponent in CONNECT_FOUR_OPPONENTS:
        cells = [f"{f[f'eval_win_{opponent}_first']:.1%} / {f[f'eval_win_{opponent}_second']:.1%}"
                 if f"eval_win_{opponent}_first" in (f := r.get("final_eval") or {}) else "-" for _, _, r in runs]
        lines.append(f"| {opponent} | " + " | ".join(cells) + " |")
    return lines


def connect_four_curve(runs: list, every_s: float = 180.0) -> list[str]:
    """The training curve in numbers: each seed's win rates at the last evaluation before every
    ``every_s`` seconds of training (metrics.csv), then the final one."""
    from common.runlog import read_metrics

    lines = ["", f"Training curve: win rate at the last evaluation before each {every_s / 60:g} minutes "
             "(metrics.csv; 200 games per opponent), then the final evaluation:", "",
             "| seed | minute | env steps | " + " | ".join(CONNECT_FOUR_OPPONENTS) + " |",
             "|---|---|---|" + "---|" * len(CONNECT_FOUR_OPPONENTS)]
    for seed, out, r in runs:
        rows = [row for row in read_metrics(out / "metrics.csv") if row.get("eval_win_random") not in (None, "")]
        shown = []
        for k in range(1, int(float(rows[-1]["wall_time"]) // every_s) + 1 if rows else 1):
            before = [row for row in rows if float(row["wall_time"]) <= k * every_s]
            if before and before[-1] not in shown:
                shown.append(before[-1])
        for row in shown:
            lines.append(f"| {seed} | {float(row['wall_time']) / 60:.1f} | {row['global_step']} | " + " | ".join(
                f"{float(row[f'eval_win_{o}']):.0%}" for o in CONNECT_FOUR_OPPONENTS) + " |")
        final = r.get("final_eval") or {}
        if final:
            lines.append(f"| {seed} | final | {r.get('global_step')} | " + " | ".join(
                f"{final[f'eval_win_{o}']:.0%}" for o in CONNECT_FOUR_OPPONENTS) + " |")
    return lines


def episodes_per_second(env_id: str, workers: int, seconds: float, games: int) -> tuple[float, float]:
    import gymnasium as gym

    from common import envs  # noqa: F401  (registers ConnectFour-v0)
    from common.manager_config import ManagerConfig, WorkerSpec
    from common.networks import QNetwork
    from common.parallel_manager import ParallelManager

    env = gym.make(env_id)
    net = QNetwork(env.observation_space, env.action_space, (256, 256))
    kwargs = {"opponent": "random"} if env_id == "ConnectFour-v0" else {}
    manager = ParallelManager(WorkerSpec(env_id, 0, env_kwargs=kwargs),
                              parallel_config=ManagerConfig(num_workers=workers, games_per_worker=games), model=net,
                              epsilon=0.1)
    try:
        manager.start_workers()
        manager.collect_experiences(timeout=60)  # warm up: every worker is running
        episodes = steps = 0
        started = time.monotonic()
        while time.monotonic() - started < seconds:
            for batch in manager.collect_experiences(timeout=10):
                episodes += len(batch.episodes)
                steps += sum(e["length"] for e in batch.episodes)
        elapsed = time.monotonic() - started
    finally:
        manager.stop_workers()
    return episodes / elapsed, steps / elapsed


def learner_updates_per_second(hidden: tuple[int, ...], batch_size: int, obs_shape, actions: int, masked: bool,
                               updates: int = 500) -> float:
    """Gradient updates per second of the learner both DQN scripts use (common.dqn.DQNLearner), one thread."""
    import gymnasium as gym
    import numpy as np
    import torch

    from common.dqn import DQNLearner
    from common.networks import QNetwork
    from common.replay import LocalReplay

    torch.set_num_threads(1)
    obs_space = gym.spaces.Box(0, 1, obs_shape, np.float32)
    learner = DQNLearner(QNetwork(obs_space, gym.spaces.Discrete(actions), hidden), torch.device("cpu"), 1e-3, 10.0,
                         250)
    buffer = LocalReplay(50_000, obs_shape, np.float32, actions if masked else None, 0)
    rng = np.random.default_rng(0)
    n = 50_000
    buffer.add_batch(rng.random((n, *obs_shape), dtype=np.float32), rng.integers(0, actions, n),
                     rng.random(n, dtype=np.float32), rng.random((n, *obs_shape), dtype=np.float32),
                     rng.random(n) < 0.05, rng.random((n, actions)) < 0.9 if masked else None)
    for _ in range(50):
        learner.update(buffer, batch_size)
    started = time.perf_counter()
    for _ in range(updates):
        learner.update(buffer, batch_size)
    return updates / (time.perf_counter() - started)


def bench_throughput(opts) -> None:
    load_before = machine_line()
    lines = ["# parallel_train_dqn.py: collection and learner throughput", "",
             f"- before: {load_before}",
             f"- command: `python benchmarks/bench_parallel_dqn.py throughput --seconds {opts.seconds}`", "",
             "Rollout workers with a 256x256 Q-network at epsilon 0.1 (ConnectFour-v0 against the random "
             "player), whole episodes through the bounded queues into the learner process, "
             f"measured over {opts.seconds} s after warm-up.", "",
             "| env | workers | games per batch | episodes/s | env steps/s |", "|---|---|---|---|---|"]
    for env_id in ("CartPole-v1", "ConnectFour-v0"):
        for workers in (1, 2):
            eps, sps = episodes_per_second(env_id, workers, opts.seconds, opts.games)
            lines.append(f"| {env_id} | {workers} | {opts.games} | {eps:.0f} | {sps:.0f} |")
            print(lines[-1], flush=True)
    lines += ["", "| learner updates/s (1 thread) | network | batch | obs | masks |", "|---|---|---|---|---|"]
    for hidden, batch, obs_shape, actions, masked, name in (
            ((256, 256), 64, (4,), 2, False, "CartPole-v1"),
            ((256, 256), 128, (2, 6, 7), 7, True, "ConnectFour-v0"),
            ((64, 64), 64, (4,), 2, False, "CartPole-v1")):
        rate = learner_updates_per_second(hidden, batch, obs_shape, actions, masked)
        lines.append(f"| {rate:.0f} | {hidden} | {batch} | {name} {obs_shape} | {masked} |")
        print(lines[-1], flush=True)
    lines += ["", f"- after: {machine_line()}"]
    write("parallel_dqn_throughput.md", lines)


def write(name: str, lines: list[str]) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / name
    path.write_text("\n".join(lines) + "\n")
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    cartpole = sub.add_parser("cartpole", help="time to solve CartPole-v1 over several seeds")
    cartpole.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    cartpole.add_argument("--workers", type=int, default=1)
    cartpole.add_argument("--timeout", type=float, default=600)
    cartpole.add_argument("--extra", default="",
                          help="more flags for the training script, in one string: --extra='--anneal-lr --gamma 0.9'")
    c4 = sub.add_parser("connect-four", help="the defaults' win rates against held-out players after a fixed time")
    c4.add_argument("--minutes", type=float, default=15)
    c4.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    c4.add_argument("--games", type=int, default=200, help="evaluation games per opponent (half from each seat)")
    c4.add_argument("--runs", nargs="+", help="report on these run directories of earlier runs instead of training")
    c4.add_argument("--extra", default="",
                          help="more flags for the training script, in one string: --extra='--anneal-lr --gamma 0.9'")
    c4.add_argument("--tag", default="", help="appended to the results file's name (a variant beside the defaults)")
    c4.add_argument("--search-depth", type=int, nargs="+", default=[],
                    help="also score the final checkpoints through a lookahead of these depths over the Q-network "
                         "(python -m common.evaluate --search-depth; 0 = greedy), in ..._lookahead.md")
    c4.add_argument("--random-opening", type=int, default=0, metavar="PLIES",
                    help="with --search-depth: open every scored game with this many random plies "
                         "(python -m common.evaluate --random-opening), in ..._opening<PLIES>.md")
    c4.add_argument("--grade", type=int, nargs="?", const=30, default=0, metavar="POSITIONS",
                    help="also grade each run by the perfect player (benchmarks/grade_selfplay.py): POSITIONS random "
                         "positions per ply (default 30), 50 games from each seat, at each --search-depth")
    throughput = sub.add_parser("throughput", help="episodes/s with 1 and 2 workers; learner updates/s")
    throughput.add_argument("--seconds", type=float, default=10)
    throughput.add_argument("--games", type=int, default=16)
    for p in (cartpole, c4):
        p.add_argument("--work-dir", default=str(ROOT / "runs" / "bench_parallel_dqn"))
    opts = parser.parse_args()
    {"cartpole": bench_cartpole, "connect-four": bench_connect_four, "throughput": bench_throughput}[opts.what](opts)


if __name__ == "__main__":
    main()
