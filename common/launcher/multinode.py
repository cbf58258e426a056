"""``--nnodes``: the torchrun command of every node, the same job as a SLURM batch script, and what a
user must know before starting them. Nothing here runs them: the commands are printed (and the script
written) for machines the launcher cannot reach."""

from __future__ import annotations

import argparse
import os
import re
import socket
import sys
from datetime import datetime

from common import system
from common.launcher import ROOT, UsageError
from common.launcher.command import build_command, default_run_dir, flag_value, has_flag, plan_args, quote
from common.launcher.modes import MODES, LaunchMode

RDZV_PORT = 29400  # the port torchrun's docs use for the c10d rendezvous
MAX_RESTARTS = 3  # torchrun restarts of a failed job; each one resumes from the newest checkpoint
JOIN_TIMEOUT_S = 600  # torch's own default, written out so that the command says how long nodes wait
READ_TIMEOUT_S = 60  # torch's default: how long a node tries to reach the rendezvous host
RANK0_ROLE = {  # what rank 0 does beyond the other ranks, per mode
    "timed": "writes the run directory (every rank collects and learns)",
    "dqn": "is the central learner: it trains, evaluates and writes the run directory",
    "ultra": "is the learner: it owns the replay and writes the run directory; the other nodes only act",
    "ppo-multiprocess": "keeps the leaderboard, runs PBT across the nodes and writes the run directory",
}


def check_multinode_usage(opts: argparse.Namespace) -> None:
    """``--nnodes`` and its flags: a UsageError (one line, exit 2) for anything torchrun or a shell would trip
    on."""
    if opts.nnodes is None:
        given = [flag for flag, value in (("--nproc-per-node", opts.nproc_per_node),
                                          ("--rdzv-endpoint", opts.rdzv_endpoint), ("--rdzv-id", opts.rdzv_id),
                                          ("--slurm-script", opts.slurm_script)) if value is not None]
        if given:
            raise UsageError(f"{given[0]} describes a multi-node job: add --nnodes N")
        return
    if opts.nnodes < 1:
        raise UsageError(f"--nnodes {opts.nnodes}: must be >= 1 (the number of machines)")
    if opts.tune:
        raise UsageError("--nnodes prints commands for other machines; it cannot run with --tune (tune on one "
                         "node, then print the commands there)")
    if opts.nproc_per_node is not None and opts.nproc_per_node < 1:
        raise UsageError(f"--nproc-per-node {opts.nproc_per_node}: must be >= 1")
    if opts.max_restarts < 0:
        raise UsageError(f"--max-restarts {opts.max_restarts}: must be >= 0")
    if opts.join_timeout < 1:
        raise UsageError(f"--join-timeout {opts.join_timeout}: must be >= 1 second")
    if opts.rdzv_endpoint is not None:
        parse_endpoint(opts.rdzv_endpoint)
    if opts.rdzv_id is not None and not re.fullmatch(r"[A-Za-z0-9_.-]+", opts.rdzv_id):
        raise UsageError(f"--rdzv-id {opts.rdzv_id!r}: letters, digits, '_', '.' and '-' only (it names the "
                         "run directory too)")


def parse_endpoint(text: str) -> tuple[str, int]:
    """``HOST[:PORT]`` (``[IPv6]:PORT``) as torchrun reads it; UsageError otherwise."""
    match = re.fullmatch(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+)(?::(\d{1,5}))?", text)
    port = int(match.group(2)) if match and match.group(2) else RDZV_PORT
    if match is None or not 1 <= port <= 65535:
        raise UsageError(f"--rdzv-endpoint {text!r}: must be HOST or HOST:PORT with PORT 1-65535 (node 0's "
                         "address on the job's cluster network)")
    return match.group(1), port


def ranks_per_node(mode: LaunchMode, plan: dict, facts: dict, passthrough: list[str],
                   requested: int | None) -> tuple[int, str]:
    """How many ranks torchrun starts on each node for this mode, and why."""
    if requested is not None:
        return requested, f"{requested} rank(s) per node, as --nproc-per-node asks"
    gpus = len(facts["gpus"])
    device = flag_value(passthrough, "--device") or plan["settings"]["device"]
    if mode.name == "timed" and gpus and device != "cpu":
        return gpus, (f"one rank per GPU: every DD-PPO rank learns on its own cuda:LOCAL_RANK, and NCCL averages "
                      f"the gradients of the {gpus} GPUs")
    if mode.name == "timed":
        on_gpus = " (with --device cuda: one rank per GPU)" if gpus else ""
        return 1, ("one rank per node: every DD-PPO rank repeats the whole update on its share of the rollout, "
                   "so on one node more workers under one rank collect the same steps for less; the learner is "
                   f"on the CPU, where a small MLP learns fastest{on_gpus}")
    if mode.name == "ppo-multiprocess":
        return 1, ("one rank per node: a rank already spreads its members over the node's cores"
                   f"{' and GPUs' if gpus else ''}, and reads one market cache in the node's shared memory")
    return 1, ("one rank per node: rank 0 learns beside its local actors and every other node's rank only acts; "
               "a rank already fills its node's cores with worker processes, so more ranks would split them")


def per_rank_args(rec_args: list[str], mode: LaunchMode, nproc: int) -> list[str]:
    """The plan's flags for one of ``nproc`` ranks that share a node: the node's workers split between them."""
    args = dict(zip(rec_args[::2], rec_args[1::2]))
    workers = int(args.get(mode.workers_flag, "0"))
    if nproc > 1 and workers:
        args[mode.workers_flag] = str(max(1, workers // nproc))
    return [item for pair in args.items() for item in pair]


# torchrun as the project runs it (common/torchrun.py): the run's own exit status and one line on every node,
# no node idle at the exit barrier for a lost one, and torch's shared store off for restarts across nodes
# (pytorch/pytorch#135712). ``-m`` finds it through PYTHONPATH, so that the commands run from any directory,
# and ``-P`` keeps that directory off sys.path: a timeit.py or random.py there would stand in for the stdlib's.
PYTHONPATH_WORDS = f"PYTHONPATH={quote(str(ROOT))}${{PYTHONPATH:+:$PYTHONPATH}}"
TORCHRUN = ["-P", "-m", "common.torchrun"]


def torchrun_words(nnodes: str, nproc: int, endpoint: str, rdzv_id: str, opts: argparse.Namespace,
                   is_host: bool | None) -> list[str]:
    """torchrun's options, already shell-quoted (``nnodes`` and ``endpoint`` may be shell variables).
    ``is_host`` says outright which node hosts the rendezvous: torch's guess compares the endpoint with
    the machine's hostname and misses an address on a second network card, a cluster network's."""
    conf = f"join_timeout={opts.join_timeout}" + ("" if is_host is None else f",is_host={int(is_host)}")
    return [*([PYTHONPATH_WORDS] if is_host is not None else []), quote(sys.executable), *TORCHRUN,
            "--nnodes", nnodes, "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
            "--rdzv-id", quote(rdzv_id), "--rdzv-conf", conf, "--max-restarts", str(opts.max_restarts)]


def build_multinode(report: dict, opts: argparse.Namespace, passthrough: list[str]) -> dict:
    """The torchrun command of every node, the SLURM batch script, and what a user must know to start them."""
    mode, facts = MODES[report["selected"]], report["system"]
    plan = report["plans"][mode.name]
    nproc, why = ranks_per_node(mode, plan, facts, passthrough, opts.nproc_per_node)
    host, port = parse_endpoint(opts.rdzv_endpoint or socket.gethostname())
    endpoint = f"{host}:{port}"
    rdzv_id = opts.rdzv_id or f"prl-{mode.name}-{datetime.now():%Y%m%d}"
    # A fixed run directory (the job's id in place of a timestamp) and --resume auto: the same commands start
    # the run or continue it, and torchrun's restarts find its newest checkpoint.
    run_dir = default_run_dir(mode, passthrough, rdzv_id)
    script = build_command(mode, per_rank_args(plan_args(report), mode, nproc), opts, passthrough, run_dir,
                           ranks=opts.nnodes * nproc)[1:]
    if not has_flag(passthrough, "--resume"):
        script += ["--resume", "auto"]
    script_words = [quote(word) for word in script]
    commands = [" ".join(torchrun_words(str(opts.nnodes), nproc, quote(endpoint), rdzv_id, opts, node == 0)
                         + script_words) for node in range(opts.nnodes)]
    workers = flag_value(script, mode.workers_flag)
    output_dir = flag_value(script, "--output-dir")
    multinode = {"mode": mode.name, "nnodes": opts.nnodes, "nproc_per_node": nproc, "nproc_reason": why,
                 "world_size": opts.nnodes * nproc, "num_workers_per_rank": int(workers) if workers else None,
                 "rdzv_endpoint": endpoint, "rdzv_id": rdzv_id, "join_timeout_s": opts.join_timeout,
                 "max_restarts": opts.max_restarts, "output_dir": output_dir, "script": script,
                 "commands": commands}
    multinode["slurm"] = slurm_script(multinode, facts, script_words, port, opts)
    multinode["notes"] = multinode_notes(multinode, host)
    return multinode


def slurm_script(multinode: dict, facts: dict, script_words: list[str], port: int, opts: argparse.Namespace) -> str:
    """The same job as one ``sbatch`` file: one torchrun per node, started by ``srun``."""
    gpus = len(facts["gpus"])
    torchrun = torchrun_words('"$SLURM_NNODES"', multinode["nproc_per_node"], f'"$head:{port}"',
                              multinode["rdzv_id"], opts, None)
    lines = [
        "#!/bin/bash",
        f"# {multinode['mode']} on {multinode['nnodes']} nodes (written by launch_parallel_training.py --nnodes)",
        f"#SBATCH --job-name={multinode['rdzv_id']}",
        f"#SBATCH --nodes={multinode['nnodes']}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --cpus-per-task={facts['usable_cores']}",
        *([f"#SBATCH --gpus-per-node={gpus}"] if gpus else []),
        "set -euo pipefail",
        "# srun does not inherit --cpus-per-task from sbatch since Slurm 22.05",
        'export SRUN_CPUS_PER_TASK="$SLURM_CPUS_PER_TASK"',
        "# python -m common.torchrun: torchrun, ending with the run's own exit status (130 on Ctrl+C, 143 on",
        "# SIGTERM, 2 for a bad configuration) on every node, none of them left waiting for a lost node",
        f"export {PYTHONPATH_WORDS}",
        "# The rendezvous host: the node whose name sorts first, the one c10d makes rank 0. Its address must be",
        "# reachable only from this job's nodes (a cluster network, never a public interface).",
        'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | LC_ALL=C sort | head -n 1)',
        "srun " + " ".join(torchrun) + " \\",
        "    " + " ".join(script_words),
    ]
    return "\n".join(lines) + "\n"


def multinode_notes(multinode: dict, host: str) -> list[str]:
    """What a user must know to start the commands: order, rank 0, trust, timeouts, restarts, workers."""
    mode = multinode["mode"]
    notes = [
        f"start node 0 first, on {host}: it hosts the rendezvous (is_host=1) and every other node connects to it; "
        f"a node that cannot reach {multinode['rdzv_endpoint']} gives up after about the store's read_timeout "
        f"({READ_TIMEOUT_S} s) with exit 1",
        f"rank 0 {RANK0_ROLE[mode]}. c10d ranks the nodes by hostname (FQDN, compared as text), then by "
        "torchrun's pid, not by who hosts the rendezvous: make node 0 the machine whose `hostname -f` sorts "
        "first (node01 before node02); otherwise rank 0 lands on another node, and losing either of the two "
        "ends the job",
        f"trust: torch.distributed trusts every peer (what it broadcasts travels pickled), so "
        f"{multinode['rdzv_endpoint']} and the ports the ranks open to each other must be reachable only from "
        "the job's own nodes: a cluster network, never a public interface",
        f"nobody answers: the rendezvous waits join_timeout={multinode['join_timeout_s']} s for all "
        f"{multinode['nnodes']} nodes, then every node that waited exits 1 with one line (RendezvousTimeoutError)",
        "every node's python -m common.torchrun exits with the run's own status and one line: 0 finished, 130 "
        "Ctrl+C and 143 SIGTERM on any node (after rank 0's checkpoint), 2 a bad configuration on any node, 3 a "
        "locked run directory, 1 a failure (after torchrun's report); a lost node keeps no other node waiting",
        f"torchrun restarts a failed job up to --max-restarts {multinode['max_restarts']} times; each restart "
        f"resumes from the newest checkpoint in {multinode['output_dir'] or 'the run directory'}, and the same "
        "commands started again continue the run (--resume auto)",
    ]
    if multinode["num_workers_per_rank"] is not None:
        workers = multinode["num_workers_per_rank"]
        notes.append(f"--num-workers is per rank: {workers} on each of {multinode['world_size']} ranks, "
                     f"{workers * multinode['world_size']} in all")
    if os.environ.get(system.ASSUME_ENV):
        notes.append(f"planned for the facts in {os.environ[system.ASSUME_ENV]}, on every node; the commands do not "
                     "carry them: on the nodes each script sees its real machine")
    return notes
