"""launch_parallel_training.py --nnodes: the torchrun command of every node and the SLURM batch script.

Every test reads the commands the launcher prints (for the machines of configs/machines/, assumed),
checks what they say, and runs what can run here: each command's script part with --validate-only,
the SLURM script with stand-ins for scontrol and srun, and, for the timed mode, the printed commands
themselves, as a shell runs them from another directory, as two nodes on localhost. Every command starts
``python -m common.torchrun`` (tests/test_torchrun.py: how it ends).
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import socket
import subprocess
import sys
import time

import pytest
from conftest import ROOT, run_script, script_env

from common import system
from common.launcher.command import flag_value
from common.launcher.modes import MODES
from common.launcher.multinode import PYTHONPATH_WORDS

LAUNCHER = "launch_parallel_training.py"
MACHINES = ROOT / "configs" / "machines"
# A machine per mode, and the launcher flags that select the mode there (recommended where no --mode).
CASES = {
    "timed": ("dev_2core.json", []),
    "dqn": ("dev_2core.json", ["--mode", "dqn"]),
    "ultra": ("workstation_128core_1gpu.json", []),
    "ppo-multiprocess": ("h100_26vcpu.json", ["--mode", "ppo-multiprocess"]),
}


def launch(*args, cwd=None) -> subprocess.CompletedProcess:
    return run_script(LAUNCHER, *args, cwd=cwd, timeout=60)


def multinode_json(facts: str, *args, cwd=None) -> dict:
    result = launch("--assume-facts", MACHINES / facts, "--json", *args, cwd=cwd)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


TORCHRUN = [sys.executable, "-P", "-m", "common.torchrun"]


def options(words: list[str]) -> dict[str, str]:
    """``--flag value`` pairs of a torchrun command (``python -m common.torchrun ...``), up to the script."""
    assert words[:4] == TORCHRUN, words
    return dict(zip(words[4::2], words[5::2]))


def split_command(command: str) -> tuple[list[str], list[str]]:
    """(torchrun and its options, the script and its flags)."""
    words = shlex.split(command)
    assert words[0] == f"PYTHONPATH={ROOT}${{PYTHONPATH:+:$PYTHONPATH}}", words[0]
    script = next(i for i, w in enumerate(words) if w.endswith(".py"))
    return words[1:script], words[script:]


def flag(words: list[str], name: str) -> str | None:
    return flag_value(words, name)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("nnodes", [2, 4])
@pytest.mark.parametrize("mode", list(CASES))
def test_each_node_gets_a_torchrun_command_with_the_plans_flags(mode, nnodes, tmp_path):
    facts, select = CASES[mode]
    report = multinode_json(facts, "--nnodes", nnodes, *select, cwd=tmp_path)
    multinode, plan, script_name = report["multinode"], report["plans"][mode], MODES[mode].script
    assert report["selected"] == mode and report["command"] is None  # --nnodes runs nothing here
    assert multinode["nnodes"] == nnodes and multinode["nproc_per_node"] == 1
    assert multinode["world_size"] == nnodes and multinode["nproc_reason"].startswith("one rank per node")
    rdzv_id = multinode["rdzv_id"]
    assert re.fullmatch(rf"prl-{mode}-\d{{8}}", rdzv_id)
    # The project's torchrun, found from any directory; it turns torch's shared store off for restarts
    assert all(c.startswith(f"{PYTHONPATH_WORDS} {' '.join(TORCHRUN)} ") for c in multinode["commands"])
    assert f"export {PYTHONPATH_WORDS}\n" in multinode["slurm"]
    env_id = MODES[mode].default_env
    run_dir = f"runs/{script_name[:-3]}/{env_id}__1__{rdzv_id}"
    assert multinode["output_dir"] == run_dir
    assert len(multinode["commands"]) == nnodes
    scripts = []
    for node, command in enumerate(multinode["commands"]):
        torchrun, script = split_command(command)
        opts = options(torchrun)
        assert opts == {"--nnodes": str(nnodes), "--nproc-per-node": "1", "--rdzv-backend": "c10d",
                        "--rdzv-endpoint": f"{socket.gethostname()}:29400", "--rdzv-id": rdzv_id,
                        "--rdzv-conf": f"join_timeout=600,is_host={int(node == 0)}", "--max-restarts": "3"}
        scripts.append(script)
    assert all(script == scripts[0] for script in scripts)  # every node runs the same script and flags
    script = scripts[0]
    assert script == multinode["script"] and script[0] == str(ROOT / script_name)
    for name, value in zip(plan["args"][::2], plan["args"][1::2]):  # the single-machine plan, per rank
        assert flag(script, name) == value, (name, script)
    assert flag(script, "--output-dir") == run_dir and script[-2:] == ["--resume", "auto"]
    assert multinode["num_workers_per_rank"] == int(flag(script, "--num-workers"))
    if mode == "dqn":  # planned for the job's ranks: the n-tuple learner, one machine's choice, runs on one only
        assert flag(script, "--learner") == "q_network" and plan["settings"]["learner"] == "q_network"
    text = launch("--assume-facts", MACHINES / facts, "--nnodes", nnodes, *select, cwd=tmp_path)
    assert text.returncode == 0, text.stderr
    for node, command in enumerate(multinode["commands"]):
        assert f"  node {node}" in text.stdout and command in text.stdout
    assert multinode["slurm"] in text.stdout
    assert not (tmp_path / "runs").exists()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", list(CASES))
def test_each_printed_command_is_one_the_script_accepts(mode, tmp_path):
    """The script part of a node's command, with --validate-only, outside torchrun, on the assumed machine."""
    facts, select = CASES[mode]
    multinode = multinode_json(facts, "--nnodes", 2, *select, cwd=tmp_path)["multinode"]
    _, script = split_command(multinode["commands"][1])
    env = {**script_env(), system.ASSUME_ENV: str(MACHINES / facts)}
    check = subprocess.run([sys.executable, *script, "--validate-only"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=50)
    assert check.returncode == 0, f"{' '.join(script)}: {check.stderr}"
    assert f"output_dir: {multinode['output_dir']}" in check.stdout and "resume: auto" in check.stdout
    assert not (tmp_path / multinode["output_dir"]).exists()


def test_one_rank_per_gpu_for_dd_ppo_on_gpus_and_the_workers_split(tmp_path):
    facts = tmp_path / "two_gpus.json"
    facts.write_text(json.dumps({"physical_cores": 16, "logical_cores": 16, "usable_cores": 16,
                                 "gpus": [{"memory_gib": 80}, {"memory_gib": 80}]}))
    report = json.loads(launch("--assume-facts", facts, "--json", "--nnodes", "2", "--mode", "timed",
                               cwd=tmp_path).stdout)
    node_workers = report["plans"]["timed"]["settings"]["num_workers"]
    on_cpu = report["multinode"]
    assert on_cpu["nproc_per_node"] == 1 and on_cpu["nproc_reason"].endswith(
        "the learner is on the CPU, where a small MLP learns fastest (with --device cuda: one rank per GPU)")
    assert flag(on_cpu["script"], "--num-workers") == str(node_workers)
    report = json.loads(launch("--assume-facts", facts, "--json", "--nnodes", "2", "--mode", "timed",
                               "--device", "cuda", cwd=tmp_path).stdout)
    on_gpus = report["multinode"]
    assert on_gpus["nproc_per_node"] == 2 and on_gpus["world_size"] == 4
    assert on_gpus["nproc_reason"].startswith("one rank per GPU")
    assert "--nproc-per-node 2" in on_gpus["commands"][0]
    assert flag(on_gpus["script"], "--num-workers") == str(node_workers // 2)  # the node's workers, split
    assert flag(on_gpus["script"], "--device") == "cuda"
    asked = json.loads(launch("--assume-facts", facts, "--json", "--nnodes", "3", "--mode", "timed",
                              "--nproc-per-node", "4", cwd=tmp_path).stdout)["multinode"]
    assert asked["nproc_per_node"] == 4 and asked["world_size"] == 12
    assert flag(asked["script"], "--num-workers") == str(node_workers // 4)
    assert any(f"{node_workers // 4} on each of 12 ranks, {12 * (node_workers // 4)} in all" in note
               for note in asked["notes"])


def test_endpoint_id_restarts_timeout_and_the_users_flags(tmp_path):
    report = multinode_json("dev_2core.json", "--nnodes", "2", "--mode", "ppo-multiprocess",
                            "--rdzv-endpoint", "10.1.2.3", "--rdzv-id", "job7", "--max-restarts", "0",
                            "--join-timeout", "120", "--episodes", "1000", "--seed", "5", cwd=tmp_path)
    multinode = report["multinode"]
    torchrun, script = split_command(multinode["commands"][0])
    opts = options(torchrun)
    assert opts["--rdzv-endpoint"] == "10.1.2.3:29400" and opts["--rdzv-id"] == "job7"
    assert opts["--max-restarts"] == "0" and opts["--rdzv-conf"] == "join_timeout=120,is_host=1"
    assert flag(script, "--output-dir") == "runs/train_ppo_multiprocess/Market-v0__5__job7"
    # --episodes counts every member of every node: steps per worker for workers x ranks members.
    workers = int(flag(script, "--num-workers"))
    assert flag(script, "--max-steps-per-worker") == str(math.ceil(1000 / (2 * workers)) * 256)
    own = multinode_json("dev_2core.json", "--nnodes", "2", "--rdzv-endpoint", "node01:29555",
                         "--output-dir", "/shared/dd", "--num-workers", "1", cwd=tmp_path)["multinode"]
    torchrun, script = split_command(own["commands"][1])
    assert options(torchrun)["--rdzv-endpoint"] == "node01:29555"
    assert own["output_dir"] == "/shared/dd" and script.count("--output-dir") == 1
    assert flag(script, "--num-workers") == "1" and script.count("--num-workers") == 1  # the user's flag wins
    assert script[-2:] == ["--resume", "auto"]
    resumed = multinode_json("dev_2core.json", "--nnodes", "2", "--resume", "runs/x/y/checkpoints/latest.pt",
                             cwd=tmp_path)["multinode"]
    assert "--output-dir" not in resumed["script"] and flag(resumed["script"], "--resume").endswith("latest.pt")


def fake_slurm(tmp_path, nodelist: str) -> dict:
    """``scontrol`` that lists ``nodelist``'s hosts, ``srun`` that records what it was asked to run."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f"#!/bin/sh\nprintf '{nodelist}'\n")
    (bin_dir / "srun").write_text('#!/bin/sh\necho "SRUN_CPUS_PER_TASK=$SRUN_CPUS_PER_TASK" > srun.txt\n'
                                  'echo "PYTHONPATH=$PYTHONPATH" >> srun.txt\n'
                                  'for a in "$@"; do echo "$a" >> srun.txt; done\n')
    for tool in ("scontrol", "srun"):
        (bin_dir / tool).chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "gpu[10,9]",
            "SLURM_NNODES": "2", "SLURM_CPUS_PER_TASK": "128", "PYTHONPATH": "/site/lib"}


@pytest.mark.timeout(60)
def test_slurm_script_starts_one_torchrun_per_node_on_the_first_host(tmp_path):
    batch = tmp_path / "job.sbatch"
    report = multinode_json("workstation_128core_1gpu.json", "--nnodes", "2", "--slurm-script", batch,
                            cwd=tmp_path)
    multinode = report["multinode"]
    assert batch.read_text() == multinode["slurm"]
    lines = multinode["slurm"].splitlines()
    assert lines[0] == "#!/bin/bash"
    directives = [line for line in lines if line.startswith("#SBATCH")]
    assert directives == [f"#SBATCH --job-name={multinode['rdzv_id']}", "#SBATCH --nodes=2",
                          "#SBATCH --ntasks-per-node=1", "#SBATCH --cpus-per-task=128", "#SBATCH --gpus-per-node=1"]
    assert lines.index(directives[-1]) < next(i for i, line in enumerate(lines) if not line.startswith("#"))
    assert 'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | LC_ALL=C sort | head -n 1)' in lines
    assert "never a public interface" in multinode["slurm"]
    # Run it: srun must get torchrun on $SLURM_NNODES nodes, the rendezvous on the host that sorts first.
    result = subprocess.run(["bash", str(batch)], cwd=tmp_path, env=fake_slurm(tmp_path, "gpu9\\ngpu10\\n"),
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    srun = (tmp_path / "srun.txt").read_text().splitlines()
    assert srun[0] == "SRUN_CPUS_PER_TASK=128"
    assert srun[1] == f"PYTHONPATH={ROOT}:/site/lib"  # the project first, the job's own path kept
    start = srun.index(multinode["script"][0])
    torchrun, script = srun[2:start], srun[start:]
    assert options(torchrun) == {"--nnodes": "2", "--nproc-per-node": "1", "--rdzv-backend": "c10d",
                                 "--rdzv-endpoint": "gpu10:29400", "--rdzv-id": multinode["rdzv_id"],
                                 "--rdzv-conf": "join_timeout=600", "--max-restarts": "3"}
    assert script == multinode["script"]
    # The head is the host c10d makes rank 0: torchrun sorts the nodes by address (as text), then pid.
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc

    assert min(_NodeDesc("gpu9", 1, 0), _NodeDesc("gpu10", 2, 0)).addr == "gpu10"
    cpu_only = multinode_json("dev_2core.json", "--nnodes", "3", cwd=tmp_path)["multinode"]["slurm"]
    assert "#SBATCH --nodes=3" in cpu_only and "#SBATCH --cpus-per-task=2" in cpu_only
    assert "--gpus-per-node" not in cpu_only


def test_check_only_prints_the_report_then_the_commands_and_what_to_know(tmp_path):
    result = launch("--assume-facts", MACHINES / "workstation_128core_1gpu.json", "--nnodes", "2", "--check-only",
                    "--rdzv-endpoint", "node01", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.index("Recommendation") < out.index("Multi-node: ultra") < out.index("SLURM batch script")
    assert "node 0 (start it first: it hosts the rendezvous and should be rank 0)" in out
    assert "start node 0 first, on node01" in out
    assert "rank 0 is the learner" in out and "c10d ranks the nodes by hostname" in out
    assert ("node01:29400 and the ports the ranks open to each other must be reachable only from the job's own "
            "nodes: a cluster network, never a public interface") in out
    assert "join_timeout=600 s for all 2 nodes, then every node that waited exits 1" in out
    assert "--num-workers is per rank: 126 on each of 2 ranks, 252 in all" in out
    assert "the commands do not carry them" in out and system.ASSUME_ENV + "=" not in out
    assert not (tmp_path / "runs").exists()


def test_nnodes_imports_no_torch(tmp_path):
    code = ("import sys, launch_parallel_training as l; status = l.main(['--nnodes', '2']); "
            "assert 'torch' not in sys.modules, 'torch was imported'; sys.exit(status)")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=script_env(), capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "node 1:" in result.stdout


@pytest.mark.parametrize("argv, message", [
    (["--nnodes", "0"], "--nnodes 0: must be >= 1"),
    (["--nnodes", "-3"], "--nnodes -3: must be >= 1"),
    (["--nnodes", "two"], "argument --nnodes: invalid int value: 'two'"),
    (["--nnodes", "2", "--rdzv-endpoint", "node01:http"], "--rdzv-endpoint 'node01:http': must be HOST or"),
    (["--nnodes", "2", "--rdzv-endpoint", ":29400"], "--rdzv-endpoint ':29400': must be HOST or"),
    (["--nnodes", "2", "--rdzv-endpoint", "node01:0"], "--rdzv-endpoint 'node01:0': must be HOST or"),
    (["--nnodes", "2", "--rdzv-endpoint", "node01:70000"], "--rdzv-endpoint 'node01:70000': must be HOST or"),
    (["--nnodes", "2", "--rdzv-endpoint", "node 01"], "--rdzv-endpoint 'node 01': must be HOST or"),
    (["--nnodes", "2", "--tune"], "--nnodes prints commands for other machines; it cannot run with --tune"),
    (["--nnodes", "2", "--nproc-per-node", "0"], "--nproc-per-node 0: must be >= 1"),
    (["--nnodes", "2", "--max-restarts", "-1"], "--max-restarts -1: must be >= 0"),
    (["--nnodes", "2", "--join-timeout", "0"], "--join-timeout 0: must be >= 1 second"),
    (["--nnodes", "2", "--rdzv-id", "a/b"], "--rdzv-id 'a/b': letters, digits"),
    (["--rdzv-endpoint", "node01"], "--rdzv-endpoint describes a multi-node job: add --nnodes N"),
    (["--nnodes", "2", "--mode", "ultra"], "mode ultra is not recommended on this machine"),
])
def test_bad_multinode_usage_is_one_line_and_exit_2(argv, message, tmp_path):
    result = launch("--assume-facts", MACHINES / "dev_2core.json", *argv, cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.startswith("error: ") and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert message in result.stderr and result.stdout == ""
    assert not list(tmp_path.iterdir())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


TINY_TIMED = ["--env-id", "CartPole-v1", "--num-workers", "0", "--num-envs-per-worker", "4", "--n-steps", "32",
              "--batch-size", "64", "--total-timesteps", "512", "--target-return", "none", "--no-tensorboard"]


def run_nodes(commands: list[str], cwd) -> list[subprocess.CompletedProcess]:
    """The printed commands, node 0 first, each run by a shell as printed, from ``cwd`` (not the checkout,
    and with no PYTHONPATH of the tests' own: the command's finds common.torchrun)."""
    env = {name: value for name, value in script_env().items() if name != "PYTHONPATH"}
    procs = []
    try:
        for command in commands:
            procs.append(subprocess.Popen(["bash", "-c", command], cwd=cwd, env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True, start_new_session=True))
            time.sleep(0.5)  # node 0's agent first: it hosts the store, and its lower pid makes it rank 0 here
        outputs = [p.communicate(timeout=100)[0] for p in procs]
        return [subprocess.CompletedProcess(p.args, p.returncode, out, "") for p, out in zip(procs, outputs)]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait(10)


@pytest.mark.timeout(240)
def test_the_printed_commands_run_a_two_node_job_and_started_again_continue_it(tmp_path):
    """The timed mode (DD-PPO) as the launcher prints it, two torchrun nodes on localhost."""
    report = multinode_json("dev_2core.json", "--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
                            *TINY_TIMED, cwd=tmp_path)
    multinode = report["multinode"]
    first = run_nodes(multinode["commands"], tmp_path)
    assert [r.returncode for r in first] == [0, 0], first[0].stdout[-3000:] + first[1].stdout[-3000:]
    run_dir = tmp_path / multinode["output_dir"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["global_step"] >= 512 and summary["resumed_from"] is None
    again = run_nodes(multinode["commands"], tmp_path)  # same commands, same rendezvous id: --resume auto
    assert [r.returncode for r in again] == [0, 0], again[0].stdout[-3000:] + again[1].stdout[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed_from"].endswith(f"{multinode['output_dir']}/checkpoints/latest.pt")
