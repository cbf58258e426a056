"""ParallelManager with the user's own model (seed 004), its one-line refusals, and its knobs."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import textwrap
import threading
import types
import zlib

import numpy as np
import psutil
import pytest
import torch
from conftest import ROOT, script_env
from manager_models import ActorCritic, BreaksInWorker, ReturnsDict, forcing, least_preferred
from torch import nn

from common.envs import make_vec_env, play_episodes
from common.manager_config import ManagerConfig, WorkerSpec
from common.model_packing import pack_model, unpack_model
from common.networks import QNetwork, SharedParams
from common.parallel_manager import ModelSynchronizer, ParallelManager
from common.rollout_worker import ExperienceBatch, sample_actions
from common.shm import segments_of
from common.supervisor import WorkerConfigError

CONNECT_FOUR = {"env_id": "ConnectFour-v0", "seed": 5, "opponent": "random"}
CARTPOLE = {"env_id": "CartPole-v1", "seed": 3}


def workers_alive() -> list[psutil.Process]:
    return [c for c in psutil.Process().children(recursive=True)
            if c.status() != psutil.STATUS_ZOMBIE and "resource_tracker" not in " ".join(c.cmdline())]


def assert_nothing_left() -> None:
    assert segments_of(os.getpid()) == [], "a shared-memory segment outlived the manager"
    assert workers_alive() == [], "a worker process outlived the manager"


def steps(batches, version: int | None = None):
    """(actions, masks) of every step of the batches (of one weights version, if given)."""
    episodes = [e for b in batches if version is None or b.model_version == version for e in b.episodes]
    if not episodes:
        return np.zeros(0, dtype=np.int64), None
    masks = np.concatenate([e["masks"][:-1] for e in episodes]) if "masks" in episodes[0] else None
    return np.concatenate([e["actions"] for e in episodes]), masks


def collect_version(m: ParallelManager, version: int, attempts: int = 30) -> list:
    """Batches played with weights ``version`` (workers may have played ahead with older ones)."""
    for _ in range(attempts):
        batches = [b for b in m.collect_experiences(timeout=10) if b.model_version == version]
        if batches:
            return batches
    raise AssertionError(f"no batch played with weights version {version}")


# ------------------------------------------------------------------ the user's model, trained and synced

@pytest.mark.timeout(120)
def test_actor_critic_trains_and_workers_act_with_the_synced_weights():
    """(logits, value) from the user's own class: workers rebuild it, act by the convention (masked
    argmax of the logits), and after a training step and sync_model_to_workers() act with the new weights."""
    torch.manual_seed(0)
    with ParallelManager(CONNECT_FOUR, parallel_config={"num_workers": 1, "games_per_worker": 8, "timeout": 60.0},
                         model=ActorCritic(84, 7), epsilon=0.0) as m:
        m.start_workers(wait=True)
        first = collect_version(m, 1)
        actions, masks = steps(first)
        assert masks[np.arange(len(actions)), actions].all()  # masked: never an illegal column
        target = (np.bincount(actions, minlength=7).argmax() + 3) % 7  # a column the first weights rarely pick
        assert (actions[masks[:, target]] != target).any()

        obs = torch.as_tensor(np.concatenate([e["obs"][:-1] for b in first for e in b.episodes]))
        optimizer = torch.optim.Adam(m.model.parameters(), lr=0.05)
        for _ in range(100):  # train manager.model: prefer the target column (the value head rides along)
            logits, value = m.model(obs)
            loss = nn.functional.cross_entropy(logits, torch.full((len(obs),), int(target))) + value.pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        assert m.sync_model_to_workers() == 2

        actions, masks = steps(collect_version(m, 2))
        legal = masks[:, target]
        assert legal.sum() >= 8 and (actions[legal] == target).all()  # wherever it is legal, the new choice
        assert masks[np.arange(len(actions)), actions].all()
        assert m.get_status()["workers"][0]["model_version"] == 2
    assert_nothing_left()
    assert m.model_version == 2


@pytest.mark.timeout(90)
def test_a_user_act_function_decides_the_actions():
    """act_fn (a module-level function the workers import) replaces the convention, in collection and evaluation."""
    model = forcing(ActorCritic(4, 2), action=0)  # the convention would push left, always
    with ParallelManager(CARTPOLE, parallel_config={"num_workers": 1, "games_per_worker": 3, "timeout": 60.0},
                         model=model, epsilon=0.0, act_fn=least_preferred) as m:
        m.start_workers()
        actions, _ = steps(m.collect_experiences())
        assert len(actions) and (actions == 1).all()
        forcing(m.model, action=1)
        m.sync_model_to_workers()
        actions, _ = steps(collect_version(m, 2))
        assert len(actions) and (actions == 0).all()
        assert all(e["length"] <= 15 for e in m.evaluate(2))  # always pushing one way fails within a few steps
    assert_nothing_left()


def test_sample_actions_is_an_act_function_for_policies():
    """The built-in act function for policy models: samples from the legal logits' softmax."""
    model = forcing(ActorCritic(84, 7), action=3)
    with torch.no_grad():
        model.policy.bias.copy_(torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, np.log(3.0)]))
    mask = np.ones((4000, 7), dtype=bool)
    mask[:, 0] = False
    actions = sample_actions(model, np.zeros((4000, 2, 6, 7), np.float32), mask, 0.0, np.random.default_rng(0))
    counts = np.bincount(actions, minlength=7) / len(actions)
    assert counts[0] == 0 and abs(counts[6] - 3 / 8) < 0.03 and abs(counts[1] - 1 / 8) < 0.03
    explored = sample_actions(forcing(model, 6), np.zeros((4000, 84), np.float32), mask, 1.0, np.random.default_rng(1))
    assert explored.min() >= 1 and abs((explored == 6).mean() - 1 / 6) < 0.03


def test_the_model_travels_without_its_weights():
    """What the workers get: the module by reference to its class, parameters as shapes only."""
    model = ActorCritic(84, 7)
    data = pack_model(model, least_preferred)
    assert len(data) < 4 * sum(p.numel() for p in model.parameters())  # the weights are not in it
    copy, act_fn = unpack_model(data)
    assert type(copy) is ActorCritic and act_fn is least_preferred and not copy.training
    assert [p.shape for p in copy.parameters()] == [p.shape for p in model.parameters()]
    assert all((p == 0).all() for p in copy.parameters())  # filled from the weights slot in a worker


# ------------------------------------------------------------------ one-line refusals, before anything exists

class _Holder(nn.Linear):
    def __init__(self):
        super().__init__(4, 2)
        self.lock = threading.Lock()  # cannot be pickled


def _local_model() -> nn.Module:
    class LocalNet(nn.Linear):
        pass

    return LocalNet(4, 2)


def _cartpole_spaces():
    import gymnasium as gym

    env = gym.make("CartPole-v1")
    return env.observation_space, env.action_space


NET = QNetwork(*_cartpole_spaces(), (8,))
REFUSALS = [  # (ParallelManager's arguments, the one line it answers)
    ({"parallel_config": {"num_workers": 0}}, "num_workers 0: must be an int >= 1"),
    ({"parallel_config": {"games_per_worker": 0}}, "games_per_worker 0: must be an int >= 1"),
    ({"parallel_config": {"timeout": 0}}, "timeout 0: must be a number > 0"),
    ({"parallel_config": {"timeout": -5.0}}, "timeout -5.0: must be a number > 0"),
    ({"parallel_config": {"num_workers": "4"}}, "num_workers '4' is a str; must be an int >= 1"),
    ({"parallel_config": {"games_per_worker": 2.0}}, "games_per_worker 2.0 is a float; must be an int"),
    ({"parallel_config": {"num_workers": True}}, "num_workers True is a bool; must be an int"),
    ({"parallel_config": {"timeout": "30"}}, "timeout '30' is a str; must be a number > 0"),
    ({"parallel_config": {"worker_reset_interval": -1}}, "worker_reset_interval -1: must be an int >= 0"),
    ({"parallel_config": {"compression_enabled": "yes"}}, "compression_enabled 'yes' is a str; must be a bool"),
    ({"parallel_config": {"compression_enabled": True}}, "compression_enabled=True is not supported: .*66.9 kB"),
    ({"parallel_config": [("num_workers", 2)]}, "parallel_config: must be a dict or a ManagerConfig"),
    ({"env_config": "CartPole-v1"}, "env_config: must be a dict or a WorkerSpec, not str"),
    ({"env_config": {"env_id": "CartPole-v1", "seed": "1"}}, "seed '1' is a str; must be an int"),
    ({"model_config": {"hidden_dim": "256"}}, "model_config: hidden_dim '256' is a str; must be an int >= 1"),
    ({"model_config": {"hidden_sizes": 64}}, "model_config: hidden_sizes 64 must be a list of ints >= 1"),
    ({"model": NET.state_dict()}, "model: must be a torch.nn.Module, not OrderedDict"),
    ({"model": _local_model()}, "model: LocalNet cannot be sent to a worker: .*LocalNet is defined inside a function"),
    ({"model": _Holder()}, "model: _Holder cannot be sent to a worker: cannot pickle '_thread.lock' object"),
    ({"model": NET, "act_fn": lambda model, obs, mask, eps, rng: obs}, "act_fn: .*<lambda> is defined inside a"),
    ({"model": NET, "act_fn": "argmax"}, "act_fn: must be a module-level function, not str"),
    ({"model": NET, "epsilon": 1.5}, "epsilon 1.5: must be in"),
    ({"model": nn.ReLU()}, "model: ReLU has no parameters"),
]


@pytest.mark.parametrize("kwargs, message", REFUSALS, ids=[message.split(":")[0][:40] for _, message in REFUSALS])
def test_what_cannot_work_is_refused_in_one_line_before_any_process_or_segment(kwargs, message):
    kwargs = {"env_config": CARTPOLE, "model_config": None, "parallel_config": {"num_workers": 2}, **kwargs}
    children = workers_alive()
    with pytest.raises(ValueError, match=message) as err:
        ParallelManager(kwargs.pop("env_config"), kwargs.pop("model_config"), kwargs.pop("parallel_config"), **kwargs)
    assert "\n" not in str(err.value)
    assert segments_of(os.getpid()) == [] and workers_alive() == children


def test_config_objects_refuse_too():
    with pytest.raises(ValueError, match="num_workers 0"):
        ManagerConfig(num_workers=0)
    config = ManagerConfig(num_workers=1)
    config.timeout = 0.0  # changed after it was checked: the manager checks again
    with pytest.raises(ValueError, match="timeout 0.0: must be a number > 0"):
        ParallelManager(WorkerSpec("CartPole-v1"), parallel_config=config, model=QNetwork(*_cartpole_spaces(), (8,)))
    with pytest.raises(ValueError, match="torch_threads 0"):
        WorkerSpec("CartPole-v1", torch_threads=0)
    assert segments_of(os.getpid()) == []


def test_a_class_of_an_interactive_main_is_refused(monkeypatch):
    """A notebook's or REPL's __main__ has no file a spawned worker could run to find the class."""
    interactive = types.ModuleType("__main__")
    net_class = type("NotebookNet", (nn.Linear,), {"__module__": "__main__"})
    interactive.NotebookNet = net_class
    monkeypatch.setitem(sys.modules, "__main__", interactive)
    with pytest.raises(ValueError, match="NotebookNet is defined in an interactive __main__"):
        ParallelManager(CARTPOLE, None, {"num_workers": 1}, model=net_class(4, 2))
    assert segments_of(os.getpid()) == []


@pytest.mark.timeout(60)
def test_python_c_main_is_refused_for_real():
    code = textwrap.dedent("""
        from torch import nn
        from common.parallel_manager import ParallelManager
        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.q = nn.Linear(4, 2)
            def forward(self, x):
                return self.q(x)
        try:
            ParallelManager({"env_id": "CartPole-v1"}, None, {"num_workers": 1}, model=Net())
        except ValueError as err:
            print(err)
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=script_env(), capture_output=True, text=True,
                         timeout=50)
    assert out.stdout.strip() == ("model: Net cannot be sent to a worker: __main__.Net is defined in an interactive "
                                  "__main__ (a notebook, the REPL, python -c), which a worker cannot import; move it "
                                  "into a .py module"), out.stderr


# ------------------------------------------------------------------ failures leak nothing

def test_a_failure_inside_the_constructor_leaves_no_segment(monkeypatch):
    def broken_supervisor(*args, **kwargs):
        raise OSError("no more processes")

    monkeypatch.setattr("common.parallel_manager.Supervisor", broken_supervisor)
    with pytest.raises(OSError, match="no more processes"):
        ParallelManager(CARTPOLE, None, {"num_workers": 1}, model=ActorCritic(4, 2))
    assert segments_of(os.getpid()) == []


@pytest.mark.timeout(60)
def test_the_supervisor_failing_inside_start_workers_leaves_nothing():
    m = ParallelManager(CARTPOLE, None, {"num_workers": 2, "timeout": 30.0}, model=ActorCritic(4, 2))
    assert len(segments_of(os.getpid())) == 3  # weights, versions, the model's pickle
    real_spawn = m.supervisor._spawn

    def spawn_one_then_fail(index):
        if index == 1:
            raise OSError("[Errno 11] Resource temporarily unavailable (fork)")
        real_spawn(index)

    m.supervisor._spawn = spawn_one_then_fail
    with pytest.raises(OSError, match="Resource temporarily unavailable"):
        m.start_workers()
    assert_nothing_left()  # worker 0, already started, was stopped; the segments are gone
    m.stop_workers()  # the caller's own finally: harmless
    with pytest.raises(RuntimeError, match="already stopped"):
        m.start_workers()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("model_class, message", [
    (BreaksInWorker, "worker 0 cannot rebuild the model: RuntimeError: this model cannot be rebuilt in a worker"),
    (ReturnsDict, "worker 0 cannot turn the model's output into actions for CartPole-v1: TypeError: the model "
                  "returned a dict"),
])
def test_a_worker_that_cannot_use_the_model_fails_start_workers_and_leaves_nothing(model_class, message):
    m = ParallelManager(CARTPOLE, None, {"num_workers": 1, "timeout": 30.0}, model=model_class(4, 2))
    with pytest.raises(WorkerConfigError, match=message):
        m.start_workers(wait=True)
    assert m.get_status()["total_restarts"] == 0  # a configuration error: no restart can fix it
    assert_nothing_left()


@pytest.mark.timeout(90)
def test_a_manager_nobody_stopped_is_stopped_when_the_interpreter_exits():
    """The user's code fails between start_workers and its try: the workers and segments go at exit all the same."""
    code = textwrap.dedent("""
        import os
        from common.parallel_manager import ParallelManager
        m = ParallelManager({"env_id": "CartPole-v1"}, {"hidden_sizes": [8]}, {"num_workers": 1, "timeout": 30.0})
        m.start_workers(wait=True)
        print(os.getpid(), *m.pids(), flush=True)
        raise RuntimeError("the user's loop failed before stop_workers")
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=script_env(), capture_output=True, text=True,
                         timeout=80)
    pid, worker = map(int, out.stdout.split())
    assert out.returncode == 1 and "the user's loop failed" in out.stderr
    assert segments_of(pid) == [] and "leaked shared_memory" not in out.stderr
    assert not psutil.pid_exists(worker) or psutil.Process(worker).status() == psutil.STATUS_ZOMBIE


# ------------------------------------------------------------------ the knobs

@pytest.mark.timeout(90)
def test_worker_reset_interval_gives_workers_fresh_envs_every_n_games():
    """worker_reset_interval=4, 2 games a batch: fresh envs after every second batch, without the learner asking."""
    m = ParallelManager(CARTPOLE, None, {"num_workers": 1, "games_per_worker": 2, "worker_reset_interval": 4,
                                         "timeout": 30.0}, model=QNetwork(*_cartpole_spaces(), (8,)))
    try:
        m.start_workers()
        batches = []
        while len(batches) < 6:
            batches += [b for b in m.collect_experiences() if b.last]
        assert [b.env_resets for b in batches[:6]] == [0, 0, 1, 1, 2, 2]
        assert m.get_status()["workers"][0]["env_resets"] == batches[-1].env_resets
    finally:
        m.stop_workers()


def test_compression_is_refused_with_its_numbers_and_false_is_accepted():
    """zlib shrinks a ConnectFour batch (the bytes measured here; the CPU it costs, by the benchmark), but
    the pipe it would shrink is local: True is refused with the numbers, seed 004's key stays as False."""
    vec = make_vec_env("ConnectFour-v0", 16, 0, opponent="random")
    episodes, steps_taken = play_episodes(vec, lambda obs, masks: masks.argmax(axis=1), 16, record=True, seed=1)
    vec.close()
    batch = ExperienceBatch(0, 1, 0.1, episodes, steps_taken, 0.0)
    data = pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL)
    assert len(data) > 8 * len(zlib.compress(data, 1))  # 66.9 kB -> 5.5 kB on the benchmark's batch
    with pytest.raises(ValueError, match=r"zlib costs more CPU than the bytes it saves .*66.9 kB -> 5.5 kB"):
        ManagerConfig(compression_enabled=True)
    assert ManagerConfig(compression_enabled=False).compression_enabled is False


def test_should_sync_counts_a_sync_without_a_step_at_the_last_known_step():
    model = QNetwork(*_cartpole_spaces(), (8,))
    n = sum(p.numel() for p in model.parameters())
    sync = ModelSynchronizer(SharedParams({"params": np.zeros((1, n), np.float32),
                                           "versions": np.zeros((1, 2), np.int64)}), model_sync_interval=10)
    sync.publish(model)  # no step known yet: counts as none
    assert sync.should_sync(3)
    sync.publish(model)  # counts at step 3, the last should_sync asked about
    assert not sync.should_sync(12) and sync.should_sync(13)
    sync.publish(model, learner_step=20)
    assert not sync.should_sync(29) and sync.should_sync(30)
    assert sync.should_sync(35)
    sync.publish(model)  # counts at 35
    assert not sync.should_sync(44) and sync.should_sync(45)

    m = ParallelManager(CARTPOLE, None, {"num_workers": 1, "model_sync_interval": 5}, model=model)
    try:  # the same through the manager: sync_model_to_workers() with no argument after a should_sync
        assert m.synchronizer.should_sync(40)
        assert m.sync_model_to_workers() == 1
        assert not m.synchronizer.should_sync(44) and m.synchronizer.should_sync(45)
        with pytest.raises(ValueError, match="does not have the parameter shapes of the workers' QNetwork"):
            m.sync_model_to_workers(QNetwork(*_cartpole_spaces(), (16,)))
    finally:
        m.stop_workers()
    assert m.model_version == 1 and m.get_status()["model_version"] == 1  # answers after the segments are gone
