"""The launcher's advice holds on every machine shape, not only on the machine the tests run on.

For a grid of machines (cores, GPUs and their memory, RAM, /dev/shm, open-files limit) the
recommended command, and ``--mode X --force`` for every mode, must pass the chosen script's own
validation (``common.run.prepare``, in this process, with the machine's facts assumed), and the
run it describes must fit: workers within the cores, buffers within RAM and /dev/shm, the
coordinator's open files within the limit. A forced mode may instead be refused by the launcher,
with a reason. Buffer sizes are computed here from the script's resolved config and the env's real
observation space, with the functions the scripts allocate them with, not taken from the launcher's plan;
and on a roomy machine the plan's own numbers must be exactly these.

Validations are deduplicated exactly: a script's validation is a function of its argv and of the
machine facts it reads, so each outcome is stored with the facts it read and reused for every
shape that agrees on them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import itertools
import math

import numpy as np
import pytest
from conftest import ROOT

import launch_parallel_training as launcher
from common import run, system
from common.config import ConfigError
from common.launcher.command import build_command
from common.launcher.modes import MODES, script_module
from common.launcher.plan import CUDA_HOST_RSS, WORKER_RSS, Plan, recommend
from common.replay import replay_bytes, storage_dtype
from common.replay_shm import ReplayLayout
from common.rollout import rollout_layout

MiB, GiB = 2**20, 2**30
CORES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
GPU_SETS = [(0, 0)] + [(n, mem) for n in (1, 2, 4, 8) for mem in (16, 40, 80)]
RAM_GIB = (4, 16, 64, 512)
OPEN_FILES = (1024, 65536)
# Open files of train_parallel_timed.py's coordinator: 32 with 1 worker, 41 with 4.
FDS_MEASURED_BASE, FDS_MEASURED_PER_WORKER = 40, 3
ASYNC = {"dqn", "ultra"}  # modes whose main process learns while the workers run


def grid() -> list[system.Machine]:
    shapes = []
    for cores, (gpus, gpu_gib), ram, files in itertools.product(CORES, GPU_SETS, RAM_GIB, OPEN_FILES):
        for shm in (64 * MiB, 1 * GiB, ram * GiB // 2):
            shapes.append(system.Machine(
                cores, cores, cores, ram * GiB, int(0.9 * ram * GiB), shm, shm,
                tuple(system.GPU(i, "GPU", gpu_gib * GiB, "8.0") for i in range(gpus)), files, "spawn",
                ("all",)))
    return shapes


SHAPES = grid()


def converted(script: str) -> bool:
    return "\nMODE = Mode(" in (ROOT / script).read_text()


def mode_params() -> list:
    """One parameter per mode; a script not yet on common.run (no MODE) is expected to fail."""
    params = []
    for name, mode in MODES.items():
        marks = [] if converted(mode.script) else [pytest.mark.xfail(
            reason=f"{mode.script} has no MODE yet (not on common.run)", run=False)]
        params.append(pytest.param(name, marks=marks, id=name))
    return params


class RecordingGPUs(tuple):
    """The GPUs of a RecordingMachine: counting them is one fact, looking at them another."""

    def __len__(self) -> int:
        self.reads.add("gpu_count")
        return tuple.__len__(self)

    def __iter__(self):
        self.reads.add("gpus")
        return tuple.__iter__(self)

    def __getitem__(self, index):
        self.reads.add("gpus")
        return tuple.__getitem__(self, index)


class RecordingMachine(system.Machine):
    """A Machine that notes which facts a validation read."""

    def __getattribute__(self, name: str):
        value = object.__getattribute__(self, name)
        if name == "gpus":
            value = RecordingGPUs(value)
            value.reads = object.__getattribute__(self, "reads")
        elif name in FACT_NAMES:
            object.__getattribute__(self, "reads").add(name)
        return value


FACT_NAMES = {f.name for f in dataclasses.fields(system.Machine)}


def fact(machine: system.Machine, name: str):
    return len(machine.gpus) if name == "gpu_count" else getattr(machine, name)


@dataclasses.dataclass
class Outcome:
    status: int  # 0 = valid, 2 = refused by the script
    message: str
    cfg: object
    env: object
    reads: dict  # fact -> value the outcome depends on


class Validator:
    """``prepare(MODE, argv)`` under assumed facts, each distinct (argv, facts read) once."""

    def __init__(self):
        self.outcomes: dict[tuple, list[Outcome]] = {}
        self.calls = 0

    def __call__(self, mode: str, argv: list[str], machine: system.Machine) -> Outcome:
        key = (mode, tuple(argv))
        for outcome in self.outcomes.get(key, []):
            if all(fact(machine, k) == v for k, v in outcome.reads.items()):
                return outcome
        outcome = self._validate(mode, argv, machine)
        self.outcomes.setdefault(key, []).append(outcome)
        return outcome

    def _validate(self, mode: str, argv: list[str], machine: system.Machine) -> Outcome:
        self.calls += 1
        recording = RecordingMachine(**{f.name: getattr(machine, f.name) for f in dataclasses.fields(machine)})
        object.__setattr__(recording, "reads", set())
        stderr = io.StringIO()
        cfg = env = None
        with system.assumed_machine(recording), contextlib.redirect_stderr(stderr):
            try:
                cfg, env, *_ = run.prepare(script_module(mode).MODE, [*argv, "--validate-only"])
                status, message = 0, ""
            except ConfigError as err:
                status, message = 2, str(err)
            except SystemExit as exit_:
                status, message = int(exit_.code or 0), stderr.getvalue().strip()
        reads = {name: fact(machine, name) for name in object.__getattribute__(recording, "reads")}
        return Outcome(status, message, cfg, env, reads)


@pytest.fixture(scope="module")
def validator() -> Validator:
    return Validator()


def command_argv(mode: str, plan: Plan) -> list[str]:
    """The script's argv as the launcher would exec it (a fixed --output-dir, so argv repeat)."""
    opts, passthrough = launcher.parse_args(["--mode", mode, "--output-dir", "/nonexistent/prl-shapes"])
    command = build_command(MODES[mode], plan.args, opts, passthrough, None)
    assert command[1].endswith(MODES[mode].script)
    return command[2:]


def buffers(mode: str, cfg, env) -> tuple[int, int]:
    """(bytes in /dev/shm, bytes in process memory) of the run's big arrays, from its resolved config and
    with the layouts the scripts allocate them with."""
    space = env.observation_space
    if mode == "timed":
        layout = rollout_layout(cfg.n_steps, cfg.total_envs, space, env.action_space)
        rollout = sum(math.prod(shape) * np.dtype(dtype).itemsize for shape, dtype in layout.values())
        return rollout, rollout  # the shared rollout, and the learner's batch built from it
    if mode == "ultra":
        return ReplayLayout(cfg.buffer_size, cfg.num_actors, space.shape, storage_dtype(space).name,
                            cfg.prioritized).nbytes(), 0
    if mode == "dqn" and cfg.learner == "ntuple":  # float32 weights of both seats' tables, in /dev/shm
        return 2 * cfg.ntuple_tuples * 4 ** cfg.ntuple_length * np.dtype(np.float32).itemsize, 0
    if mode == "dqn":
        masks = int(env.action_space.n) if env.action_mask else None
        return 0, replay_bytes(cfg.buffer_size, space.shape, storage_dtype(space), masks)
    return (env.extra["data"].nbytes if cfg.env_id == "Market-v0" else 0), 0  # the market cache


def check_fits(mode: str, machine: system.Machine, outcome: Outcome, what: str) -> None:
    cfg = outcome.cfg
    workers = cfg.num_workers
    cores = machine.usable_cores
    assert workers <= cores, f"{what}: {workers} workers on {cores} cores"
    if mode in ASYNC and cores >= 2:
        assert workers + 1 <= cores, f"{what}: {workers} workers and a learner on {cores} cores"
    shm, private = buffers(mode, cfg, outcome.env)
    assert shm <= machine.shm_free, f"{what}: {shm} bytes of /dev/shm, {machine.shm_free} free"
    gpu_workers = workers if mode == "ppo-multiprocess" and machine.gpus else 0
    processes = (workers + 1) * WORKER_RSS + gpu_workers * CUDA_HOST_RSS
    ram = shm + private + processes
    assert ram <= system.RAM_HEADROOM * machine.ram_available, \
        f"{what}: {ram / GiB:.1f} GiB planned, {machine.ram_available / GiB:.1f} GiB available"
    files = FDS_MEASURED_BASE + FDS_MEASURED_PER_WORKER * workers
    assert files <= machine.open_files_limit, f"{what}: ~{files} open files, limit {machine.open_files_limit}"


def check_command(mode: str, plan: Plan, machine: system.Machine, validator: Validator,
                  what: str) -> None:
    outcome = validator(mode, command_argv(mode, plan), machine)
    assert outcome.status == 0, f"{what}: {' '.join(plan.args)} -> exit {outcome.status}: {outcome.message}"
    check_fits(mode, machine, outcome, what)


def describe(m: system.Machine) -> str:
    gpus = f"{len(m.gpus)}x{m.gpus[0].memory // GiB}G" if m.gpus else "0"
    return (f"{m.usable_cores} cores, {gpus} GPUs, {m.ram_total // GiB} GiB RAM, /dev/shm {m.shm_free // MiB} MiB, "
            f"{m.open_files_limit} files")


@pytest.mark.parametrize("mode", mode_params())
def test_recommended_command_validates_and_fits(mode, validator):
    chosen = 0
    for machine in SHAPES:
        rec = recommend(machine)
        if rec.mode != mode:
            continue
        chosen += 1
        assert rec.plan.cannot_run is None and rec.plan.not_recommended is None, describe(machine)
        assert rec.plan.reason
        check_command(mode, rec.plan, machine, validator, f"recommended on {describe(machine)}")
    assert chosen, f"no shape of the grid gets {mode} recommended"


@pytest.mark.parametrize("mode", mode_params())
def test_forced_mode_validates_or_is_refused_with_a_reason(mode, validator):
    refused = 0
    for machine in SHAPES:
        plan = recommend(machine).plans[mode]
        if plan.cannot_run:
            assert len(plan.cannot_run) > 20, plan.cannot_run
            refused += 1
            continue
        check_command(mode, plan, machine, validator, f"--mode {mode} --force on {describe(machine)}")
    assert refused < len(SHAPES) // 10, f"{mode} refused on {refused} of {len(SHAPES)} shapes"


def test_every_shape_gets_a_recommendation_that_runs():
    modes = {recommend(m).mode for m in SHAPES}
    assert modes == set(MODES), modes  # every rule of recommend() is exercised by the grid


PLAN_BUFFERS = {"timed": "rollout", "dqn": "replay", "ultra": "replay", "ppo-multiprocess": "cache"}


def plan_buffer(mode: str, cfg) -> str:
    """The buffer a plan sizes: the dqn mode's is its learner's (the validated config names the one that runs)."""
    return "ntuple_weights" if mode == "dqn" and cfg.learner == "ntuple" else PLAN_BUFFERS[mode]


@pytest.mark.parametrize("mode", mode_params())
def test_the_plan_is_what_the_script_runs_with(mode, validator):
    """The plan reads the script's declaration (its config's defaults, its env) and sizes buffers with the
    script's own formulas: on a machine with room to spare, every setting it reports is the validated
    config's, and its buffer is exactly what the script allocates."""
    roomy = system.Machine(16, 16, 16, 64 * GiB, 60 * GiB, 32 * GiB, 32 * GiB, (), 65536, "spawn", ("all",))
    plan = recommend(roomy).plans[mode]
    outcome = validator(mode, command_argv(mode, plan), roomy)
    assert outcome.status == 0, outcome.message
    cfg = outcome.cfg
    assert cfg.env_id == MODES[mode].default_env
    for name, value in plan.settings.items():
        if name == "device":  # the plan says where the learner will be: the script's device, resolved
            with system.assumed_machine(roomy):
                assert system.resolve_device(cfg.device) == value
        elif name != "split":
            assert getattr(cfg, name) == value, f"{MODES[mode].script}: {name} is {getattr(cfg, name)!r}, not {value!r}"
    shm, private = buffers(mode, cfg, outcome.env)
    assert plan.memory[f"{plan_buffer(mode, cfg)}_bytes"] == (shm or private)  # in /dev/shm, or the DQN learner's
