"""A search in a fixed wall-clock budget, then what it found against the defaults over seeds it never saw.

    python benchmarks/bench_search.py                          # configs/search_lunarlander.yaml, 20 minutes, 3 seeds
    python benchmarks/bench_search.py --search-hours 0.1 --seeds 2 --search-file configs/search_cartpole.yaml

First ``launch_parallel_training.py --search FILE --search-hours H`` into a fresh directory (its study, trials
and ``best.yaml``); then, seed by seed (101, 102, ...: none the search ran), one run of the best trial's
settings (``--config best.yaml``) and one of the search file's settings alone (the script's defaults where no
field is set), interleaved so that a change in the machine's load falls on both alike. Each run has the
search file's budget. Per run: the training seconds and env steps until the mean of the last 100 returns first
reached the target (from metrics.csv), and the final mean. A markdown section with the command is printed and
appended to benchmarks/results/search.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "search.md"
sys.path.insert(0, str(ROOT))

from common.launcher.search import last_mean, read_rows  # noqa: E402
from common.launcher.search_file import load_search  # noqa: E402


def first_reaching(rows: list[dict], target: float) -> dict | None:
    return next((r for r in rows if r.get("return_mean100") and float(r["return_mean100"]) >= target), None)


def one_run(script: str, config: Path, seed: int, run_dir: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(ROOT / script), "--config", str(config), "--seed", str(seed),
                           "--output-dir", str(run_dir)], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{run_dir}: exit {proc.returncode}: {proc.stderr[-2000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = read_rows(run_dir / "metrics.csv")
    hit = first_reaching(rows, summary["target_return"])
    return {"seconds": float(hit["wall_time"]) if hit else None, "steps": int(hit["global_step"]) if hit else None,
            "final": summary["final_mean_return"] if summary["final_mean_return"] is not None else last_mean(rows),
            "wall": summary["wall_time_s"], "target": summary["target_return"]}


def cell(result: dict) -> str:
    if result["seconds"] is None:
        return f"not in {result['wall']:.0f} s (final {result['final']:.0f})"
    return f"{result['seconds']:.0f} s, {result['steps']:,} steps"


def median_seconds(results: list[dict]) -> str:
    """The median time to the target; a run that never reached it counts as slower than every run that did."""
    keyed = sorted(results, key=lambda r: (r["seconds"] is None, r["seconds"] or 0.0))
    middle = keyed[(len(keyed) - 1) // 2] if len(keyed) % 2 else None
    if middle is None:  # an even count: the mean of the two middle ones, where both reached it
        a, b = keyed[len(keyed) // 2 - 1], keyed[len(keyed) // 2]
        return f"{(a['seconds'] + b['seconds']) / 2:.0f} s" if b["seconds"] is not None else "not reached"
    return f"{middle['seconds']:.0f} s" if middle["seconds"] is not None else "not reached"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--search-file", default="configs/search_lunarlander.yaml")
    parser.add_argument("--search-hours", type=float, default=1 / 3, help="the search's wall-clock budget")
    parser.add_argument("--seeds", type=int, default=3, help="seeds of the comparison, each run of both settings")
    parser.add_argument("--first-seed", type=int, default=101)
    parser.add_argument("--work-dir", help="where the search and the runs go (default: a temporary directory)")
    args = parser.parse_args()
    spec = yaml.safe_load((ROOT / args.search_file).read_text())
    settings = load_search(str(ROOT / args.search_file), {}, []).settings  # its config file and settings, flat
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="prl_bench_search_"))
    search_dir = work / "search"
    command = [sys.executable, str(ROOT / "launch_parallel_training.py"), "--search", str(ROOT / args.search_file),
               "--search-hours", str(args.search_hours), "--search-dir", str(search_dir)]
    started = datetime.now(UTC)
    searched = subprocess.run(command, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, text=True,
                              capture_output=True)
    print(searched.stdout, searched.stderr, sep="", flush=True)
    if searched.returncode != 0:
        return searched.returncode
    best_file = search_dir / "best.yaml"
    baseline_file = work / "baseline.yaml"
    baseline_file.write_text(yaml.safe_dump(settings))
    best = yaml.safe_load(best_file.read_text())
    found = {k: best[k] for k in spec["ranges"]}
    results: dict[str, list[dict]] = {"best": [], "baseline": []}
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        for name, config in (("best", best_file), ("baseline", baseline_file)):
            results[name].append(one_run(spec["script"], config, seed, work / f"{name}_{seed}"))
            print(f"seed {seed} {name}: {cell(results[name][-1])}", flush=True)
    import optuna

    study = optuna.load_study(study_name=spec.get("study_name") or Path(args.search_file).stem,
                              storage=f"sqlite:///{search_dir / 'study.db'}")
    states = Counter("stopped by the deadline" if t.user_attrs.get("interrupted") else t.state.name.lower()
                     for t in study.trials if t.state.name != "WAITING")
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    lines = [f"## {spec['script']} on {settings.get('env_id', 'its default env')}: "
             f"{args.search_hours * 60:.0f}-minute search, {started:%Y-%m-%d %H:%M} UTC", "",
             f"`{shlex.join(['python', 'benchmarks/bench_search.py', *sys.argv[1:]])}`", "",
             f"The search: {sum(states.values())} trials ({', '.join(f'{n} {s}' for s, n in sorted(states.items()))}); "
             f"the best, trial {study.best_trial.number} ({study.best_value:.1f} in the search), with:", "",
             "```yaml", yaml.safe_dump(found, sort_keys=False).rstrip(), "```", "",
             f"| settings | {' | '.join(f'seed {s}' for s in seeds)} | median to target | median final mean |",
             "|---|" + "---|" * (len(seeds) + 2)]
    for name, label in (("baseline", "the search file's settings alone (else the defaults)"),
                        ("best", "the best trial's")):
        finals = statistics.median([r["final"] for r in results[name]])
        lines.append(f"| {label} | {' | '.join(cell(r) for r in results[name])} | {median_seconds(results[name])} | "
                     f"{finals:.1f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    with open(RESULTS, "a") as f:
        f.write("\n" + text)
    print(f"(the search, its trials and the runs are in {work})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
