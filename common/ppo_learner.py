"""The PPO learner, one interface for both PPO scripts: which learner runs, its hyperparameters, its methods.

Two learners implement :class:`PPOLearner`. The torch learner (``common.ppo.TorchLearner``:
``common.networks.ActorCritic``, ``common.optim.FusedAdam``, the clipped-surrogate update) is the
reference; it learns any policy on any device, and averages gradients across ranks under torchrun.
The numpy learner (``common.numpy_ppo.NumpyLearner``) is the fast path for an MLP policy on the CPU:
the same network, loss and Adam step, checked against torch's by tests/test_numpy_ppo.py, without
torch's per-operation overhead and without importing torch (docs/performance.md, "The numpy learner").
Both write the same checkpoint (``model``, ``optimizer``, ``policy``), so a run resumes with either.

:func:`choose_learner` is the one place that decides between them (``--learner auto|numpy|torch``);
:func:`make_learner` builds the chosen one and imports only its own module. A seed does not give
the two learners the same initial weights: each draws ``ActorCritic``'s initialization with its
own library's generator (docs/train_parallel_timed.md, "The learner").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from common.config import ConfigError
from common.numpy_actor_critic import acts_in_numpy

LEARNERS = ("auto", "numpy", "torch")


@dataclass
class PPOSettings:
    """The hyperparameters of a PPO update, for either learner (common.ppo, common.numpy_ppo)."""

    n_epochs: int
    minibatch_size: int
    clip_coef: float
    clip_vloss: bool
    ent_coef: float
    vf_coef: float
    max_grad_norm: float
    norm_adv: bool = True
    target_kl: float | None = None
    # Decoupled PPO (Hilton et al., 2021), for rollouts collected by a policy older than the learner's
    # (train_parallel_timed.py --async-training): the ratio is clipped around the policy as the update starts
    # (the proximal policy, whose log-probabilities the learner computes first), and each sample's advantage is
    # weighted by proximal / behaviour probability, capped at PROXIMAL_WEIGHT_CAP. The trust region is then
    # centred where the learner is, not one update back, while the gradient stays that of the proximal policy.
    decoupled: bool = False


PROXIMAL_WEIGHT_CAP = 2.0  # bounds a sample whose action the behaviour policy found unlikely (V-trace's rho-bar idea)


class PPOLearner:
    """What a script does with its learner, whichever it is; the two learners derive from this class.

    ``name`` ("numpy" or "torch") and ``device`` (``str()`` of it: "cpu", "cuda:0") are what the run
    reports (the log line, summary.json's ``learner`` and ``device``); ``spec`` is the policy's
    description (a checkpoint's ``policy``); ``settings`` the :class:`PPOSettings` of the next update
    (a script may replace them between updates, as PBT does). ``model`` and ``optimizer`` are the
    network and its Adam, each with ``state_dict``/``load_state_dict`` in torch's layout.
    """

    name: str
    device: object
    spec: dict
    settings: PPOSettings

    @property
    def learning_rate(self) -> float:
        """Adam's step size for the next update (set it to anneal)."""
        return self.optimizer.param_groups[0]["lr"]

    @learning_rate.setter
    def learning_rate(self, value: float) -> None:
        self.optimizer.param_groups[0]["lr"] = value

    @property
    def cpu_agent(self):
        """The learner's own torch network where it is one on the CPU (a rollout of an image policy in this
        process acts with it rather than a copy), else None."""
        return None

    def update(self, batch: dict[str, np.ndarray], after_epoch: Callable[[int], None] | None = None) -> dict:
        """``n_epochs`` passes of minibatch PPO over a flat numpy batch (``common.gae.flat_batch``); the
        statistics of the last epoch. ``after_epoch(e)`` runs after the e-th pass (1-based)."""
        raise NotImplementedError

    def seed_minibatches(self, seed: int) -> None:
        """Draw the minibatches' order from a generator seeded with ``seed`` from now on (a resumed run
        seeds it by the updates it has done)."""
        raise NotImplementedError

    def publish(self, out: np.ndarray) -> None:
        """Write the parameters into the flat float32 array ``out`` (``networks.write_flat_params``'s layout)."""
        raise NotImplementedError

    def acting(self, seed: int):
        """How a rollout in this process acts with the current parameters (``common.rollout.RolloutCollector``'s
        ``acting``): in numpy for an MLP policy, else with a CPU torch network kept in step with the learner."""
        raise NotImplementedError

    def torch_network(self):
        """The policy as a ``common.networks.ActorCritic`` on the CPU with the current parameters (an evaluation
        plays with it): the torch learner's own network, or the CPU copy that acts for it; the numpy learner's
        weights in a new one."""
        raise NotImplementedError

    def finite(self) -> bool:
        """Whether every parameter is finite (an update that diverged leaves them NaN)."""
        raise NotImplementedError

    def params_digest(self) -> str:
        """A digest of the parameters to compare across ranks; "" where there is one learner."""
        return ""

    def state_dict(self) -> dict:
        """The checkpoint's ``model``, ``optimizer`` and ``policy`` entries."""
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(), "policy": self.spec}

    def load_state_dict(self, state: dict) -> None:
        """Load a checkpoint's ``model`` and ``optimizer`` entries (written by either learner)."""
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])


def numpy_learner_fits(device: str, observation_space, world_size: int = 1) -> bool:
    """Whether the numpy learner can learn this policy: an MLP (vector observations) on the CPU, in one
    process (under DD-PPO torch.distributed averages the gradients of ``world_size`` ranks)."""
    return device == "cpu" and acts_in_numpy(observation_space) and world_size == 1


def choose_learner(requested: str, device: str, observation_space, world_size: int | None = None) -> str:
    """The learner that runs for ``--learner requested`` (auto, numpy or torch) with the policy on ``device``
    (resolved: "cpu", "cuda:0"): auto is numpy where it fits (:func:`numpy_learner_fits`), else torch.

    ``world_size`` is the number of ranks whose gradients every update averages (DD-PPO), or None where each
    process learns alone. ``numpy`` where it does not fit is a :class:`common.config.ConfigError` (exit 2,
    before anything is written).
    """
    fits = numpy_learner_fits(device, observation_space, world_size or 1)
    if requested == "numpy" and not fits:
        if world_size is None:
            raise ConfigError("learner", requested, "numpy learns an MLP policy (vector observations) on the CPU; "
                              "use torch or auto for images or a GPU")
        raise ConfigError("learner", requested, "numpy learns an MLP policy (vector observations) on the CPU "
                          "in one process; use torch or auto for images, a GPU or torchrun")
    return "numpy" if requested == "numpy" or (requested == "auto" and fits) else "torch"


def make_learner(name: str, observation_space, action_space, network, learning_rate: float, settings: PPOSettings,
                 seed: int, shuffle_seed: int, device: str = "cpu", dist=None, state: dict | None = None) -> PPOLearner:
    """The learner ``name`` (:func:`choose_learner`'s answer) for the ``ActorCritic`` policy of these spaces that
    ``network`` describes (its ``hidden_sizes``, ``activation`` and ``log_std_init``: a PPO script's config).

    ``seed`` draws the initial weights, ``shuffle_seed`` the minibatches' order; ``state``, a checkpoint to
    continue from, replaces the weights and Adam's state. The torch learner is on ``device``; with ``dist``
    (``common.distributed``) on the rank's device, starting from rank 0's weights and averaging gradients
    across ranks before every step. Adam's epsilon is 1e-5, as in CleanRL's PPO.
    """
    args = (observation_space, action_space, tuple(network.hidden_sizes), network.activation, network.log_std_init,
            learning_rate, settings, seed, shuffle_seed)
    if name == "numpy":
        from common.numpy_ppo import NumpyLearner

        return NumpyLearner(*args, state=state)
    from common.ppo import TorchLearner

    return TorchLearner(*args, device=device, dist=dist, state=state)
