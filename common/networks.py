"""Actor-critic and Q networks, and flat parameter views for sharing weights between processes."""

from __future__ import annotations

import math
import time

import gymnasium as gym
import numpy as np
import torch
from torch import nn
from torch.distributions import Categorical, Normal

from common.network_spec import actor_critic_spec, space_from_spec, space_spec
from common.replay import is_image
from common.shm import Seqlock

# Argument validation costs more than the math for the tiny batches of a rollout step.
torch.distributions.Distribution.set_default_validate_args(False)


def layer_init(layer: nn.Linear, std: float = math.sqrt(2), bias: float = 0.0) -> nn.Linear:
    """Orthogonal init, as in the PPO implementation details (Huang et al., 2022)."""
    nn.init.orthogonal_(layer.weight, std)
    nn.init.constant_(layer.bias, bias)
    return layer


ACTIVATIONS = {"tanh": nn.Tanh, "relu": nn.ReLU}


def mlp(in_dim: int, hidden: tuple[int, ...], out_dim: int, out_std: float,
        activation: type[nn.Module] = nn.Tanh) -> nn.Sequential:
    layers: list[nn.Module] = []
    for width in hidden:
        layers += [layer_init(nn.Linear(in_dim, width)), activation()]
        in_dim = width
    layers.append(layer_init(nn.Linear(in_dim, out_dim), std=out_std))
    return nn.Sequential(*layers)


def obs_dim(space: gym.Space) -> int:
    return int(np.prod(space.shape))


class NatureCNN(nn.Module):
    """The convolutional encoder of the DQN Nature paper (Mnih et al., 2015): uint8 frames in, 512 features out."""

    out_dim = 512

    def __init__(self, observation_space: gym.Space):
        super().__init__()
        channels, height, width = observation_space.shape
        self.conv = nn.Sequential(
            layer_init(nn.Conv2d(channels, 32, 8, stride=4)), nn.ReLU(),
            layer_init(nn.Conv2d(32, 64, 4, stride=2)), nn.ReLU(),
            layer_init(nn.Conv2d(64, 64, 3, stride=1)), nn.ReLU(), nn.Flatten())
        with torch.no_grad():
            flat = self.conv(torch.zeros(1, channels, height, width)).shape[1]
        self.fc = nn.Sequential(layer_init(nn.Linear(flat, self.out_dim)), nn.ReLU())

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.fc(self.conv(obs.float() / 255.0))


class Flat(nn.Flatten):
    """The encoder of a vector observation: the observation itself, as one float vector."""

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return obs.flatten(1).float()


class BoardCNN(nn.Module):
    """3x3 convolutions over a small board of planes (float, channels first, e.g. Connect Four's
    2x6x7), padded so every cell keeps its place: the same pattern (three in a row, a blocked
    column) is recognised wherever it stands, which an MLP must learn cell by cell."""

    def __init__(self, observation_space: gym.Space, channels: tuple[int, ...]):
        super().__init__()
        planes, height, width = observation_space.shape
        layers: list[nn.Module] = []
        for out in channels:
            layers += [layer_init(nn.Conv2d(planes, out, 3, padding=1)), nn.ReLU()]
            planes = out
        self.conv = nn.Sequential(*layers, nn.Flatten())
        self.out_dim = planes * height * width

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.conv(obs.float())


def is_board(space: gym.Space) -> bool:
    """Planes of a small board: a float observation of rank 3, channels first (not a picture)."""
    return isinstance(space, gym.spaces.Box) and len(space.shape) == 3 and not is_image(space)


def encoder(observation_space: gym.Space, conv_channels: tuple[int, ...] = ()) -> tuple[nn.Module, int]:
    """The observation encoder, chosen by the observation: a Nature CNN for images, 3x3
    convolutions for a board when ``conv_channels`` are given, else none."""
    if is_image(observation_space):
        return NatureCNN(observation_space), NatureCNN.out_dim
    if conv_channels and is_board(observation_space):
        board = BoardCNN(observation_space, tuple(conv_channels))
        return board, board.out_dim
    return Flat(), obs_dim(observation_space)


class ActorCritic(nn.Module):
    """Actor and critic for a Discrete or Box action space.

    Vector observations: separate actor and critic MLPs. Images: one Nature CNN shared by
    linear actor and critic heads (as CleanRL's ``ppo_atari.py``). Discrete actions: a
    categorical over logits. Box actions: a diagonal Gaussian with a state-independent log
    standard deviation; the sampled action is returned unclipped (the rollout clips it to the
    bounds before stepping the env).
    """

    def __init__(self, observation_space: gym.Space, action_space: gym.Space,
                 hidden: tuple[int, ...] = (64, 64), activation: str = "tanh", log_std_init: float = 0.0):
        super().__init__()
        # Everything needed to build this network again (a checkpoint stores it under "policy").
        self.spec = actor_critic_spec(observation_space, action_space, hidden, activation, log_std_init)
        self.trunk, in_dim = encoder(observation_space)
        heads_hidden = () if is_image(observation_space) else tuple(hidden)
        self.discrete = isinstance(action_space, gym.spaces.Discrete)
        if not self.discrete and not isinstance(action_space, gym.spaces.Box):
            raise ValueError(f"unsupported action space {action_space}")
        out_dim = int(action_space.n) if self.discrete else int(np.prod(action_space.shape))
        self.critic = mlp(in_dim, heads_hidden, 1, out_std=1.0, activation=ACTIVATIONS[activation])
        self.actor = mlp(in_dim, heads_hidden, out_dim, out_std=0.01, activation=ACTIVATIONS[activation])
        if not self.discrete:  # state-independent: exp(log_std_init) is the first policy's spread
            self.actor_logstd = nn.Parameter(torch.full((1, out_dim), float(log_std_init)))

    def head(self, obs: torch.Tensor) -> torch.Tensor:
        """The actor's output: logits (Discrete) or the mean action (Box)."""
        return self.actor(self.trunk(obs))

    def get_value(self, obs: torch.Tensor) -> torch.Tensor:
        return self.critic(self.trunk(obs)).squeeze(-1)

    def distribution(self, obs: torch.Tensor):
        out = self.head(obs)
        if self.discrete:
            return Categorical(logits=out)
        return Normal(out, self.actor_logstd.expand_as(out).exp())

    @torch.no_grad()
    def act(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Sample actions for a rollout: action, log-prob, value.

        The same distribution as :meth:`get_action_and_value`, without building
        ``torch.distributions`` objects, which cost more than the network on a rollout step.
        """
        features = self.trunk(obs)
        out = self.actor(features)
        value = self.critic(features).squeeze(-1)
        if self.discrete:
            log_probs = torch.log_softmax(out, dim=-1)
            action = torch.multinomial(log_probs.exp(), 1).squeeze(1)
            return action, log_probs.gather(1, action.unsqueeze(1)).squeeze(1), value
        log_std = self.actor_logstd.expand_as(out)
        noise = torch.randn_like(out)
        action = out + noise * log_std.exp()
        logprob = (-0.5 * noise.pow(2) - log_std - 0.5 * math.log(2 * math.pi)).sum(-1)
        return action, logprob, value

    def get_action_and_value(self, obs: torch.Tensor, action: torch.Tensor | None = None):
        """Sample (or score a given) action: returns action, log-prob, entropy, value."""
        if self.discrete and action is not None:
            # The PPO update's hot path: categorical log-prob and entropy straight from logits.
            features = self.trunk(obs)
            log_probs = torch.log_softmax(self.actor(features), dim=-1)
            logprob = log_probs.gather(1, action.long().unsqueeze(1)).squeeze(1)
            entropy = -(log_probs.exp() * log_probs).sum(-1)
            return action, logprob, entropy, self.critic(features).squeeze(-1)
        dist = self.distribution(obs)
        if action is None:
            action = dist.sample()
        logprob = dist.log_prob(action)
        entropy = dist.entropy()
        if not self.discrete:
            logprob, entropy = logprob.sum(-1), entropy.sum(-1)
        return action, logprob, entropy, self.get_value(obs)


class QNetwork(nn.Module):
    """One Q-value per discrete action: an MLP, or for images a Nature CNN and a linear head;
    for a board (:func:`is_board`) with ``conv_channels``, 3x3 convolutions and then the MLP."""

    def __init__(self, observation_space: gym.Space, action_space: gym.Space,
                 hidden: tuple[int, ...] = (128, 128), conv_channels: tuple[int, ...] = ()):
        super().__init__()
        if not isinstance(action_space, gym.spaces.Discrete):
            raise ValueError(f"DQN needs a Discrete action space, not {action_space}")
        self.spec = {"class": "QNetwork", "observation_space": space_spec(observation_space),
                     "action_space": space_spec(action_space), "hidden_sizes": list(hidden), "activation": "relu"}
        if conv_channels and is_board(observation_space):  # absent otherwise: older checkpoints' specs stay valid
            self.spec["conv_channels"] = list(conv_channels)
        self.trunk, in_dim = encoder(observation_space, conv_channels)
        hidden = () if is_image(observation_space) else tuple(hidden)
        self.net = mlp(in_dim, hidden, int(action_space.n), out_std=1.0, activation=nn.ReLU)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.net(self.trunk(obs))


def build_network(spec: dict) -> nn.Module:
    """The (untrained) network a ``spec`` describes; load a checkpoint's ``model`` into it."""
    spaces = space_from_spec(spec["observation_space"]), space_from_spec(spec["action_space"])
    if spec["class"] == "QNetwork":
        return QNetwork(*spaces, tuple(spec["hidden_sizes"]), tuple(spec.get("conv_channels", ())))
    return ActorCritic(*spaces, tuple(spec["hidden_sizes"]), spec.get("activation", "tanh"),
                       spec.get("log_std_init", 0.0))


def flat_size(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@torch.no_grad()
def write_flat_params(model: nn.Module, out: np.ndarray) -> None:
    """Copy every parameter of ``model`` into the 1-D float32 array ``out`` (e.g. shared memory)."""
    torch.from_numpy(out).copy_(nn.utils.parameters_to_vector(model.parameters()).detach().float().cpu())


@torch.no_grad()
def read_flat_params(model: nn.Module, flat: np.ndarray) -> None:
    """Load parameters from a 1-D float32 array written by :func:`write_flat_params`."""
    source = torch.from_numpy(flat)
    offset = 0
    for param in model.parameters():  # copy, never alias: the shared array changes under us
        count = param.numel()
        param.copy_(source[offset:offset + count].view_as(param))
        offset += count


class SharedParams:
    """The parameters of a network in shared memory, under a version seqlock (:class:`common.shm.Seqlock`):
    one writer, many readers.

    ``arrays["params"]`` is ``[slots, n]`` float32 (slot 0 the learner's current weights; more
    slots hold, e.g., past snapshots for self-play) and ``arrays["versions"]`` is ``[slots, 2]``,
    the seqlock's counters. A version of 0 means "never written".
    """

    def __init__(self, arrays: dict[str, np.ndarray]):
        self.params, self.versions = arrays["params"], arrays["versions"]
        self.lock = Seqlock(self.params, self.versions)
        self._scratch = np.empty(self.params.shape[1], dtype=np.float32)

    @staticmethod
    def allocate(shared_arrays, num_params: int, slots: int = 1) -> SharedParams:
        """Create the segments in ``shared_arrays`` (a common.shm.SharedArrays of the coordinator)."""
        shared_arrays.create("params", (slots, num_params), np.float32)
        shared_arrays.create("versions", (slots, 2), np.int64)
        return SharedParams({"params": shared_arrays["params"], "versions": shared_arrays["versions"]})

    def version(self, slot: int = 0) -> int:
        return self.lock.version(slot)

    def publish(self, model: nn.Module, slot: int = 0) -> int:
        """Write ``model``'s parameters into ``slot``; returns the new version."""
        return self.lock.write(lambda row: write_flat_params(model, row), slot)

    def fetch(self, model: nn.Module, slot: int = 0) -> int | None:
        """Load ``slot`` into ``model`` if it was not being written meanwhile; its version, or None."""
        version = self.lock.read(self._scratch, slot)
        if version is not None:
            read_flat_params(model, self._scratch)
        return version

    def wait_fetch(self, model: nn.Module, slot: int = 0, alive=lambda: True) -> int:
        """Fetch, retrying until a consistent copy is read (the writer holds a slot for microseconds)."""
        while (version := self.fetch(model, slot)) is None:
            if not alive():
                raise ConnectionError("the learner is gone")
            time.sleep(0.0005)
        return version
