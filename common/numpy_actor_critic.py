"""The MLP actor-critic in numpy: ``common.networks.ActorCritic`` for vector observations, over one flat
float32 parameter vector. Rollouts act with it (:class:`NumpyActing`) and the numpy learner trains it
(:class:`MLPActorCritic`, whose gradient ``common.numpy_ppo`` computes); both run this module's one
forward pass (:func:`forward`, :func:`log_softmax`, :func:`gaussian_log_prob`).

The parameters are ``ActorCritic``'s, in its ``parameters()`` order (the layout of
``networks.write_flat_params``, :func:`actor_critic_shapes`) under its ``state_dict`` names, so a
learner of either kind publishes parameters that numpy acts with, and a checkpoint written by either
loads into the other and into ``common.policy``. tests/test_numpy_ppo.py and tests/test_common.py
check this against torch.

Nothing here imports torch: a rollout worker of an MLP policy never does, and starts in a fraction of
the time (torch's import is most of a worker's start-up).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from common.replay import is_image

LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


def acts_in_numpy(observation_space) -> bool:
    """Whether ``common.networks.ActorCritic`` is a pair of MLPs for this observation (anything but a
    picture, which gets a CNN), so that numpy can act for it."""
    return not is_image(observation_space)


def actor_critic_shapes(observation_space, action_space, hidden) -> list[tuple[int, ...]]:
    """The shapes of ``ActorCritic``'s parameters for a vector observation, in ``parameters()`` order
    (the order of a flat parameter vector): the log-std of Box actions (a parameter of the module itself
    comes before those of its children), then the critic's layers and the actor's, each a weight
    ``(out, in)`` and a bias ``(out,)``."""
    discrete = hasattr(action_space, "n")
    in_dim = int(np.prod(observation_space.shape))
    out_dim = int(action_space.n) if discrete else int(np.prod(action_space.shape))
    shapes: list[tuple[int, ...]] = []
    for head_out in (1, out_dim):
        width = in_dim
        for layer_out in (*hidden, head_out):
            shapes += [(layer_out, width), (layer_out,)]
            width = layer_out
    return shapes if discrete else [(1, out_dim), *shapes]


def parameter_count(shapes) -> int:
    """How many numbers a flat parameter vector of tensors of these ``shapes`` holds."""
    return sum(int(np.prod(shape)) for shape in shapes)


def split_flat(flat: np.ndarray, shapes) -> list[np.ndarray]:
    """Views into a flat parameter vector, one of each of ``shapes``, in order."""
    views, offset = [], 0
    for shape in shapes:
        count = int(np.prod(shape))
        views.append(flat[offset:offset + count].reshape(shape))
        offset += count
    return views


def split_heads(tensors: list[np.ndarray], discrete: bool):
    """``ActorCritic``'s tensors (:func:`split_flat` of its flat vector) as ``(log_std, critic, actor)``:
    the log-std (None for Discrete actions), then each head's layers as ``(weight, bias)`` pairs."""
    log_std = None if discrete else tensors[0]
    layers = tensors if discrete else tensors[1:]
    pairs = list(zip(layers[0::2], layers[1::2]))
    depth = len(pairs) // 2
    return log_std, pairs[:depth], pairs[depth:]


def forward(x: np.ndarray, layers, tanh: bool) -> list[np.ndarray]:
    """One MLP head on a batch ``x``: every layer's output, the input first, the hidden ones after their
    activation (tanh, else ReLU). ``layers`` are ``(weight (out, in), bias)``, as ``nn.Linear`` holds them."""
    outs = [x]
    for weight, bias in layers[:-1]:
        z = outs[-1] @ weight.T + bias
        outs.append(np.tanh(z, out=z) if tanh else np.maximum(z, 0.0, out=z))
    weight, bias = layers[-1]
    outs.append(outs[-1] @ weight.T + bias)
    return outs


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """The log-probabilities of a categorical over ``logits`` (one row per sample)."""
    # np.maximum.reduce and np.add.reduce are .max and .sum without their wrappers' microseconds
    shifted = logits - np.maximum.reduce(logits, axis=1, keepdims=True)
    total = np.add.reduce(np.exp(shifted), axis=1, keepdims=True)
    return np.subtract(shifted, np.log(total, out=total), out=shifted)


def gaussian_log_prob(z: np.ndarray, log_std: np.ndarray, log_sqrt_2pi: float = LOG_SQRT_2PI) -> np.ndarray:
    """The log-density of a diagonal Gaussian at the standardized actions ``z`` = (action - mean) / std.

    In float32, unless ``log_sqrt_2pi`` is a float64 scalar: the terms are then summed in float64 (acting does
    this, the learner not; each keeps the rounding that runs of a fixed seed have always had)."""
    return (-0.5 * z * z - log_std - log_sqrt_2pi).sum(axis=1)


def orthogonal(shape: tuple[int, int], gain: float, rng: np.random.Generator) -> np.ndarray:
    """``torch.nn.init.orthogonal_`` in numpy: the Q of a Gaussian matrix's QR, signs fixed by R's diagonal."""
    rows, cols = shape
    flat = rng.standard_normal((rows, cols) if rows >= cols else (cols, rows))
    q, r = np.linalg.qr(flat)
    q *= np.sign(np.diag(r))
    return (gain * (q if rows >= cols else q.T)).astype(np.float32)


class MLPActorCritic:
    """The learner's network: a flat parameter vector ``params`` (float32) and a gradient vector ``grads``
    of the same layout; ``critic``, ``actor`` (each a list of (weight, bias)), ``log_std`` and their ``grad_*``
    twins are views into them. ``spec`` is ``common.network_spec.actor_critic_spec``'s description.

    ``seed`` draws ``ActorCritic``'s initialization with numpy's generator (torch's is another: the two
    learners start from different weights for one seed, docs/train_parallel_timed.md)."""

    def __init__(self, spec: dict, observation_space, action_space, seed: int):
        self.spec = spec
        hidden = tuple(spec["hidden_sizes"])
        self.discrete = hasattr(action_space, "n")
        self.shapes = actor_critic_shapes(observation_space, action_space, hidden)
        self.params = np.zeros(parameter_count(self.shapes), dtype=np.float32)
        self.grads = np.zeros_like(self.params)
        self.tanh = spec["activation"] == "tanh"
        depth = len(hidden) + 1
        # state_dict names, in parameters() order: actor_logstd (Box), then critic.<2i>, then actor.<2i>
        self.names = [] if self.discrete else ["actor_logstd"]
        for head in ("critic", "actor"):
            self.names += [f"{head}.{2 * i}.{kind}" for i in range(depth) for kind in ("weight", "bias")]
        self.log_std, self.critic, self.actor = split_heads(split_flat(self.params, self.shapes), self.discrete)
        self.grad_log_std, self.grad_critic, self.grad_actor = split_heads(split_flat(self.grads, self.shapes),
                                                                          self.discrete)
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
    def log_probs(self, head: np.ndarray, actions: np.ndarray):
        """The log-probability of ``actions`` under the action head's output, and what the gradient needs:
        the log-probabilities of every action (discrete) or the standardized actions (Gaussian)."""
        if self.discrete:
            log_probs = log_softmax(head)
            return log_probs[np.arange(len(head)), actions], log_probs
        z = (actions - head) / np.exp(self.log_std[0])
        return gaussian_log_prob(z, self.log_std[0]), z

    def logprobs(self, obs: np.ndarray, actions: np.ndarray) -> np.ndarray:
        """The current policy's log-probability of ``actions`` (the proximal policy of a decoupled update)."""
        return self.log_probs(forward(obs, self.actor, self.tanh)[-1], actions)[0]

    def backward(self, outs: list[np.ndarray], layers, grad_layers, d_out: np.ndarray) -> None:
        """Gradients of every weight and bias of one head (its :func:`forward` outputs ``outs``) from the
        gradient ``d_out`` of its output, written into ``grad_layers``."""
        d = d_out
        for i in reversed(range(len(layers))):
            grad_weight, grad_bias = grad_layers[i]
            np.matmul(d.T, outs[i], out=grad_weight)
            d.sum(axis=0, out=grad_bias)
            if i:
                d = d @ layers[i][0]
                d *= (1.0 - outs[i] * outs[i]) if self.tanh else (outs[i] > 0.0)

    def clip_gradients(self, max_norm: float) -> None:
        """``torch.nn.utils.clip_grad_norm_`` over the whole gradient vector."""
        norm = math.sqrt(float(np.dot(self.grads, self.grads)))
        if max_norm / (norm + 1e-6) < 1.0:
            self.grads *= max_norm / (norm + 1e-6)


class NumpyActing:
    """The rollout step of an MLP actor-critic in numpy, from a copy of its flat parameters.

    A rollout step runs the network on a handful of observations, where torch's per-call
    overhead dominates: numpy's matmuls took a quarter of the time (16 CartPole envs: 122 vs
    511 us per step, measured). Actions are sampled from the same distributions as
    ``ActorCritic.act`` (categorical by the Gumbel-max trick, or the diagonal Gaussian), with
    this collector's own generator; the learner recomputes log-probabilities (common.ppo, common.numpy_ppo).
    ``params`` returns the current flat parameter vector (``networks.write_flat_params``'s
    layout: shared memory a learner publishes to, or a learner's own vector).

    At a few envs a step's cost is numpy's per-call overhead, not arithmetic, so :meth:`act` makes
    fewer calls for the same numbers (docs/performance.md, "Collection against the env's own rate"): the
    two heads' hidden layers run as one stacked matmul each (numpy runs each head's product with the
    same BLAS call as alone: bit for bit the same), and the noise is drawn ``NOISE_ROWS`` rows at a time
    (the generator yields the same stream in one call as in many), with a Gaussian's log-probabilities
    computed for the whole block at once.
    """

    NOISE_ROWS = 1024  # rows (one per env and step) of noise drawn at once

    def __init__(self, observation_space, action_space, hidden, activation: str,
                 params: Callable[[], np.ndarray], seed: int):
        self.shapes = actor_critic_shapes(observation_space, action_space, tuple(hidden))
        self.size = parameter_count(self.shapes)
        self.discrete = hasattr(action_space, "n")
        self.width = int(action_space.n) if self.discrete else int(np.prod(action_space.shape))
        self.tanh = activation == "tanh"
        self.params, self.rng = params, np.random.default_rng(seed)
        self.noise = np.empty((0, self.width), dtype=np.float64 if self.discrete else np.float32)
        self.noise_logprob = np.empty(0, dtype=np.float32)  # a Gaussian's log-probability of each noise row
        self.noise_next = 0
        self.rows: dict[int, np.ndarray] = {}  # np.arange(n) by n, to pick each row's log-probability
        self.refresh()

    def refresh(self) -> None:
        """Copy the current parameters (call before every rollout): never alias them, they change under us."""
        flat = np.asarray(self.params(), dtype=np.float32)
        if flat.size != self.size:
            raise ValueError(f"{flat.size} parameters where the MLP policy has {self.size}")
        log_std, critic, actor = split_heads(split_flat(flat, self.shapes), self.discrete)
        self.log_std = None if log_std is None else log_std[0].copy()
        self.std = None if log_std is None else np.exp(self.log_std)
        # Weights copied column-major: ``x @ weight.T`` then multiplies two contiguous matrices, no transposed
        # operand for BLAS (the learner's views are row-major; the layout changes the rounding, not the math).
        self.critic = [(np.array(weight, order="F"), bias.copy()) for weight, bias in critic]
        self.actor = [(np.array(weight, order="F"), bias.copy()) for weight, bias in actor]
        # The hidden layers of both heads stacked, critic first: [2, in, out] (each the contiguous ``weight.T``) and
        # [2, 1, out]. The heads' output layers differ in width and stay apart.
        self.stacked = [(np.stack([c[0].T, a[0].T]), np.stack([c[1], a[1]])[:, None, :])
                        for c, a in zip(self.critic[:-1], self.actor[:-1])]
        if not self.discrete and len(self.noise):
            self.noise_logprob = self._gaussian_log_prob(self.noise)

    def value(self, obs: np.ndarray) -> np.ndarray:
        return forward(_flat(obs), self.critic, self.tanh)[-1][:, 0]

    def heads(self, obs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The forward pass: the action head's output (logits or means) and the value of each observation."""
        hidden = _flat(obs)
        for weight, bias in self.stacked:  # [n, in] then [2, n, in] @ [2, in, out]
            z = np.matmul(hidden, weight)
            z += bias
            hidden = np.tanh(z, out=z) if self.tanh else np.maximum(z, 0.0, out=z)
        (critic_weight, critic_bias), (actor_weight, actor_bias) = self.critic[-1], self.actor[-1]
        if self.stacked:
            value = (hidden[0] @ critic_weight.T + critic_bias)[:, 0]
            out = hidden[1] @ actor_weight.T + actor_bias
        else:
            value, out = (hidden @ critic_weight.T + critic_bias)[:, 0], hidden @ actor_weight.T + actor_bias
        return out, value

    def act(self, obs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        out, value = self.heads(obs)
        n = len(out)
        rows = self._take_noise(n)
        if self.log_std is None:
            log_probs = log_softmax(out)
            action = (log_probs + self.noise[rows]).argmax(axis=1)
            index = self.rows.get(n)
            if index is None:
                index = self.rows[n] = np.arange(n)
            return action, log_probs[index, action], value
        action = out + self.noise[rows] * self.std
        return action, self.noise_logprob[rows], value

    def _take_noise(self, n: int) -> slice:
        """The next ``n`` rows of noise (Gumbel for a categorical, standard normal for a Gaussian), drawn ahead."""
        if self.noise_next + n > len(self.noise):
            size = (max(self.NOISE_ROWS, n), self.width)
            fresh = self.rng.gumbel(size=size) if self.discrete else self.rng.standard_normal(size).astype(np.float32)
            self.noise = np.concatenate([self.noise[self.noise_next:], fresh])
            self.noise_next = 0
            if not self.discrete:
                self.noise_logprob = self._gaussian_log_prob(self.noise)
        self.noise_next += n
        return slice(self.noise_next - n, self.noise_next)

    def _gaussian_log_prob(self, noise: np.ndarray) -> np.ndarray:
        return gaussian_log_prob(noise, self.log_std, np.float64(LOG_SQRT_2PI)).astype(np.float32)


def _flat(obs: np.ndarray) -> np.ndarray:
    return obs.reshape(len(obs), -1).astype(np.float32, copy=False)
