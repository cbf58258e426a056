"""launch_parallel_training.py: the report, the recommendation, assumed facts, dry runs, launches and signals."""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import importlib.util
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import ROOT, run_script, script_env

import launch_parallel_training as launcher
from common import system
from common.config import ConfigError
from common.launcher import plan, report
from common.launcher.dependencies import EXTRAS
from common.launcher.modes import MODES, script_module
from common.launcher.plan import FDS_BASE, ULTRA_MIN_CORES, recommend

LAUNCHER = "launch_parallel_training.py"
GiB = 2**30
MACHINE_FILES = sorted((ROOT / "configs" / "machines").glob("*.json"))


def machine(cores: int, gpus: int = 0, shm_gib: float = 16.0, ram_gib: float = 64.0,
            files: int = 65536) -> system.Machine:
    return system.Machine(cores, cores, cores, int(ram_gib * GiB), int(ram_gib * GiB), int(shm_gib * GiB),
                          int(shm_gib * GiB), tuple(system.GPU(i, "GPU", 80 * GiB, "9.0") for i in range(gpus)),
                          files, "spawn")


def converted(script: str) -> bool:
    """Whether the script is on common.run (has MODE, so the launcher's flags are its flags)."""
    return "\nMODE = Mode(" in (ROOT / script).read_text()


def unconverted_mark(mode: str) -> list:
    script = MODES[mode].script
    return [] if converted(script) else [pytest.mark.xfail(reason=f"{script} has no MODE yet", run=False)]


def test_check_only_json_describes_this_machine():
    result = run_script(LAUNCHER, "--check-only", "--json", timeout=60)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert set(report) >= {"dependencies", "system", "recommendation"}
    facts = report["system"]
    assert facts["logical_cores"] == os.cpu_count()
    assert facts["physical_cores"] == psutil.cpu_count(logical=False)
    assert abs(facts["ram_total_gib"] - psutil.virtual_memory().total / 2**30) < 0.1
    import torch

    assert len(facts["gpus"]) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    assert facts["assumed"] == [] and facts["assumed_from"] is None
    packages = {p["package"]: p for p in report["dependencies"]["packages"]}
    assert packages["torch"]["ok"] and packages["torch"]["installed"] == importlib.metadata.version("torch")
    assert report["dependencies"]["torch_build"] == (f"CUDA {torch.version.cuda}" if torch.version.cuda
                                                     else "CPU only")
    rec = report["recommendation"]
    assert rec["mode"] in MODES and rec["reason"]
    assert set(report["plans"]) == set(MODES)
    assert rec["memory"]["total_ram_bytes"] <= rec["memory"]["ram_budget_bytes"]
    assert rec["threads"] and rec["devices"]
    assert report["command"][1].endswith(MODES[rec["mode"]].script)


def test_check_only_imports_no_torch():
    """--check-only answers in a fraction of a second because it never imports torch, except to count the
    GPUs where an NVIDIA driver is present (common.system)."""
    driver = ((Path("/proc/driver/nvidia/gpus").is_dir() or Path("/dev/nvidia0").exists())
              and os.environ.get("CUDA_VISIBLE_DEVICES") not in ("", "-1"))
    code = ("import sys, launch_parallel_training as l; status = l.main(['--check-only']); "
            f"assert ('torch' in sys.modules) == {driver}, 'torch imported: ' + str('torch' in sys.modules); "
            "sys.exit(status)")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=script_env(), capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "Recommendation" in result.stdout


def test_check_only_text_has_every_section():
    result = run_script(LAUNCHER, "--check-only", timeout=60)
    assert result.returncode == 0
    for heading in ("Dependencies", "System", "Recommendation", "/dev/shm", "open-files limit", "torch build",
                    "start method", "why:", "flags:", "threads:", "devices:", "memory plan:", "Other modes"):
        assert heading in result.stdout
    assert "assumed" not in result.stdout


def test_json_alone_reports_and_starts_nothing(tmp_path):
    result = run_script(LAUNCHER, "--json", "--mode", "timed", "--episodes", "30", cwd=tmp_path, timeout=60)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["selected"] == "timed" and report["refused"] is None
    command = report["command"]
    assert command[1].endswith("train_parallel_timed.py") and "--total-episodes" in command
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("facts, mode, expect", [
    (machine(2), "timed", {"num_workers": 2, "device": "cpu"}),
    (machine(1), "timed", {"num_workers": 0}),
    (machine(16, gpus=1), "ultra", {"num_workers": 14, "device": "cuda:0", "buffer_size": 200_000}),
    (machine(128), "timed", {"num_workers": 128}),
    (machine(64, gpus=4), "ppo-multiprocess", {"num_workers": 63}),
    (machine(16, gpus=1, shm_gib=0.01), "dqn", {"learner": "q_network", "device": "cuda:0"}),
    (machine(4, gpus=1), "dqn", {"learner": "q_network", "device": "cuda:0", "num_workers": 3}),
])
def test_recommendation_for_simulated_machines(facts, mode, expect):
    rec = recommend(facts)
    assert rec.mode == mode, rec.plan.reason
    assert rec.plan.reason and rec.plan.cannot_run is None and rec.plan.not_recommended is None
    for key, value in expect.items():
        assert rec.plan.settings[key] == value, (key, rec.plan.settings)
    if facts.usable_cores < ULTRA_MIN_CORES:
        assert "ultra" in rec.refused
    if facts.shm_free < 0.05 * GiB:
        assert "/dev/shm" in rec.refused["ultra"]
    if not facts.gpus:
        assert any("no CUDA GPU" in w for w in rec.warnings)


def test_advice_for_a_big_machine_bounds_workers_and_buffers_by_what_it_has():
    """Open files, RAM and /dev/shm each bound the plan, and each bound is said."""
    rec = recommend(machine(128, gpus=1, files=256))
    assert rec.mode == "ultra" and rec.plan.settings["num_workers"] == (256 - FDS_BASE) // 4
    assert any("open-files limit allows" in w and "ulimit -n" in w for w in rec.warnings)
    rec = recommend(machine(256, ram_gib=4))
    assert rec.mode == "timed" and 1 <= rec.plan.settings["num_workers"] < 16
    assert any(w.startswith("RAM allows") for w in rec.warnings)
    ultra = recommend(machine(128, gpus=1, shm_gib=0.0625)).plans["ultra"]
    assert "--buffer-size" in ultra.args and ultra.memory["replay_bytes"] <= 0.0625 * GiB
    assert any("/dev/shm" in w for w in ultra.warnings)
    population = recommend(machine(256, gpus=8, ram_gib=512)).plan
    assert population.mode == "ppo-multiprocess" and "round robin over 8 GPUs" in population.devices
    assert population.settings["num_workers"] == 255 and population.threads == {"per_worker": 1}
    population = recommend(machine(256, gpus=8, ram_gib=64)).plan  # a CUDA worker needs ~768 MiB
    assert population.settings["num_workers"] == 67 and population.threads == {"per_worker": 3}
    assert recommend(machine(256, gpus=1)).plan.threads == {"per_actor": 1, "learner": 1}
    dqn_on_4_gpus = recommend(machine(64, gpus=4)).plans["dqn"]
    assert any("cuda:0; 3 more GPUs would stay idle" in w for w in dqn_on_4_gpus.warnings)


def test_the_dqn_plan_is_the_learner_the_machine_suits():
    """No GPU: the n-tuple learner (the script's choice for ConnectFour-v0 on one machine), its main process and
    workers on the CPU over one table in /dev/shm, unless the table does not fit there; a GPU: the Q-network on
    it, named, since the script alone would choose the n-tuple learner."""
    dqn = script_module("dqn")
    table = dqn.replay_buffers(dataclasses.replace(dqn.Config(), learner="ntuple"), None)["ntuple_weights"]
    ntuple = recommend(machine(8)).plans["dqn"]
    assert ntuple.args == ["--num-workers", "7"] and ntuple.settings["learner"] == "ntuple"
    assert ntuple.settings["num_workers"] == 7 and ntuple.threads == {"per_worker": 1, "main": 1}
    assert ntuple.devices == "CPU: the main process and 7 workers self-play over one table in /dev/shm"
    assert "n-tuple learner" in ntuple.reason and ntuple.warnings == []
    assert ntuple.memory["ntuple_weights_bytes"] == ntuple.memory["shm_bytes"] == table
    assert recommend(machine(1)).plans["dqn"].args == ["--num-workers", "1"]  # at least one worker

    small_shm = recommend(machine(8, shm_gib=1 / 16)).plans["dqn"]  # 64 MiB: the table (~140 MiB) does not fit
    assert small_shm.args[:2] == ["--learner", "q_network"] and small_shm.settings["learner"] == "q_network"
    assert small_shm.settings["device"] == "cpu" and small_shm.cannot_run is None
    assert small_shm.warnings[0] == (f"/dev/shm has 64.0 MiB free, too little for the n-tuple table of "
                                     f"{system.format_bytes(table)} (docker: --shm-size=1g): the Q-network learner "
                                     "instead (--learner q_network)")
    small_ram = recommend(machine(8, ram_gib=1)).plans["dqn"]  # ~820 MiB budget: the main process, table, no worker
    assert small_ram.args[:2] == ["--learner", "q_network"]
    assert small_ram.warnings[0].startswith("RAM holds no worker beside the main process and the n-tuple table")

    on_gpu = recommend(machine(4, gpus=1)).plans["dqn"]
    assert on_gpu.args[:2] == ["--learner", "q_network"] and "--device" in on_gpu.args
    assert on_gpu.args[on_gpu.args.index("--device") + 1] == "cuda:0"
    assert on_gpu.settings["learner"] == "q_network" and "the Q-network learns on the GPU" in on_gpu.reason
    assert "replay_bytes" in on_gpu.memory and on_gpu.memory["shm_bytes"] == 0

    # A job of several ranks runs the Q-network (the n-tuple learner's table is one machine's shared memory).
    ranks = recommend(machine(8), world_size=2).plans["dqn"]
    assert ranks.args[:2] == ["--learner", "q_network"] and "2 ranks" in ranks.reason


def test_the_dqn_plan_is_for_the_learner_the_flags_choose():
    """With --mode dqn the flags after the launcher's are the script's, and they choose its learner as the script
    does: the plan (and its memory) is for that learner and that table, not the defaults'."""
    dqn = script_module("dqn")
    asked = recommend(machine(8), dqn_args=["--batch-size", "32"]).plans["dqn"]
    assert asked.settings["learner"] == "q_network" and "--learner" not in asked.args  # the script chooses it too
    assert "auto's choice since --batch-size is set" in asked.reason and asked.memory["shm_bytes"] == 0
    assert "Q-network" in recommend(machine(8), dqn_args=["--env-id", "CartPole-v1"]).plans["dqn"].reason
    smaller = recommend(machine(8), dqn_args=["--ntuple-tuples", "70", "--ntuple-length", "8"]).plans["dqn"]
    table = dqn.replay_buffers(dqn.Config(learner="ntuple", ntuple_tuples=70, ntuple_length=8), None)
    assert smaller.settings["learner"] == "ntuple" and smaller.memory["shm_bytes"] == sum(table.values())
    assert smaller.memory["shm_bytes"] * 4 == recommend(machine(8)).plans["dqn"].memory["shm_bytes"] // 2
    # Flags the script's parser refuses: the defaults' plan (the script says what is wrong when it starts).
    assert recommend(machine(8), dqn_args=["--no-such-flag"]).plans["dqn"].settings["learner"] == "ntuple"


def test_the_memory_plan_counts_the_buffers_each_script_declares():
    """The plans size buffers with the scripts' own declarations (Mode.buffers, Mode.shm_buffers), nothing else."""
    made: dict[str, set[str]] = {}
    # With and without a GPU: the dqn mode's learner, and so its buffers, differ (a replay, an n-tuple table)
    for m in (machine(64, gpus=1, ram_gib=512, shm_gib=256), machine(64, ram_gib=512, shm_gib=256)):
        for name, mode_plan in recommend(m).plans.items():
            declared = script_module(name).MODE
            assert declared.buffers is not None, name
            buffer_keys = {key.removesuffix("_bytes") for key in mode_plan.memory} - {
                "per_worker_rss", "main_rss", "total_ram", "ram_budget", "shm", "shm_free"}
            assert buffer_keys, name
            made.setdefault(name, set()).update(buffer_keys)
            assert mode_plan.memory["shm_bytes"] == sum(mode_plan.memory.get(f"{k}_bytes", 0)
                                                        for k in declared.shm_buffers)
    for name, keys in made.items():  # every buffer declared as in /dev/shm is one some plan makes
        assert set(script_module(name).MODE.shm_buffers) <= keys, (name, keys)


def test_assume_facts_replaces_the_measured_facts_for_the_launcher():
    facts_file = ROOT / "configs" / "machines" / "workstation_128core_1gpu.json"
    result = run_script(LAUNCHER, "--assume-facts", facts_file, "--json", timeout=60)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["system"]["logical_cores"] == 128 and report["system"]["ram_total_gib"] == 512
    assert {"gpus", "logical_cores", "ram_total"} <= set(report["system"]["assumed"])
    assert report["system"]["assumed_from"] == str(facts_file)
    assert report["recommendation"]["mode"] == "ultra"
    assert report["recommendation"]["settings"]["num_workers"] == 126
    text = run_script(LAUNCHER, "--assume-facts", facts_file, "--check-only", timeout=60).stdout
    assert f"assumed (from {facts_file})" in text and "GPU 0: NVIDIA RTX A6000" in text


@pytest.mark.parametrize("facts_file", [
    pytest.param(f, id=f.stem, marks=unconverted_mark(recommend(
        system.with_facts(system.measure(), system.read_facts_file(f))).mode)) for f in MACHINE_FILES])
def test_dry_run_on_each_machine_file_prints_a_command_that_validates(facts_file, tmp_path):
    """The printed command, run with --validate-only under the same facts, exits 0."""
    result = run_script(LAUNCHER, "--assume-facts", facts_file, "--dry-run", cwd=tmp_path, timeout=60)
    assert result.returncode == 0, result.stderr
    line = shlex.split(result.stdout.strip().splitlines()[-1])
    assert line[0] == f"{system.ASSUME_ENV}={facts_file}"
    env = {**script_env(), system.ASSUME_ENV: str(facts_file)}
    check = subprocess.run([*line[1:], "--validate-only"], cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=120)
    assert check.returncode == 0, f"{' '.join(line[1:])}: {check.stderr}"
    assert not (tmp_path / "runs").exists()


def test_a_mode_that_cannot_run_is_refused_even_with_force(tmp_path):
    facts = tmp_path / "tiny_shm.json"
    facts.write_text(json.dumps({"logical_cores": 16, "shm_total": 2**20, "gpus": [{"memory_gib": 16}]}))
    result = run_script(LAUNCHER, "--assume-facts", facts, "--mode", "ultra", "--force", cwd=tmp_path, timeout=60)
    assert result.returncode == 2
    assert "mode ultra cannot run on this machine: room for" in result.stderr
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("mode, extra, expected", [
    ("timed", ["--episodes", "300", "--seed", "4"], ["train_parallel_timed.py", "--total-episodes 300", "--seed 4"]),
    ("dqn", ["--duration", "0.5", "--seed", "4"], ["parallel_train_dqn.py", "--duration 0.5", "--seed 4"]),
    ("dqn", ["--learner", "q_network", "--batch-size", "32"], ["parallel_train_dqn.py", "--learner q_network",
                                                              "--batch-size 32"]),
    ("ultra", ["--force", "--episodes", "50"], ["ultra_parallel_train_dqn.py", "--total-episodes 50",
                                                "--num-workers 1"]),
    ("ppo-multiprocess", ["--episodes", "40", "--num-workers", "2"],
     ["train_ppo_multiprocess.py", "--max-steps-per-worker 5120", "--num-workers 2"]),
])
def test_dry_run_prints_the_translated_command(mode, extra, expected):
    result = run_script(LAUNCHER, "--mode", mode, "--dry-run", *extra, timeout=60)
    assert result.returncode == 0, result.stderr
    command = result.stdout.strip().splitlines()[-1]
    for part in expected:
        assert part in command, command


@pytest.mark.parametrize("argv, status, message", [
    (["--mode", "warp"], 2, "--mode 'warp': must be one of"),
    (["--episodes", "0"], 2, "--episodes 0: must be > 0"),
    (["--mode", "ultra"], 2, "not recommended on this machine"),
    (["--mode", "timed", "--no-such-flag", "3"], 2, "unrecognized arguments: --no-such-flag"),
    (["--assume-facts", "no_such_file.json", "--check-only"], 2, "--assume-facts 'no_such_file.json': no such file"),
    (["--assume-facts", "bad_facts.json", "--check-only"], 2, "--assume-facts 'cores': unknown fact; known:"),
    (["--assume-facts", "bad_facts.json", "--tune"], 2, "--tune measures this machine"),
])
def test_bad_input_exits_with_one_clear_line(argv, status, message, tmp_path):
    if argv[:2] == ["--mode", "ultra"] and os.cpu_count() >= ULTRA_MIN_CORES:
        pytest.skip("this machine has enough cores for the ultra mode")
    (tmp_path / "bad_facts.json").write_text('{"cores": 64}')
    result = run_script(LAUNCHER, *argv, cwd=tmp_path, timeout=60)
    assert result.returncode == status
    assert message in result.stderr, result.stderr
    assert not (tmp_path / "runs").exists()


def test_missing_package_exits_1_with_how_to_install(monkeypatch, capsys):
    real = importlib.metadata.version

    def version(name):
        if name == "tqdm":
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
    assert launcher.main(["--check-only"]) == 1
    assert "missing or wrong version: tqdm -> pip install -r requirements.txt" in capsys.readouterr().out
    assert launcher.main(["--mode", "timed"]) == 1
    assert "missing required packages: tqdm" in capsys.readouterr().err


WITHOUT_NUMPY = """
import importlib.metadata, json, sys
sys.modules["numpy"] = None  # import numpy fails, as where it is not installed
real = importlib.metadata.version

def version(name):
    if name == "numpy":
        raise importlib.metadata.PackageNotFoundError(name)
    return real(name)

importlib.metadata.version = version
import launch_parallel_training as launcher
sys.exit(launcher.main(sys.argv[1:]))
"""


@pytest.mark.parametrize("argv, stream, expected", [
    (["--check-only"], "stdout", "none: the training scripts need the missing packages (pip install -r requirements"),
    (["--json"], "stdout", '"recommendation": null'),
    (["--mode", "timed", "--dry-run"], "stderr", "error: missing required packages: numpy (pip install -r"),
])
def test_a_package_the_scripts_import_is_missing_the_report_says_so_and_plans_nothing(argv, stream, expected):
    """The plans import the training scripts; without numpy they cannot, and the launcher reports instead."""
    result = subprocess.run([sys.executable, "-c", WITHOUT_NUMPY, *argv], cwd=ROOT, env=script_env(),
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1, result.stderr
    assert expected in getattr(result, stream), result.stdout + result.stderr
    assert "Traceback" not in result.stderr


def test_a_default_env_that_cannot_be_made_here_is_not_recommended(monkeypatch):
    """Without Box2D the timed mode's LunarLander-v3 cannot be made: the mode needs --force (and another
    --env-id), and the recommendation goes elsewhere."""
    real = plan.default_env

    def default_env(name):
        if name == "timed":
            raise ConfigError("env_id", "LunarLander-v3", "cannot create it (No module named 'Box2D')")
        return real(name)

    monkeypatch.setattr(plan, "default_env", default_env)
    # A fresh cache of the buffers' sizes: those of the real env are cached.
    monkeypatch.setattr(plan, "buffer_bytes", functools.cache(plan.buffer_bytes.__wrapped__))
    rec = recommend(machine(2))
    timed = rec.plans["timed"]
    assert timed.cannot_run is None and "LunarLander-v3" in timed.not_recommended
    assert rec.mode == "dqn" and rec.plan.reason.startswith("timed: its default env: --env-id 'LunarLander-v3'")
    report.print_plan(dataclasses.asdict(timed))  # a plan without buffers prints too


def test_every_extra_is_listed_where_its_install_hint_says():
    for extra in EXTRAS:
        lines = (ROOT / extra["file"]).read_text().splitlines()
        listed = {re.match(r"[A-Za-z0-9_.-]+(\[[^\]]*\])?", line).group(0) for line in lines
                  if line.strip() and not line.startswith("#")}
        assert set(extra["packages"]) <= listed, (extra["extra"], extra["file"])
    optional = {extra["extra"] for extra in EXTRAS if extra["file"] == "requirements-extras.txt"}
    assert optional == {"onnx", "moviepy", "ale-py", "mujoco", "pettingzoo", "cshogi", "bitbully"}


def test_missing_extra_says_what_it_enables_and_how_to_install(monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "ale_py" else real(name))
    assert launcher.main(["--check-only"]) == 0
    out = capsys.readouterr().out
    assert ("extra ale-py  -> Atari ids such as ALE/Pong-v5 (configs/atari_*.yaml): not installed "
            "(pip install -r requirements-extras.txt)") in out


TINY = {
    "timed": ["--env-id", "CartPole-v1", "--num-workers", "1", "--num-envs-per-worker", "4", "--n-steps", "32",
              "--batch-size", "64", "--total-timesteps", "512", "--target-return", "none", "--no-tensorboard"],
    "dqn": ["--env-id", "CartPole-v1", "--num-workers", "1", "--episodes-per-batch", "4", "--total-episodes", "8",
            "--eval-interval", "0", "--eval-episodes", "2", "--learning-starts", "50", "--no-tensorboard"],
    "ultra": ["--force", "--env-id", "CartPole-v1", "--num-workers", "1", "--num-envs-per-worker", "4",
              "--total-episodes", "10", "--learning-starts", "100", "--no-tensorboard"],
    "ppo-multiprocess": ["--num-items", "20", "--history-steps", "2000", "--num-workers", "1",
                         "--num-envs-per-worker", "4", "--rollout-steps", "256", "--batch-size", "64",
                         "--episode-length", "64", "--max-steps-per-worker", "512", "--eval-episodes", "4",
                         "--no-tensorboard"],
}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", [pytest.param(m, marks=unconverted_mark(m) if m == "ultra" else []) for m in TINY])
def test_tiny_launch_of_each_mode(mode, tmp_path):
    extra = ["--cache-dir", str(tmp_path / "cache")] if mode == "ppo-multiprocess" else []
    result = run_script(LAUNCHER, "--mode", mode, *TINY[mode], *extra, cwd=tmp_path, timeout=220)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "results in runs/" in result.stdout
    run_dirs = list((tmp_path / "runs").glob("*/*"))
    assert len(run_dirs) == 1 and (run_dirs[0] / "metrics.csv").is_file() and (run_dirs[0] / "config.yaml").is_file()


@pytest.mark.timeout(120)
def test_sigint_reaches_the_script_through_execv(tmp_path):
    proc = subprocess.Popen([sys.executable, str(ROOT / LAUNCHER), "--mode", "timed",
                             "--env-id", "CartPole-v1", "--num-workers", "1", "--n-steps", "32", "--batch-size", "64",
                             "--total-timesteps", "1000000000", "--target-return", "none", "--no-tensorboard"],
                            cwd=tmp_path, env=script_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        deadline = time.monotonic() + 60
        metrics = []
        while time.monotonic() < deadline and not (metrics and len(metrics[0].read_text().splitlines()) > 1):
            metrics = list((tmp_path / "runs").glob("*/*/metrics.csv"))  # a row: an update is done
            time.sleep(0.2)
        assert metrics, "the launched script never started training"
        assert "train_parallel_timed.py" in " ".join(psutil.Process(proc.pid).cmdline())  # same pid, new program
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        proc.stdout.close()
    assert (metrics[0].parent / "checkpoints" / "latest.pt").is_file()


@pytest.mark.timeout(200)
def test_tune_measures_and_caches_the_fastest_setting(tmp_path):
    cache = tmp_path / "tune.json"
    env = script_env()
    env["PRL_TUNE_CACHE"] = str(cache)
    result = subprocess.run([sys.executable, str(ROOT / LAUNCHER), "--mode", "timed", "--tune", "--trial-seconds",
                             "1", "--env-id", "CartPole-v1", "--n-steps", "32", "--batch-size", "64",
                             "--target-return", "none"], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=190)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "steps/s" in result.stdout and "fastest:" in result.stdout
    stored = json.loads(cache.read_text())
    (entry,) = stored.values()
    assert entry["sps"] > 0 and len(entry["table"]) >= 2
    dry = subprocess.run([sys.executable, str(ROOT / LAUNCHER), "--mode", "timed", "--dry-run", "--env-id",
                          "CartPole-v1"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert "using the tuned setting" in dry.stdout
    assert " ".join(entry["args"]) in dry.stdout.strip().splitlines()[-1]
