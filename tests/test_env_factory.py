"""The user's own env, wherever the user's model goes: ``env_factory`` in ParallelManager and in
``train(config, env_factory=...)``, its ``"module:name"`` id, resume, and the one-line refusals."""

from __future__ import annotations

import functools
import multiprocessing
import os
import subprocess
import sys
import types

import gymnasium as gym
import numpy as np
import psutil
import pytest
import torch
import yaml
from conftest import ROOT, script_env
from torch import nn

from common.config import ConfigError, require_env_id
from common.envs import env_factory_id, make_vec_env, register_entry_point
from common.parallel_manager import ParallelManager
from common.shm import segments_of
from common.supervisor import WorkerConfigError


class Board(gym.Env):
    """A board of ``board_size`` x ``board_size`` cells, filled one empty cell a move (``info["action_mask"]``:
    the empty ones) for ``max_moves`` moves; a move on the centre pays 1, one on a taken cell (a player that
    ignores the mask) costs 1 and ends the game. The last step's info reports the keyword arguments the env
    was made with, so a test sees them arrive in a worker's episodes."""

    def __init__(self, board_size: int = 3, max_moves: int = 4):
        self.board_size, self.max_moves = board_size, max_moves
        cells = board_size * board_size
        self.observation_space = gym.spaces.Box(0.0, 1.0, (cells,), np.float32)
        self.action_space = gym.spaces.Discrete(cells)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.board, self.moves = np.zeros(self.board_size ** 2, dtype=np.float32), 0
        return self.board.copy(), {"action_mask": self.board == 0}

    def step(self, action):
        illegal = bool(self.board[action])
        self.board[action], self.moves = 1.0, self.moves + 1
        done = illegal or self.moves >= min(self.max_moves, self.board_size ** 2)
        info = {"action_mask": self.board == 0}
        if done:
            info.update(board_size=self.board_size, max_moves=self.max_moves)
        return self.board.copy(), -1.0 if illegal else float(action == self.board_size ** 2 // 2), done, False, info


def make_board(board_size: int = 3, max_moves: int = 4) -> Board:
    """A factory function rather than a class."""
    return Board(board_size, max_moves)


def breaks_in_workers(board_size: int = 3, max_moves: int = 4) -> Board:
    """Works in the learner's process, fails in a worker (as an env whose data only the learner's machine has)."""
    if multiprocessing.parent_process() is not None:
        raise RuntimeError("no board here")
    return Board(board_size, max_moves)


class BadMask(Board):
    """Marks legal actions with a mask one entry short."""

    def reset(self, *, seed=None, options=None):
        obs, info = super().reset(seed=seed)
        return obs, {"action_mask": info["action_mask"][:-1]}


class Policy(nn.Module):
    """The user's model: per-action scores for a flat board."""

    def __init__(self, inputs: int, actions: int):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(inputs, 16), nn.Tanh(), nn.Linear(16, actions))

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.net(obs)


def leftovers() -> tuple[list, list]:
    children = [c for c in psutil.Process().children(recursive=True)
                if c.status() != psutil.STATUS_ZOMBIE and "resource_tracker" not in " ".join(c.cmdline())]
    return segments_of(os.getpid()), children


# ------------------------------------------------------------------ the id

def test_an_importable_factory_is_a_module_name_id_every_process_can_make():
    assert env_factory_id(Board) == "test_env_factory:Board"
    assert env_factory_id(make_board) == "test_env_factory:make_board"
    require_env_id("test_env_factory:make_board")  # a config's check registers it
    vec = make_vec_env("test_env_factory:make_board", 2, seed=0, board_size=4, max_moves=2)
    try:
        assert vec.single_observation_space.shape == (16,) and vec.single_action_space.n == 16
        vec.reset()
        assert vec.last_infos["action_mask"].shape == (2, 16) and vec.last_infos["action_mask"].all()
        result = vec.step(np.array([0, 5]))
        assert not result.infos["action_mask"][0, 0] and not result.infos["action_mask"][1, 5]
        result = vec.step(np.array([1, 6]))
        assert [e["max_moves"] for e in result.episodes] == [2.0, 2.0]
    finally:
        vec.close()


def _closure():
    def inner_env():
        return Board()

    return inner_env


class _Holder:
    @staticmethod
    def make():
        return Board()


@pytest.mark.parametrize("factory, message", [
    (lambda: Board(), r"env_factory: test_env_factory.<lambda> is a lambda, which another process cannot import "
                      r"by name \(workers start with spawn\); define a module-level function or class"),
    (_closure(), "env_factory: test_env_factory._closure.<locals>.inner_env is defined inside a function, which "
                 "another process cannot import by name"),
    (functools.partial(make_board, 5), r"env_factory: functools.partial\(.*\) has no name another process could "
                                       "import it by"),
    (_Holder.make, "env_factory: test_env_factory._Holder.make is not a module-level name"),
    ("Board", "env_factory: must be an env class or a function that returns an env, not str"),
], ids=["lambda", "closure", "partial", "method", "str"])
def test_a_factory_that_cannot_be_imported_by_name_is_refused_in_one_line(factory, message):
    with pytest.raises(ValueError, match=message) as err:
        env_factory_id(factory)
    assert "\n" not in str(err.value)


def test_a_factory_of_an_interactive_main_is_refused(monkeypatch):
    interactive = types.ModuleType("__main__")
    notebook_env = type("NotebookEnv", (Board,), {"__module__": "__main__"})
    interactive.NotebookEnv = notebook_env
    monkeypatch.setitem(sys.modules, "__main__", interactive)
    with pytest.raises(ValueError, match="env_factory: __main__.NotebookEnv is defined in an interactive __main__"):
        env_factory_id(notebook_env)


def test_an_id_whose_module_or_name_is_missing_is_one_config_line():
    with pytest.raises(ConfigError, match=r"^--env-id 'no_such_module:Env': cannot import no_such_module "
                                          r"\(ModuleNotFoundError: No module named 'no_such_module'\)$"):
        require_env_id("no_such_module:Env")
    with pytest.raises(ValueError, match="test_env_factory has no env class or function named Nowhere"):
        register_entry_point("test_env_factory:Nowhere")


# ------------------------------------------------------------------ ParallelManager

@pytest.mark.timeout(90)
def test_the_manager_plays_the_users_env_made_with_env_configs_keys():
    """Seed 004's env_config, keys the env takes and no env_id: they reach the factory in every worker."""
    env_config = {"board_size": 5, "max_moves": 7, "seed": 3}
    with ParallelManager(env_config, parallel_config={"num_workers": 1, "games_per_worker": 3, "timeout": 30.0},
                         model=Policy(25, 25), env_factory=make_board, epsilon=1.0) as manager:
        assert manager.spec.env_id == "test_env_factory:make_board"
        assert manager.spec.env_kwargs == {"board_size": 5, "max_moves": 7} and manager.spec.seed == 3
        assert manager.observation_space.shape == (25,) and manager.action_space.n == 25 and manager.action_mask
        manager.start_workers(wait=True)
        episodes = [e for batch in manager.collect_experiences() for e in batch.episodes]
        # a batch of 3 games, or two: the worker may play one batch ahead (experience_queue_size), and on a
        # busy machine the second is often in by the time the collection starts
        assert len(episodes) in (3, 6)
        for episode in episodes:
            assert (episode["board_size"], episode["max_moves"], episode["length"]) == (5.0, 7.0, 7)
            # the masks the workers read from the env: every move on a cell that was empty, then taken (a
            # terminal observation's mask is never used: all True)
            masks, actions = episode["masks"], episode["actions"]
            assert masks.shape == (8, 25) and masks[0].all() and masks[-1].all()
            assert all(masks[t, a] and not masks[t + 1, a] for t, a in enumerate(actions[:-1]))
            assert [int(masks[t].sum()) for t in range(7)] == list(range(25, 18, -1))
    assert leftovers() == ([], [])


MODEL_REFUSALS = [
    ({"model": Policy(9, 25)}, r"model: Policy \(its first layer takes 9 inputs\) cannot take "
                               r"test_env_factory:Board's observations of shape \(25,\) \(25 values\): "
                               r"RuntimeError: mat1 and mat2 shapes cannot be multiplied \(1x25 and 9x16\)"),
    ({"model": Policy(25, 9)}, r"model: Policy gives 9 scores per observation \(output shape \(1, 9\) for a batch "
                               r"of 1\), but test_env_factory:Board has 25 actions \(Discrete\(25\)\)"),
    ({"model_config": {"input_dim": 81 * 14, "hidden_dim": 512, "action_dim": 2187}},
     r"model_config: input_dim 1134 does not match test_env_factory:Board \(25: observations of shape \(25,\), "
     r"action space Discrete\(25\)\)"),
    ({"env_config": {"env_id": "CartPole-v1", "board_size": 5}},
     "env_config: env_id 'CartPole-v1' and env_factory both name the env; give one"),
    ({"env_factory": BadMask}, r"env_config: test_env_factory:BadMask's info\['action_mask'\] has shape \(24,\); "
                               r"its action space Discrete\(25\) needs \(25,\), one bool per action"),
    ({"env_factory": lambda **kwargs: Board(**kwargs)}, "env_factory: test_env_factory.<lambda> is a lambda"),
    ({"env_config": {"board_size": 5, "no_such_option": 1}},
     "env_config: cannot create test_env_factory:Board with {'board_size': 5, 'no_such_option': 1}: "),
    ({"env_factory": None}, r"env_config: needs an env_id \(a Gymnasium id, e.g. ConnectFour-v0\) or env_factory="),
]


@pytest.mark.parametrize("kwargs, message", MODEL_REFUSALS, ids=[m.split(":")[0] + str(i)
                                                                 for i, (_, m) in enumerate(MODEL_REFUSALS)])
def test_what_does_not_fit_the_users_env_is_refused_in_one_line_before_any_process(kwargs, message):
    kwargs = {"env_config": {"board_size": 5}, "model_config": None,
              "model": None if "model_config" in kwargs else Policy(25, 25), "env_factory": Board, **kwargs}
    with pytest.raises(ValueError, match=message) as err:
        ParallelManager(kwargs.pop("env_config"), kwargs.pop("model_config"), {"num_workers": 1}, **kwargs)
    assert "\n" not in str(err.value)
    assert leftovers() == ([], [])


def test_seed_004s_model_config_fits_an_env_of_its_sizes():
    """input_dim 81*14 and action_dim 2187 are checked against what the env says, and then they fit."""
    manager = ParallelManager({"board_size": 9}, {"input_dim": 81, "hidden_dim": 32, "action_dim": 81},
                              {"num_workers": 1}, env_factory=Board)
    try:
        assert [tuple(p.shape) for p in manager.model.parameters()][0] == (32, 81)
    finally:
        manager.stop_workers()
    assert leftovers() == ([], [])


@pytest.mark.timeout(90)
def test_an_env_that_fails_only_in_a_worker_stops_the_manager_without_a_restart():
    manager = ParallelManager({}, parallel_config={"num_workers": 1, "timeout": 30.0}, model=Policy(9, 9),
                              env_factory=breaks_in_workers)
    try:
        with pytest.raises(WorkerConfigError, match="cannot create test_env_factory:breaks_in_workers with {}: .*"
                                                    "no board here"):
            manager.start_workers(wait=True)
        assert manager.get_status()["total_restarts"] == 0
    finally:
        manager.stop_workers()
    assert leftovers() == ([], [])


# ------------------------------------------------------------------ the training scripts

@pytest.mark.timeout(240)
def test_two_scripts_train_the_users_env_from_python_and_a_run_resumes(tmp_path):
    import parallel_train_dqn
    import train_parallel_timed

    timed = train_parallel_timed.Config(num_workers=1, num_envs_per_worker=2, n_steps=16, batch_size=32,
                                        total_timesteps=64, duration=None, target_return="none", tensorboard=False,
                                        env_kwargs=["board_size=4", "max_moves=5"], output_dir=str(tmp_path / "ppo"))
    first = train_parallel_timed.train(timed, env_factory=Board)
    assert timed.env_id == "LunarLander-v3"  # the caller's config is left as it was
    assert (first["exit_code"], first["env_id"], first["global_step"]) == (0, "test_env_factory:Board", 64)
    saved = yaml.safe_load((tmp_path / "ppo" / "config.yaml").read_text())
    assert saved["env_id"] == "test_env_factory:Board"

    timed.resume, timed.total_timesteps = str(tmp_path / "ppo"), 128
    resumed = train_parallel_timed.train(timed, env_factory=Board)
    assert (resumed["exit_code"], resumed["global_step"]) == (0, 128)
    assert resumed["resumed_from"].endswith("latest.pt") and resumed["episodes"] > first["episodes"]
    with pytest.raises(ValueError, match="--resume .*: was trained with env_id 'test_env_factory:Board', not "
                                         "'test_env_factory:make_board'"):
        train_parallel_timed.train(timed, env_factory=make_board)

    dqn = parallel_train_dqn.train(parallel_train_dqn.Config(
        num_workers=1, episodes_per_batch=4, total_timesteps=200, duration=None, target_return="none",
        learning_starts=32, batch_size=16, hidden_sizes=[16], eval_episodes=4, tensorboard=False,
        env_kwargs=["board_size=3", "max_moves=4"], output_dir=str(tmp_path / "dqn")), env_factory=make_board)
    assert (dqn["exit_code"], dqn["env_id"]) == (0, "test_env_factory:make_board") and dqn["global_step"] >= 200
    metrics = (tmp_path / "dqn" / "metrics.csv").read_text().splitlines()
    lengths = {float(row.split(",")[4]) for row in metrics[1:] if row.split(",")[4]}
    assert lengths == {4.0}, lengths  # max_moves=4 reached the env in the workers
    assert leftovers() == ([], [])


def test_train_refuses_a_factory_it_cannot_use_in_one_line_writing_nothing(tmp_path):
    import parallel_train_dqn
    import train_parallel_timed

    with pytest.raises(ValueError, match=r"^env_factory: test_env_factory\..*<lambda> is a lambda"):
        parallel_train_dqn.train(parallel_train_dqn.Config(output_dir=str(tmp_path / "never")),
                                 env_factory=lambda: Board())
    with pytest.raises(ValueError) as err:
        train_parallel_timed.train(train_parallel_timed.Config(output_dir=str(tmp_path / "never")),
                                   env_factory=BadMask)
    assert str(err.value) == ("--env-id 'test_env_factory:BadMask': its info['action_mask'] has shape (8,); its "
                              "action space Discrete(9) needs (9,), one bool per action")
    assert not (tmp_path / "never").exists() and leftovers() == ([], [])


@pytest.mark.timeout(120)
def test_the_command_line_takes_the_id_and_refuses_a_missing_module_in_one_line(tmp_path):
    def run(*args):
        return subprocess.run([sys.executable, str(ROOT / "train_parallel_timed.py"), *args, "--validate-only"],
                              cwd=tmp_path, env={**script_env(), "PYTHONPATH": f"{ROOT / 'tests'}:{ROOT}"},
                              capture_output=True, text=True, timeout=100)

    ok = run("--env-id", "test_env_factory:Board", "--env-kwargs", "board_size=4", "--num-workers", "1")
    assert ok.returncode == 0, ok.stderr
    resolved = yaml.safe_load(ok.stdout)
    assert (resolved["env_id"], resolved["env_kwargs"]) == ("test_env_factory:Board", ["board_size=4"])
    bad = run("--env-id", "no_such_module:Board")
    assert bad.returncode == 2
    assert bad.stderr.strip() == ("error: --env-id 'no_such_module:Board': cannot import no_such_module "
                                  "(ModuleNotFoundError: No module named 'no_such_module')")
