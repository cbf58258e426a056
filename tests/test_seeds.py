"""Every seed's first line: the names the seeds gave their users work here, or are refused in one line
that says why (docs/seeds.md): seed 002's learning_steps_per_batch=None, seed 003's make targets, its
config/ directory and Procgen, seed 001's progress against an episode budget, and the vocabulary that
docs/conventions.md promises in every script."""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import re
import subprocess
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import ROOT, run_script

from common.config import ConfigError, parse_args, require_env_id
from common.runlog import Progress

DOCS = ROOT / "docs"


# ----------------------------------------------------------------------------- seed 002: train_dqn


def test_learning_steps_per_batch_none_is_auto_and_a_number_counts_per_batch(tmp_path):
    """Seed 002's call with learning_steps_per_batch=None trains, and auto means replay_ratio: its updates
    are replay_ratio times the env steps. A number N makes N updates per num_workers x episodes_per_batch
    episodes. None is also `none` as a flag and `null` or `none` in YAML; 0 is refused in one line."""
    import parallel_train_dqn

    summary = parallel_train_dqn.train_dqn(
        n_episodes=24, num_workers=1, episodes_per_batch=4, learning_steps_per_batch=None, replay_ratio=0.5,
        env_id="CartPole-v1", batch_size=16, learning_starts=0, hidden_sizes=[32], eval_interval=0,
        eval_episodes=2, target_return="none", duration=None, tensorboard=False, output_dir=str(tmp_path / "run"))
    assert summary["exit_code"] == 0 and summary["episodes"] >= 24, summary
    assert abs(summary["updates"] - 0.5 * summary["global_step"]) <= 1, summary  # every step counted, at 0.5
    assert summary["num_envs_per_worker"] == 4  # every script's name for what episodes_per_batch sets here

    # A number: the trainer's own learn() over a real learner and replay (the counting, without workers).
    import gymnasium as gym
    import torch

    from common.dqn import DQNLearner
    from common.networks import QNetwork
    from common.replay import LocalReplay

    cfg = parallel_train_dqn.Config(env_id="CartPole-v1", num_workers=3, episodes_per_batch=4,
                                    learning_steps_per_batch=6, replay_ratio=0.5, batch_size=8, learning_starts=0)
    space = gym.spaces.Box(-1, 1, (4,), np.float32)
    replay = LocalReplay(100, (4,), np.float32, None, 0)
    rows = 64
    replay.add_batch(obs=np.zeros((rows, 4), np.float32), actions=np.zeros(rows, np.int64),
                     rewards=np.ones(rows, np.float32), next_obs=np.zeros((rows, 4), np.float32),
                     dones=np.zeros(rows, np.float32), discounts=np.full(rows, 0.99, np.float32), next_masks=None)
    trainer = parallel_train_dqn.DQNTrainer.__new__(parallel_train_dqn.DQNTrainer)
    trainer.cfg, trainer.buffer, trainer.update_credit = cfg, replay, 0.0
    trainer.learner = DQNLearner(QNetwork(space, gym.spaces.Discrete(2), (16,)), torch.device("cpu"), 1e-3, 10.0,
                                 100)
    trainer.run = SimpleNamespace(graceful=SimpleNamespace(requested=False), budget_used=lambda: 0.0, counters={})
    made = [len(trainer.learn(new_steps=500, new_episodes=episodes)) for episodes in (12, 6, 6, 2)]
    assert made == [6, 3, 3, 1]  # 6 per 12 episodes, whatever the steps; fractions carried to the next batch
    assert trainer.learner.updates == 13

    fields = {"": parallel_train_dqn.Config}
    assert parse_args(fields, ["--learning-steps-per-batch", "none"], exit_on_error=False)[0] \
        .learning_steps_per_batch is None
    for text in ("null", "none"):
        (tmp_path / f"{text}.yaml").write_text(f"learning_steps_per_batch: {text}\n")
        cfg = parse_args(fields, ["--config", str(tmp_path / f"{text}.yaml")], exit_on_error=False)[0]
        assert cfg.learning_steps_per_batch is None
    with pytest.raises(ConfigError, match=r"^--learning-steps-per-batch 0: must be > 0$"):
        parse_args(fields, ["--learning-steps-per-batch", "0"], exit_on_error=False)


# ----------------------------------------------------------------------------- seed 003: make


def documented_commands() -> set[str]:
    """Every command line in a ```bash block of the README and docs/, without its comment."""
    commands = set()
    for page in [ROOT / "README.md", *DOCS.glob("*.md")]:
        for block in re.findall(r"^```bash\n(.*?)^```", page.read_text(), re.MULTILINE | re.DOTALL):
            for line in block.replace("\\\n", " ").splitlines():
                line = re.sub(r"\s+#.*$", "", line).strip()
                if line:
                    commands.add(" ".join(line.split()))
    return commands


def make_n(*args: str, cwd=ROOT) -> list[str]:
    result = subprocess.run(["make", "-n", "-f", str(ROOT / "Makefile"), "PYTHON=python", *args], cwd=cwd,
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


def test_make_targets_run_the_documented_commands(tmp_path):
    """Seed 003's `make train-parallel` and `make compare`, and `make test`: each line a target runs is a
    command the docs give. `make compare` first trains whichever of its two runs is not there yet."""
    documented = documented_commands()
    parallel = make_n("train-parallel")
    assert parallel == ["python train_parallel_timed.py --duration 1 --num-workers 4 --num-envs-per-worker 8 "
                        "--output-dir runs/par_1h"]
    sequential = make_n("train-sequential")
    compare = ["python compare_results.py --sequential runs/seq_1h --parallel runs/par_1h"]
    assert make_n("compare", cwd=tmp_path) == sequential + parallel + compare  # neither run there yet
    (tmp_path / "runs" / "seq_1h").mkdir(parents=True)
    (tmp_path / "runs" / "par_1h").mkdir()
    assert make_n("compare", cwd=tmp_path) == compare
    for line in parallel + sequential + compare:
        assert line in documented, f"not a documented command: {line}"
    readme_test = [c for c in documented if c.endswith("-m pytest -q -n 2")]
    assert make_n("test") == readme_test and len(readme_test) == 1


# ----------------------------------------------------------------------------- seed 003: config/ and Procgen


def test_config_in_a_directory_named_config_reads_configs(tmp_path, monkeypatch, capsys):
    """`--config config/ppo_parallel.yaml` reads configs/ppo_parallel.yaml and says so in one line; a file
    the user has at the path named is read as it is, without a word; a path found in neither is refused."""
    import train_parallel_timed

    monkeypatch.chdir(ROOT)
    cfg = parse_args(train_parallel_timed.Config, ["--config", "config/ppo_parallel.yaml"], exit_on_error=False)[0]
    assert (cfg.num_workers, cfg.num_envs_per_worker, cfg.n_steps) == (4, 8, 128)
    assert capsys.readouterr().err.splitlines() == [
        "note: --config config/ppo_parallel.yaml: no such file; reading configs/ppo_parallel.yaml "
        "(this project's directory is configs/)"]

    monkeypatch.chdir(tmp_path)
    (tmp_path / "config").mkdir()
    (tmp_path / "configs").mkdir()
    (tmp_path / "config" / "mine.yaml").write_text("num_workers: 3\n")
    (tmp_path / "configs" / "mine.yaml").write_text("num_workers: 1\n")
    cfg = parse_args(train_parallel_timed.Config, ["--config", "config/mine.yaml"], exit_on_error=False)[0]
    assert cfg.num_workers == 3 and capsys.readouterr().err == ""
    with pytest.raises(ConfigError, match=r"^--config 'config/missing.yaml': no such file$"):
        parse_args(train_parallel_timed.Config, ["--config", "config/missing.yaml"], exit_on_error=False)


def test_procgen_is_refused_in_one_line_that_says_why():
    """No procgen build installs beside numpy 2 on this Python: a Procgen id is refused, exit 2, with the reason
    and what to use instead, in every spelling seed 003's users would write it."""
    assert importlib.util.find_spec("procgen") is None
    for env_id in ("procgen-coinrun-v0", "procgen:procgen-coinrun-v0"):
        with pytest.raises(ConfigError, match="numpy < 2.*ALE/Breakout-v5"):
            require_env_id(env_id)
    result = run_script("parallel_train_dqn.py", "--validate-only", "--env-id", "procgen:procgen-coinrun-v0",
                        timeout=60)
    assert result.returncode == 2 and result.stdout == ""
    (line,) = result.stderr.splitlines()
    assert line.startswith("error: --env-id 'procgen:procgen-coinrun-v0': Procgen has no package that installs "
                           "beside numpy 2 on Python 3.")
    assert "Catch-v0" in line


def test_seed_000_cpu_is_a_device_not_minus_one_workers():
    """Seed 000 ran on the CPU with num_workers -1; here that is --device cpu, and -1 workers is one line."""
    import train_ppo_multiprocess

    cfg = parse_args(train_ppo_multiprocess.CONFIG_GROUPS, ["--device", "cpu", "--num-workers", "2"],
                     exit_on_error=False)[0]
    assert cfg["TRAIN_KWARGS"].device == "cpu"
    with pytest.raises(ConfigError, match=r"^--num-workers -1: must be >= 1$"):
        parse_args(train_ppo_multiprocess.CONFIG_GROUPS, ["--num-workers", "-1"], exit_on_error=False)


# ----------------------------------------------------------------------------- seed 001: progress


@pytest.mark.timeout(120)
def test_ultra_progress_shows_episodes_of_the_budget(tmp_path):
    """With an episode budget the ultra script's progress line shows the episodes done of it, the percentage
    and episodes per second (here the main.log lines of a run whose stderr is not a terminal)."""
    import ultra_parallel_train_dqn

    summary = ultra_parallel_train_dqn.train(
        env_id="CartPole-v1", num_workers=1, num_envs_per_worker=4, hidden_sizes=[32], batch_size=32,
        n_step=1, n_episodes=60, learning_starts=64, buffer_size=4000, target_return=None, tensorboard=False,
        log_interval_s=0.01, metrics_interval_s=0.05, output_dir=str(tmp_path / "run"))
    assert summary["exit_code"] == 0 and summary["stop_reason"] == "total_episodes 60 reached", summary
    lines = re.findall(r"episodes=(\d+)/60 \((\d+\.\d)%\)  eps/s=([\d.]+)",
                       (tmp_path / "run" / "logs" / "main.log").read_text())
    assert len(lines) >= 3, lines
    done = [int(n) for n, _, _ in lines]
    assert done == sorted(done) and 0 < done[-1] <= summary["episodes"]
    assert all(percent == f"{100 * int(n) / 60:.1f}" for n, percent, _ in lines)
    assert max(float(rate) for _, _, rate in lines) > 0


def test_a_progress_line_shows_the_percentage_of_a_step_budget(caplog):
    logger = logging.getLogger("prl.test_seeds")
    progress = Progress(100_000, "steps", logger, interval_s=0.0)
    with caplog.at_level(logging.INFO, logger="prl.test_seeds"):
        progress.update(5000, {"sps": 2500})
        Progress(None, "steps", logger, interval_s=0.0).update(7, {})
    assert [r.getMessage() for r in caplog.records] == ["steps 5000/100000 (5.0%)  sps=2500", "steps 7  "]


# ----------------------------------------------------------------------------- docs/conventions.md


def config_names(script) -> set[str]:
    """The fields of a script's config (all its groups) and the other names it takes for them."""
    classes = list(script.CONFIG_GROUPS.values()) if hasattr(script, "CONFIG_GROUPS") else [script.Config]
    return {f.name for cls in classes for f in dataclasses.fields(cls)} | \
        {alias for cls in classes for alias in getattr(cls, "ALIASES", {})}


def test_the_vocabulary_names_a_field_of_every_script_it_lists():
    """docs/conventions.md's "One vocabulary": each name is a field (or an alias of one) of every script its
    row lists; seed 003's `parallel:` section takes num_envs_per_worker in parallel_train_dqn.py too."""
    import parallel_train_dqn
    import train_parallel_timed
    import train_ppo_multiprocess
    import ultra_parallel_train_dqn

    scripts = {m.__name__ + ".py": m for m in (train_parallel_timed, train_ppo_multiprocess, parallel_train_dqn,
                                               ultra_parallel_train_dqn)}
    table = (DOCS / "conventions.md").read_text().split("## One vocabulary")[1].split("\n## ")[0]
    rows = [line.strip().strip("|").split("|") for line in table.splitlines() if line.startswith("| ")][1:]
    checked, concept = 0, ""
    for row in rows:
        concept, names, where = (row[0].strip() or concept), row[1], row[2].split(", whose")[0]
        if concept == "files":
            continue
        while re.search(r"\([^()]*\)", names):  # what a parenthesis explains is not a name
            names = re.sub(r"\([^()]*\)", "", names)
        named = re.findall(r"`(\w+)`", names)
        listed = re.findall(r"`(\w+\.py)`", where)
        if "every script" in where:
            listed = list(scripts)
        elif where.strip().startswith("all but"):
            listed = [s for s in scripts if s not in listed]
        assert named and listed, row
        for script in listed:
            missing = set(named) - config_names(scripts[script])
            assert not missing, f"{concept}: {script} has no {sorted(missing)}"
            checked += len(named)
    assert checked > 100


def test_num_envs_per_worker_is_episodes_per_batch_in_parallel_train_dqn(tmp_path):
    """parallel_train_dqn.py takes every script's num_envs_per_worker, also in seed 003's `parallel:` section,
    as the envs its workers step together: episodes_per_batch; a wrong value names the field it sets."""
    import parallel_train_dqn

    (tmp_path / "sections.yaml").write_text("parallel:\n  num_workers: 2\n  num_envs_per_worker: 8\n")
    cfg = parse_args(parallel_train_dqn.Config, ["--config", str(tmp_path / "sections.yaml"), "--learner", "q_network"],
                     exit_on_error=False)[0]  # (episodes_per_batch is the Q-network learner's)
    assert cfg.episodes_per_batch == cfg.num_envs_per_worker == 8 and cfg.num_workers == 2
    assert parallel_train_dqn.Config(num_envs_per_worker=4).episodes_per_batch == 4
    with pytest.raises(ConfigError, match=r"^--episodes-per-batch 0: must be > 0$"):
        parse_args(parallel_train_dqn.Config, ["--num-envs-per-worker", "0"], exit_on_error=False)
    (tmp_path / "wrong.yaml").write_text("training:\n  num_envs_per_worker: 8\n")
    with pytest.raises(ConfigError, match="unknown key 'training.num_envs_per_worker'"):
        parse_args(parallel_train_dqn.Config, ["--config", str(tmp_path / "wrong.yaml")], exit_on_error=False)


# ----------------------------------------------------------------------------- docs/seeds.md

SEEDS_PAGE_MODULES = ("train_parallel_timed", "train_ppo_multiprocess", "parallel_train_dqn",
                      "ultra_parallel_train_dqn", "common.parallel_manager", "common.rollout_worker",
                      "common.manager_config", "common.dqn", "common.policy")


def test_every_name_on_the_seeds_page_exists():
    """docs/seeds.md's "here" column names what exists: its files and directories, its classes (in the
    scripts or the manager's modules), its `common.*` names and its flags; its table covers all five seeds."""
    import importlib

    modules = [importlib.import_module(name) for name in SEEDS_PAGE_MODULES]
    flags = {"--config", "--validate-only"}
    for script in modules[:4]:
        flags |= {"--" + name.replace("_", "-") for name in config_names(script)}
    rows = [line.strip().strip("|").split("|") for line in (DOCS / "seeds.md").read_text().splitlines()
            if re.match(r"\| 00\d \|", line)]
    assert {row[0].strip() for row in rows} == {"000", "001", "002", "003", "004"}
    missing, checked = [], 0
    for row in rows:
        for token in re.findall(r"`([^`]+)`", row[2]):
            if token.split()[0] in ("tensorboard", "pip"):  # other programs' flags
                continue
            for word in re.split(r"[\s(),=]+", token):
                word = word.strip("\"'")
                if re.fullmatch(r"(common|configs|tests|examples|docs)/[\w./-]+|\w+\.py|Makefile", word):
                    ok = (ROOT / word).exists()
                elif re.fullmatch(r"common(\.\w+)+", word):
                    module, _, attribute = word.rpartition(".")
                    ok = hasattr(importlib.import_module(module), attribute)
                elif re.fullmatch(r"[A-Z]\w*[a-z]\w*(\.\w+)?", word) and word not in ("True", "False", "None"):
                    owner, _, attribute = word.partition(".")
                    found = [getattr(m, owner) for m in modules if hasattr(m, owner)]
                    ok = bool(found) and (not attribute or hasattr(found[0], attribute))
                elif word.startswith("--") and len(word) > 2:
                    ok = word in flags
                else:
                    continue
                checked += 1
                if not ok:
                    missing.append(f"{row[0].strip()}: {word}")
    assert not missing, missing
    assert checked > 50
