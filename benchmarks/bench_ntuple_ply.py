"""Time one lockstep self-play ply of the n-tuple learner (common/ntuple.py), against another commit's.

    python benchmarks/bench_ntuple_ply.py                       # this tree: ms per ply, games per second
    python benchmarks/bench_ntuple_ply.py --compare 5fe79cc     # and that commit's common/ntuple.py, interleaved

One core (BLAS and torch held to one thread). Each version plays ``--warmup`` plies of ``--lockstep`` games
from the same tuples and seed, then ``--repeats`` rounds of ``--plies`` plies, the versions taking turns in
one process, so the machine's drift hits both alike; it prints the median ms per ply and games per second,
and whether the two versions' weights are still bit for bit the same (a change made for speed should keep
them so).
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import importlib.util  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def module_at(commit: str, directory: Path):
    """common/ntuple.py as it was at ``commit``, imported under its own name."""
    source = subprocess.run(["git", "-C", str(ROOT), "show", f"{commit}:common/ntuple.py"], check=True,
                            capture_output=True, text=True).stdout
    path = directory / f"ntuple_{commit}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compare", default="", help="a commit whose common/ntuple.py to time beside this tree's")
    parser.add_argument("--tuples", type=int, default=70)
    parser.add_argument("--length", type=int, default=8)
    parser.add_argument("--lockstep", type=int, default=1024, help="games played together")
    parser.add_argument("--warmup", type=int, default=150, help="plies before timing (games of every length)")
    parser.add_argument("--plies", type=int, default=40, help="plies per timed round")
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds per version")
    opts = parser.parse_args()
    torch.set_num_threads(1)

    import common.ntuple as this_tree

    with tempfile.TemporaryDirectory() as scratch:
        versions = {"this tree": this_tree}
        if opts.compare:
            versions[opts.compare] = module_at(opts.compare, Path(scratch))
        plays = {}
        for name, module in versions.items():
            value = module.NTupleValue.random(opts.tuples, opts.length, 1)
            play = module.SelfPlay(value, module.TrainConfig(games_in_lockstep=opts.lockstep), 1)
            for _ in range(opts.warmup):
                play.ply(1.0, 0.2)
            plays[name] = play
        seconds = {name: [] for name in plays}
        games = {name: [] for name in plays}
        for _ in range(opts.repeats):
            for name, play in plays.items():
                before, started = play.games, time.perf_counter()
                for _ in range(opts.plies):
                    play.ply(1.0, 0.2)
                seconds[name].append(time.perf_counter() - started)
                games[name].append(play.games - before)
    print(f"{opts.lockstep} games in lockstep, {opts.tuples} {opts.length}-tuples, one core, median of "
          f"{opts.repeats} rounds of {opts.plies} plies:")
    for name in plays:
        per_ply = 1e3 * float(np.median(seconds[name])) / opts.plies
        rate = float(np.median(np.array(games[name]) / np.array(seconds[name])))
        print(f"  {name:>10}: {per_ply:6.2f} ms per ply, {rate:6.0f} games/s")
    if opts.compare:
        same = np.array_equal(*(play.value.weights for play in plays.values()))
        print(f"  weights after {opts.warmup + opts.repeats * opts.plies} plies: "
              f"{'bit for bit the same' if same else 'different'}")


if __name__ == "__main__":
    main()
