"""GridCoverage-v0: visit every free cell of a grid with obstacles.

An agent on a ``size x size`` grid moves up, down, left or right. Obstacles are drawn
per episode from the seed; every free cell is always reachable from the start (cells
cut off from the start's connected region become obstacles, and a layout with too
little free space is redrawn). Reward: ``cell_reward`` for each newly visited cell,
minus ``step_cost`` every step, plus ``coverage_bonus`` on full coverage. The episode
terminates at full coverage and is truncated after ``max_steps``.

Observation (``view="global"``, the default): float32 array ``(3, size, size)``: agent
one-hot, visited map, obstacle map. ``view="egocentric"`` shows the same maps centred on
the agent instead: ``(2, 2*size - 1, 2*size - 1)``, visited cells and blocked cells
(obstacles and everything off the grid), with the agent always in the middle. The rule
"head for the nearest unvisited cell" then looks the same wherever the agent stands, which
a value network learns far faster than from absolute coordinates.
``info["coverage"]`` is the visited fraction of the free cells.

Render modes of the single env: ``"ansi"`` (A agent, # obstacle, . visited) and ``"rgb_array"``
(uint8, white free cells, green visited ones, dark obstacles, a blue agent, grey grid lines).

:class:`GridCoverageVectorEnv` steps thousands of copies in a handful of numpy calls and
resets finished copies in the same step (``info["final_obs"]``). Copy ``i`` reset with
seed ``s`` plays exactly the episodes of :class:`GridCoverageEnv` reset with ``s + i``.
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np
from gymnasium.utils import seeding
from gymnasium.vector import AutoresetMode, VectorEnv

# up, down, left, right as (row, column) moves
MOVES = np.array([[-1, 0], [1, 0], [0, -1], [0, 1]], dtype=np.int64)
MIN_FREE_FRACTION = 0.5  # a layout whose reachable region is smaller than this is redrawn
VIEWS = ("global", "egocentric")
# rgb_array colours: free, visited, obstacle, agent, grid line
FREE, VISITED, OBSTACLE, AGENT, LINE = (250, 250, 250), (120, 200, 120), (50, 50, 60), (30, 90, 220), (170, 170, 170)


def observation_space(size: int, view: str) -> gym.spaces.Box:
    if view not in VIEWS:
        raise ValueError(f"GridCoverage view must be one of {VIEWS}, got {view!r}")
    shape = (3, size, size) if view == "global" else (2, 2 * size - 1, 2 * size - 1)
    return gym.spaces.Box(0.0, 1.0, shape, np.float32)


def _check_sizes(size: int, obstacle_density: float, max_steps: int | None) -> int:
    if size < 2:
        raise ValueError(f"GridCoverage size must be >= 2, got {size}")
    if not 0.0 <= obstacle_density < MIN_FREE_FRACTION:
        raise ValueError(f"GridCoverage obstacle_density must be in [0, {MIN_FREE_FRACTION}), got {obstacle_density}")
    steps = max_steps if max_steps is not None else 4 * size * size
    if steps < 1:
        raise ValueError(f"GridCoverage max_steps must be >= 1, got {max_steps}")
    return steps


def reachable(free: np.ndarray, start: np.ndarray) -> np.ndarray:
    """Cells of each grid in ``free`` (batch, n, n) 4-connected to ``start`` (batch, 2)."""
    batch = np.arange(len(free))
    reach = np.zeros_like(free)
    reach[batch, start[:, 0], start[:, 1]] = True
    while True:  # flood fill by repeated dilation, all grids at once
        grown = reach.copy()
        grown[:, 1:, :] |= reach[:, :-1, :]
        grown[:, :-1, :] |= reach[:, 1:, :]
        grown[:, :, 1:] |= reach[:, :, :-1]
        grown[:, :, :-1] |= reach[:, :, 1:]
        grown &= free
        if np.array_equal(grown, reach):
            return reach
        reach = grown


def draw_layouts(rngs: list[np.random.Generator], size: int, density: float) -> tuple[np.ndarray, np.ndarray]:
    """One layout per generator: obstacles (k, n, n) bool and start positions (k, 2).

    Each generator is consumed exactly as a lone environment would consume it, so a
    vectorized copy and a single environment with the same seed draw the same layouts.
    """
    k = len(rngs)
    obstacles = np.zeros((k, size, size), dtype=bool)
    starts = np.zeros((k, 2), dtype=np.int64)
    pending = np.arange(k)
    while len(pending):
        for j in pending:
            obstacles[j] = rngs[j].random((size, size)) < density
            starts[j] = rngs[j].integers(0, size, size=2)
            obstacles[j, starts[j, 0], starts[j, 1]] = False
        reach = reachable(~obstacles[pending], starts[pending])
        obstacles[pending] = ~reach  # unreachable free cells become walls
        enough = reach.sum(axis=(1, 2)) >= MIN_FREE_FRACTION * size * size
        pending = pending[~enough]
    return obstacles, starts


class GridState:
    """The state of a batch of grids and the one step rule both env classes use."""

    def __init__(self, num: int, size: int):
        self.size = size
        self.obstacles = np.zeros((num, size, size), dtype=bool)
        self.visited = np.zeros((num, size, size), dtype=bool)
        self.pos = np.zeros((num, 2), dtype=np.int64)
        self.free_count = np.ones(num, dtype=np.int64)
        self.visited_count = np.zeros(num, dtype=np.int64)
        self.steps = np.zeros(num, dtype=np.int64)

    def reset(self, idx: np.ndarray, rngs: list[np.random.Generator], density: float) -> None:
        obstacles, starts = draw_layouts(rngs, self.size, density)
        self.obstacles[idx] = obstacles
        self.pos[idx] = starts
        self.visited[idx] = False
        self.visited[idx, starts[:, 0], starts[:, 1]] = True
        self.free_count[idx] = (~obstacles).sum(axis=(1, 2))
        self.visited_count[idx] = 1
        self.steps[idx] = 0

    def observe(self, view: str = "global") -> np.ndarray:
        if view == "egocentric":
            return self._observe_egocentric()
        visited, obstacles, pos = self.visited, self.obstacles, self.pos
        obs = np.zeros((len(pos), 3, self.size, self.size), dtype=np.float32)
        obs[np.arange(len(pos)), 0, pos[:, 0], pos[:, 1]] = 1.0
        obs[:, 1] = visited
        obs[:, 2] = obstacles
        return obs

    def _observe_egocentric(self) -> np.ndarray:
        n, batch = self.size, len(self.pos)
        # Pad by n - 1 on every side (off-grid counts as blocked), then cut the (2n - 1)-wide window whose
        # centre is the agent: window cell (i, j) is grid cell (row + i - (n - 1), col + j - (n - 1)).
        padded = np.zeros((batch, 2, 3 * n - 2, 3 * n - 2), dtype=np.float32)
        padded[:, 1] = 1.0
        padded[:, 0, n - 1:2 * n - 1, n - 1:2 * n - 1] = self.visited
        padded[:, 1, n - 1:2 * n - 1, n - 1:2 * n - 1] = self.obstacles
        offsets = np.arange(2 * n - 1)
        rows = (self.pos[:, 0, None] + offsets)[:, None, :, None]
        cols = (self.pos[:, 1, None] + offsets)[:, None, None, :]
        return padded[np.arange(batch)[:, None, None, None], np.arange(2)[None, :, None, None], rows, cols]

    def coverage(self) -> np.ndarray:
        return self.visited_count / self.free_count

    def step(self, actions: np.ndarray) -> np.ndarray:
        """Move every agent (walls and obstacles block); returns which moves found a new cell."""
        batch = np.arange(len(self.pos))
        target = np.clip(self.pos + MOVES[actions], 0, self.size - 1)
        blocked = self.obstacles[batch, target[:, 0], target[:, 1]]
        self.pos = np.where(blocked[:, None], self.pos, target)
        new_cell = ~self.visited[batch, self.pos[:, 0], self.pos[:, 1]]
        self.visited[batch, self.pos[:, 0], self.pos[:, 1]] = True
        self.visited_count += new_cell
        self.steps += 1
        return new_cell


def draw_grid(obstacles: np.ndarray, visited: np.ndarray, pos) -> np.ndarray:
    """One grid as a uint8 ``(n * cell, n * cell, 3)`` picture; cells are a multiple of 16 pixels wide."""
    n = obstacles.shape[0]
    cell = 16 * max(1, 16 // n)
    palette = np.array([FREE, VISITED, OBSTACLE], dtype=np.uint8)
    kind = np.where(obstacles, 2, visited.astype(np.int64))
    picture = palette[kind].repeat(cell, axis=0).repeat(cell, axis=1)
    picture[::cell] = LINE
    picture[:, ::cell] = LINE
    picture[-1], picture[:, -1] = LINE, LINE
    centre = (np.arange(cell) - (cell - 1) / 2) ** 2
    agent = centre[:, None] + centre[None, :] <= (0.35 * cell) ** 2
    r, c = int(pos[0]) * cell, int(pos[1]) * cell
    picture[r:r + cell, c:c + cell][agent] = AGENT
    return picture


class _Rules:
    """Reward and episode-end settings shared by the single and the vectorized env."""

    def _init_rules(self, size, obstacle_density, max_steps, cell_reward, step_cost, coverage_bonus, view):
        self.size = int(size)
        self.view = view
        self.single_space = observation_space(self.size, view)
        self.obstacle_density = float(obstacle_density)
        self.max_steps = _check_sizes(self.size, self.obstacle_density, max_steps)
        self.cell_reward, self.step_cost, self.coverage_bonus = float(cell_reward), float(step_cost), \
            float(coverage_bonus)

    def _outcome(self, state: GridState, new_cell: np.ndarray):
        full = state.visited_count == state.free_count
        rewards = (self.cell_reward * new_cell - self.step_cost + self.coverage_bonus * full).astype(np.float32)
        truncated = (state.steps >= self.max_steps) & ~full
        return rewards, full, truncated


class GridCoverageEnv(_Rules, gym.Env):
    """One grid; see the module docstring for the rules."""

    metadata = {"render_modes": ["ansi", "rgb_array"], "render_fps": 8}

    def __init__(self, size: int = 6, obstacle_density: float = 0.15, max_steps: int | None = None,
                 cell_reward: float = 1.0, step_cost: float = 0.05, coverage_bonus: float = 5.0,
                 view: str = "global", render_mode: str | None = None):
        self._init_rules(size, obstacle_density, max_steps, cell_reward, step_cost, coverage_bonus, view)
        self.observation_space = self.single_space
        self.action_space = gym.spaces.Discrete(4)
        self.render_mode = render_mode
        self._state = GridState(1, self.size)

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self._state.reset(np.array([0]), [self.np_random], self.obstacle_density)
        return self._state.observe(self.view)[0], {"coverage": float(self._state.coverage()[0])}

    def step(self, action):
        new_cell = self._state.step(np.array([int(action)]))
        rewards, full, truncated = self._outcome(self._state, new_cell)
        info = {"coverage": float(self._state.coverage()[0])}
        return self._state.observe(self.view)[0], float(rewards[0]), bool(full[0]), bool(truncated[0]), info

    def render(self):
        s = self._state
        if self.render_mode == "rgb_array":
            return draw_grid(s.obstacles[0], s.visited[0], s.pos[0])
        rows = []
        for r in range(self.size):
            row = ""
            for c in range(self.size):
                row += "A" if (r, c) == tuple(s.pos[0]) else "#" if s.obstacles[0, r, c] else \
                    "." if s.visited[0, r, c] else " "
            rows.append(row)
        return "\n".join(rows)


class GridCoverageVectorEnv(_Rules, VectorEnv):
    """``num_envs`` grids stepped in numpy, with same-step autoreset."""

    metadata = {"autoreset_mode": AutoresetMode.SAME_STEP}

    def __init__(self, num_envs: int = 1, size: int = 6, obstacle_density: float = 0.15,
                 max_steps: int | None = None, cell_reward: float = 1.0, step_cost: float = 0.05,
                 coverage_bonus: float = 5.0, view: str = "global", **_ignored):
        self._init_rules(size, obstacle_density, max_steps, cell_reward, step_cost, coverage_bonus, view)
        self.num_envs = int(num_envs)
        self.single_observation_space = self.single_space
        self.single_action_space = gym.spaces.Discrete(4)
        self.observation_space = gym.vector.utils.batch_space(self.single_observation_space, self.num_envs)
        self.action_space = gym.vector.utils.batch_space(self.single_action_space, self.num_envs)
        self._state = GridState(self.num_envs, self.size)
        self._rngs: list[np.random.Generator] = []

    def reset(self, *, seed: int | list[int] | None = None, options: dict | None = None):
        if isinstance(seed, int):
            seeds = [seed + i for i in range(self.num_envs)]
        else:
            seeds = list(seed) if seed is not None else [None] * self.num_envs
        self._rngs = [seeding.np_random(s)[0] for s in seeds]
        self._state.reset(np.arange(self.num_envs), self._rngs, self.obstacle_density)
        return self._state.observe(self.view), {"coverage": self._state.coverage()}

    def step(self, actions):
        if not self._rngs:
            raise RuntimeError("call reset() before step()")
        state = self._state
        new_cell = state.step(np.asarray(actions, dtype=np.int64))
        rewards, terminated, truncated = self._outcome(state, new_cell)
        coverage = state.coverage()
        info = {"coverage": coverage}
        done = terminated | truncated
        if done.any():
            info["final_obs"] = state.observe(self.view)
            info["_final_obs"] = done
            info["final_info"] = {"coverage": coverage.copy(), "_coverage": done}
            idx = np.flatnonzero(done)
            state.reset(idx, [self._rngs[i] for i in idx], self.obstacle_density)
            info["coverage"] = state.coverage()
        return state.observe(self.view), rewards, terminated, truncated, info
