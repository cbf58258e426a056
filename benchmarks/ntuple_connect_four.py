"""The n-tuple TD self-play learner (common/ntuple.py) on ConnectFour-v0, graded by a perfect player.

    python benchmarks/ntuple_connect_four.py                      # 15 minutes of training, seed 1
    python benchmarks/ntuple_connect_four.py --minutes 3 --seed 2 --grade-every 1 --tag short

Trains for ``--minutes`` of wall time on one core (BLAS held to one thread), grading the greedy policy
every ``--grade-every`` minutes and at the end with common/grading.py: the optimal-move and blunder rates
over ``--positions`` random positions per ply (plies 0-30), and ``--games`` games against the perfect
player from each seat. Grading pauses the training clock, so the minutes are training alone. Writes
benchmarks/results/ntuple_connect_four_<minutes>min_seed<seed>[_<tag>].md with the command, the machine's
core count and load average, games per second and the graded curve; ``--save`` keeps the weights (npz).
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before numpy: one core, as the figures say
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import shlex  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from dataclasses import asdict  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_parallel_dqn import machine_line, write  # noqa: E402

from common.grading import grade, perfect_play, text  # noqa: E402
from common.ntuple import NTupleValue, Progress, TrainConfig, train  # noqa: E402

ENV_ID = "ConnectFour-v0"
TARGETS = {"optimal": 0.90, "blunder": 0.03, "first_not_lost": 0.50}  # the raw policy's, after 15 minutes


def main() -> None:
    defaults = TrainConfig()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=15, help="minutes of training (grading not counted)")
    parser.add_argument("--seed", type=int, default=1, help="seeds the tuples and the self-play")
    parser.add_argument("--grade-every", type=float, default=5, help="minutes of training between gradings")
    parser.add_argument("--positions", type=int, default=30, help="random positions per ply (default 30)")
    parser.add_argument("--games", type=int, default=50, help="games against the perfect player from each seat")
    parser.add_argument("--grade-seed", type=int, default=0, help="the graded positions (the same at every grading)")
    parser.add_argument("--tuples", type=int, default=70, help="random-walk tuples")
    parser.add_argument("--length", type=int, default=8, help="cells per tuple")
    parser.add_argument("--lockstep", type=int, default=defaults.games_in_lockstep, help="games played together")
    parser.add_argument("--lr", type=float, default=defaults.learning_rate)
    parser.add_argument("--final-lr", type=float, default=defaults.final_learning_rate)
    parser.add_argument("--td-lambda", type=float, default=defaults.td_lambda, help="TD(lambda); 0: TD(0)")
    parser.add_argument("--epsilon", type=float, default=defaults.epsilon)
    parser.add_argument("--final-epsilon", type=float, default=defaults.final_epsilon)
    parser.add_argument("--opening", type=int, nargs=2, default=list(defaults.random_opening),
                        help="random plies that open each game, drawn between these two")
    parser.add_argument("--no-tanh-gradient", action="store_true", help="TD error not scaled by tanh's slope")
    parser.add_argument("--tag", default="", help="appended to the results file's name")
    parser.add_argument("--save", default="", help="write the trained weights to this .npz")
    opts = parser.parse_args()

    command = "python benchmarks/ntuple_connect_four.py " + shlex.join(sys.argv[1:])
    load_before = machine_line()
    config = TrainConfig(games_in_lockstep=opts.lockstep, learning_rate=opts.lr, final_learning_rate=opts.final_lr,
                         epsilon=opts.epsilon, final_epsilon=opts.final_epsilon, random_opening=tuple(opts.opening),
                         tanh_gradient=not opts.no_tanh_gradient, td_lambda=opts.td_lambda)
    value = NTupleValue.random(opts.tuples, opts.length, opts.seed)
    perfect = perfect_play(ENV_ID)
    curve: list[tuple[Progress, dict]] = []

    def graded(progress: Progress) -> None:
        report = grade(lambda obs, masks: value.act(obs, masks), ENV_ID, {}, opts.positions, opts.games,
                       opts.grade_seed, perfect)
        curve.append((progress, report))
        a = report["positions"]["all"]
        print(f"{progress.seconds / 60:5.1f} min, {progress.games} games ({progress.games / progress.seconds:.0f}/s): "
              f"optimal {a['optimal']:.1%} blunder {a['blunder']:.1%}, as first "
              f"{report['vs_perfect']['first']}", flush=True)
        print("\n".join(text(report)), flush=True)

    started = time.monotonic()
    final = train(value, minutes=opts.minutes, seed=opts.seed, config=config, callback=graded,
                  callback_every_s=opts.grade_every * 60)
    graded(final)
    wall = time.monotonic() - started
    if opts.save:
        value.save(opts.save)

    lines = ["# n-tuple TD self-play on ConnectFour-v0, graded by a perfect player", "",
             f"- command: `{command}`", f"- before: {load_before}", f"- after: {machine_line()}",
             f"- learner: common/ntuple.py, {opts.tuples} random-walk {opts.length}-tuples (seed {opts.seed}), "
             f"mirror-shared, two seats' LUTs: {value.weights.size:,} float32 weights",
             f"- training: {asdict(config)}",
             f"- {final.games:,} self-play games ({final.plies:,} plies) in {final.seconds / 60:.1f} min of training "
             f"on one core: {final.games / final.seconds:.0f} games/s, {final.plies / final.seconds:.0f} plies/s; "
             f"{wall / 60:.1f} min of wall time with the gradings",
             "", f"Graded by {curve[-1][1]['perfect_player']} (common/grading.py): {opts.positions} random positions "
             "per ply of plies 0-30 (the same at every grading), the greedy policy's optimal-move and blunder rates; "
             f"{opts.games} games from each seat against the perfect player from the empty board.", "",
             "| training min | games | optimal | blunder | optimal 0-9 / 10-19 / 20-30 | blunder 0-9 / 10-19 / 20-30 "
             "| as first W/D/L | as second W/D/L |", "|---|---|---|---|---|---|---|---|"]
    for progress, report in curve:
        bands = [b for b in report["positions"] if b != "all"]
        a = report["positions"]["all"]
        seats = [" / ".join(f"{report['vs_perfect'][seat][k]:.0%}" for k in ("win", "draw", "loss"))
                 for seat in ("first", "second")]
        lines.append(f"| {progress.seconds / 60:.1f} | {progress.games:,} | {a['optimal']:.1%} | {a['blunder']:.1%} | "
                     + " / ".join(f"{report['positions'][b]['optimal']:.0%}" for b in bands) + " | "
                     + " / ".join(f"{report['positions'][b]['blunder']:.0%}" for b in bands)
                     + f" | {seats[0]} | {seats[1]} |")
    last = curve[-1][1]
    met = {"optimal": last["positions"]["all"]["optimal"] >= TARGETS["optimal"],
           "blunder": last["positions"]["all"]["blunder"] <= TARGETS["blunder"],
           "first_not_lost": 1 - last["vs_perfect"]["first"]["loss"] >= TARGETS["first_not_lost"]}
    lines += ["", f"Targets at the end: optimal >= {TARGETS['optimal']:.0%} ({'met' if met['optimal'] else 'missed'}), "
              f"blunder <= {TARGETS['blunder']:.0%} ({'met' if met['blunder'] else 'missed'}), not lost as first "
              f">= {TARGETS['first_not_lost']:.0%} ({'met' if met['first_not_lost'] else 'missed'})."]
    name = f"ntuple_connect_four_{opts.minutes:g}min_seed{opts.seed}{'_' + opts.tag if opts.tag else ''}.md"
    write(name, lines)


if __name__ == "__main__":
    main()
