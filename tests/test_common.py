"""Unit tests of the common package: config, seeding, GAE, checkpoints, shared memory."""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import shutil
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass, field

import numpy as np
import psutil
import pytest
import torch
from conftest import ROOT

from common.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from common.config import ConfigError, parse_config, require
from common.envs import make_vec_env
from common.gae import compute_gae
from common.networks import ActorCritic, flat_size, read_flat_params, write_flat_params
from common.shm import SHM_DIR as SHM
from common.shm import SharedArray, reclaim_stale_segments, segments_of
from common.system import assign_devices, resolve_device, threads_per_process


@dataclass
class DemoConfig:
    env_id: str = "CartPole-v1"  # which env
    num_workers: int = 2  # processes
    learning_rate: float = 3e-4  # step size
    anneal_lr: bool = True  # decay
    duration: float | None = None  # hours
    hidden_sizes: list[int] = field(default_factory=lambda: [64, 64])  # widths

    def validate(self):
        require(self.num_workers >= 0, "num_workers", self.num_workers, "must be >= 0")


# ------------------------------------------------------------------ config

def test_flags_override_defaults_and_types_are_coerced():
    cfg = parse_config(DemoConfig, ["--num-workers", "4", "--learning-rate", "1e-3", "--no-anneal-lr",
                                    "--duration", "0.5", "--hidden-sizes", "32", "16"])
    assert cfg == DemoConfig("CartPole-v1", 4, 1e-3, False, 0.5, [32, 16])


def test_yaml_overlays_defaults_and_flags_win_over_yaml(tmp_path):
    file = tmp_path / "c.yaml"
    file.write_text("num_workers: 3\nlearning-rate: 0.01\nduration: null\n")
    cfg = parse_config(DemoConfig, ["--config", str(file), "--num-workers", "5"])
    assert (cfg.num_workers, cfg.learning_rate, cfg.duration) == (5, 0.01, None)


def test_grouped_configs_accept_nested_yaml(tmp_path):
    @dataclass
    class Env:
        top_n_items: int = 10  # items

    file = tmp_path / "g.yaml"
    file.write_text("env:\n  top_n_items: 7\ntrain:\n  num_workers: 1\n")
    cfgs = parse_config({"env": Env, "train": DemoConfig}, ["--config", str(file)])
    assert cfgs["env"].top_n_items == 7 and cfgs["train"].num_workers == 1


@pytest.mark.parametrize("argv, message", [
    (["--num-workers", "-1"], "--num-workers -1: must be >= 0"),
    (["--num-workers", "two"], "--num-workers 'two': must be an integer"),
    (["--learning-rate", "fast"], "must be a number"),
    (["--no-such-flag", "1"], "unrecognized arguments"),
])
def test_bad_values_exit_2_with_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_config(DemoConfig, argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_unknown_yaml_key_names_the_key(tmp_path, capsys):
    file = tmp_path / "bad.yaml"
    file.write_text("num_wrkers: 3\n")
    with pytest.raises(SystemExit) as exit_info:
        parse_config(DemoConfig, ["--config", str(file)])
    assert exit_info.value.code == 2
    assert "num_wrkers" in capsys.readouterr().err


def test_device_checks():
    assert resolve_device("cpu") == "cpu"
    with pytest.raises(ConfigError):
        resolve_device("cuda:7" if not torch.cuda.is_available() else f"cuda:{torch.cuda.device_count()}")
    with pytest.raises(ConfigError):
        resolve_device("tpu")
    assert assign_devices(3, "cpu") == ["cpu"] * 3
    assert threads_per_process(10**6) == 1


# ------------------------------------------------------------------ envs

def test_vector_env_seeding_is_deterministic_and_distinct_per_env():
    def rollout(seed: int, first: int = 0):
        envs = make_vec_env("CartPole-v1", 4, seed, first_index=first)
        obs = [envs.reset()]
        rng = np.random.default_rng(0)
        for _ in range(50):
            obs.append(envs.step(rng.integers(0, 2, 4)).obs)
        envs.close()
        return np.stack(obs)

    a, b, c = rollout(7), rollout(7), rollout(8)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    assert len({tuple(row) for row in a[0]}) == 4  # four environments, four different starts


def test_vector_env_reports_episodes_and_final_observation():
    envs = make_vec_env("CartPole-v1", 2, seed=0)
    envs.reset()
    total = 0
    for _ in range(200):
        result = envs.step(np.zeros(2, dtype=np.int64))  # always push left: episodes end fast
        for episode in result.episodes:
            i = episode["env_index"]
            assert result.terminations[i]
            assert abs(result.final_obs[i][2]) > 0.2 or abs(result.final_obs[i][0]) > 2.4  # the failing state
            assert abs(result.obs[i][2]) <= 0.05  # already the next episode's first observation
            assert episode["length"] == episode["return"]
            total += 1
    assert total >= 10


def test_cartpoles_vector_action_check_answers_as_multidiscrete_does():
    from gymnasium.spaces import MultiDiscrete

    envs = make_vec_env("CartPole-v1", 3, seed=0)
    fast, reference = envs.env.action_space, MultiDiscrete([2, 2, 2])
    assert type(fast).__name__ == "SameActionsEverywhere"  # the env's own step asserts membership with it
    candidates = [np.array([0, 1, 1]), np.array([0, 2, 1]), np.array([-1, 0, 0]), np.array([0, 1]),
                  np.array([[0, 1, 1]]), np.array([0, 1, 1], dtype=np.int8), np.array([0, 1, 1], dtype=np.uint8),
                  np.array([0, 1, 1], dtype=np.uint64), np.array([0.0, 1.0, 1.0]), [0, 1, 1], [0, 1, 2]]
    for x in candidates:
        assert fast.contains(x) == reference.contains(x), x
    envs.reset()
    with pytest.raises(AssertionError):
        envs.step(np.array([0, 2, 1]))


# ------------------------------------------------------------------ GAE

def test_gae_matches_hand_computation_with_termination_and_truncation():
    gamma, lam = 0.9, 0.8
    # one env, 4 steps: step 1 ends by time limit (truncation), step 3 is the last of the rollout
    rewards = np.array([[1.0], [2.0], [0.5], [1.0]], dtype=np.float32)
    values = np.array([[0.5], [1.0], [0.2], [0.4]], dtype=np.float32)
    terms = np.zeros((4, 1), dtype=np.float32)
    truncs = np.array([[0], [1], [0], [0]], dtype=np.float32)
    final_values = np.array([[0], [3.0], [0], [0]], dtype=np.float32)
    next_values = np.array([0.6], dtype=np.float32)
    adv, ret = compute_gae(rewards, values, terms, truncs, final_values, next_values, gamma, lam)
    d3 = 1.0 + 0.9 * 0.6 - 0.4
    d2 = 0.5 + 0.9 * 0.4 - 0.2
    d1 = 2.0 + 0.9 * 3.0 - 1.0  # bootstraps from the truncated episode's final value
    d0 = 1.0 + 0.9 * 1.0 - 0.5
    a3 = d3
    a2 = d2 + 0.9 * 0.8 * a3
    a1 = d1  # the episode ended: nothing flows back across the boundary
    a0 = d0 + 0.9 * 0.8 * a1
    np.testing.assert_allclose(adv[:, 0], [a0, a1, a2, a3], rtol=1e-6)
    np.testing.assert_allclose(ret, adv + values, rtol=1e-6)

    terms[1], truncs[1] = 1, 0  # a termination never bootstraps
    adv, _ = compute_gae(rewards, values, terms, truncs, final_values, next_values, gamma, lam)
    assert adv[1, 0] == pytest.approx(2.0 - 1.0)


# ------------------------------------------------------------------ checkpoints

def test_checkpoint_round_trip_restores_model_optimizer_counters_and_rng(tmp_path):
    import gymnasium as gym

    space = gym.spaces.Box(-1, 1, (4,))
    model = ActorCritic(space, gym.spaces.Discrete(2))
    optim = torch.optim.Adam(model.parameters())
    loss = model.get_value(torch.ones(3, 4)).sum()
    loss.backward()
    optim.step()
    path = save_checkpoint({"model": model.state_dict(), "optimizer": optim.state_dict(), "global_step": 123,
                            "rng": rng_state()}, tmp_path / "ck.pt")
    expected = (torch.rand(3), np.random.rand(3))
    state = load_checkpoint(path)
    set_rng_state(state["rng"])
    assert torch.equal(torch.rand(3), expected[0]) and np.array_equal(np.random.rand(3), expected[1])
    fresh = ActorCritic(space, gym.spaces.Discrete(2))
    fresh.load_state_dict(state["model"])
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(a, b)
    assert state["global_step"] == 123 and state["optimizer"]["state"]


def test_a_checkpoint_written_without_torch_is_the_one_torch_save_writes(tmp_path):
    """common/torch_file.py: what a process that never imported torch writes loads, value for value and
    dtype for dtype, as the same state written by torch.save with every array a tensor (also memory-mapped)."""
    from common import torch_file
    from common.checkpoint import _tensor

    rng = np.random.default_rng(0)
    state = {"model": {"critic.0.weight": rng.standard_normal((8, 4)).astype(np.float32),
                       "actor_logstd": np.full((1, 2), -0.5, np.float32)},
             "optimizer": {"state": {0: {"step": np.array(3.0, np.float32), "exp_avg": np.ones(5)}},
                           "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0], "foreach": None}]},
             "rng": {"python": random.getstate(), "numpy": ("MT19937", np.arange(624, dtype=np.int64), 2, 0, 0.0)},
             "counters": {"global_step": 1024, "wall_time": 1.5, "recent_returns": [9.0, 10.5],
                          "best_mean_return": np.float64(10.5), "flag": True, "none": None},
             "codes": np.asfortranarray(np.arange(6, dtype=np.int64).reshape(2, 3)), "empty": np.zeros((0, 3)),
             "frames": np.arange(12, dtype=np.uint8).reshape(3, 4), "mask": np.array([True, False])}
    with open(tmp_path / "mine.pt", "wb") as f:
        torch_file.write(state, f)
    torch.save(torch_file.plain({**state, "counters": {**state["counters"], "best_mean_return": 10.5}}, _tensor),
               tmp_path / "torch.pt")

    def same(a, b, where="state"):
        assert type(a) is type(b), (where, type(a), type(b))
        if isinstance(a, torch.Tensor):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
        elif isinstance(a, dict):
            assert list(a) == list(b), where
            for key in a:
                same(a[key], b[key], f"{where}[{key!r}]")
        elif isinstance(a, (list, tuple)):
            assert len(a) == len(b), where
            for i, (x, y) in enumerate(zip(a, b)):
                same(x, y, f"{where}[{i}]")
        else:
            assert a == b, where

    want = torch.load(tmp_path / "torch.pt", weights_only=True)
    same(torch.load(tmp_path / "mine.pt", weights_only=True), want)
    same(torch.load(tmp_path / "mine.pt", weights_only=True, mmap=True), want)
    assert want["optimizer"]["state"][0]["step"].shape == ()


def test_interrupted_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    path = save_checkpoint({"model": {"w": torch.ones(2)}, "step": 1}, tmp_path / "ck.pt")

    def dies_half_way(obj, f):
        f.write(b"half a checkpoint")
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", dies_half_way)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint({"model": {"w": torch.zeros(2)}, "step": 2}, path)
    assert load_checkpoint(path)["step"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["ck.pt"]  # no temporary file left


def test_loading_a_non_checkpoint_raises_a_clear_error(tmp_path):
    bogus = tmp_path / "notes.pt"
    bogus.write_text("not a checkpoint")
    with pytest.raises(CheckpointError, match="not a readable checkpoint"):
        load_checkpoint(bogus)
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        load_checkpoint(tmp_path / "missing.pt")
    assert latest_checkpoint(tmp_path / "nowhere") is None


def test_latest_checkpoint_is_the_one_written_last_whatever_its_name_says(tmp_path):
    """--resume auto continues the file written last: a higher step in a name can be a timeline the run left."""
    def written_at(name: str, when: int) -> None:
        (tmp_path / name).touch()
        os.utime(tmp_path / name, (when, when))

    written_at("ultra_model_ep300.pt", 100)
    written_at("ultra_model_ep100.pt", 200)
    written_at("latest.pt", 150)
    assert latest_checkpoint(tmp_path).name == "ultra_model_ep100.pt"
    written_at("latest.pt", 200)  # the same time: a final or latest one first, then the higher number
    assert latest_checkpoint(tmp_path).name == "latest.pt"
    written_at("latest.pt", 100)
    written_at("ultra_model_ep300.pt", 200)
    assert latest_checkpoint(tmp_path).name == "ultra_model_ep300.pt"
    assert latest_checkpoint(tmp_path, r"ultra_model_ep\d+\.pt|other\.pt").name == "ultra_model_ep300.pt"


def test_resume_finds_its_checkpoint_and_refuses_another_script_env_or_network_width(tmp_path):
    from types import SimpleNamespace

    from common.run_setup import load_resume

    saved = {"script": "script", "model": {}, "config": {"env_id": "CartPole-v1", "hidden_sizes": [64, 64]}}
    path = save_checkpoint(saved, tmp_path / "checkpoints" / "latest.pt")

    def resume(value, script="script", **settings):
        cfg = {"resume": value, "output_dir": str(tmp_path), "env_id": "CartPole-v1", "seed": 1,
               "hidden_sizes": [64, 64], **settings}
        return load_resume(script, SimpleNamespace(**cfg), r".*\.pt", ("model",))

    found, state = resume("auto")
    assert found == path and state["config"]["hidden_sizes"] == [64, 64]
    assert resume(str(tmp_path))[0] == path and resume(str(path))[0] == path
    assert resume("auto", output_dir=str(tmp_path / "fresh")) == (None, None)  # nothing to continue: a fresh run
    (tmp_path / "empty").mkdir()
    for value, script, settings, message in (
            (str(path), "script", {"hidden_sizes": [128, 128]}, "was trained with hidden_sizes \\[64, 64\\]"),
            (str(path), "script", {"env_id": "Acrobot-v1"}, "was trained with env_id 'CartPole-v1'"),
            (str(path), "other", {}, "is a checkpoint of script.py, not of other.py"),
            (str(tmp_path / "missing"), "script", {}, "no such checkpoint file or run directory"),
            (str(tmp_path / "empty"), "script", {}, "this run directory holds no checkpoint")):
        with pytest.raises(ConfigError, match=message):
            resume(value, script, **settings)


# ------------------------------------------------------------------ shared memory

def _child_writes(spec, value):
    shared = SharedArray.attach(spec)
    shared.array[:] = value
    shared.close()


def test_shared_array_is_seen_by_a_child_without_copying_and_cleaned_up():
    with SharedArray.create("unit_test", (16,), np.float32) as shared:
        name = shared.spec.name
        assert name.startswith(f"prl_{os.getpid()}_") and (SHM / name).exists()
        child = mp.get_context("spawn").Process(target=_child_writes, args=(shared.spec, 7.0))
        child.start()
        child.join(30)
        assert child.exitcode == 0
        np.testing.assert_array_equal(shared.array, np.full(16, 7.0, np.float32))
    assert not (SHM / name).exists()
    shared.unlink()  # a second release is harmless


def test_flat_parameters_travel_through_shared_memory():
    import gymnasium as gym

    space = gym.spaces.Box(-1, 1, (3,))
    source, target = ActorCritic(space, gym.spaces.Discrete(2)), ActorCritic(space, gym.spaces.Discrete(2))
    with SharedArray.create("unit_params", (flat_size(source),), np.float32) as shared:
        write_flat_params(source, shared.array)
        read_flat_params(target, shared.array)
        shared.array[:] = 0  # the target holds a copy, not a view of the segment
    for a, b in zip(source.parameters(), target.parameters()):
        assert torch.equal(a, b)


def test_a_seqlock_never_hands_out_a_half_written_row():
    from common.shm import Seqlock

    lock = Seqlock(np.zeros((2, 4), np.float32), np.zeros((2, 2), np.int64))
    out = np.full(4, -1.0, np.float32)
    assert lock.version() == 0 and lock.read(out) is None  # never written
    assert lock.write(lambda row: row.fill(3.0)) == 1 and lock.write(lambda row: row.fill(5.0), slot=1) == 1
    assert lock.read(out) == 1 and (out == 3.0).all()
    lock.versions[0, 0] += 1  # a write begun and not finished (its writer killed mid-copy, or still copying)
    lock.rows[0, :2] = 9.0
    assert lock.read(out) is None and lock.version() == 1
    assert lock.read(out, slot=1) == 1 and (out == 5.0).all()  # the other slot is unaffected


def test_a_collector_takes_up_parameters_published_during_its_rollout():
    """An overlapped worker acts with whatever the learner published last, from the next step on, and stores the
    log-probability of the parameters that acted; a reader that never gets a whole copy says so."""

    from common.normalize import Normalizer
    from common.numpy_actor_critic import NumpyActing, actor_critic_shapes, parameter_count
    from common.rollout import PublishedParams, RolloutCollector, rollout_layout
    from common.shm import Seqlock

    envs = make_vec_env("CartPole-v1", 4, seed=0)
    obs_space, act_space = envs.single_observation_space, envs.single_action_space
    size = parameter_count(actor_critic_shapes(obs_space, act_space, (8,)))
    lock = Seqlock(np.zeros((1, size), np.float32), np.zeros((1, 2), np.int64))
    lock.write(lambda row: row.__setitem__(slice(None), np.random.default_rng(0).normal(size=size)))
    published = PublishedParams(lock)
    acting = NumpyActing(obs_space, act_space, (8,), "tanh", published, seed=0)

    class PublishAtStep:  # the learner finishing an update while step 10 of the rollout is stepped
        def __init__(self):
            self.steps, self.single_action_space, self.num_envs = 0, act_space, envs.num_envs

        def reset(self):
            return envs.reset()

        def step(self, action):
            self.steps += 1
            if self.steps == 10:
                lock.write(lambda row: row.fill(0.0))  # zero weights: both actions equally likely
            return envs.step(action)

    layout = rollout_layout(16, 4, obs_space, act_space)
    buf = {key: np.zeros(shape, dtype) for key, (shape, dtype) in layout.items()}
    collector = RolloutCollector(acting, PublishAtStep(), buf, slice(None), Normalizer((4,), False, False), published)
    collector.collect(16)
    envs.close()
    assert collector.steps_by_version == {1: 10 * 4, 2: 6 * 4}
    np.testing.assert_allclose(buf["logprobs"][10:], np.log(0.5), rtol=1e-6)
    assert not np.isclose(buf["logprobs"][:10], np.log(0.5)).all()
    lock.versions[0, 0] += 1  # a write that never finishes
    with pytest.raises(RuntimeError, match="no consistent copy of the published parameters in 3 attempts"):
        PublishedParams(lock, attempts=3)()


def test_stale_segments_of_dead_processes_are_reclaimed(tmp_path):
    dead = mp.get_context("spawn").Process(target=os.getpid)
    dead.start()
    dead.join()
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])  # exited, not yet reaped: as kill -9 leaves one
    while psutil.Process(zombie.pid).status() != psutil.STATUS_ZOMBIE:
        time.sleep(0.01)
    stale, unreaped = SHM / f"prl_{dead.pid}_leftover", SHM / f"prl_{zombie.pid}_leftover"
    for path in (stale, unreaped):
        path.write_bytes(b"x" * 64)
    mine = SharedArray.create("still_mine", (4,), np.float32)
    try:
        reclaimed = reclaim_stale_segments()
        assert {stale.name, unreaped.name} <= set(reclaimed) and not stale.exists() and not unreaped.exists()
        assert segments_of(os.getpid()) == [mine.spec.name]  # a live owner's segment is kept
    finally:
        zombie.wait()
        mine.unlink()
        for path in (stale, unreaped):
            path.unlink(missing_ok=True)



@pytest.mark.parametrize("continuous", [False, True])
def test_fast_rollout_sampling_matches_the_distribution(continuous):
    import gymnasium as gym

    obs_space = gym.spaces.Box(-1, 1, (3,))
    act_space = gym.spaces.Box(-1, 1, (2,)) if continuous else gym.spaces.Discrete(3)
    torch.manual_seed(0)
    agent = ActorCritic(obs_space, act_space)
    obs = torch.randn(4000, 3) * 3
    action, logprob, value = agent.act(obs)
    dist = agent.distribution(obs)
    expected_logprob = dist.log_prob(action).sum(-1) if continuous else dist.log_prob(action)
    expected_entropy = dist.entropy().sum(-1) if continuous else dist.entropy()
    torch.testing.assert_close(logprob, expected_logprob.detach(), rtol=1e-4, atol=1e-4)
    _, scored_logprob, entropy, scored_value = agent.get_action_and_value(obs, action)
    torch.testing.assert_close(scored_logprob, expected_logprob, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(entropy, expected_entropy, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(value, scored_value.detach())
    if not continuous:  # sampled frequencies follow the policy's probabilities
        probs = agent.distribution(obs[:1].expand(4000, 3)).probs[0]
        samples = agent.act(obs[:1].expand(4000, 3))[0]
        freq = torch.bincount(samples, minlength=3).float() / 4000
        torch.testing.assert_close(freq, probs.detach(), atol=0.03, rtol=0)


@pytest.mark.parametrize("continuous, hidden, activation", [(False, (64, 64), "tanh"), (True, (32,), "relu")])
def test_numpy_acting_from_flat_parameters_is_the_torch_network(continuous, hidden, activation):
    """A rollout worker acts in numpy from the flat parameters the learner publishes (never importing torch):
    the parameter shapes it reads them with are ActorCritic's, in its order, and its values, actions and
    log-probabilities are the torch network's."""
    import gymnasium as gym

    from common.networks import write_flat_params
    from common.numpy_actor_critic import NumpyActing, actor_critic_shapes

    obs_space = gym.spaces.Box(-1, 1, (5,))
    act_space = gym.spaces.Box(-1, 1, (2,)) if continuous else gym.spaces.Discrete(3)
    torch.manual_seed(1)
    agent = ActorCritic(obs_space, act_space, hidden, activation, log_std_init=-0.5)
    with torch.no_grad():  # every parameter distinct from its neighbours, so an order mix-up shows
        for param in agent.parameters():
            param.add_(torch.randn_like(param) * 0.3)
    assert actor_critic_shapes(obs_space, act_space, hidden) == [tuple(p.shape) for p in agent.parameters()]
    flat = np.zeros(sum(p.numel() for p in agent.parameters()), np.float32)
    write_flat_params(agent, flat)
    acting = NumpyActing(obs_space, act_space, hidden, activation, lambda: flat, seed=0)
    obs = np.random.default_rng(0).normal(size=(256, 5)).astype(np.float32)
    action, logprob, value = acting.act(obs)
    with torch.no_grad():
        dist = agent.distribution(torch.as_tensor(obs))
        taken = torch.as_tensor(action)
        expected = dist.log_prob(taken).sum(-1) if continuous else dist.log_prob(taken)
        np.testing.assert_allclose(value, agent.get_value(torch.as_tensor(obs)).numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(logprob, expected.numpy(), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(acting.value(obs), value, rtol=1e-6)
    flat[:] = 0.0  # a refresh reads what is published now; until then the copy taken stands
    np.testing.assert_allclose(acting.value(obs), value, rtol=1e-6)
    acting.refresh()
    assert not acting.value(obs).any()


# ------------------------------------------------------------------ optimizer

def test_fused_adam_is_bit_identical_to_torch_adam_and_shares_its_checkpoints():
    from common.optim import FusedAdam

    torch.manual_seed(0)
    ours, theirs = torch.nn.Linear(5, 3), torch.nn.Linear(5, 3)
    theirs.load_state_dict(ours.state_dict())
    mine = FusedAdam(ours.parameters(), lr=3e-3, eps=1e-5)
    reference = torch.optim.Adam(theirs.parameters(), lr=3e-3, eps=1e-5, fused=True)
    x = torch.randn(16, 5)
    for step in range(6):
        for model, opt in ((ours, mine), (theirs, reference)):
            opt.zero_grad()
            (model(x) ** 2).mean().backward()
            opt.step()
        mine.param_groups[0]["lr"] = reference.param_groups[0]["lr"] = 3e-3 * (1 - step / 6)
    assert all(torch.equal(a, b) for a, b in zip(ours.parameters(), theirs.parameters()))
    # Either one's state loads into the other and continues identically.
    other = torch.optim.Adam(ours.parameters(), lr=1.0, eps=1e-5, fused=True)
    other.load_state_dict(mine.state_dict())
    again = FusedAdam(theirs.parameters())
    again.load_state_dict(reference.state_dict())
    assert other.state_dict()["state"][0]["step"].item() == 6 and again.steps[0].item() == 6
    assert torch.equal(again.exp_avg_sq[1], reference.state_dict()["state"][1]["exp_avg_sq"])


def test_the_project_builds_as_a_package_with_the_envs_scripts_and_evaluate_command(tmp_path):
    """``pip install -e .`` / ``pip install .`` work: one wheel holds common/, its envs, every script and
    the ``prl-evaluate`` command (setuptools refuses a flat layout it cannot tell apart)."""
    source = tmp_path / "src"  # a copy: building writes build/ and *.egg-info next to the sources
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".*", "runs", "build", "*.egg-info", "__pycache__",
                                                                "benchmarks", "tests"))
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                           str(tmp_path), str(source)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (wheel,) = tmp_path.glob("parallel_rl-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for module in ("common/run.py", "common/envs/market.py", "common/envs/catch.py", "train_parallel_timed.py",
                   "ultra_parallel_train_dqn.py", "launch_parallel_training.py", "compare_results.py"):
        assert module in names, module
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "prl-evaluate = common.evaluate:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


BLAS_PROBE = """
import ctypes, multiprocessing as mp
import numpy
import common  # as every script does, once numpy is loaded


def blas_threads(queue):
    # numpy's OpenBLAS thread count in this process (None where numpy does not use OpenBLAS)
    libraries = sorted({line.split()[-1] for line in open("/proc/self/maps") if "openblas" in line and ".so" in line})
    for path in libraries:
        library = ctypes.CDLL(path)
        for name in ("scipy_openblas_get_num_threads64_", "openblas_get_num_threads64_", "openblas_get_num_threads"):
            if hasattr(library, name):
                return queue.put(getattr(library, name)())
    queue.put(None)


if __name__ == "__main__":
    context = mp.get_context("spawn")
    queue = context.Queue()
    worker = context.Process(target=blas_threads, args=(queue,))
    worker.start()
    print(queue.get(timeout=60))
    worker.join()
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads the loaded libraries from /proc")
def test_workers_run_numpy_blas_on_one_thread_unless_the_user_sets_it(tmp_path):
    """Acting for 128 envs on a busy machine was 6x slower with one BLAS thread per core (docs/performance.md):
    every process a script starts gets one, and a value the user exported is kept."""
    probe = tmp_path / "probe.py"
    probe.write_text(BLAS_PROBE)
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    env["PYTHONPATH"] = str(ROOT)
    seen = {}
    for setting in (None, "2"):
        run_env = env if setting is None else {**env, "OPENBLAS_NUM_THREADS": setting}
        proc = subprocess.run([sys.executable, str(probe)], env=run_env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        seen[setting] = proc.stdout.strip()
    if seen[None] == "None":
        pytest.skip("numpy does not use OpenBLAS here")
    assert seen == {None: "1", "2": "2"}


def test_budget_used_is_the_largest_fraction_of_steps_episodes_and_this_invocations_duration():
    """Schedules over the run (anneal_lr, prioritized replay's beta) read Run.budget_used: steps and episodes
    count over resumes, --duration only this invocation's wall time (a resumed run has a fresh deadline)."""
    import time
    from types import SimpleNamespace

    from common.run import Run

    def used(deadline_in_s=None, steps=0, episodes=0, **cfg):
        deadline = time.monotonic() + deadline_in_s if deadline_in_s is not None else float("inf")
        run = SimpleNamespace(cfg=SimpleNamespace(**cfg), counters={"global_step": steps, "episodes": episodes},
                              _deadline=deadline)
        return Run.budget_used(run)

    assert used() == 0.0 and used(steps=500, total_timesteps=None) == 0.0
    assert used(steps=250, total_timesteps=1000) == pytest.approx(0.25)
    assert used(steps=250, episodes=30, total_timesteps=1000, total_episodes=40) == pytest.approx(0.75)
    assert used(steps=5000, total_timesteps=1000) == 1.0
    assert used(deadline_in_s=2700, duration=1.0) == pytest.approx(0.25, abs=1e-3)  # 15 of 60 min gone
    assert used(deadline_in_s=2700, steps=600, duration=1.0, total_timesteps=1000) == pytest.approx(0.6)
    assert used(deadline_in_s=-5, duration=1.0) == 1.0


def test_metrics_rows_and_episodes_reach_tensorboard_with_their_values_and_steps(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from common.runlog import MetricsWriter

    metrics = MetricsWriter(tmp_path, ["policy_loss"])
    metrics.write({"wall_time": 1.0, "global_step": 1024, "sps": 500.0, "policy_loss": -0.25, "flag": True})
    metrics.episode(1500, 21.0, 21)
    metrics.write({"wall_time": 2.0, "global_step": 2048, "sps": 600.0, "policy_loss": float("nan")})
    metrics.close()
    (events,) = (tmp_path / "tb").glob("events.out.tfevents.*")
    board = EventAccumulator(str(events), size_guidance={"scalars": 0})
    board.Reload()

    def read(tag):
        return [(e.step, e.value) for e in board.Scalars(tag)]

    assert read("charts/SPS") == [(1024, 500.0), (2048, 600.0)]
    assert read("losses/policy_loss") == [(1024, -0.25)]  # NaN and booleans are not scalars
    assert read("charts/episodic_return") == [(1500, 21.0)] and read("charts/episodic_length") == [(1500, 21.0)]
    assert "prl/flag" not in board.Tags()["scalars"]
