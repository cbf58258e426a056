"""A plan per mode for this machine, and the recommendation: a pure function of the machine's facts.

Each planner reads its script's declaration (:mod:`.modes`: the config's defaults, the default
env's spaces) and sizes the run's buffers with what the script declares of them (``Mode.buffers``:
name -> bytes for a config, from the very functions the script allocates them with; ``Mode.shm_buffers``:
those in /dev/shm), for the default config with the plan's own workers and replay size. What the
launcher adds is its own model of a process (the RSS constants below), the same in every mode, and
the rules that choose workers, threads and devices.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from common import system
from common.config import ConfigError, parse_config
from common.launcher.modes import MODES, default_buffer, default_env, script_defaults, script_module

MiB, GiB = 2**20, 2**30

# What the memory plan counts on (measured on the 2-core development machine, rounded up).
WORKER_RSS = 256 * MiB  # one worker process: interpreter, numpy, torch, its envs (226-230 MiB PSS measured)
MAIN_RSS = 512 * MiB  # the coordinator / learner process, with logs and TensorBoard
CUDA_HOST_RSS = 512 * MiB  # host memory a CUDA context adds to a process
POPULATION_VRAM = 1 * GiB  # GPU memory of one population worker: CUDA context, small nets, PPO batches
GPU_MEMORY_SHARE = 0.85  # plan to use at most this share of a GPU's memory
RAM_SHARE = system.RAM_HEADROOM  # and of the RAM available now (shared memory counts as RAM too)
SHM_SHARE = 0.9  # and of /dev/shm's free space
FDS_BASE = 128  # open files of a run before its workers (logs, TensorBoard, shared-memory segments)
FDS_PER_WORKER = 4  # the coordinator's pipe and process sentinel per worker (3 measured)
ULTRA_MIN_CORES = 8  # fewer, and the learner starves the asynchronous actors
MIN_REPLAY = 10_000  # the smallest replay buffer worth running the DQN modes with


@dataclass
class Plan:
    """How one mode would run on this machine: its flags, threads, devices and memory."""

    mode: str
    args: list[str]  # flags for the script: only what differs from its defaults
    settings: dict  # what the run will use (the flags and the defaults the plan relies on)
    threads: dict  # torch threads per process
    devices: str  # where the learner(s) and workers run
    memory: dict  # bytes: buffers, cache, per-process RSS, the total against the budget
    reason: str = ""  # why this mode suits this machine
    not_recommended: str | None = None  # the launcher asks for --force
    cannot_run: str | None = None  # the launcher refuses it, --force or not
    warnings: list[str] = field(default_factory=list)


def fit_workers(m: system.Machine, wanted: int, per_worker: int, fixed: int, what: str = "workers",
                per_gpu: int | None = None) -> tuple[int, list[str]]:
    """The most workers, up to ``wanted``, whose RAM, GPU memory and open files fit; and what bounded them."""
    limits = {"RAM": int((RAM_SHARE * m.ram_available - fixed) // per_worker),
              "the open-files limit": (m.open_files_limit - FDS_BASE) // FDS_PER_WORKER}
    if per_gpu and m.gpus:
        limits["GPU memory"] = sum(int(GPU_MEMORY_SHARE * g.memory // per_gpu) for g in m.gpus)
    count = max(0, min(wanted, *limits.values()))
    notes = []
    for name, limit in limits.items():
        if limit < wanted:
            hint = f" (ulimit -n {FDS_BASE + FDS_PER_WORKER * wanted} for {wanted})" if name.startswith("the") else ""
            notes.append(f"{name} allows {max(0, limit)} {what}, not {wanted}{hint}")
    return count, notes


def memory_plan(m: system.Machine, workers: int, per_worker: int, main: int, buffers: dict[str, int],
                shm_keys: tuple[str, ...] = ()) -> dict:
    """Bytes of every buffer, the per-process estimates, and the totals against RAM and /dev/shm."""
    shm = sum(buffers.get(k, 0) for k in shm_keys)  # a key of a buffer this config does not make counts 0
    total = main + workers * per_worker + sum(buffers.values())
    return {**{f"{k}_bytes": v for k, v in buffers.items()}, "per_worker_rss_bytes": per_worker,
            "main_rss_bytes": main, "total_ram_bytes": total, "ram_budget_bytes": int(RAM_SHARE * m.ram_available),
            "shm_bytes": shm, "shm_free_bytes": m.shm_free}


@functools.cache  # the plans of many machines share their sizes (tests/test_launcher_shapes.py plans thousands)
def buffer_bytes(name: str, **settings) -> dict[str, int]:
    """The big buffers (name -> bytes) of mode ``name``'s default config with ``settings`` (the plan's
    ``num_workers``, ``buffer_size``), as its script declares them, for its default env: None for a mode that
    probes its env its own way (the population's market, whose making builds the history). Shared: do not
    change it. ConfigError where the default env cannot be made here."""
    mode, defaults = script_module(name).MODE, script_defaults(name)
    cfg = dataclasses.replace(defaults, **settings) if settings else defaults
    return mode.buffers(cfg, None if mode.probe else default_env(name))


def shm_buffers(name: str) -> tuple[str, ...]:
    """Which of mode ``name``'s buffers live in /dev/shm, as its script declares them."""
    return script_module(name).MODE.shm_buffers


# --------------------------------------------------------------------------- the timed mode

def plan_timed(m: system.Machine) -> Plan:
    mode, d, shm_keys = MODES["timed"], script_defaults("timed"), shm_buffers("timed")
    # Every array of a rollout has a column per env: a worker adds one worker's share of each buffer (and the
    # sequential run, with no workers, has one worker's envs in the main process).
    one = buffer_bytes("timed", num_workers=1)

    # Lockstep workers wait for the slowest, and two on one core's hyperthreads slow each other: one per core.
    wanted = min(m.usable_cores, m.physical_cores) if m.usable_cores > 1 else 0
    per_worker = WORKER_RSS + sum(one.values())  # its share of the shared rollout and of the learner's batch
    workers, notes = fit_workers(m, wanted, per_worker, MAIN_RSS + sum(one.values()))
    by_shm = int(SHM_SHARE * m.shm_free // sum(one[k] for k in shm_keys))
    if by_shm < workers:
        notes.append(f"/dev/shm holds the rollout of {by_shm} workers, not {workers}")
        workers = by_shm
    memory = memory_plan(m, workers, WORKER_RSS, MAIN_RSS, buffer_bytes("timed", num_workers=workers), shm_keys)
    plan = Plan("timed", [mode.workers_flag, str(workers)],
                {"num_workers": workers, "num_envs_per_worker": d.num_envs_per_worker, "n_steps": d.n_steps,
                 "device": d.device},
                {"per_worker": 1, "learner": d.torch_threads},
                "learner and workers on the CPU (a 64-wide MLP updates fastest there)", memory,
                warnings=notes)
    if memory["total_ram_bytes"] > memory["ram_budget_bytes"] or memory["shm_bytes"] > m.shm_free:
        plan.cannot_run = (f"even the sequential run needs {system.format_bytes(memory['total_ram_bytes'])} of RAM "
                           f"and {system.format_bytes(memory['shm_bytes'])} of /dev/shm")
    cores = (f"{m.usable_cores} cores ({m.physical_cores} physical)" if m.physical_cores < m.usable_cores
             else f"{m.usable_cores} core{'s' * (m.usable_cores > 1)}")
    per_core = " (one per physical core)" if workers == wanted else ""
    who = (f"{workers} worker processes{per_core} in lockstep" if workers > 1 else
           "1 worker process" if workers else "its envs in the main process (no worker processes)")
    plan.reason = (f"{cores}, no GPU needed: synchronous PPO steps {who} and updates on the CPU, where a small "
                   "network learns fastest")
    return plan


# --------------------------------------------------------------------------- the DQN modes

@dataclass
class ReplayBudget:
    """Workers and replay capacity of a DQN mode: the replay first (up to half the RAM budget, and in
    /dev/shm where it lives there), then as many workers as the rest holds."""

    workers: int
    buffer: int
    main: int  # bytes of the learner process
    notes: list[str]

    def refusal(self, what: str) -> str | None:
        if self.workers >= 1 and self.buffer >= MIN_REPLAY:
            return None
        return (f"room for {self.workers} {what} and a replay of {self.buffer} transitions "
                f"({'; '.join(self.notes)}), it needs 1 and {MIN_REPLAY} transitions")


def replay_budget(m: system.Machine, name: str, transition: int, wanted: int, in_shm: bool,
                  what: str) -> ReplayBudget:
    """The replay capacity and workers of DQN mode ``name`` on ``m``; ``transition`` is the bytes of one
    transition of its replay, as the script counts them when it fits its buffer to the machine."""
    default = default_buffer(name)
    main = MAIN_RSS + (CUDA_HOST_RSS if m.gpus else 0)
    room, why = (RAM_SHARE * m.ram_available - main) / 2, "half the RAM budget"
    if in_shm and SHM_SHARE * m.shm_free < room:
        room, why = SHM_SHARE * m.shm_free, "/dev/shm (docker: --shm-size=8g)"
    buffer, notes = default, []
    if default * transition > room:
        buffer = max(0, int(room // transition) // 1000 * 1000)
        notes.append(f"replay buffer bounded to {buffer} transitions ({system.format_bytes(buffer * transition)}) "
                     f"by {why}")
    workers, limits = fit_workers(m, wanted, WORKER_RSS, main + buffer * transition, what)
    return ReplayBudget(workers, buffer, main, notes + limits)


def idle_gpus(m: system.Machine) -> list[str]:
    """A single learner uses one GPU; say so where there are more."""
    if len(m.gpus) < 2:
        return []
    others = len(m.gpus) - 1
    return [f"the learner uses cuda:0; {others} more GPU{'s' * (others > 1)} would stay idle "
            "(the ppo-multiprocess population spreads its workers over all of them)"]


def replay_flags(name: str, budget: ReplayBudget, device: str | None = None) -> list[str]:
    """The worker count; a device and a replay size only where they differ from the script's defaults."""
    args = [MODES[name].workers_flag, str(max(1, budget.workers))]
    if device is not None and device != script_defaults(name).device:
        args += ["--device", device]
    if budget.buffer != default_buffer(name):
        args += ["--buffer-size", str(budget.buffer)]
    return args


def plan_ultra(m: system.Machine) -> Plan:
    d = script_defaults("ultra")
    gpu, cores = bool(m.gpus), m.usable_cores
    learner_threads = 1 if gpu else max(1, min(8, cores // 4))  # a GPU learner needs one core to feed it
    # and one core stays for the system and the bookkeeping
    budget = replay_budget(m, "ultra", sum(buffer_bytes("ultra", num_workers=1, buffer_size=1).values()),
                           max(1, cores - learner_threads - 1), in_shm=True, what="actors")
    actors, buffer = budget.workers, budget.buffer
    burst = d.n_step * d.num_envs_per_worker  # each actor's replay share must hold one vector step's output
    if actors and buffer // actors < burst:
        actors = budget.workers = buffer // burst
        budget.notes.append(f"a replay of {buffer} transitions holds {actors} actors' shares")
    args = replay_flags("ultra", budget)  # the script's device "auto" puts the learner on the GPU
    device = "cuda:0" if gpu else "cpu"
    replay = buffer_bytes("ultra", num_workers=max(1, actors), buffer_size=buffer)
    memory = memory_plan(m, actors, WORKER_RSS, budget.main, replay, shm_buffers("ultra"))
    # fp32 by default: at these networks' sizes autocast measured slower on an H200 (common.dqn.resolve_precision)
    precision = ("fp32; bf16 autocast" if float(m.gpus[0].capability) >= 8.0 else "fp32; fp16 with a GradScaler") \
        if gpu else "fp32"
    plan = Plan("ultra", args, {"num_workers": actors, "num_envs_per_worker": d.num_envs_per_worker,
                                "buffer_size": buffer, "device": device,
                                "split": f"{actors} actor processes, 1 learner ({learner_threads} thread(s))"},
                {"per_actor": 1, "learner": learner_threads},
                f"learner on {device} ({precision} possible, --mixed-precision); actors act on the CPU", memory,
                warnings=budget.notes + idle_gpus(m), cannot_run=budget.refusal("actors"))
    if plan.cannot_run is None and cores < ULTRA_MIN_CORES:
        plan.not_recommended = (f"{cores} cores: asynchronous actors and a learner need at least {ULTRA_MIN_CORES} "
                                "cores, or the learner starves the actors")
    plan.reason = (f"{cores} cores{' and a GPU' if gpu else ''}: {actors} asynchronous actors keep the replay full "
                   f"while the {'GPU' if gpu else 'CPU'} learner trains")
    return plan


def dqn_config(args: Sequence[str]) -> Any:
    """The dqn script's config as the flags ``args`` the launcher passes it set it (a ``--config`` file's included),
    unvalidated: validation asks this machine, and a plan may be for another. The defaults where the script's
    parser refuses the flags: the script says why when it starts."""
    if not args:
        return script_defaults("dqn")
    script = script_module("dqn")

    class Unvalidated(script.Config):
        def validate(self) -> None:
            pass

    try:
        with contextlib.redirect_stderr(io.StringIO()):  # argparse's usage message: the script prints its own
            return parse_config(Unvalidated, list(args))
    except SystemExit:
        return script_defaults("dqn")


def plan_dqn(m: system.Machine, world_size: int = 1, args: Sequence[str] = ()) -> Plan:
    """The learner the machine suits: the Q-network on cuda:0 where there is a GPU; else the learner the script
    chooses for the run ``args`` asks for (``chosen_learner``: the n-tuple learner for ConnectFour-v0 on one
    machine unless a setting of the Q-network is given) where its table fits in /dev/shm and RAM, the Q-network
    on the CPU where it does not. ``world_size``: the ranks of the job (``--nnodes``), which the script's choice
    depends on; ``args``: the flags the launcher passes the script."""
    script, cfg = script_module("dqn"), dqn_config(args)
    q_network_set = script.settings_set(cfg, script.Q_NETWORK_SETTINGS)
    alone = script.chosen_learner(cfg.learner, cfg.env_id, 1, q_network_set)  # the script started alone, here
    if m.gpus:
        instead = (f" (the n-tuple learner, the script's choice for {cfg.env_id} on one machine, runs on the CPU "
                   "only)" if alone == "ntuple" else "")
        return plan_q_network(m, f"the Q-network learns on the GPU{instead}", name_it=alone != "q_network")
    chosen = script.chosen_learner(cfg.learner, cfg.env_id, world_size, q_network_set)
    if chosen != "ntuple":
        if alone == "ntuple":
            why = f"{world_size} ranks: the n-tuple learner runs on one machine only"
        elif cfg.learner == "q_network":
            why = "--learner q_network"
        elif q_network_set:
            why = f"the Q-network, auto's choice since --{q_network_set[0].replace('_', '-')} is set"
        else:
            why = f"the Q-network, the script's learner for {cfg.env_id}"
        return plan_q_network(m, why, name_it=alone != "q_network")
    ntuple, problem = plan_ntuple(m, cfg)
    if problem is None:
        return ntuple
    plan = plan_q_network(m, f"{problem}, so the Q-network learner", name_it=True)
    plan.warnings.insert(0, f"{problem}: the Q-network learner instead (--learner q_network)")
    return plan


def plan_ntuple(m: system.Machine, cfg: Any) -> tuple[Plan, str | None]:
    """The n-tuple learner of the dqn config ``cfg``: the main process and its workers self-play over one table
    in /dev/shm, all on the CPU; and why it cannot run here, or None."""
    cores = m.usable_cores
    table = buffer_bytes("dqn", learner="ntuple", ntuple_tuples=cfg.ntuple_tuples, ntuple_length=cfg.ntuple_length)
    # The main process plays and learns like a worker: one core each, the main process's included.
    workers, notes = fit_workers(m, max(1, cores - 1), WORKER_RSS, MAIN_RSS + sum(table.values()))
    memory = memory_plan(m, workers, WORKER_RSS, MAIN_RSS, table, shm_buffers("dqn"))  # the table, in /dev/shm
    size = system.format_bytes(memory["shm_bytes"])
    problem = None
    if memory["shm_bytes"] > SHM_SHARE * m.shm_free:
        problem = (f"/dev/shm has {system.format_bytes(m.shm_free)} free, too little for the n-tuple table of "
                   f"{size} (docker: --shm-size=1g)")
    elif workers < 1:
        problem = f"RAM holds no worker beside the main process and the n-tuple table of {size} ({'; '.join(notes)})"
    who = f"{workers} worker{'s' * (workers != 1)}"
    plan = Plan("dqn", [MODES["dqn"].workers_flag, str(max(1, workers))],
                {"learner": "ntuple", "num_workers": workers, "device": "cpu"}, {"per_worker": 1, "main": 1},
                f"CPU: the main process and {who} self-play over one table in /dev/shm", memory,
                warnings=notes)
    plan.reason = (f"{cores} core{'s' * (cores > 1)}, no GPU: the n-tuple learner, the script's choice for "
                   f"{cfg.env_id} on one machine, self-plays and learns by TD in the main "
                   f"process and {who} over one {size} table in /dev/shm; no replay, no network")
    return plan, problem


def plan_q_network(m: system.Machine, why: str, name_it: bool) -> Plan:
    """The Q-network learner (Double DQN) on cuda:0 where there is a GPU, else on the CPU, fed by rollout workers
    through its replay; ``why`` this learner. ``name_it``: the command says ``--learner q_network`` (where the
    script started alone with the same flags would choose the n-tuple learner), so that it means the same run
    wherever it is started or validated (under torchrun or not)."""
    d = script_defaults("dqn")
    cores = m.usable_cores
    learner_threads = 1 if m.gpus or cores < 4 else 2
    budget = replay_budget(m, "dqn", sum(buffer_bytes("dqn", learner="q_network", buffer_size=1).values()),
                           max(1, cores - learner_threads), in_shm=False, what="workers")
    workers = budget.workers
    device = "cuda:0" if m.gpus else d.device
    memory = memory_plan(m, workers, WORKER_RSS, budget.main,
                         buffer_bytes("dqn", learner="q_network", buffer_size=budget.buffer), shm_buffers("dqn"))
    named = ["--learner", "q_network"] if name_it else []
    plan = Plan("dqn", named + replay_flags("dqn", budget, device),
                {"learner": "q_network", "num_workers": workers, "buffer_size": budget.buffer, "device": device},
                {"per_worker": 1, "learner": learner_threads},
                f"learner on {device}; rollout workers act on the CPU and send whole episodes", memory,
                warnings=budget.notes + idle_gpus(m), cannot_run=budget.refusal("workers"))
    plan.reason = (f"{cores} core{'s' * (cores > 1)}{' and a GPU' if m.gpus else ''}: {why}; {workers} rollout "
                   f"processes feed one {'GPU' if m.gpus else 'CPU'} learner through its replay; nothing large goes "
                   "through /dev/shm")
    return plan


# --------------------------------------------------------------------------- the population

def plan_population(m: system.Machine) -> Plan:
    mode, d, gpus = MODES["ppo-multiprocess"], script_defaults("ppo-multiprocess"), len(m.gpus)
    # The default Market-v0's history in /dev/shm: the script counts it from the config (no env: making one
    # builds the history, seconds).
    buffers = buffer_bytes("ppo-multiprocess")
    cache = sum(buffers.values())
    per_worker = WORKER_RSS + (CUDA_HOST_RSS if gpus else 0)
    # One core stays for the coordinator; each worker's GPU memory counts too.
    workers, notes = fit_workers(m, max(1, m.usable_cores - 1), per_worker, MAIN_RSS + cache, per_gpu=POPULATION_VRAM)
    threads = max(1, m.usable_cores // max(1, workers))
    # The script's device "auto" puts image (CNN) policies on the GPUs and MLP policies, the default
    # market's among them, on the CPU, where they measured faster; the memory plan still counts the GPUs.
    if gpus:
        on_gpus = (f"round robin over {gpus} GPUs: worker i on cuda:(i mod {gpus}), "
                   f"{math.ceil(max(1, workers) / gpus)} per GPU" if gpus > 1 else "every worker on cuda:0")
        devices = (f"MLP policies (the default {d.env_id}'s) on the CPU, where they train faster; "
                   f"image policies {on_gpus}")
    else:
        devices = "every worker on the CPU"
    memory = memory_plan(m, workers, per_worker, MAIN_RSS, buffers, shm_buffers("ppo-multiprocess"))
    plan = Plan("ppo-multiprocess", [mode.workers_flag, str(max(1, workers))],
                {"num_workers": workers, "num_envs_per_worker": d.num_envs_per_worker,
                 "device": "cpu"},  # what the script's device "auto" picks for the default env's MLP policy
                {"per_worker": threads}, devices, memory, warnings=notes)
    if workers < 1:
        plan.cannot_run = "not enough RAM or GPU memory for one worker"
    elif cache > SHM_SHARE * m.shm_free:
        plan.cannot_run = (f"the market cache needs {system.format_bytes(cache)} of /dev/shm, "
                           f"{system.format_bytes(m.shm_free)} free (docker: --shm-size=8g)")
    plan.reason = (f"{gpus} GPUs: a population of {workers} independent agents, one per core; image policies "
                   "spread round robin over the GPUs" if gpus > 1
                   else f"a population of {workers} independent agents, one per core")
    return plan


# --------------------------------------------------------------------------- runs side by side (--search)

def cores_per_run(name: str, workers: int, overlapped: bool = False) -> int:
    """The cores one run of mode ``name`` with ``workers`` workers keeps busy, as the plans above count them: the
    timed mode's lockstep workers one per core, its learner updating while they wait (and on a core of its own when
    ``overlapped``, its async training); the other modes' learner (the population's coordinator) beside its workers,
    on a core of its own."""
    return max(1, workers) + (1 if overlapped or name != "timed" else 0)


def runs_at_once(m: system.Machine, cores: int, run_bytes: int, shm_bytes: int = 0) -> tuple[int, list[str]]:
    """How many runs of ``cores`` cores and ``run_bytes`` of RAM (``shm_bytes`` of it in /dev/shm) fit on ``m`` side
    by side, at least one, by the shares the plans keep; and what bounded them."""
    limits = {"cores": m.usable_cores // max(1, cores),
              "RAM": int(RAM_SHARE * m.ram_available // max(1, run_bytes))}
    if shm_bytes:
        limits["/dev/shm"] = int(SHM_SHARE * m.shm_free // shm_bytes)
    count = max(1, min(limits.values()))
    bound = [f"{name} ({m.usable_cores} usable, {cores} per run)" if name == "cores" else name
             for name, limit in limits.items() if limit == min(limits.values())]
    return count, bound


def run_bytes(workers: int, buffers: dict[str, int], cuda: bool = False) -> int:
    """RAM of one run: its main process (with a CUDA context where it learns on a GPU), its workers, its buffers."""
    return MAIN_RSS + (CUDA_HOST_RSS if cuda else 0) + workers * WORKER_RSS + sum(buffers.values())


# --------------------------------------------------------------------------- the recommendation

PLANNERS = {"timed": plan_timed, "dqn": plan_dqn, "ultra": plan_ultra, "ppo-multiprocess": plan_population}


def plan_mode(m: system.Machine, name: str, world_size: int = 1, dqn_args: Sequence[str] = ()) -> Plan:
    """The mode's plan for a job of ``world_size`` ranks; where its default env cannot be made here, a plan that
    needs --force (and the user's own --env-id) and says why. ``dqn_args``: the flags the dqn script is given."""
    try:
        # Only the dqn mode's learner depends on the world size and the flags (the script's chosen_learner); the
        # other modes plan each rank alike.
        return plan_dqn(m, world_size, dqn_args) if name == "dqn" else PLANNERS[name](m)
    except ConfigError as err:  # from default_env: an extra the env needs is missing (Box2D for LunarLander-v3)
        return Plan(name, [], {"device": script_defaults(name).device}, {}, "as the script decides",
                    memory_plan(m, 0, WORKER_RSS, MAIN_RSS, {}), not_recommended=f"its default env: {err}")


@dataclass
class Recommendation:
    mode: str
    plan: Plan
    plans: dict[str, Plan]  # every mode's plan on this machine
    refused: dict[str, str]  # mode -> why it does not run (or is not recommended) here
    warnings: list[str]


def recommend(m: system.Machine, world_size: int = 1, dqn_args: Sequence[str] = ()) -> Recommendation:
    """Pick a mode and its settings from the machine's facts, for a job of ``world_size`` ranks (``--nnodes``),
    the dqn mode's for the flags ``dqn_args`` it is given (``--mode dqn``'s own). A pure function of them."""
    plans = {name: plan_mode(m, name, world_size, dqn_args) for name in PLANNERS}
    refused = {name: p.cannot_run or p.not_recommended for name, p in plans.items()
               if p.cannot_run or p.not_recommended}
    gpus = len(m.gpus)
    if gpus >= 2 and "ppo-multiprocess" not in refused:
        choice = "ppo-multiprocess"
    elif gpus and "ultra" not in refused:
        choice = "ultra"
    elif gpus or "timed" in refused:
        choice = "dqn"
        if not gpus:
            why = ("/dev/shm or RAM is too small for the shared-memory rollout" if plans["timed"].cannot_run
                   else f"timed: {refused['timed']}")
            plans["dqn"].reason = f"{why}; {plans['dqn'].reason}"
    else:
        choice = "timed"
    warnings = list(plans[choice].warnings)
    if not gpus:
        warnings.append("no CUDA GPU: learners run on the CPU (the ultra mode prefers a GPU)")
    return Recommendation(choice, plans[choice], plans, refused, warnings)


def refusal(plan: dict, force: bool) -> str | None:
    """Why the launcher will not start this plan, or None."""
    if plan["cannot_run"]:
        return f"mode {plan['mode']} cannot run on this machine: {plan['cannot_run']}"
    if plan["not_recommended"] and not force:
        return (f"mode {plan['mode']} is not recommended on this machine: {plan['not_recommended']} "
                "(add --force to run it anyway)")
    return None
