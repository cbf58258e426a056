"""PPO in numpy for an MLP actor-critic: the fast path of a run whose policy is an MLP on the CPU.

An MLP policy's update is a few dozen small matrix products per minibatch, where torch spends
more time dispatching operations and recording the autograd graph than computing: a LunarLander
update (16 minibatches of 256, 4 epochs) took 143 ms with torch and 65 ms here, medians on a
2-core machine (docs/performance.md, "The numpy learner"). And a process that learns in numpy
never imports torch (1.4 s on that machine): it writes its checkpoints without it
(common/torch_file.py).

It is ``common.ppo``'s algorithm, term by term: :func:`loss_and_gradients` is ``common.ppo.ppo_update``'s
loss with its gradient written out by hand (through ``common.numpy_actor_critic.MLPActorCritic``'s
backward pass), :func:`ppo_update` its epochs and minibatches, and :class:`Adam` the arithmetic of
``common.optim.FusedAdam``. tests/test_numpy_ppo.py checks all three against torch.
:class:`NumpyLearner` puts them behind ``common.ppo_learner.PPOLearner``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from common.network_spec import actor_critic_spec
from common.numpy_actor_critic import LOG_SQRT_2PI, MLPActorCritic, NumpyActing, forward, split_flat
from common.ppo_learner import PROXIMAL_WEIGHT_CAP, PPOLearner, PPOSettings
from common.torch_file import adam_param_group, load_adam_param_group


def loss_and_gradients(model: MLPActorCritic, obs, actions, old_logprobs, advantages, returns, old_values,
                       settings: PPOSettings, weights=None) -> dict[str, float]:
    """The PPO loss of one minibatch (``common.ppo.ppo_update``'s, term by term) and its gradient in
    ``model.grads``; returns the minibatch's statistics. ``weights`` scale the (normalized) advantages."""
    n = len(obs)
    critic_outs, actor_outs = forward(obs, model.critic, model.tanh), forward(obs, model.actor, model.tanh)
    value, head = critic_outs[-1][:, 0], actor_outs[-1]
    new_logprobs, detail = model.log_probs(head, actions)
    if model.discrete:
        log_probs = detail
        probs = np.exp(log_probs)
        rows = np.arange(n)
        entropy = -(probs * log_probs).sum(axis=1)
    else:
        std, z = np.exp(model.log_std[0]), detail
        entropy = np.full(n, (0.5 + LOG_SQRT_2PI + model.log_std[0]).sum(), dtype=np.float32)

    logratio = new_logprobs - old_logprobs
    ratio = np.exp(logratio)
    if settings.norm_adv and n > 1:
        advantages = (advantages - advantages.mean()) / (advantages.std(ddof=1) + 1e-8)
    if weights is not None:
        advantages = advantages * weights
    low, high = 1.0 - settings.clip_coef, 1.0 + settings.clip_coef
    surrogate, clipped_surrogate = -advantages * ratio, -advantages * np.clip(ratio, low, high)
    unclipped = surrogate >= clipped_surrogate  # where the max is the unclipped term, it carries the gradient
    policy_loss = np.maximum(surrogate, clipped_surrogate).mean()

    error = value - returns
    if settings.clip_vloss:
        clipped_value = old_values + np.clip(value - old_values, -settings.clip_coef, settings.clip_coef)
        clipped_error = clipped_value - returns
        value_loss = 0.5 * np.maximum(error ** 2, clipped_error ** 2).mean()
        inside = np.abs(value - old_values) <= settings.clip_coef
        d_value = np.where(error ** 2 >= clipped_error ** 2, error, clipped_error * inside)
    else:
        value_loss = 0.5 * (error ** 2).mean()
        d_value = error
    d_value = (settings.vf_coef / n) * d_value

    # loss = policy_loss - ent_coef * mean(entropy) + vf_coef * value_loss
    d_logprob = np.where(unclipped, -advantages, 0.0) * ratio / n
    if model.discrete:
        d_head = -probs * d_logprob[:, None]
        d_head[rows, actions] += d_logprob
        if settings.ent_coef:  # d entropy / d logit_j = -p_j (log p_j + entropy)
            d_head += (settings.ent_coef / n) * probs * (log_probs + entropy[:, None])
    else:
        d_head = (d_logprob[:, None] * z) / std
        model.grad_log_std[0] = (d_logprob[:, None] * (z * z - 1.0)).sum(axis=0) - settings.ent_coef
    model.backward(actor_outs, model.actor, model.grad_actor, d_head.astype(np.float32, copy=False))
    model.backward(critic_outs, model.critic, model.grad_critic, d_value[:, None].astype(np.float32, copy=False))
    return {"policy_loss": float(policy_loss), "value_loss": float(value_loss),
            "entropy": float(entropy.mean()), "approx_kl": float(((ratio - 1.0) - logratio).mean()),
            "old_approx_kl": float((-logratio).mean()),
            "clipped": float((np.abs(ratio - 1.0) > settings.clip_coef).mean())}


class Adam:
    """Adam over a flat parameter vector, step for step the arithmetic of torch's fused Adam kernel
    (``common.optim.FusedAdam``); its ``state_dict`` has ``torch.optim.Adam``'s layout, per tensor."""

    def __init__(self, params: np.ndarray, grads: np.ndarray, shapes, lr: float, betas=(0.9, 0.999),
                 eps: float = 1e-8):
        self.params, self.grads, self.shapes = params, grads, shapes
        self.param_groups = [{"lr": lr, "betas": betas, "eps": eps}]
        self.exp_avg, self.exp_avg_sq = np.zeros_like(params), np.zeros_like(params)
        self.steps = 0

    def step(self) -> None:
        group = self.param_groups[0]
        beta1, beta2 = group["betas"]
        self.steps += 1
        self.exp_avg += (1.0 - beta1) * (self.grads - self.exp_avg)
        self.exp_avg_sq *= beta2
        self.exp_avg_sq += (1.0 - beta2) * self.grads * self.grads
        step_size = group["lr"] / (1.0 - beta1 ** self.steps)
        denom = np.sqrt(self.exp_avg_sq) / math.sqrt(1.0 - beta2 ** self.steps) + group["eps"]
        self.params -= step_size * self.exp_avg / denom

    def state_dict(self) -> dict:
        group = adam_param_group(self.param_groups[0], len(self.shapes))
        state = {}
        if self.steps:
            moments = zip(split_flat(self.exp_avg, self.shapes), split_flat(self.exp_avg_sq, self.shapes))
            for i, (m, v) in enumerate(moments):
                state[i] = {"step": np.array(float(self.steps), dtype=np.float32), "exp_avg": m.copy(),
                            "exp_avg_sq": v.copy()}
        return {"state": state, "param_groups": [group]}

    def load_state_dict(self, state_dict: dict) -> None:
        indices = load_adam_param_group(state_dict, self.param_groups[0], len(self.shapes))
        saved = [state_dict["state"].get(index) for index in indices]
        if any(s is None for s in saved):  # never stepped (or only in part: start the moments afresh)
            self.exp_avg[:], self.exp_avg_sq[:], self.steps = 0.0, 0.0, 0
            return
        for key, target in (("exp_avg", self.exp_avg), ("exp_avg_sq", self.exp_avg_sq)):
            for view, s in zip(split_flat(target, self.shapes), saved):
                view[:] = np.asarray(s[key], dtype=np.float32).reshape(view.shape)
        self.steps = int(float(np.asarray(saved[0]["step"])))


def ppo_update(model: MLPActorCritic, optimizer: Adam, batch: dict[str, np.ndarray], settings: PPOSettings,
               rng: np.random.Generator, after_epoch: Callable[[int], None] | None = None) -> dict[str, float]:
    """``common.ppo.ppo_update`` for :class:`MLPActorCritic`: ``n_epochs`` passes of minibatch PPO over a
    flat numpy batch; returns the last minibatch's statistics, as the torch version does. ``after_epoch(e)``
    runs after the e-th pass (1-based), as in the torch version."""
    size = len(batch["obs"])
    obs = batch["obs"].reshape(size, -1).astype(np.float32, copy=False)
    clipped, minibatches, stats = 0.0, 0, {}
    old_logprobs, weights = batch["logprobs"], None
    if settings.decoupled:  # (common.ppo_learner.PPOSettings)
        old_logprobs = model.logprobs(obs, batch["actions"]).astype(np.float32, copy=False)
        weights = np.minimum(np.exp(old_logprobs - batch["logprobs"]), PROXIMAL_WEIGHT_CAP)
    for epoch in range(settings.n_epochs):
        order = rng.permutation(size)
        for start in range(0, size, settings.minibatch_size):
            mb = order[start:start + settings.minibatch_size]
            stats = loss_and_gradients(model, obs[mb], batch["actions"][mb], old_logprobs[mb],
                                       batch["advantages"][mb], batch["returns"][mb], batch["values"][mb],
                                       settings, None if weights is None else weights[mb])
            clipped += stats.pop("clipped")
            minibatches += 1
            model.clip_gradients(settings.max_grad_norm)
            optimizer.step()
        if after_epoch is not None:
            after_epoch(epoch + 1)
        if settings.target_kl is not None and stats["approx_kl"] > settings.target_kl:
            break
    returns, values = batch["returns"], batch["values"]
    var_returns = float(returns.var(ddof=1)) if size > 1 else 0.0
    explained = 1.0 - float((returns - values).var(ddof=1)) / var_returns if var_returns > 0 else float("nan")
    return {**stats, "clipfrac": clipped / max(1, minibatches), "explained_variance": explained}


class NumpyLearner(PPOLearner):
    """The numpy learner: :class:`MLPActorCritic` and :class:`Adam` on the CPU, built by
    ``common.ppo_learner.make_learner``."""

    name, device = "numpy", "cpu"

    def __init__(self, observation_space, action_space, hidden: tuple[int, ...], activation: str,
                 log_std_init: float, learning_rate: float, settings: PPOSettings, seed: int, shuffle_seed: int,
                 state: dict | None = None):
        self.spaces = observation_space, action_space
        self.spec = actor_critic_spec(observation_space, action_space, hidden, activation, log_std_init)
        self.model = MLPActorCritic(self.spec, observation_space, action_space, seed=seed)
        self.optimizer = Adam(self.model.params, self.model.grads, self.model.shapes, learning_rate, eps=1e-5)
        if state is not None:
            self.load_state_dict(state)
        self.settings = settings
        self.seed_minibatches(shuffle_seed)

    def update(self, batch: dict[str, np.ndarray], after_epoch: Callable[[int], None] | None = None) -> dict:
        return ppo_update(self.model, self.optimizer, batch, self.settings, self.rng, after_epoch)

    def seed_minibatches(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)

    def publish(self, out: np.ndarray) -> None:
        out[:] = self.model.params

    def acting(self, seed: int) -> NumpyActing:
        return NumpyActing(*self.spaces, self.spec["hidden_sizes"], self.spec["activation"], lambda: self.model.params,
                           seed)

    def torch_network(self):
        import torch  # here only: the numpy learner itself never needs it

        from common.networks import build_network

        network = build_network(self.spec)
        network.load_state_dict({name: torch.from_numpy(value) for name, value in self.model.state_dict().items()})
        return network

    def finite(self) -> bool:
        return bool(np.isfinite(self.model.params).all())
