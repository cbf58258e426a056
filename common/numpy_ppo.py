"""PPO for an MLP actor-critic in numpy: the learner of a run whose policy is an MLP on the CPU.

An MLP policy's update is a few dozen small matrix products per minibatch, where torch spends
more time dispatching operations and recording the autograd graph than computing: a LunarLander
update (16 minibatches of 256, 4 epochs) took 143 ms with torch and 65 ms here, medians on a
2-core machine (docs/performance.md, "The numpy learner"). And a process that learns in numpy
never imports torch (1.4 s on that machine): it writes its checkpoints without it
(common/torch_file.py).

:class:`MLPActorCritic` is the numpy twin of ``common.networks.ActorCritic`` for vector
observations: the same layers, the same parameters in the same order (``parameters()`` order,
the layout of ``networks.write_flat_params``) under the same ``state_dict`` names, so a checkpoint
written by either loads into the other and ``common.policy`` acts with it. Its backward pass is
written out by hand; tests/test_numpy_ppo.py checks it against torch's autograd, and
:class:`Adam` against ``common.optim.FusedAdam``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from common.rollout import PROXIMAL_WEIGHT_CAP, actor_critic_shapes, parameter_count, split_flat

LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


def orthogonal(shape: tuple[int, int], gain: float, rng: np.random.Generator) -> np.ndarray:
    """``torch.nn.init.orthogonal_`` in numpy: the Q of a Gaussian matrix's QR, signs fixed by R's diagonal."""
    rows, cols = shape
    flat = rng.standard_normal((rows, cols) if rows >= cols else (cols, rows))
    q, r = np.linalg.qr(flat)
    q *= np.sign(np.diag(r))
    return (gain * (q if rows >= cols else q.T)).astype(np.float32)


class MLPActorCritic:
    """Separate actor and critic MLPs over a flat parameter vector ``params`` (float32), with a
    gradient vector ``grads`` of the same layout; ``critic``, ``actor`` (each a list of (weight, bias)),
    ``log_std`` and their ``grad_*`` twins are views into them."""

    def __init__(self, spec: dict, observation_space, action_space, seed: int):
        self.spec = spec
        hidden = tuple(spec["hidden_sizes"])
        self.discrete = hasattr(action_space, "n")
        shapes = actor_critic_shapes(observation_space, action_space, hidden)
        self.params = np.zeros(parameter_count(shapes), dtype=np.float32)
        self.grads = np.zeros_like(self.params)
        self.tanh = spec["activation"] == "tanh"
        depth = len(hidden) + 1
        # state_dict names, in parameters() order: actor_logstd (Box), then critic.<2i>, then actor.<2i>
        self.names = [] if self.discrete else ["actor_logstd"]
        for head in ("critic", "actor"):
            self.names += [f"{head}.{2 * i}.{kind}" for i in range(depth) for kind in ("weight", "bias")]
        self.shapes = shapes
        views, grad_views = split_flat(self.params, shapes), split_flat(self.grads, shapes)
        self.log_std = None if self.discrete else views.pop(0)
        self.grad_log_std = None if self.discrete else grad_views.pop(0)
        pairs = list(zip(views[0::2], views[1::2]))
        grad_pairs = list(zip(grad_views[0::2], grad_views[1::2]))
        self.critic, self.actor = pairs[:depth], pairs[depth:]
        self.grad_critic, self.grad_actor = grad_pairs[:depth], grad_pairs[depth:]
        # ActorCritic's initialization: orthogonal weights, gain sqrt(2) in the hidden layers, 1 for the
        # value and 0.01 for the action head; zero biases; log-std log_std_init.
        rng = np.random.default_rng(seed)
        for layers, out_gain in ((self.critic, 1.0), (self.actor, 0.01)):
            for i, (weight, _) in enumerate(layers):
                weight[:] = orthogonal(weight.shape, out_gain if i == depth - 1 else math.sqrt(2), rng)
        if self.log_std is not None:
            self.log_std[:] = spec["log_std_init"]

    # -- parameters
    def state_dict(self) -> dict[str, np.ndarray]:
        return {name: view.copy() for name, view in zip(self.names, split_flat(self.params, self.shapes))}

    def load_state_dict(self, state: dict) -> None:
        views = split_flat(self.params, self.shapes)
        if set(state) != set(self.names):
            raise ValueError(f"a model with parameters {sorted(state)}, not {sorted(self.names)}")
        for name, view in zip(self.names, views):
            value = np.asarray(state[name], dtype=np.float32)
            if value.shape != view.shape:
                raise ValueError(f"{name}: shape {value.shape}, not {view.shape}")
            view[:] = value

    # -- forward and backward
    def _forward(self, x: np.ndarray, layers) -> list[np.ndarray]:
        """Every layer's output, the input first; the hidden ones after their activation."""
        outs = [x]
        for weight, bias in layers[:-1]:
            z = outs[-1] @ weight.T + bias
            outs.append(np.tanh(z, out=z) if self.tanh else np.maximum(z, 0.0, out=z))
        weight, bias = layers[-1]
        outs.append(outs[-1] @ weight.T + bias)
        return outs

    def _backward(self, outs: list[np.ndarray], layers, grad_layers, d_out: np.ndarray) -> None:
        """Gradients of every weight and bias of one MLP from the gradient ``d_out`` of its output."""
        d = d_out
        for i in reversed(range(len(layers))):
            grad_weight, grad_bias = grad_layers[i]
            np.matmul(d.T, outs[i], out=grad_weight)
            d.sum(axis=0, out=grad_bias)
            if i:
                d = d @ layers[i][0]
                d *= (1.0 - outs[i] * outs[i]) if self.tanh else (outs[i] > 0.0)

    def _log_probs(self, head: np.ndarray, actions: np.ndarray):
        """The log-probability of ``actions`` under the action head's output, and what the gradient needs:
        the log-probabilities of every action (discrete) or the standardized actions (Gaussian)."""
        if self.discrete:
            shifted = head - head.max(axis=1, keepdims=True)
            log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
            return log_probs[np.arange(len(head)), actions], log_probs
        z = (actions - head) / np.exp(self.log_std[0])
        return (-0.5 * z * z - self.log_std[0] - LOG_SQRT_2PI).sum(axis=1), z

    def logprobs(self, obs: np.ndarray, actions: np.ndarray) -> np.ndarray:
        """The current policy's log-probability of ``actions`` (the proximal policy of a decoupled update)."""
        return self._log_probs(self._forward(obs, self.actor)[-1], actions)[0]

    def loss_and_gradients(self, obs, actions, old_logprobs, advantages, returns, old_values,
                           settings, weights=None) -> dict[str, float]:
        """The PPO loss of one minibatch (``common.ppo.ppo_update``'s, term by term) and its gradient in
        :attr:`grads`; returns the minibatch's statistics. ``weights`` scale the (normalized) advantages."""
        n = len(obs)
        critic_outs, actor_outs = self._forward(obs, self.critic), self._forward(obs, self.actor)
        value, head = critic_outs[-1][:, 0], actor_outs[-1]
        new_logprobs, detail = self._log_probs(head, actions)
        if self.discrete:
            log_probs = detail
            probs = np.exp(log_probs)
            rows = np.arange(n)
            entropy = -(probs * log_probs).sum(axis=1)
        else:
            std, z = np.exp(self.log_std[0]), detail
            entropy = np.full(n, (0.5 + LOG_SQRT_2PI + self.log_std[0]).sum(), dtype=np.float32)

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
        if self.discrete:
            d_head = -probs * d_logprob[:, None]
            d_head[rows, actions] += d_logprob
            if settings.ent_coef:  # d entropy / d logit_j = -p_j (log p_j + entropy)
                d_head += (settings.ent_coef / n) * probs * (log_probs + entropy[:, None])
        else:
            d_head = (d_logprob[:, None] * z) / std
            self.grad_log_std[0] = (d_logprob[:, None] * (z * z - 1.0)).sum(axis=0) - settings.ent_coef
        self._backward(actor_outs, self.actor, self.grad_actor, d_head.astype(np.float32, copy=False))
        self._backward(critic_outs, self.critic, self.grad_critic, d_value[:, None].astype(np.float32, copy=False))
        return {"policy_loss": float(policy_loss), "value_loss": float(value_loss),
                "entropy": float(entropy.mean()), "approx_kl": float(((ratio - 1.0) - logratio).mean()),
                "old_approx_kl": float((-logratio).mean()),
                "clipped": float((np.abs(ratio - 1.0) > settings.clip_coef).mean())}

    def clip_gradients(self, max_norm: float) -> None:
        """``torch.nn.utils.clip_grad_norm_`` over the whole gradient vector."""
        norm = math.sqrt(float(np.dot(self.grads, self.grads)))
        if max_norm / (norm + 1e-6) < 1.0:
            self.grads *= max_norm / (norm + 1e-6)


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
        group = dict(self.param_groups[0], params=list(range(len(self.shapes))), weight_decay=0.0, amsgrad=False,
                     maximize=False, foreach=None, capturable=False, differentiable=False, fused=True,
                     decoupled_weight_decay=False)
        state = {}
        if self.steps:
            moments = zip(split_flat(self.exp_avg, self.shapes), split_flat(self.exp_avg_sq, self.shapes))
            for i, (m, v) in enumerate(moments):
                state[i] = {"step": np.array(float(self.steps), dtype=np.float32), "exp_avg": m.copy(),
                            "exp_avg_sq": v.copy()}
        return {"state": state, "param_groups": [group]}

    def load_state_dict(self, state_dict: dict) -> None:
        group = state_dict["param_groups"][0]
        if len(group["params"]) != len(self.shapes):
            raise ValueError(f"optimizer state for {len(group['params'])} parameters, not {len(self.shapes)}")
        self.param_groups[0].update(lr=group["lr"], betas=tuple(group["betas"]), eps=group["eps"])
        saved = [state_dict["state"].get(index) for index in group["params"]]
        if any(s is None for s in saved):  # never stepped (or only in part: start the moments afresh)
            self.exp_avg[:], self.exp_avg_sq[:], self.steps = 0.0, 0.0, 0
            return
        for key, target in (("exp_avg", self.exp_avg), ("exp_avg_sq", self.exp_avg_sq)):
            for view, s in zip(split_flat(target, self.shapes), saved):
                view[:] = np.asarray(s[key], dtype=np.float32).reshape(view.shape)
        self.steps = int(float(np.asarray(saved[0]["step"])))


def ppo_update(model: MLPActorCritic, optimizer: Adam, batch: dict[str, np.ndarray], settings,
               rng: np.random.Generator, after_epoch: Callable[[int], None] | None = None) -> dict[str, float]:
    """``common.ppo.ppo_update`` for :class:`MLPActorCritic`: ``n_epochs`` passes of minibatch PPO over a
    flat numpy batch; returns the last minibatch's statistics, as the torch version does. ``after_epoch(e)``
    runs after the e-th pass (1-based), as in the torch version."""
    size = len(batch["obs"])
    obs = batch["obs"].reshape(size, -1).astype(np.float32, copy=False)
    clipped, minibatches, stats = 0.0, 0, {}
    old_logprobs, weights = batch["logprobs"], None
    if settings.decoupled:  # (common.rollout.PPOSettings)
        old_logprobs = model.logprobs(obs, batch["actions"]).astype(np.float32, copy=False)
        weights = np.minimum(np.exp(old_logprobs - batch["logprobs"]), PROXIMAL_WEIGHT_CAP)
    for epoch in range(settings.n_epochs):
        order = rng.permutation(size)
        for start in range(0, size, settings.minibatch_size):
            mb = order[start:start + settings.minibatch_size]
            stats = model.loss_and_gradients(obs[mb], batch["actions"][mb], old_logprobs[mb],
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
