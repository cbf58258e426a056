"""Benchmarks of Shogi-v0 (common/envs/shogi.py, on cshogi) with seed 004's model.

    python benchmarks/bench_shogi.py speed     # games/s of one worker: random moves, the seed's model acting
    python benchmarks/bench_shogi.py sync      # the cost of ParallelManager.sync_model_to_workers() at that size
    python benchmarks/bench_shogi.py curve --minutes 5   # parallel_train_dqn.py's win rate against random over time

The model is seed 004's ``model_config``: ``input_dim 81*14, hidden_dim 512, action_dim 2187``, a
QNetwork of 1,965,707 parameters. Each writes a Markdown table to ``benchmarks/results/shogi_<name>.md``
with the machine's core count and load average, since timings on a shared machine move with whatever
else runs on it.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results"
SEED_004_ENV = {"env_id": "Shogi-v0", "board_size": 9, "max_moves": 200}
SEED_004_MODEL = {"input_dim": 81 * 14, "hidden_dim": 512, "action_dim": 2187}


def machine_line() -> str:
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return (f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC, {os.cpu_count()} logical cores, "
            f"load average (1, 5, 15 min) {load}")


def write(name: str, lines: list[str]) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / name
    path.write_text("\n".join(lines) + "\n")
    print(f"wrote {path}")


def seed_model():
    from common.manager_config import WorkerSpec, build_model

    spec = WorkerSpec(SEED_004_ENV["env_id"], env_kwargs={k: v for k, v in SEED_004_ENV.items() if k != "env_id"})
    return build_model(spec, SEED_004_MODEL)


# --------------------------------------------------------------------------- speed

class Timed:
    """An act function that also counts the seconds spent in it."""

    def __init__(self, act):
        self.act, self.seconds = act, 0.0

    def __call__(self, obs, masks):
        started = time.perf_counter()
        actions = self.act(obs, masks)
        self.seconds += time.perf_counter() - started
        return actions


def play_games(acting: str, opponent: str, envs: int, games: int, seed: int) -> dict:
    """``games`` games played as a rollout worker plays them (play_episodes over a vector of ``envs`` games,
    recording every step): the learner's moves by ``acting`` (random, model), the replies by ``opponent``
    (random, heuristic, model = the same network at the self-play opponents' epsilon 0.25)."""
    from common.envs import make_vec_env, play_episodes
    from common.envs.selfplay import PolicyPlayer
    from common.envs.shogi import RandomPlayer
    from common.rollout_worker import InferencePolicy

    rng = np.random.default_rng(seed)
    policy = InferencePolicy(seed_model()) if "model" in (acting, opponent) else None
    vec = make_vec_env("Shogi-v0", envs, seed, max_moves=SEED_004_ENV["max_moves"],
                       opponent=PolicyPlayer(policy, 0.25, rng) if opponent == "model" else opponent)
    if acting == "model":
        act = Timed(lambda obs, masks: policy.act(obs, masks, 0.05, rng))
    else:
        player = RandomPlayer(seed)
        act = Timed(lambda obs, masks: player.act(obs, masks))
    started = time.perf_counter()
    episodes, steps = play_episodes(vec, act, games, SEED_004_ENV["max_moves"], record=True, seed=seed)
    seconds = time.perf_counter() - started
    vec.close()
    results = np.array([e["result"] for e in episodes])
    return {"games_per_s": len(episodes) / seconds, "steps_per_s": steps / seconds,
            "plies_per_s": sum(e["plies"] for e in episodes) / seconds,
            "plies_per_game": float(np.mean([e["plies"] for e in episodes])),
            "act_share": act.seconds / seconds, "win": float(np.mean(results == 1)),
            "draw": float(np.mean(results == 0)), "loss": float(np.mean(results == -1))}


def cshogi_alone(games: int, seed: int) -> dict:
    """Random games on cshogi's own API (its legal move list and push, one board after another), no env:
    what the rules cost without the masks and observations a learner needs."""
    import cshogi

    rng = np.random.default_rng(seed)
    board, plies = cshogi.Board(), 0
    started = time.perf_counter()
    for _ in range(games):
        board.reset()
        for _ in range(SEED_004_ENV["max_moves"]):
            moves = list(board.legal_moves)
            if not moves:
                break
            board.push(moves[int(rng.integers(len(moves)))])
            plies += 1
    seconds = time.perf_counter() - started
    return {"games_per_s": games / seconds, "plies_per_s": plies / seconds}


def manager_rates(num_workers: int, batches: int, seed: int) -> dict:
    """Games/s of real rollout workers (ParallelManager, seed 004's dicts, the model acting, the env's default
    opponent: random): each batch's episodes over the seconds its worker played it, and all episodes collected
    over the wall time after a first collection (which takes what the workers played ahead)."""
    from common.parallel_manager import ParallelManager

    manager = ParallelManager({**SEED_004_ENV, "seed": seed}, SEED_004_MODEL,
                              {"num_workers": num_workers, "games_per_worker": 8, "timeout": 600.0}, epsilon=0.05)
    per_batch, episodes = [], 0
    with manager:
        manager.start_workers(wait=True)
        manager.collect_experiences()  # what the workers played ahead before the clock starts is not counted
        started = time.perf_counter()
        while len(per_batch) < batches:
            for batch in manager.collect_experiences():
                if batch.last and batch.steps:  # a whole batch in one message (8 games fit one)
                    per_batch.append(len(batch.episodes) / batch.collect_seconds)
                episodes += len(batch.episodes)
        wall = time.perf_counter() - started
    return {"per_worker": statistics.median(per_batch), "all": episodes / wall, "batches": len(per_batch)}


def bench_speed(opts) -> None:
    from common.supervisor import set_torch_threads

    set_torch_threads(1)  # as a rollout worker
    before = machine_line()
    cases = [("random", "random"), ("random", "heuristic"), ("model", "random"), ("model", "model")]
    names = {"random": "random moves", "model": "seed 004's model", "heuristic": "heuristic"}
    rows = []
    for acting, opponent in cases:
        games = opts.games if acting == "random" else opts.model_games
        runs = [play_games(acting, opponent, opts.envs, games, seed) for seed in range(opts.repeats)]
        row = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
        rows.append((acting, opponent, games, row))
        print(f"{acting} vs {opponent}: {row['games_per_s']:.2f} games/s", flush=True)
    alone = statistics.median(cshogi_alone(opts.games, seed)["plies_per_s"] for seed in range(opts.repeats))
    workers = [(n, manager_rates(n, opts.batches, seed=n)) for n in opts.workers]
    lines = ["# Shogi-v0: games per second of one rollout worker", "",
             f"One process, one torch thread (as a rollout worker), {opts.envs} games at a time "
             f"(ManagerConfig's default `games_per_worker`), games of at most {SEED_004_ENV['max_moves']} moves "
             f"(seed 004's `max_moves`), played with `play_episodes` recording every step as a worker does; "
             f"medians of {opts.repeats} runs. The model is seed 004's (1134 -> 512 -> 512 -> 2187), acting with "
             "epsilon 0.05 over the legal moves; as the opponent it plays at the self-play opponents' 0.25.", "",
             f"- before: {before}", f"- after: {machine_line()}",
             f"- command: `python benchmarks/bench_shogi.py speed --envs {opts.envs} --games {opts.games} "
             f"--model-games {opts.model_games} --repeats {opts.repeats} --workers "
             f"{' '.join(map(str, opts.workers))} --batches {opts.batches}`", "",
             "| learner's moves | opponent | games | games/s | learner steps/s | moves/s (both sides) | "
             "moves per game | time in acting | learner's win / draw / loss |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for acting, opponent, games, r in rows:
        lines.append(f"| {names[acting]} | {names[opponent]} | {games} | {r['games_per_s']:.2f} | "
                     f"{r['steps_per_s']:.0f} | {r['plies_per_s']:.0f} | {r['plies_per_game']:.0f} | "
                     f"{r['act_share']:.0%} | {r['win']:.0%} / {r['draw']:.0%} / {r['loss']:.0%} |")
    lines += ["", f"For comparison, cshogi alone ({opts.games} random games on its legal move list and push, one "
              f"board after another, no masks or observations): {alone:,.0f} moves/s."]
    lines += ["", "Through ParallelManager (seed 004's three dicts, the model acting against the env's random "
              f"player, {opts.batches} batches of 8 games): each batch's games over the seconds its worker played "
              "it (median), and all games over the wall time of the collection, after a first collection of what "
              "the workers played ahead:", "",
              "| workers | games/s per worker | games/s, all workers |", "|---:|---:|---:|"]
    for n, r in workers:
        lines.append(f"| {n} | {r['per_worker']:.2f} | {r['all']:.2f} |")
    write("shogi_speed.md", lines)


# --------------------------------------------------------------------------- sync

def bench_sync(opts) -> None:
    import torch

    from common.networks import flat_size
    from common.parallel_manager import ParallelManager
    from common.rollout_worker import InferencePolicy

    torch.set_num_threads(1)
    before = machine_line()
    manager = ParallelManager(SEED_004_ENV, SEED_004_MODEL, {"num_workers": opts.num_workers, "games_per_worker": 8,
                                                             "timeout": 600.0})
    params = flat_size(manager.model)
    reader = InferencePolicy(seed_model())
    times: dict[str, list[float]] = {}

    def timed(name: str, call) -> None:
        started = time.perf_counter()
        call()
        times.setdefault(name, []).append(time.perf_counter() - started)

    def pickled_size(timed) -> int:
        buffer = io.BytesIO()
        timed("pickle", lambda: torch.save(manager.model.state_dict(), buffer))
        return buffer.getbuffer().nbytes

    def syncs(phase: str) -> None:
        for _ in range(opts.repeats):
            with torch.no_grad():
                for p in manager.model.parameters():
                    p.add_(1e-3)
            timed(f"publish {phase}", manager.sync_model_to_workers)
            timed(f"fetch {phase}", lambda: reader.fetch(manager.params, 0))  # a worker's part, before its next batch
            if phase == "idle":  # what sending the weights through a queue would pickle first
                times["bytes"] = [pickled_size(timed)]
            else:
                manager.collect_experiences(timeout=0.01)
            assert all(torch.equal(a, b) for a, b in zip(reader.net.parameters(), manager.model.parameters()))

    with manager:
        syncs("idle")  # nothing else running in this program: the cost itself
        manager.start_workers(wait=True)
        syncs("playing")  # the workers playing meanwhile, as in training
    ms = {name: (1000 * statistics.median(t), 1000 * min(t)) for name, t in times.items() if name != "bytes"}

    def row(what: str, name: str) -> str:
        return f"| {what} | {ms[name][0]:.2f} | {ms[name][1]:.2f} |"

    lines = ["# Shogi-v0: the cost of one model sync at seed 004's model size", "",
             f"Seed 004's model (1134 -> 512 -> 512 -> 2187): {params:,} parameters, {4 * params / 1e6:.2f} MB of "
             "float32. `manager.sync_model_to_workers()` writes them into the shared-memory slot the workers read "
             "(under a seqlock); a worker that sees the new version copies them into its network before its next "
             f"batch (timed here in the learner's process, on the same shared memory). {opts.repeats} syncs with no "
             f"worker started, then {opts.repeats} with {opts.num_workers} worker(s) playing; one torch thread; "
             "milliseconds, median and minimum.", "",
             f"- before: {before}", f"- after: {machine_line()}",
             f"- command: `python benchmarks/bench_shogi.py sync --repeats {opts.repeats} --num-workers "
             f"{opts.num_workers}`", "",
             "| step | median ms | min ms |", "|---|---:|---:|",
             row("learner: `sync_model_to_workers()` (publish), no worker playing", "publish idle"),
             row("worker: fetch the new version into its network, no worker playing", "fetch idle"),
             row(f"learner: publish, {opts.num_workers} worker(s) playing", "publish playing"),
             row(f"worker: fetch, {opts.num_workers} worker(s) playing", "fetch playing"),
             row(f"for comparison: `torch.save(state_dict)` to memory ({times['bytes'][0] / 1e6:.2f} MB), what a "
                 "queue would carry before the pipe", "pickle")]
    write("shogi_sync.md", lines)


# --------------------------------------------------------------------------- curve

def bench_curve(opts) -> None:
    from common.runlog import read_metrics

    before = machine_line()
    if opts.run:  # the report of a run made before
        out = Path(opts.run)
        before = (f"trained {datetime.fromtimestamp((out / 'config.yaml').stat().st_mtime, UTC):%Y-%m-%d %H:%M} UTC; "
                  "this report rebuilt from its run directory with --run")
    else:
        out = Path(opts.work_dir) / f"shogi_{opts.seed}_{int(time.time())}"
        args = ["--config", str(ROOT / "configs" / "shogi_selfplay.yaml"), "--seed", str(opts.seed), "--duration",
                str(opts.minutes / 60), "--no-tensorboard", "--output-dir", str(out), *opts.extra.split()]
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        proc = subprocess.run([sys.executable, str(ROOT / "parallel_train_dqn.py"), *args], env=env,
                              capture_output=True, text=True, timeout=opts.minutes * 60 + 900)
        if proc.returncode != 0:
            print(proc.stdout[-3000:], proc.stderr[-3000:])
            raise SystemExit(f"parallel_train_dqn.py exited {proc.returncode}")
    summary = json.loads((out / "summary.json").read_text())
    budget = ", ".join(f"{name.removesuffix('_s')} {seconds:.0f} s" for name, seconds in summary["time_budget"].items()
                       if name != "process_s")
    rows = [row for row in read_metrics(out / "metrics.csv") if row.get("eval_win_random") not in (None, "")]
    import yaml

    config = yaml.safe_load((out / "config.yaml").read_text())
    games = 2 * config["eval_episodes"]
    lines = ["# Shogi-v0: parallel_train_dqn.py self-play, the win rate against a random player over time", "",
             "`configs/shogi_selfplay.yaml` (seed 004's model, self-play against the latest policy, past snapshots "
             "and a random player; games of at most 200 moves, a draw after that)"
             f"{' + ' + opts.extra if opts.extra else ''}, "
             f"{opts.minutes:g} min, seed {opts.seed}. Each evaluation: the greedy policy, {games} games against each "
             f"fixed player ({games // 2} from each seat).", "",
             f"- before: {before}", f"- after: {machine_line()}",
             f"- command: `python benchmarks/bench_shogi.py curve --minutes {opts.minutes:g} --seed {opts.seed}"
             f"{' --extra=' + repr(opts.extra) if opts.extra else ''}`",
             f"- run: exit {summary['exit_code']}, {summary['episodes']} games, {summary['global_step']} learner "
             f"steps, {summary['updates']} gradient updates; process {summary['time_budget']['process_s']:.0f} s: "
             f"{budget}",
             "",
             "| minute | games | learner steps | updates | vs random: win / draw / loss | "
             "vs heuristic: win / draw / loss |",
             "|---:|---:|---:|---:|---|---|"]

    def rates(values, opponent):
        return " / ".join(f"{float(values[f'eval_{what}_{opponent}']):.0%}" for what in ("win", "draw", "loss"))

    for row in rows:
        lines.append(f"| {float(row['wall_time']) / 60:.1f} | {row['episodes']} | {row['global_step']} | "
                     f"{row['learner_updates']} | {rates(row, 'random')} | {rates(row, 'heuristic')} |")
    final = summary.get("final_eval") or {}
    if final:
        lines.append(f"| final | {summary['episodes']} | {summary['global_step']} | {summary['updates']} | "
                     f"{rates(final, 'random')} | {rates(final, 'heuristic')} |")
    write(f"shogi_curve_{opts.minutes:g}min.md", lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    speed = sub.add_parser("speed", help="games/s of one worker: random moves and seed 004's model acting")
    speed.add_argument("--envs", type=int, default=8, help="games a worker plays at a time")
    speed.add_argument("--games", type=int, default=64, help="games per run with random moves")
    speed.add_argument("--model-games", type=int, default=32, help="games per run with the model acting")
    speed.add_argument("--repeats", type=int, default=3)
    speed.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="ParallelManager runs with these")
    speed.add_argument("--batches", type=int, default=6, help="batches collected in each ParallelManager run")
    sync = sub.add_parser("sync", help="the cost of one model sync at seed 004's model size")
    sync.add_argument("--repeats", type=int, default=50)
    sync.add_argument("--num-workers", type=int, default=1)
    curve = sub.add_parser("curve", help="parallel_train_dqn.py's win rate against random over a fixed time")
    curve.add_argument("--minutes", type=float, default=5)
    curve.add_argument("--seed", type=int, default=1)
    curve.add_argument("--work-dir", default=str(ROOT / "runs" / "bench_shogi"))
    curve.add_argument("--extra", default="", help="more flags for the training script, in one string")
    curve.add_argument("--run", help="report on this run directory of an earlier run instead of training")
    opts = parser.parse_args()
    {"speed": bench_speed, "sync": bench_sync, "curve": bench_curve}[opts.what](opts)


if __name__ == "__main__":
    main()
