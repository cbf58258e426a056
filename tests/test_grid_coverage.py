"""GridCoverage-v0: layouts always reachable, coverage accounting, vectorized == single."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest

from common.envs import make_vec_env
from common.envs.grid_coverage import GridCoverageEnv, GridCoverageVectorEnv, draw_layouts, reachable


def test_registered_and_spaces():
    env = gym.make("GridCoverage-v0", size=5)
    obs, info = env.reset(seed=0)
    assert obs.shape == (3, 5, 5) and obs.dtype == np.float32
    assert env.observation_space.contains(obs)
    assert env.action_space.n == 4
    assert 0 < info["coverage"] <= 1


def test_egocentric_view_is_the_global_maps_centred_on_the_agent():
    size, centre = 5, 4
    glob = GridCoverageEnv(size=size, obstacle_density=0.3)
    ego = GridCoverageEnv(size=size, obstacle_density=0.3, view="egocentric")
    assert ego.observation_space.shape == (2, 9, 9)
    g, _ = glob.reset(seed=4)
    e, _ = ego.reset(seed=4)
    rng = np.random.default_rng(1)
    for _ in range(40):
        row, col = np.argwhere(g[0] == 1)[0]
        assert ego.observation_space.contains(e)
        for r in range(-centre, centre + 1):
            for c in range(-centre, centre + 1):
                gr, gc = row + r, col + c
                on_grid = 0 <= gr < size and 0 <= gc < size
                assert e[0, centre + r, centre + c] == (g[1, gr, gc] if on_grid else 0.0)
                assert e[1, centre + r, centre + c] == (g[2, gr, gc] if on_grid else 1.0)
        action = int(rng.integers(0, 4))
        g, *_ = glob.step(action)
        e, *_ = ego.step(action)
    with pytest.raises(ValueError, match="view"):
        GridCoverageEnv(view="sideways")


@pytest.mark.parametrize("density", [0.0, 0.3, 0.45])
def test_every_layout_is_fully_reachable(density):
    rngs = [np.random.default_rng(seed) for seed in range(300)]
    obstacles, starts = draw_layouts(rngs, 7, density)
    free = ~obstacles
    assert not obstacles[np.arange(300), starts[:, 0], starts[:, 1]].any(), "start on an obstacle"
    np.testing.assert_array_equal(reachable(free, starts), free)
    assert (free.sum(axis=(1, 2)) >= 0.5 * 49).all()
    if density > 0:
        assert obstacles.any()


def test_coverage_accounting_and_rewards():
    env = GridCoverageEnv(size=4, obstacle_density=0.0, max_steps=100, cell_reward=1.0, step_cost=0.1,
                          coverage_bonus=5.0)
    obs, info = env.reset(seed=1)
    assert info["coverage"] == pytest.approx(1 / 16)
    row, col = np.argwhere(obs[0] == 1)[0]
    # Walk to the top-left corner, then sweep the rows like a snake.
    plan = [0] * row + [2] * col
    for r in range(4):
        plan += [3] * 3 if r % 2 == 0 else [2] * 3
        if r < 3:
            plan.append(1)
    total, seen, terminated = 0.0, {(row, col)}, False
    r_pos = [row, col]
    for action in plan:
        moves = {0: (-1, 0), 1: (1, 0), 2: (0, -1), 3: (0, 1)}[action]
        r_pos = [min(3, max(0, r_pos[0] + moves[0])), min(3, max(0, r_pos[1] + moves[1]))]
        new = tuple(r_pos) not in seen
        seen.add(tuple(r_pos))
        obs, reward, terminated, truncated, info = env.step(action)
        expected = (1.0 if new else 0.0) - 0.1 + (5.0 if len(seen) == 16 else 0.0)
        assert reward == pytest.approx(expected)
        assert info["coverage"] == pytest.approx(len(seen) / 16)
        assert obs[1].sum() == len(seen)
        total += reward
        if terminated:
            break
    assert terminated and info["coverage"] == 1.0


def test_obstacles_block_and_truncation():
    env = GridCoverageEnv(size=5, obstacle_density=0.4, max_steps=7)
    obs, _ = env.reset(seed=3)
    for step in range(7):
        before = np.argwhere(obs[0] == 1)[0]
        obs, _, terminated, truncated, _ = env.step(step % 4)
        after = np.argwhere(obs[0] == 1)[0]
        assert obs[2][tuple(after)] == 0, "agent stands on an obstacle"
        assert np.abs(after - before).sum() <= 1
    assert truncated and not terminated


@pytest.mark.parametrize("view", ["global", "egocentric"])
def test_vectorized_equals_single(view):
    n, steps = 6, 300
    vec = GridCoverageVectorEnv(num_envs=n, size=5, obstacle_density=0.2, max_steps=30, view=view)
    singles = [GridCoverageEnv(size=5, obstacle_density=0.2, max_steps=30, view=view) for _ in range(n)]
    obs, _ = vec.reset(seed=10)
    single_obs = np.stack([env.reset(seed=10 + i)[0] for i, env in enumerate(singles)])
    np.testing.assert_array_equal(obs, single_obs)
    rng = np.random.default_rng(0)
    dones = 0
    for _ in range(steps):
        actions = rng.integers(0, 4, n)
        obs, rewards, terms, truncs, info = vec.step(actions)
        for i, env in enumerate(singles):
            o, r, te, tr, inf = env.step(actions[i])
            assert r == pytest.approx(rewards[i]) and te == terms[i] and tr == truncs[i]
            if te or tr:
                dones += 1
                np.testing.assert_array_equal(info["final_obs"][i], o)
                assert info["final_info"]["coverage"][i] == pytest.approx(inf["coverage"])
                o, _ = env.reset()
            np.testing.assert_array_equal(obs[i], o)
    assert dones >= n * 5


def test_make_vec_env_reports_coverage_per_episode():
    env = make_vec_env("GridCoverage-v0", 8, seed=0, size=4, max_steps=10)
    env.reset()
    episodes = []
    for _ in range(25):
        episodes += env.step(np.random.default_rng(1).integers(0, 4, 8)).episodes
    assert episodes and all(0 < ep["coverage"] <= 1 and ep["length"] <= 10 for ep in episodes)


def test_rgb_array_frame_shows_obstacles_visited_cells_and_the_agent():
    env = gym.make("GridCoverage-v0", size=6, obstacle_density=0.3, render_mode="rgb_array")
    assert "rgb_array" in env.metadata["render_modes"] and env.metadata["render_fps"] > 0
    env.reset(seed=3)
    state = env.unwrapped._state
    first = env.render()
    cell = 32  # 16 * (16 // 6)
    assert first.dtype == np.uint8 and first.shape == (6 * cell, 6 * cell, 3)

    def colour(frame, r, c, dr=2, dc=2):  # a pixel inside cell (r, c), off the grid lines and the agent disc
        return tuple(frame[r * cell + dr, c * cell + dc].tolist())

    obstacles = list(zip(*np.nonzero(state.obstacles[0])))
    assert obstacles and all(colour(first, r, c) == (50, 50, 60) for r, c in obstacles)
    start = tuple(state.pos[0])
    assert tuple(first[start[0] * cell + cell // 2, start[1] * cell + cell // 2].tolist()) == (30, 90, 220)
    for action in range(4):  # the first move that reaches a new cell
        env.step(action)
        if tuple(state.pos[0]) != start:
            break
    frame = env.render()
    assert (frame != first).any()
    assert colour(frame, *start, dr=cell // 2, dc=cell // 2) == (120, 200, 120)  # left behind: visited
    unvisited = list(zip(*np.nonzero(~state.visited[0] & ~state.obstacles[0])))
    assert all(colour(frame, r, c) == (250, 250, 250) for r, c in unvisited)
    text = GridCoverageEnv(render_mode="ansi")
    text.reset(seed=0)
    assert text.render().count("A") == 1  # the text mode is still there
