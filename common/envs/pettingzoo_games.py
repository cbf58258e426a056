"""PettingZoo's two-player classic games as single-agent Gymnasium envs with the opponent inside.

PettingZoo (the multi-agent API of the Farama ecosystem) runs a turn-based game as an AEC env: the
agents take turns, each observes the board from its own side with a mask of its legal moves. One
adapter turns such a game into what ConnectFour-v0 is (common/envs/connect_four.py): an env where the
learner moves and a pluggable opponent replies inside ``step``, so that self-play (common/envs/selfplay.py),
the opponent pool and PFSP of ``parallel_train_dqn.py``, ``ParallelManager``, evaluation against fixed
players and ``python -m common.evaluate`` work on it unchanged.

Ids are PettingZoo's own registry ids with ``pettingzoo`` for their ``classic`` namespace (a Gymnasium
namespace holds no slash): ``pettingzoo.make("aec", "classic/tictactoe-v3")``, the module
``pettingzoo.classic.tictactoe_v3``, is ``gym.make("pettingzoo/tictactoe-v3")``. So the name and the version
are PettingZoo's (the rules are PettingZoo's own, and a new version of them would be a new id), Gymnasium reads
the version as a version, and no id can be taken for a built-in. Registered: ``pettingzoo/tictactoe-v3``,
``pettingzoo/connect_four-v3``, ``pettingzoo/go-v5`` (keyword arguments that are not the adapter's go to the
game: ``board_size=9``).

What the learner sees:

- Observation: the game's ``observation`` for the side to move, float32, channels first (PettingZoo's
  board planes are channels last: tic-tac-toe ``(3, 3, 2)`` becomes ``(2, 3, 3)``, plane 0 the mover's
  marks, plane 1 the other side's). The opponent is shown its own side the same way, so one Q-network
  plays both seats.
- ``info["action_mask"]``: bool, the game's ``action_mask``; an action outside it raises ``ValueError``.
- Reward: the learner's reward from the game (PettingZoo's: +1 win, -1 loss, 0 otherwise in these games),
  summed over its move and the replies up to its next turn. ``info["result"]`` (vector form:
  ``info["final_info"]["result"]``) is its sign when a game ends, and in the vector form
  ``info["final_info"]["opponent"]`` labels the game's opponent when the opponent labels its games (a
  self-play mixture: the snapshot's id, else -1).
- ``opponent``: a player name of the game (:data:`GAMES`: ``random`` for every game, ``heuristic`` and the
  held-out ``minimax`` for tic-tac-toe, ``heuristic`` and the held-out ``search1`` .. ``search4`` for
  Connect Four), or any object with ``act(obs, action_mask, env_ids) -> actions`` (and optionally
  ``start_games(env_ids)``). A self-play mixture's fixed players are made by the game's own players.
- ``learner_first``: True/False fixes the seat, None draws it per game (``reset(options={"learner_first":
  ...})`` for one game of the single env); ``random_opening``: this many uniformly random plies of both
  sides open every game (at most the game's ``MAX_RANDOM_OPENING``, where no game can end yet).
- Seeds: ``reset(seed=s)`` seeds the seat draws, the openings, the opponent and every game (PettingZoo's
  ``reset(seed)``) from ``s``; the same seed plays the same games.

What a game declares, on the classes its id is registered with (where ``common/envs/symmetry.py``,
``parallel_train_dqn.py`` and ``common/evaluate.py`` read them): ``EVALUATION_OPPONENTS`` (the fixed players
evaluation scores against), ``HELD_OUT_PLAYERS`` (never in a training mix), ``MAX_RANDOM_OPENING``,
``symmetries`` (tic-tac-toe: the 7 rotations and reflections of the square; Connect Four: the mirror),
and for games where a move puts one mark on an empty cell and nothing else changes (tic-tac-toe, Connect
Four) ``other_seat`` and ``plies``, which rebuild the opponent's moves from the learner's record, so that
``parallel_train_dqn.py`` learns negamax values from both players' moves. Connect Four also offers the
built-in's ``LookaheadPlayer`` (``python -m common.evaluate RUN --search-depth 2``).

PettingZoo is an extra (requirements-extras.txt): it is imported when a game is made (through its registry,
``pettingzoo.make``; the adapter steps the unwrapped game and checks every move against the mask itself), and
a missing one is a one-line error that names the file.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.vector import AutoresetMode

from common.envs import connect_four, placement, tictactoe_players
from common.envs.one_game import OneGame
from common.envs.placement import Placement
from common.envs.symmetry import Symmetry

Player = Any  # anything with act(obs, action_mask, env_ids) -> actions (common/envs/connect_four.py's Player)


# ------------------------------------------------------------------ games that place one mark per move

TICTACTOE_RULES = Placement(landing=lambda boards, actions: np.divmod(actions, 3),
                            action_at=lambda rows, cols: 3 * rows + cols,
                            legal=lambda boards: boards.reshape(len(boards), -1) == 0)


def _connect_four_landing(boards: np.ndarray, columns: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """PettingZoo's Connect Four has row 0 at the top: a disc lands on the lowest empty cell of its column."""
    empty = (boards[np.arange(len(boards)), :, columns] == 0).sum(axis=1)
    return empty - 1, columns


CONNECT_FOUR_RULES = Placement(landing=_connect_four_landing, action_at=lambda rows, cols: cols,
                               legal=lambda boards: boards[:, 0, :] == 0)


# ------------------------------------------------------------------ symmetries of a square board

def _square_symmetries(size: int, name: str) -> tuple[Symmetry, ...]:
    """The 7 rotations and reflections of a ``size`` x ``size`` board (observation axes -2, -1) other than the
    identity, each with the move that a cell's move becomes (action ``size * row + column``)."""
    transforms = {"rot90": lambda x: np.rot90(x, 1, axes=(-2, -1)), "rot180": lambda x: np.rot90(x, 2, axes=(-2, -1)),
                  "rot270": lambda x: np.rot90(x, 3, axes=(-2, -1)), "flip_rows": lambda x: x[..., ::-1, :],
                  "flip_cols": lambda x: x[..., :, ::-1], "transpose": lambda x: np.swapaxes(x, -2, -1),
                  "anti_transpose": lambda x: np.rot90(np.swapaxes(x, -2, -1), 2, axes=(-2, -1))}
    out = []
    for label, transform in transforms.items():
        cells = transform(np.arange(size * size).reshape(size, size))  # where each cell's content goes
        action_map = np.empty(size * size, dtype=np.int64)
        action_map[cells.ravel()] = np.arange(size * size)
        out.append(Symmetry(f"{name}_{label}", transform, tuple(int(a) for a in action_map)))
    return tuple(out)


# ------------------------------------------------------------------ the games and their players

class RowsFlipped:
    """A ConnectFour-v0 player (row 0 at the bottom) playing PettingZoo's Connect Four (row 0 at the top)."""

    def __init__(self, player: Player):
        self.player = player

    @property
    def rng(self) -> np.random.Generator:
        return self.player.rng

    @rng.setter
    def rng(self, rng: np.random.Generator) -> None:
        self.player.rng = rng

    def act(self, obs: np.ndarray, action_mask: np.ndarray | None = None,
            env_ids: np.ndarray | None = None) -> np.ndarray:
        return self.player.act(np.ascontiguousarray(np.asarray(obs)[:, :, ::-1]), action_mask, env_ids)


def connect_four_lookahead(q_values_fn, depth: int, seed: int | None = None) -> RowsFlipped:
    """ConnectFour-v0's ``LookaheadPlayer`` over a Q-network trained on ``pettingzoo/connect_four-v3``."""
    def q_values(obs: np.ndarray) -> np.ndarray:  # the search's boards (row 0 at the bottom) as the network saw them
        return q_values_fn(np.ascontiguousarray(obs[:, :, ::-1]))

    return RowsFlipped(connect_four.LookaheadPlayer(q_values, depth, seed))


@dataclass(frozen=True)
class Game:
    """One PettingZoo classic game: its name, its fixed players by name, and what it declares."""

    name: str  # PettingZoo's registry id without its namespace: classic/<name>; ours is pettingzoo/<name>
    players: dict[str, Callable[[int | None], Player]]  # seed -> player
    evaluation_opponents: tuple[str, ...]  # the fixed players evaluation scores against, from both seats
    held_out: tuple[str, ...] = ()  # players no training mix may contain
    symmetries: tuple[Symmetry, ...] = ()
    placement: Placement | None = None  # the rules that rebuild the other seat and the plies
    max_random_opening: int = 0  # random plies that may open a game: none ends that early
    lookahead: Callable | None = None  # (q_values_fn, depth, seed) -> player, for common.evaluate --search-depth

    def make_player(self, name: str, seed: int | None = None) -> Player:
        if name not in self.players:
            raise ValueError(f"unknown player {name!r} for {self.env_id}; known: {', '.join(self.players)}")
        return self.players[name](seed)

    def check_training_opponents(self, names) -> None:
        """ValueError when a training mix (names, or a dict name -> share) names a held-out player."""
        held_out = [name for name in names if name in self.held_out]
        if held_out:
            raise ValueError(f"training opponents {held_out} are held out for evaluation: "
                             f"{', '.join(self.held_out)} may never be in a training mix of {self.env_id}")

    @property
    def env_id(self) -> str:
        return f"pettingzoo/{self.name}"

    def make(self, **kwargs):
        """The game's PettingZoo AEC env, unwrapped, or one line that says what to install."""
        try:
            import pettingzoo
        except ImportError:
            raise ModuleNotFoundError(f"{self.env_id} needs PettingZoo, which is not installed: "
                                      "pip install -r requirements-extras.txt") from None
        return pettingzoo.make("aec", f"classic/{self.name}", **kwargs).unwrapped


def _flipped(make: Callable[[int | None], Player]) -> Callable[[int | None], Player]:
    return lambda seed: RowsFlipped(make(seed))


TICTACTOE = Game("tictactoe-v3",
                 players={"random": connect_four.RandomPlayer, "heuristic": tictactoe_players.HeuristicPlayer,
                          "minimax": tictactoe_players.MinimaxPlayer},
                 evaluation_opponents=("random", "heuristic", "minimax"), held_out=("minimax",),
                 symmetries=_square_symmetries(3, "tictactoe"), placement=TICTACTOE_RULES,
                 max_random_opening=4)
CONNECT_FOUR = Game("connect_four-v3",
                    players={"random": connect_four.RandomPlayer,
                             "heuristic": _flipped(connect_four.HeuristicPlayer),
                             **{f"search{d}": _flipped(partial(connect_four.SearchPlayer, d))
                                for d in connect_four.SEARCH_DEPTHS}},
                    evaluation_opponents=connect_four.EVALUATION_OPPONENTS, held_out=connect_four.HELD_OUT_PLAYERS,
                    symmetries=(connect_four.MIRROR,), placement=CONNECT_FOUR_RULES,
                    max_random_opening=connect_four.MAX_RANDOM_OPENING, lookahead=connect_four_lookahead)
GO = Game("go-v5", players={"random": connect_four.RandomPlayer}, evaluation_opponents=("random",))
GAMES = {game.env_id: game for game in (TICTACTOE, CONNECT_FOUR, GO)}


# ------------------------------------------------------------------ the adapter

class _Declares:
    """Puts a game's declarations on each class registered for it (``class X(..., game=TICTACTOE)``)."""

    game: Game

    def __init_subclass__(cls, game: Game | None = None, **kwargs):
        super().__init_subclass__(**kwargs)
        if game is None:
            return
        cls.game = game
        cls.EVALUATION_OPPONENTS = game.evaluation_opponents
        cls.HELD_OUT_PLAYERS = game.held_out
        cls.MAX_RANDOM_OPENING = game.max_random_opening
        cls.symmetries = game.symmetries  # what replay augmentation may use (common/envs/symmetry.py)
        if game.placement is not None:  # what learning from both seats and negamax targets use
            cls.other_seat = staticmethod(partial(placement.other_seat, game.placement))
            cls.plies = staticmethod(partial(placement.plies, game.placement))
        if game.lookahead is not None:
            cls.LookaheadPlayer = staticmethod(game.lookahead)


def _as_observation(observation: np.ndarray) -> np.ndarray:
    """A game's observation as the learner gets it: float32, board planes channels first."""
    observation = np.asarray(observation, dtype=np.float32)
    return np.moveaxis(observation, -1, 0) if observation.ndim == 3 else observation


class PettingZooGameVectorEnv(_Declares, gym.vector.VectorEnv):
    """``num_envs`` games of one PettingZoo AEC game against one (batched) opponent, with same-step autoreset.

    Each step plays the learner's move in every game, then the opponent's moves, one batched ``act`` call
    per round for every game where it is the opponent's turn, until each game is at the learner's turn again
    or over. A game that ends starts again in the same step.
    """

    metadata = {"autoreset_mode": AutoresetMode.SAME_STEP, "render_modes": []}

    def __init__(self, num_envs: int = 1, opponent: Player | str | None = None, learner_first: bool | None = None,
                 seed: int | None = None, random_opening: int = 0, render_mode: str | None = None,
                 max_episode_steps: int | None = None,  # the games end by themselves (max_game_length cuts them)
                 **game_kwargs):
        if not 0 <= random_opening <= self.game.max_random_opening:
            raise ValueError(f"random_opening must be 0..{self.game.max_random_opening} plies for "
                             f"{self.game.env_id} (no game ends that early), got {random_opening}")
        self.games = [self.game.make(**game_kwargs, **({"render_mode": render_mode} if render_mode else {}))
                      for _ in range(num_envs)]
        first = self.games[0]
        self.agents = list(first.possible_agents)
        if len(self.agents) != 2:
            raise ValueError(f"{self.game.env_id} has {len(self.agents)} agents; the adapter plays two")
        space = first.observation_space(self.agents[0])
        if not isinstance(space, gym.spaces.Dict) or "action_mask" not in space.spaces:
            raise ValueError(f"{self.game.env_id} observes {space}, not a dict with an action_mask")
        board = space["observation"]
        shape = _as_observation(np.zeros(board.shape, dtype=board.dtype)).shape
        self.num_envs = num_envs
        self.random_opening = random_opening
        self.single_observation_space = gym.spaces.Box(float(np.min(board.low)), float(np.max(board.high)), shape,
                                                       np.float32)
        self.single_action_space = gym.spaces.Discrete(int(first.action_space(self.agents[0]).n))
        self.observation_space = gym.vector.utils.batch_space(self.single_observation_space, num_envs)
        self.action_space = gym.vector.utils.batch_space(self.single_action_space, num_envs)
        self.learner_first = learner_first
        self.np_random = np.random.default_rng(seed)
        self.opponent = self._as_player(opponent, seed)
        self.learner = [self.agents[0]] * num_envs  # the learner's agent in each game
        self.returns = np.zeros(num_envs, dtype=np.float64)  # the learner's reward so far in each game

    # -- opponents and seats
    def _as_player(self, opponent: Player | str | None, seed: int | None) -> Player:
        if opponent is None:
            return self.game.make_player("random", seed)
        if isinstance(opponent, str):
            return self.game.make_player(opponent, seed)
        remake = getattr(opponent, "remake_fixed_players", None)
        if remake is not None:  # a self-play mixture: its fixed players are this game's
            self.game.check_training_opponents(name for name in opponent.names if name is not None)
            remake(self.game.make_player)
        return opponent

    def set_opponent(self, opponent: Player | str) -> None:
        """Replace the opponent (a player name of this game, or a player); takes effect at the next move."""
        self.opponent = self._as_player(opponent, int(self.np_random.integers(2**31)))

    def set_learner_first(self, learner_first: bool | None) -> None:
        """Fix the learner's seat for games that start from now on (None = random per game)."""
        self.learner_first = learner_first

    # -- the games
    def _observe(self, env_ids, agents) -> tuple[np.ndarray, np.ndarray]:
        seen = [self.games[i].observe(agent) for i, agent in zip(env_ids, agents)]
        obs = np.stack([_as_observation(s["observation"]) for s in seen]) if seen else \
            np.zeros((0, *self.single_observation_space.shape), np.float32)
        masks = np.stack([np.asarray(s["action_mask"], dtype=bool) for s in seen]) if seen else \
            np.zeros((0, self.single_action_space.n), bool)
        return obs, masks

    def _over(self, i: int) -> bool:
        game, learner = self.games[i], self.learner[i]
        return bool(game.terminations[learner] or game.truncations[learner])

    def _play(self, i: int, action: int, mask: np.ndarray) -> None:
        if not 0 <= action < len(mask) or not mask[action]:
            raise ValueError(f"illegal move: action {action} is not legal in {self.game.env_id} here "
                             "(use info['action_mask'])")
        game = self.games[i]
        game.step(action)
        self.returns[i] += float(game.rewards[self.learner[i]])

    def _opponent_moves(self, env_ids) -> None:
        """The opponent moves, one batched call per round, until every game is at the learner's turn or over."""
        waiting = [i for i in env_ids if not self._over(i) and self.games[i].agent_selection != self.learner[i]]
        while waiting:
            obs, masks = self._observe(waiting, [self.games[i].agent_selection for i in waiting])
            actions = np.asarray(self.opponent.act(obs, masks, np.asarray(waiting, dtype=np.int64)), dtype=np.int64)
            for k, i in enumerate(waiting):
                self._play(i, int(actions[k]), masks[k])
            waiting = [i for i in waiting if not self._over(i) and self.games[i].agent_selection != self.learner[i]]

    def _start_games(self, env_ids: np.ndarray) -> None:
        env_ids = [int(i) for i in env_ids]
        seeds = self.np_random.integers(2**31 - 1, size=len(env_ids))
        for i, seed in zip(env_ids, seeds):
            self.games[i].reset(seed=int(seed))
            self.returns[i] = 0.0
        start_games = getattr(self.opponent, "start_games", None)
        if start_games is not None:
            start_games(np.asarray(env_ids, dtype=np.int64))
        if self.learner_first is None:
            learner_first = self.np_random.random(len(env_ids)) < 0.5
        else:
            learner_first = np.full(len(env_ids), bool(self.learner_first))
        for i, first in zip(env_ids, learner_first):
            opener = self.games[i].agent_selection
            self.learner[i] = opener if first else next(a for a in self.agents if a != opener)
        for _ in range(self.random_opening):  # uniformly random plies of both sides, the opener's first
            for i in env_ids:
                _, mask = self._observe([i], [self.games[i].agent_selection])
                self._play(i, int(connect_four.sample_legal(self.np_random, mask)[0]), mask[0])
        self._opponent_moves(env_ids)

    def _learner_moves(self, env_ids: list[int], actions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The learner's moves in ``env_ids`` and the replies: its rewards, and which games ended or were cut."""
        before = self.returns[env_ids].copy()
        _, masks = self._observe(env_ids, [self.learner[i] for i in env_ids])
        for k, i in enumerate(env_ids):
            self._play(i, int(actions[k]), masks[k])
        self._opponent_moves(env_ids)
        terminated = np.array([bool(self.games[i].terminations[self.learner[i]]) for i in env_ids])
        truncated = np.array([bool(self.games[i].truncations[self.learner[i]]) for i in env_ids]) & ~terminated
        return (self.returns[env_ids] - before).astype(np.float32), terminated, truncated

    # -- the vector env
    def reset(self, *, seed: int | None = None, options: dict | None = None):
        if seed is not None:
            self.np_random = np.random.default_rng(seed)
            if hasattr(self.opponent, "rng"):
                self.opponent.rng = np.random.default_rng(seed + 1)
        self._start_games(np.arange(self.num_envs))
        obs, masks = self._observe(range(self.num_envs), self.learner)
        return obs, {"action_mask": masks}

    def step(self, actions):
        actions = np.asarray(actions, dtype=np.int64).reshape(self.num_envs)
        every = list(range(self.num_envs))
        rewards, terminations, truncations = self._learner_moves(every, actions)
        done = terminations | truncations
        obs, masks = self._observe(every, self.learner)
        infos: dict[str, Any] = {}
        if done.any():
            ended = np.flatnonzero(done)
            infos["final_obs"] = obs.copy()
            infos["_final_obs"] = done.copy()
            infos["final_info"] = {"result": np.where(done, np.sign(self.returns), 0.0), "_result": done.copy()}
            game_labels = getattr(self.opponent, "game_labels", None)
            if game_labels is not None:  # who each game was against (a self-play pool's snapshot id)
                labels = np.zeros(self.num_envs)
                labels[done] = game_labels(ended)
                infos["final_info"].update(opponent=labels, _opponent=done.copy())
            self._start_games(ended)
            obs, masks = self._observe(every, self.learner)
        infos["action_mask"] = masks
        return obs, rewards, terminations, truncations, infos

    def close(self, **kwargs) -> None:
        for game in self.games:
            game.close()


class PettingZooGameEnv(_Declares, OneGame):
    """One game of a PettingZoo AEC game against ``opponent`` (default: the random player); the vector form's
    code with one game, without the autoreset. ``render_mode`` goes to the game (``rgb_array``, ``human``)."""

    metadata = {"render_modes": ["human", "rgb_array"], "render_fps": 2}
    vector_class: type[PettingZooGameVectorEnv]

    def __init__(self, opponent: Player | str | None = None, learner_first: bool | None = None,
                 render_mode: str | None = None, random_opening: int = 0, **game_kwargs):
        self.render_mode = render_mode
        self._vec = self.vector_class(1, opponent=opponent, learner_first=learner_first,
                                      random_opening=random_opening, render_mode=render_mode, **game_kwargs)
        self.observation_space = self._vec.single_observation_space
        self.action_space = self._vec.single_action_space
        self._done = True

    @property
    def aec_env(self):
        """The PettingZoo AEC env of the game in play (its ``agent_selection``, ``board`` ...)."""
        return self._vec.games[0]

    @property
    def learner_agent(self) -> str:
        """The PettingZoo agent the learner plays in this game (``player_1`` ...)."""
        return self._vec.learner[0]

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        self._start_game(seed, options)
        vec = self._vec
        self._done = vec._over(0)
        obs, masks = vec._observe([0], vec.learner)
        return obs[0], {"action_mask": masks[0]}

    def step(self, action):
        if self._done:
            raise RuntimeError("step() called on a finished game; call reset()")
        vec = self._vec
        rewards, terminated, truncated = vec._learner_moves([0], np.array([int(action)]))
        self._done = bool(terminated[0] or truncated[0])
        obs, masks = vec._observe([0], vec.learner)
        info: dict[str, Any] = {"action_mask": masks[0]}
        if self._done:
            info["result"] = float(np.sign(vec.returns[0]))
        return obs[0], float(rewards[0]), bool(terminated[0]), bool(truncated[0]), info

    def render(self):
        return self.aec_env.render() if self.render_mode is not None else None

    def close(self) -> None:
        self._vec.close()


# One pair of classes per registered id (common/envs/registry.py): the adapter's code, each game's declarations.

class TicTacToeVectorEnv(PettingZooGameVectorEnv, game=TICTACTOE):
    """``pettingzoo/tictactoe-v3``, N games."""


class TicTacToeEnv(PettingZooGameEnv, game=TICTACTOE):
    """``pettingzoo/tictactoe-v3``."""

    vector_class = TicTacToeVectorEnv


class PettingZooConnectFourVectorEnv(PettingZooGameVectorEnv, game=CONNECT_FOUR):
    """``pettingzoo/connect_four-v3``, N games."""


class PettingZooConnectFourEnv(PettingZooGameEnv, game=CONNECT_FOUR):
    """``pettingzoo/connect_four-v3``."""

    vector_class = PettingZooConnectFourVectorEnv


class GoVectorEnv(PettingZooGameVectorEnv, game=GO):
    """``pettingzoo/go-v5``, N games."""


class GoEnv(PettingZooGameEnv, game=GO):
    """``pettingzoo/go-v5``."""

    vector_class = GoVectorEnv
