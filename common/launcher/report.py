"""The report: dependencies, the machine's facts, the recommendation and every mode's plan, as
``--check-only`` prints it and ``--json`` writes it; and the multi-node job as ``--nnodes`` prints it."""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from dataclasses import asdict

from common import system
from common.launcher.dependencies import dependency_report
from common.launcher.modes import MODES
from common.launcher.plan import GiB, recommend
from common.launcher.tune import tuned_choice


def facts_report(m: system.Machine) -> dict:
    """The machine's facts for people and JSON (GiB rounded), with which were assumed and from where."""
    return {"physical_cores": m.physical_cores, "logical_cores": m.logical_cores, "usable_cores": m.usable_cores,
            "ram_total_gib": round(m.ram_total / GiB, 1), "ram_available_gib": round(m.ram_available / GiB, 1),
            "gpus": [{"index": g.index, "name": g.name, "memory_gib": round(g.memory / GiB, 1),
                      "capability": g.capability} for g in m.gpus],
            "shm_total_gib": round(m.shm_total / GiB, 2), "shm_free_gib": round(m.shm_free / GiB, 2),
            "open_files_limit": m.open_files_limit,
            "start_method": f"{m.start_method} (set by every script; the platform default is "
                            f"{system.platform_start_method()})",
            "hostname": socket.gethostname(), "assumed": list(m.assumed),
            "assumed_from": os.environ.get(system.ASSUME_ENV) if m.assumed else None}


def build_report(m: system.Machine, mode: str | None = None, env_id: str | None = None,
                 world_size: int = 1, dqn_args: Sequence[str] = ()) -> dict:
    """Dependencies, facts, the recommendation, every mode's plan (for a job of ``world_size`` ranks; the dqn
    mode's for the flags ``dqn_args`` it is given), and the mode selected (``mode`` or the recommended one) with
    its ``--tune`` measurement for ``env_id`` if there is one.

    The dependencies come first: the plans import the training scripts, and where a required package
    they import is missing there are none (``recommendation`` None, ``plans`` empty)."""
    deps = dependency_report()
    facts = facts_report(m)
    try:
        rec = recommend(m, world_size, dqn_args)
    except ImportError:
        if not deps["missing"]:
            raise
        return {"dependencies": deps, "system": facts, "recommendation": None, "plans": {}, "selected": mode,
                "tuned": None, "ready": False}
    chosen = mode or rec.mode
    return {"dependencies": deps, "system": facts, "recommendation": {"mode": rec.mode, **asdict(rec.plan),
                                                                      "refused": rec.refused,
                                                                      "warnings": rec.warnings},
            "plans": {name: asdict(p) for name, p in rec.plans.items()}, "selected": chosen,
            "tuned": tuned_choice(facts, chosen, env_id or MODES[chosen].default_env), "ready": not deps["missing"]}


def print_report(report: dict) -> None:
    deps, facts, rec = report["dependencies"], report["system"], report["recommendation"]
    print("Dependencies")
    for p in deps["packages"]:
        state = p["installed"] or "MISSING"
        tested = f", tested with {p['tested']}" if p.get("tested") else ""
        print(f"  {'ok ' if p['ok'] else 'BAD'} {p['package']:<15} {state:<14} (requires {p['required']}{tested})")
    print(f"  torch build: {deps['torch_build'] or 'torch not installed'}")
    for extra in deps["extras"]:
        state = "installed" if extra["installed"] else f"not installed ({extra['install_hint']})"
        print(f"  extra {extra['extra']:<7} -> {extra['enables']}: {state}")
    if deps["missing"]:
        print(f"  missing or wrong version: {', '.join(deps['missing'])} -> {deps['install_hint']}")
    print_system(facts)
    if rec is None:
        print("\nRecommendation")
        print(f"  none: the training scripts need the missing packages ({deps['install_hint']})")
        return
    for warning in rec["warnings"]:
        print(f"  warning: {warning}")
    print("\nRecommendation")
    print(f"  mode: {rec['mode']} ({MODES[rec['mode']].script}: {MODES[rec['mode']].summary})")
    print(f"  why: {rec['reason']}")
    selected = report["selected"]
    if selected != rec["mode"]:
        print(f"\nSelected with --mode: {selected} ({MODES[selected].script})")
    print_plan(report["plans"][selected])
    if report["tuned"]:
        print(f"  measured by --tune: {report['tuned']['args']} ({report['tuned']['sps']:.0f} steps/s), "
              "used instead of the guess")
    print("\nOther modes on this machine")
    for name, plan in report["plans"].items():
        if name != selected:
            state = (f"cannot run: {plan['cannot_run']}" if plan["cannot_run"] else
                     f"not recommended: {plan['not_recommended']}" if plan["not_recommended"] else
                     f"would run with {' '.join(plan['args'])}")
            print(f"  {name:<17} {state}")


def print_system(facts: dict) -> None:
    print("\nSystem")
    if facts["assumed"]:
        print(f"  assumed (from {facts['assumed_from']}): {', '.join(facts['assumed'])}; the rest is measured")
    print(f"  cores: {facts['physical_cores']} physical, {facts['logical_cores']} logical "
          f"({facts['usable_cores']} usable by this process)")
    print(f"  RAM: {facts['ram_total_gib']} GiB total, {facts['ram_available_gib']} GiB available")
    for gpu in facts["gpus"]:
        print(f"  GPU {gpu['index']}: {gpu['name']}, {gpu['memory_gib']} GiB, compute capability {gpu['capability']}")
    if not facts["gpus"]:
        print("  GPUs: none")
    print(f"  /dev/shm: {facts['shm_total_gib']} GiB, {facts['shm_free_gib']} GiB free")
    print(f"  open-files limit: {facts['open_files_limit']}")
    print(f"  start method: {facts['start_method']}")


def print_plan(plan: dict) -> None:
    fmt = system.format_bytes
    print(f"  flags: {' '.join(plan['args']) or '(the script defaults)'}")
    print(f"  settings: {', '.join(f'{k}={v}' for k, v in plan['settings'].items())}")
    print(f"  threads: {', '.join(f'{k} {v}' for k, v in plan['threads'].items())}")
    print(f"  devices: {plan['devices']}")
    mem = plan["memory"]
    buffers = [f"{k[:-6]} {fmt(v)}" for k, v in mem.items()
               if k.endswith("_bytes") and k[:-6] in ("rollout", "batch", "replay", "cache", "ntuple_weights")]
    sizes = f"{', '.join(buffers)}; " if buffers else ""  # none where the plan could not be made
    print(f"  memory plan: {sizes}per worker ~{fmt(mem['per_worker_rss_bytes'])} RSS, "
          f"main ~{fmt(mem['main_rss_bytes'])}; total ~{fmt(mem['total_ram_bytes'])} of a "
          f"{fmt(mem['ram_budget_bytes'])} RAM budget; /dev/shm {fmt(mem['shm_bytes'])} of "
          f"{fmt(mem['shm_free_bytes'])} free")
    for warning in plan["warnings"]:
        print(f"  note: {warning}")
    if plan["cannot_run"]:
        print(f"  cannot run here: {plan['cannot_run']}")
    elif plan["not_recommended"]:
        print(f"  not recommended here: {plan['not_recommended']}")


def print_multinode(multinode: dict, facts: dict) -> None:
    mode = MODES[multinode["mode"]]
    gpus = len(facts["gpus"])
    print(f"Multi-node: {mode.name} ({mode.script}) on {multinode['nnodes']} nodes x "
          f"{multinode['nproc_per_node']} rank(s) = world size {multinode['world_size']}")
    print(f"  every node alike: {facts['usable_cores']} cores, {gpus} GPU{'s' * (gpus != 1)}, "
          f"{facts['ram_total_gib']} GiB RAM ({'assumed' if facts['assumed'] else 'this machine'})")
    print(f"  ranks per node: {multinode['nproc_reason']}")
    run_dir = multinode["output_dir"] or "the checkpoint's"
    print(f"  run directory: {run_dir} on node 0 (rank 0 alone writes it)")
    for node, command in enumerate(multinode["commands"]):
        role = " (start it first: it hosts the rendezvous and should be rank 0)" if node == 0 else ""
        print(f"  node {node}{role}:\n    {command}")
    for note in multinode["notes"]:
        print(f"  note: {note}")
    print("\nSLURM batch script (sbatch FILE; the same job, one torchrun per node):\n")
    print(multinode["slurm"], end="")
