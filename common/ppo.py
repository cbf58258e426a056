"""PPO with torch, the reference learner: the clipped-surrogate update (:func:`ppo_update`), the learner that
runs it behind ``common.ppo_learner.PPOLearner`` (:class:`TorchLearner`), and acting with a torch network.

A rollout (``common.rollout``) becomes a flat numpy batch through GAE (``common.gae.flat_batch``), and
reaches :func:`ppo_update` through :func:`as_tensors`. ``common.numpy_ppo`` is the same update in numpy,
checked against this one by tests/test_numpy_ppo.py.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from common import networks
from common.distributed import params_digest
from common.network_spec import space_from_spec
from common.numpy_actor_critic import NumpyActing
from common.optim import FusedAdam
from common.ppo_learner import PROXIMAL_WEIGHT_CAP, PPOLearner, PPOSettings


class TorchActing:
    """The rollout step done by the torch network itself (images, and anything not an MLP).

    With ``params`` (a flat parameter vector's source, as for ``common.numpy_actor_critic.NumpyActing``)
    the network is a copy that loads them before every rollout; without, it is the learner itself.
    """

    def __init__(self, agent, params: Callable[[], np.ndarray] | None = None):
        self.agent, self.params = agent, params

    def refresh(self) -> None:
        if self.params is not None:
            networks.read_flat_params(self.agent, self.params())

    @torch.inference_mode()
    def act(self, obs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        action, logprob, value = self.agent.act(_tensor(obs))
        return action.numpy(), logprob.numpy(), value.numpy()

    @torch.inference_mode()
    def value(self, obs: np.ndarray) -> np.ndarray:
        return self.agent.get_value(_tensor(obs)).numpy()


def _tensor(obs: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(obs if obs.dtype in (np.float32, np.uint8) else obs.astype(np.float32))


def acting_for(agent, seed: int):
    """How a rollout acts with the CPU network ``agent``: in numpy from a copy of its weights for an MLP
    (:class:`common.numpy_actor_critic.NumpyActing`), else with the network itself."""
    if not isinstance(agent.trunk, networks.Flat):
        return TorchActing(agent)
    spec = agent.spec

    def params() -> np.ndarray:
        return nn.utils.parameters_to_vector(agent.parameters()).detach().numpy()

    return NumpyActing(space_from_spec(spec["observation_space"]), space_from_spec(spec["action_space"]),
                       spec["hidden_sizes"], spec["activation"], params, seed)


def as_tensors(batch: dict[str, np.ndarray], device) -> dict[str, torch.Tensor]:
    """A flat numpy batch (``common.gae.flat_batch``) as tensors on ``device``."""
    return {key: torch.as_tensor(array).to(device) for key, array in batch.items()}


def ppo_update(agent: nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, torch.Tensor],
               settings: PPOSettings, generator: torch.Generator | None = None,
               after_backward: Callable[[], None] | None = None,
               after_epoch: Callable[[int], None] | None = None) -> dict[str, float]:
    """``n_epochs`` passes of minibatch PPO over a flat batch; returns the last epoch's statistics.

    ``batch`` holds ``obs, actions, logprobs, advantages, returns, values`` with the
    sample dimension first. ``after_backward`` runs between ``backward()`` and the
    optimizer step (distributed training averages gradients there); ``after_epoch(e)`` after
    the e-th pass (1-based; train_parallel_timed.py publishes the parameters there).
    """
    size, device = batch["obs"].shape[0], batch["obs"].device
    # summed on the batch's device and read once at the end: no per-minibatch sync with a GPU
    clipped, minibatches = torch.zeros((), device=device), 0
    approx_kl = old_approx_kl = pg_loss = v_loss = entropy_loss = torch.zeros(())
    old_logprobs, weights = batch["logprobs"], None
    if settings.decoupled:  # (common.ppo_learner.PPOSettings)
        with torch.no_grad():
            step = settings.minibatch_size
            chunks = [slice(start, start + step) for start in range(0, size, step)]
            old_logprobs = torch.cat([agent.get_action_and_value(batch["obs"][chunk], batch["actions"][chunk])[1]
                                      for chunk in chunks])
            weights = (old_logprobs - batch["logprobs"]).exp().clamp(max=PROXIMAL_WEIGHT_CAP)
    for epoch in range(settings.n_epochs):
        # drawn on the CPU (the seeded generator's stream is the same on any device), indexed on the batch's
        order = torch.randperm(size, generator=generator).to(device)
        for start in range(0, size, settings.minibatch_size):
            mb_inds = order[start:start + settings.minibatch_size]
            _, newlogprob, entropy, newvalue = agent.get_action_and_value(
                batch["obs"][mb_inds], batch["actions"][mb_inds])
            logratio = newlogprob - old_logprobs[mb_inds]
            ratio = logratio.exp()
            with torch.no_grad():
                old_approx_kl = (-logratio).mean()
                approx_kl = ((ratio - 1) - logratio).mean()
                clipped += ((ratio - 1.0).abs() > settings.clip_coef).float().mean()
                minibatches += 1

            mb_advantages = batch["advantages"][mb_inds]
            if settings.norm_adv and mb_advantages.numel() > 1:
                mb_advantages = (mb_advantages - mb_advantages.mean()) / (mb_advantages.std() + 1e-8)
            if weights is not None:
                mb_advantages = mb_advantages * weights[mb_inds]
            pg_loss1 = -mb_advantages * ratio
            pg_loss2 = -mb_advantages * torch.clamp(ratio, 1 - settings.clip_coef, 1 + settings.clip_coef)
            pg_loss = torch.max(pg_loss1, pg_loss2).mean()

            mb_returns = batch["returns"][mb_inds]
            if settings.clip_vloss:
                mb_values = batch["values"][mb_inds]
                v_clipped = mb_values + torch.clamp(newvalue - mb_values, -settings.clip_coef, settings.clip_coef)
                v_loss = 0.5 * torch.max((newvalue - mb_returns) ** 2, (v_clipped - mb_returns) ** 2).mean()
            else:
                v_loss = 0.5 * ((newvalue - mb_returns) ** 2).mean()

            entropy_loss = entropy.mean()
            loss = pg_loss - settings.ent_coef * entropy_loss + settings.vf_coef * v_loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if after_backward is not None:
                after_backward()
            nn.utils.clip_grad_norm_(agent.parameters(), settings.max_grad_norm)
            optimizer.step()
        if after_epoch is not None:
            after_epoch(epoch + 1)
        if settings.target_kl is not None and approx_kl.item() > settings.target_kl:
            break

    returns, values = batch["returns"], batch["values"]
    explained_var = float("nan")
    var_returns = returns.var().item()
    if var_returns > 0:
        explained_var = 1.0 - (returns - values).var().item() / var_returns
    return {"policy_loss": pg_loss.item(), "value_loss": v_loss.item(), "entropy": entropy_loss.item(),
            "approx_kl": approx_kl.item(), "old_approx_kl": old_approx_kl.item(),
            "clipfrac": clipped.item() / max(1, minibatches), "explained_variance": explained_var}


class TorchLearner(PPOLearner):
    """The torch learner: ``common.networks.ActorCritic`` and ``common.optim.FusedAdam`` on ``device``, built by
    ``common.ppo_learner.make_learner``. With ``dist`` (``common.distributed``, under torchrun) it learns on the
    rank's device (the one its process group reduces on: cuda:LOCAL_RANK with NCCL, whatever GPU ``device``
    names), starts from rank 0's weights and averages the gradients across ranks before every step."""

    name = "torch"

    def __init__(self, observation_space, action_space, hidden: tuple[int, ...], activation: str,
                 log_std_init: float, learning_rate: float, settings: PPOSettings, seed: int, shuffle_seed: int,
                 device: str = "cpu", dist=None, state: dict | None = None):
        torch.manual_seed(seed)
        self.device = getattr(dist, "device", None) or torch.device(device)
        self.model = networks.ActorCritic(observation_space, action_space, hidden, activation, log_std_init)
        self.model.to(self.device)
        self.spec = self.model.spec
        # Adam's fused kernel, without torch.optim's 1.6 s import of the compiler (common/optim.py)
        self.optimizer = FusedAdam(self.model.parameters(), lr=learning_rate, eps=1e-5)
        self.actor: nn.Module | None = None  # the CPU network that acts (torch_network())
        if state is not None:
            self.load_state_dict(state)
        self.dist, self.after_backward = dist, None
        if dist is not None:
            dist.broadcast_model(self.model)
            self.after_backward = dist.gradient_hook(self.model)
        self.settings = settings
        self.seed_minibatches(shuffle_seed)

    @property
    def cpu_agent(self) -> nn.Module | None:
        return self.model if self.device.type == "cpu" else None

    def update(self, batch: dict[str, np.ndarray], after_epoch: Callable[[int], None] | None = None) -> dict:
        stats = ppo_update(self.model, self.optimizer, as_tensors(batch, self.device), self.settings,
                           self.generator, self.after_backward, after_epoch)
        self._sync_actor()
        return stats

    def seed_minibatches(self, seed: int) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def publish(self, out: np.ndarray) -> None:
        networks.write_flat_params(self.model, out)

    def acting(self, seed: int):
        return acting_for(self.torch_network(), seed)

    def torch_network(self) -> nn.Module:
        # Rollouts step a few observations at a time, where a GPU only adds latency: act with a CPU copy.
        if self.actor is None:
            self.actor = self.model if self.device.type == "cpu" else copy.deepcopy(self.model).cpu()
        return self.actor

    def finite(self) -> bool:
        return all(bool(torch.isfinite(p).all()) for p in self.model.parameters())

    def params_digest(self) -> str:
        return params_digest(self.model) if self.dist is not None and self.dist.world_size > 1 else ""

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self._sync_actor()

    def _sync_actor(self) -> None:
        if self.actor is not None and self.actor is not self.model:
            self.actor.load_state_dict(self.model.state_dict())
