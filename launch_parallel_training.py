"""Inspect this machine, recommend a training mode with settings that fit it, and run it.

    python launch_parallel_training.py --check-only        # dependencies, machine, recommendation, memory plan
    python launch_parallel_training.py --json              # the same as one JSON object; starts nothing
    python launch_parallel_training.py                     # run the recommended mode (about 10 minutes)
    python launch_parallel_training.py --mode dqn --episodes 5000 --seed 3
    python launch_parallel_training.py --mode timed --dry-run --duration 1
    python launch_parallel_training.py --assume-facts configs/machines/workstation_128core_1gpu.json --check-only
    python launch_parallel_training.py --tune [--run]      # measure worker counts instead of guessing
    python launch_parallel_training.py --nnodes 2          # print the torchrun command of every node and a SLURM script
    python launch_parallel_training.py --search configs/search_lunarlander.yaml   # an Optuna study over config fields

Every machine fact (cores, RAM, /dev/shm, GPUs, open-files limit) comes from
``common.system.machine()``; ``--assume-facts FILE.json`` replaces some of them, for the launcher
and for the script it starts, so the advice for another machine can be read (and tested) here.
Every flag the launcher does not know passes through untouched to the chosen script. The
launcher then replaces itself with the script (``os.execv``), so Ctrl+C, SIGTERM and the exit
status are the script's own. Its work lives in ``common.launcher``: the dependency check reads
package metadata (torch's build too) before anything else, and only the plans import the training
scripts, whose own declarations (``MODE``: config defaults, env) they read; torch is never imported,
so the launcher answers at once and reports missing packages instead of crashing on them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from common import system
from common.config import ConfigError
from common.launcher import ROOT, UsageError
from common.launcher.command import flag_value, plan_command, shell_line
from common.launcher.modes import MODES
from common.launcher.multinode import JOIN_TIMEOUT_S, MAX_RESTARTS, RDZV_PORT, build_multinode, check_multinode_usage
from common.launcher.plan import refusal
from common.launcher.report import build_report, print_multinode, print_report
from common.launcher.search import search_main
from common.launcher.tune import tune

EXIT_MISSING = 1
EXIT_USAGE = 2


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The launcher's own flags, and every other flag (for the script)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--check-only", action="store_true",
                        help="report dependencies, machine, recommendation and memory plan; start nothing")
    parser.add_argument("--json", action="store_true",
                        help="print the report, and the command it would run, as JSON; start nothing")
    parser.add_argument("--mode", help=f"run this mode instead of the recommended one: {', '.join(MODES)}")
    parser.add_argument("--force", action="store_true", help="run a mode the check does not recommend here")
    parser.add_argument("--assume-facts", metavar="FILE.json",
                        help="take these machine facts instead of measured ones, for the launcher and the script "
                             "(sets PRL_ASSUME_FACTS; see configs/machines/)")
    parser.add_argument("--episodes", type=int, help="episode budget, translated into the script's own flag")
    parser.add_argument("--duration", type=float, help="hours of wall time, passed to the script")
    parser.add_argument("--dry-run", action="store_true", help="print the exact command instead of running it")
    parser.add_argument("--tune", action="store_true", help="measure worker counts and envs per worker")
    parser.add_argument("--run", action="store_true", help="with --tune: run the fastest setting afterwards")
    parser.add_argument("--trial-seconds", type=float, default=8.0, help="--tune: seconds per trial")
    nodes = parser.add_argument_group("past one machine (print the commands, run nothing)")
    nodes.add_argument("--nnodes", type=int, metavar="N",
                       help="print the torchrun command for each of N nodes like this one, and a SLURM batch script")
    nodes.add_argument("--nproc-per-node", type=int, metavar="M", help="ranks per node (default: decided per mode)")
    nodes.add_argument("--rdzv-endpoint", metavar="HOST[:PORT]",
                       help=f"node 0's address on the cluster network (default: this machine, port {RDZV_PORT})")
    nodes.add_argument("--rdzv-id", metavar="ID", help="the job's rendezvous id (default: prl-<mode>-<date>)")
    nodes.add_argument("--max-restarts", type=int, default=MAX_RESTARTS,
                       help=f"torchrun restarts of a failed job, each resuming its newest checkpoint ({MAX_RESTARTS})")
    nodes.add_argument("--join-timeout", type=int, default=JOIN_TIMEOUT_S, metavar="SECONDS",
                       help=f"how long the rendezvous waits for every node ({JOIN_TIMEOUT_S})")
    nodes.add_argument("--slurm-script", metavar="FILE", help="also write the SLURM batch script to FILE")
    search = parser.add_argument_group("hyperparameter search (docs/search.md; needs requirements-tracking.txt)")
    search.add_argument("--search", metavar="FILE.yaml",
                        help="run an Optuna study over the script's config fields the file names; again: continue it")
    search.add_argument("--trials", type=int, help="trials in the study (the file's trials)")
    search.add_argument("--seeds", type=int, metavar="K", help="score each trial over K seeds (the file's seeds)")
    search.add_argument("--trials-at-once", type=int, metavar="N", help="instead of the plan's sizing")
    search.add_argument("--storage", metavar="URL",
                        help="the study's database: sqlite:///PATH, another RDB URL, or journal:PATH")
    search.add_argument("--search-hours", type=float, metavar="H", help="stop the search after H hours")
    search.add_argument("--search-dir", metavar="DIR", help="the trials' run directories (default runs/search/NAME)")

    def error(message: str):
        raise UsageError(message)

    parser.error = error
    return parser.parse_known_args(argv)


def check_usage(opts: argparse.Namespace) -> None:
    """The launcher's own flags, checked before the machine is looked at: UsageError for a bad one."""
    if opts.episodes is not None and opts.episodes <= 0:
        raise UsageError(f"--episodes {opts.episodes}: must be > 0")
    if opts.duration is not None and opts.duration <= 0:
        raise UsageError(f"--duration {opts.duration}: must be > 0")
    if opts.mode is not None and opts.mode not in MODES:
        raise UsageError(f"--mode {opts.mode!r}: must be one of {', '.join(MODES)}")
    check_multinode_usage(opts)
    search_flags = [flag for flag, value in (("--trials", opts.trials), ("--seeds", opts.seeds),
                                             ("--trials-at-once", opts.trials_at_once), ("--storage", opts.storage),
                                             ("--search-hours", opts.search_hours),
                                             ("--search-dir", opts.search_dir)) if value is not None]
    if search_flags and not opts.search:
        raise UsageError(f"{search_flags[0]} needs --search FILE.yaml")
    if opts.search:
        clashing = [flag for flag, value in (("--check-only", opts.check_only), ("--json", opts.json),
                                             ("--mode", opts.mode), ("--episodes", opts.episodes),
                                             ("--duration", opts.duration), ("--tune", opts.tune),
                                             ("--nnodes", opts.nnodes)) if value]
        if clashing:
            raise UsageError(f"--search runs its own trials (the script and budgets are in its file); "
                             f"{clashing[0]} does not apply")
    if opts.tune and (opts.assume_facts or os.environ.get(system.ASSUME_ENV)):
        raise UsageError("--tune measures this machine; it cannot run with assumed facts")


def load_machine(opts: argparse.Namespace) -> system.Machine:
    """The facts, with ``--assume-facts`` applied (and exported, so the script sees them too)."""
    if opts.assume_facts:
        path = Path(opts.assume_facts)
        if not path.is_file():
            raise UsageError(f"--assume-facts {opts.assume_facts!r}: no such file")
        os.environ[system.ASSUME_ENV] = str(path.resolve())
        system.forget_machine()
    try:
        return system.machine()
    except ConfigError as err:
        raise UsageError(str(err)) from None


def main(argv: list[str] | None = None) -> int:
    """The launcher's exit status; once it runs a script, the script's own (it replaces the launcher)."""
    try:
        return launch(*parse_args(sys.argv[1:] if argv is None else argv))
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE


def launch(opts: argparse.Namespace, passthrough: list[str]) -> int:
    """Report, print the commands of a multi-node job, or run the selected mode's plan (``os.execv``)."""
    check_usage(opts)
    if opts.search:
        overrides = {"trials": opts.trials, "seeds": opts.seeds, "trials_at_once": opts.trials_at_once,
                     "storage": opts.storage, "search_hours": opts.search_hours, "output_dir": opts.search_dir}
        return search_main(opts.search, overrides, passthrough, load_machine(opts), opts.dry_run)
    # The ranks of a --nnodes job, one per node unless --nproc-per-node says otherwise (as the dqn mode, whose
    # learner depends on them, runs): the plans are for the job the commands start.
    world_size = opts.nnodes * (opts.nproc_per_node or 1) if opts.nnodes is not None else 1
    # The flags after the launcher's are the selected script's: with --mode dqn they choose its learner
    # (--batch-size means the Q-network, as the script decides), and the plan is for that learner.
    dqn_args = passthrough if opts.mode == "dqn" else []
    report = build_report(load_machine(opts), opts.mode, flag_value(passthrough, "--env-id"), world_size, dqn_args)
    if report["recommendation"] is None:  # the scripts import a missing package: nothing can be planned
        return missing_packages(report, opts)
    mode = MODES[report["selected"]]
    refused = refusal(report["plans"][mode.name], opts.force)
    if opts.nnodes is not None:
        return multinode_main(report, opts, passthrough, refused)
    if opts.check_only or opts.json:
        if opts.json:
            command = None if refused else plan_command(report, opts, passthrough)[0]
            print(json.dumps({**report, "command": command, "refused": refused}, indent=2))
        else:
            print_report(report)
        return EXIT_MISSING if not report["ready"] else EXIT_USAGE if refused and opts.mode else 0
    if not report["ready"]:
        return missing_packages(report, opts)
    if refused:
        print(f"error: {refused}", file=sys.stderr)
        return EXIT_USAGE
    if opts.tune:
        env_id = flag_value(passthrough, "--env-id") or mode.default_env
        best = tune(mode, env_id, report["system"], passthrough, opts.trial_seconds)
        if not opts.run:
            return 0
        report["tuned"] = best
    elif report["tuned"]:
        cached = report["tuned"]
        print(f"using the tuned setting {' '.join(cached['args'])} ({cached['sps']:.0f} steps/s measured "
              f"{cached['measured']})")
    command, run_dir = plan_command(report, opts, passthrough)
    if opts.dry_run:
        print(shell_line(command))
        return 0
    print(f"mode {mode.name}: {mode.summary}" + (f"; results in {run_dir}" if run_dir else ""), flush=True)
    print(shell_line(command), flush=True)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    os.execv(sys.executable, command)
    return 0  # not reached


def missing_packages(report: dict, opts: argparse.Namespace) -> int:
    """A required package is missing: the report says which (``--check-only``, ``--json``), or one line does."""
    if opts.json:
        print(json.dumps({**report, "command": None, "refused": None,
                          **({"multinode": None} if opts.nnodes is not None else {})}, indent=2))
    elif opts.check_only:
        print_report(report)
    else:
        missing = report["dependencies"]["missing"]
        print(f"error: missing required packages: {', '.join(missing)} (pip install -r requirements.txt)",
              file=sys.stderr)
    return EXIT_MISSING


def multinode_main(report: dict, opts: argparse.Namespace, passthrough: list[str], refused: str | None) -> int:
    """``--nnodes``: print (never run) the commands for every node and the SLURM script; exit status as
    ``--check-only``'s, and 2 where the mode is refused on the nodes."""
    multinode = None if refused else build_multinode(report, opts, passthrough)
    if opts.json:
        print(json.dumps({**report, "command": None, "refused": refused, "multinode": multinode}, indent=2))
    elif refused:
        print(f"error: {refused}", file=sys.stderr)
    else:
        if opts.check_only:
            print_report(report)
            print()
        print_multinode(multinode, report["system"])
    if refused:
        return EXIT_USAGE
    if opts.slurm_script:
        Path(opts.slurm_script).write_text(multinode["slurm"])
        print(f"wrote {opts.slurm_script}", file=sys.stderr)
    return EXIT_MISSING if not report["ready"] else 0


if __name__ == "__main__":
    sys.exit(main())
