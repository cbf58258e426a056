"""The numpy PPO learner against the torch one (common/numpy_ppo.py, common/numpy_actor_critic.py, common/ppo.py,
common/ppo_learner.py): the hand-written backward pass and Adam must do what autograd and FusedAdam do,
checkpoints must move between the two learners, and both stand behind one interface, chosen in one place.

Promises checked (docs/train_parallel_timed.md, "The learner"): the numpy learner computes the same loss,
gradients and Adam steps as the torch one; its ``state_dict`` loads into ``ActorCritic`` and back; it
starts from ActorCritic's initialization (orthogonal weights with its gains, zero biases).
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch

from common import numpy_ppo, ppo
from common.checkpoint import load_checkpoint, save_checkpoint
from common.config import ConfigError
from common.network_spec import actor_critic_spec
from common.networks import ActorCritic
from common.numpy_actor_critic import MLPActorCritic, NumpyActing, forward, split_flat
from common.optim import FusedAdam
from common.ppo_learner import PPOSettings, choose_learner, make_learner

DISCRETE = gym.spaces.Box(-5, 5, (6,), np.float32), gym.spaces.Discrete(3)
CONTINUOUS = gym.spaces.Box(-5, 5, (5,), np.float32), gym.spaces.Box(-1, 1, (2,), np.float32)


def pair(spaces, activation="tanh", hidden=(16, 8), seed=0):
    spec = actor_critic_spec(*spaces, hidden, activation, -0.3)
    model = MLPActorCritic(spec, *spaces, seed)
    agent = ActorCritic(*spaces, hidden, activation, -0.3)
    agent.load_state_dict({k: torch.from_numpy(v) for k, v in model.state_dict().items()})
    return model, agent


def batch_for(spaces, size=64, seed=1):
    rng = np.random.default_rng(seed)
    obs = rng.standard_normal((size, spaces[0].shape[0])).astype(np.float32)
    if hasattr(spaces[1], "n"):
        actions = rng.integers(0, spaces[1].n, size)
        logprobs = np.log(rng.uniform(0.2, 0.5, size)).astype(np.float32)
    else:
        actions = rng.standard_normal((size, spaces[1].shape[0])).astype(np.float32)
        logprobs = rng.normal(-2.5, 0.5, size).astype(np.float32)
    values = rng.standard_normal(size).astype(np.float32)
    return {"obs": obs, "actions": actions, "logprobs": logprobs, "values": values,
            "advantages": rng.standard_normal(size).astype(np.float32),
            "returns": (values + rng.standard_normal(size)).astype(np.float32)}


def settings(**changes):
    fields = dict(n_epochs=1, minibatch_size=64, clip_coef=0.2, clip_vloss=False, ent_coef=0.01, vf_coef=0.5,
                  max_grad_norm=1e9)
    return PPOSettings(**{**fields, **changes})


def torch_gradients(agent, batch, ppo_settings):
    """The gradient of ppo_update's loss on the whole batch as one minibatch, as torch computes it."""
    captured = {}

    class Capture:
        param_groups = [{"lr": 0.0}]

        def zero_grad(self, set_to_none=True):
            agent.zero_grad(set_to_none=True)

        def step(self):
            pass

    def grab():
        captured.update({name: p.grad.detach().numpy().copy() for name, p in agent.named_parameters()})

    stats = ppo.ppo_update(agent, Capture(), {k: torch.as_tensor(v) for k, v in batch.items()}, ppo_settings,
                           after_backward=grab)
    return captured, stats


@pytest.mark.parametrize("spaces,activation,clip_vloss,norm_adv", [
    (DISCRETE, "tanh", False, True), (DISCRETE, "relu", True, False),
    (CONTINUOUS, "tanh", True, True), (CONTINUOUS, "relu", False, True)])
def test_gradients_and_statistics_match_torch_autograd(spaces, activation, clip_vloss, norm_adv):
    model, agent = pair(spaces, activation)
    batch = batch_for(spaces)
    # Move the learner away from the old policy, so that the ratio is clipped for some samples.
    model.params += np.random.default_rng(3).normal(0, 0.2, model.params.shape).astype(np.float32)
    agent.load_state_dict({k: torch.from_numpy(v) for k, v in model.state_dict().items()})
    ppo_settings = settings(clip_vloss=clip_vloss, norm_adv=norm_adv)
    want, torch_stats = torch_gradients(agent, batch, ppo_settings)

    stats = numpy_ppo.loss_and_gradients(model, batch["obs"], batch["actions"], batch["logprobs"],
                                         batch["advantages"], batch["returns"], batch["values"], ppo_settings)
    assert 0.05 < stats["clipped"] < 0.95  # both branches of the clipped surrogate are exercised
    got = dict(zip(model.names, split_flat(model.grads, model.shapes)))
    assert set(got) == set(want)
    for name, grad in want.items():
        np.testing.assert_allclose(got[name], grad, rtol=2e-4, atol=2e-6, err_msg=name)
    for key in ("policy_loss", "value_loss", "entropy", "approx_kl", "old_approx_kl"):
        assert stats[key] == pytest.approx(torch_stats[key], rel=1e-4, abs=1e-6), key


@pytest.mark.parametrize("spaces", [DISCRETE, CONTINUOUS])
def test_a_decoupled_update_changes_only_what_an_older_policy_collected(spaces):
    """On samples of the learner's own policy the proximal policy is the behaviour policy and every weight is 1:
    the decoupled update is the plain one. On samples of another policy it is not."""
    def updated(batch, decoupled):
        model, _ = pair(spaces)
        optimizer = numpy_ppo.Adam(model.params, model.grads, model.shapes, lr=3e-3, eps=1e-5)
        numpy_ppo.ppo_update(model, optimizer, batch, settings(n_epochs=3, decoupled=decoupled),
                             np.random.default_rng(0))
        return model.params

    older = batch_for(spaces)
    own = {**older, "logprobs": pair(spaces)[0].logprobs(older["obs"], older["actions"]).astype(np.float32)}
    np.testing.assert_allclose(updated(own, True), updated(own, False), rtol=1e-5, atol=1e-6)
    assert np.abs(updated(older, True) - updated(older, False)).max() > 1e-3


@pytest.mark.parametrize("decoupled", [False, True])
@pytest.mark.parametrize("spaces", [DISCRETE, CONTINUOUS])
def test_updates_with_clipping_and_adam_match_the_torch_learner(spaces, decoupled):
    """Three epochs over one minibatch (so the sample order cannot differ), gradient clipping active,
    Adam at 3e-3: the parameters and Adam's moments stay within float32 noise of the torch learner's,
    also decoupled (the ratio around the policy as the update starts, capped importance weights)."""
    model, agent = pair(spaces)
    batch = batch_for(spaces)
    ppo_settings = settings(n_epochs=3, max_grad_norm=0.1, decoupled=decoupled)
    optimizer = numpy_ppo.Adam(model.params, model.grads, model.shapes, lr=3e-3, eps=1e-5)
    epochs_seen = {"numpy": [], "torch": []}  # train_parallel_timed.py publishes the parameters after each
    stats = numpy_ppo.ppo_update(model, optimizer, batch, ppo_settings, np.random.default_rng(0),
                                 epochs_seen["numpy"].append)
    torch_optimizer = FusedAdam(agent.parameters(), lr=3e-3, eps=1e-5)
    torch_stats = ppo.ppo_update(agent, torch_optimizer, {k: torch.as_tensor(v) for k, v in batch.items()},
                                 ppo_settings, after_epoch=epochs_seen["torch"].append)
    assert epochs_seen == {"numpy": [1, 2, 3], "torch": [1, 2, 3]}
    for name, value in agent.state_dict().items():
        np.testing.assert_allclose(model.state_dict()[name], value.numpy(), rtol=1e-4, atol=1e-5, err_msg=name)
    for key in ("policy_loss", "value_loss", "clipfrac", "explained_variance"):
        assert stats[key] == pytest.approx(torch_stats[key], rel=1e-3, abs=1e-5), key
    # Adam's state moves across: numpy -> torch -> numpy, moments and step count intact.
    saved = optimizer.state_dict()
    assert saved["state"][0]["step"] == 3
    as_tensors = {"state": {i: {k: torch.as_tensor(v) for k, v in s.items()} for i, s in saved["state"].items()},
                  "param_groups": saved["param_groups"]}
    fresh = FusedAdam(ActorCritic(*spaces, (16, 8), "tanh", -0.3).parameters(), lr=1.0)
    fresh.load_state_dict(as_tensors)
    back = numpy_ppo.Adam(np.zeros_like(model.params), np.zeros_like(model.grads), model.shapes, lr=1.0)
    back.load_state_dict(fresh.state_dict())
    assert back.steps == 3 and back.param_groups[0]["lr"] == 3e-3
    np.testing.assert_array_equal(back.exp_avg_sq, optimizer.exp_avg_sq)
    for torch_state, numpy_m in zip(torch_optimizer.exp_avg, split_flat(optimizer.exp_avg, model.shapes)):
        np.testing.assert_allclose(numpy_m, torch_state.numpy(), rtol=1e-3, atol=1e-6)


def test_initialization_is_actor_critics_and_state_dicts_interchange():
    spaces = CONTINUOUS
    spec = actor_critic_spec(*spaces, (16, 8), "tanh", -0.3)
    model = MLPActorCritic(spec, *spaces, seed=5)
    agent = ActorCritic(*spaces, (16, 8), "tanh", -0.3)
    state = model.state_dict()
    assert list(state) == list(agent.state_dict())  # same names, same order (the flat parameter layout)
    for name, value in agent.state_dict().items():
        assert state[name].shape == tuple(value.shape) and state[name].dtype == np.float32
    gains = {"critic.0": 2 ** 0.5, "critic.2": 2 ** 0.5, "critic.4": 1.0, "actor.4": 0.01}
    for layer, gain in gains.items():
        weight = state[f"{layer}.weight"].astype(np.float64)
        rows, cols = weight.shape
        gram = weight @ weight.T if rows <= cols else weight.T @ weight
        np.testing.assert_allclose(gram, gain ** 2 * np.eye(min(rows, cols)), atol=1e-5)
        assert not state[f"{layer}.bias"].any()
    np.testing.assert_array_equal(state["actor_logstd"], np.full((1, 2), -0.3, np.float32))
    assert not np.array_equal(state["critic.0.weight"],
                              MLPActorCritic(spec, *spaces, seed=6).state_dict()["critic.0.weight"])
    # torch -> numpy: the same network acts the same
    agent.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()})
    trained = ActorCritic(*spaces, (16, 8), "tanh", -0.3)
    model.load_state_dict(trained.state_dict())
    obs = np.random.default_rng(0).standard_normal((4, 5)).astype(np.float32)
    with torch.no_grad():
        np.testing.assert_allclose(forward(obs, model.critic, model.tanh)[-1][:, 0],
                                   trained.get_value(torch.from_numpy(obs)).numpy(), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="not"):
        model.load_state_dict({"critic.0.weight": np.zeros((16, 5))})


def test_the_learner_is_chosen_in_one_place():
    """--learner auto is numpy for an MLP on the CPU in one process, else torch; numpy where it cannot learn
    is refused (exit 2 before anything is written), in the words of the script that asked."""
    vector, image = DISCRETE[0], gym.spaces.Box(0, 255, (4, 84, 84), np.uint8)
    assert choose_learner("auto", "cpu", vector, 1) == "numpy"
    assert choose_learner("auto", "cpu", vector) == "numpy"  # a population member learns alone
    for device, space, world_size in (("cuda:0", vector, 1), ("cpu", image, 1), ("cpu", vector, 2)):
        assert choose_learner("auto", device, space, world_size) == "torch"
        assert choose_learner("torch", device, space, world_size) == "torch"
        with pytest.raises(ConfigError, match="a GPU or torchrun"):
            choose_learner("numpy", device, space, world_size)
    assert choose_learner("torch", "cpu", vector, 1) == "torch"
    with pytest.raises(ConfigError, match="for images or a GPU$"):
        choose_learner("numpy", "cuda:0", vector)


class Network:  # a PPO script's config, as far as make_learner reads it
    hidden_sizes, activation, log_std_init = [16, 8], "tanh", -0.3


@pytest.mark.parametrize("spaces", [DISCRETE, CONTINUOUS])
def test_both_learners_stand_behind_one_interface(spaces, tmp_path):
    """Built by make_learner, either learner updates on a flat numpy batch, publishes its flat parameters (which
    numpy acting reads), takes a learning rate, gives a torch network to evaluate with, and writes a checkpoint
    the other one loads and continues from."""
    learners = {name: make_learner(name, *spaces, Network, 3e-3, settings(n_epochs=2), seed=0,
                                   shuffle_seed=0) for name in ("numpy", "torch")}
    batch = batch_for(spaces)
    numpy_learner, torch_learner = learners["numpy"], learners["torch"]
    assert (numpy_learner.name, str(numpy_learner.device)) == ("numpy", "cpu")
    assert (torch_learner.name, str(torch_learner.device)) == ("torch", "cpu")
    assert numpy_learner.spec == torch_learner.spec
    def through_a_file(state: dict) -> dict:  # as a run saves and resumes
        return load_checkpoint(save_checkpoint(state, tmp_path / "learner.pt"))

    torch_learner.load_state_dict(through_a_file(numpy_learner.state_dict()))  # one start, so the updates compare
    for learner in learners.values():
        learner.seed_minibatches(7)
        learner.learning_rate = 1e-3
        assert learner.learning_rate == 1e-3
        epochs = []
        stats = learner.update(batch, epochs.append)
        assert epochs == [1, 2] and set(stats) >= {"policy_loss", "value_loss", "clipfrac", "explained_variance"}
        assert learner.finite() and learner.params_digest() == ""
    published = {}
    for name, learner in learners.items():
        published[name] = np.zeros(numpy_learner.model.params.size, np.float32)
        learner.publish(published[name])
    np.testing.assert_allclose(published["numpy"], published["torch"], rtol=1e-4, atol=1e-5)
    # numpy acting reads what either publishes, and acts as the learner's own acting does
    obs = batch["obs"][:8]
    from_published = NumpyActing(*spaces, Network.hidden_sizes, Network.activation, lambda: published["numpy"], 1)
    np.testing.assert_array_equal(from_published.value(obs), numpy_learner.acting(1).value(obs))
    np.testing.assert_allclose(torch_learner.acting(1).value(obs), from_published.value(obs), rtol=1e-4, atol=1e-5)
    # an evaluation plays with a torch network of the current parameters: the torch learner's own on the CPU
    assert torch_learner.torch_network() is torch_learner.model
    for learner in learners.values():
        with torch.no_grad():
            values = learner.torch_network().get_value(torch.as_tensor(obs, dtype=torch.float32)).numpy()
        np.testing.assert_allclose(values, from_published.value(obs), rtol=1e-4, atol=1e-5)
    # a checkpoint of either continues in the other
    state = torch_learner.state_dict()
    assert set(state) == {"model", "optimizer", "policy"}
    numpy_learner.load_state_dict(through_a_file(state))
    np.testing.assert_array_equal(numpy_learner.model.params, published["torch"])
    assert numpy_learner.optimizer.steps == torch_learner.optimizer.steps[0].item() == 2  # one minibatch an epoch
