"""ConnectFour decision-time lookahead over a learned Q-network: greedy at depth 0, takes a win at
depth 1, blocks a loss at depth 2, the negamax a plain recursion computes, legal, seeded, one network
call a search; and python -m common.evaluate --search-depth plays through it or refuses in one line."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from test_connect_four_search import _four, act_on, board_from_rows, positions

from common.envs.connect_four import (
    COLS,
    LOOKAHEAD_LEAVES,
    ROWS,
    WIN_SCORE,
    LookaheadPlayer,
    legal_mask,
    lookahead_values,
    observe,
)


def prefers(column: int):
    """A hand-built Q function: whatever the board, ``column`` is worth 1 and every other column 0."""
    def q_values(obs: np.ndarray) -> np.ndarray:
        out = np.zeros((len(obs), COLS), dtype=np.float32)
        out[:, column] = 1.0
        return out
    return q_values


def linear_q(seed: int):
    """A fixed random linear function of the observation: distinct values, the same for the same board."""
    weights = np.random.default_rng(seed).normal(size=(2 * ROWS * COLS, COLS)).astype(np.float32)
    return lambda obs: np.asarray(obs, np.float32).reshape(len(obs), -1) @ weights


def masks_of(boards: np.ndarray) -> np.ndarray:
    return legal_mask((boards != 0).sum(axis=1))


# Three of the side to move (X) on the bottom row: column 1 or 5 wins at once.
WIN_IN_ONE = board_from_rows([".......", ".......", ".......", ".......", "..OO...", "..XXX.O"])
# Three of the other side (O) on the bottom row: only column 3 stops it winning next move.
MUST_BLOCK = board_from_rows([".......", ".......", ".......", ".......", "....XX.", "....OOO"])


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_from_depth_1_an_immediate_win_is_taken_over_what_the_network_prefers(depth):
    for seed in range(20):
        assert act_on(LookaheadPlayer(prefers(0), depth, seed), WIN_IN_ONE) in (1, 5)
    values = lookahead_values(prefers(0), observe(WIN_IN_ONE[None]), depth)[0]
    assert values[1] == values[5] == WIN_SCORE + depth  # a win now is worth more than any later one
    assert act_on(LookaheadPlayer(prefers(0), 0, 0), WIN_IN_ONE) == 0  # the network alone misses it


@pytest.mark.parametrize("depth", [2, 3])
def test_from_depth_2_the_opponents_immediate_win_is_blocked(depth):
    for seed in range(20):
        assert act_on(LookaheadPlayer(prefers(0), depth, seed), MUST_BLOCK) == 3
    values = lookahead_values(prefers(0), observe(MUST_BLOCK[None]), depth)[0]
    assert (values[[0, 1, 2, 4, 5, 6]] <= -WIN_SCORE).all() and values[3] > -WIN_SCORE
    assert act_on(LookaheadPlayer(prefers(0), 0, 0), MUST_BLOCK) == 0  # the network alone loses
    one_ply = {act_on(LookaheadPlayer(prefers(0), 1, seed), MUST_BLOCK) for seed in range(20)}
    assert one_ply != {3}  # one ply does not see the reply


def test_depth_0_is_the_networks_greedy_play():
    boards, _ = positions(200, 12, seed=3)
    obs, masks = observe(boards), masks_of(boards)
    q_values = linear_q(0)
    values = lookahead_values(q_values, obs, 0, masks)
    np.testing.assert_array_equal(values, np.where(masks, q_values(obs), -np.inf))
    np.testing.assert_array_equal(LookaheadPlayer(q_values, 0, seed=1).act(obs, masks),
                                  np.where(masks, q_values(obs), -np.inf).argmax(axis=1))


def _negamax(board: np.ndarray, depth: int, q_values) -> np.ndarray:
    """The same search as a plain recursion over one board (+1 to move), every move expanded."""
    values = np.full(COLS, -np.inf)
    if depth == 0:
        q = np.asarray(q_values(observe(board[None])), dtype=np.float64)[0]
        legal = (board != 0).sum(axis=0) < ROWS
        return np.where(legal, q, -np.inf)
    for col in range(COLS):
        row = int((board[:, col] != 0).sum())
        if row == ROWS:
            continue
        child = board.copy()
        child[row, col] = 1
        if _four(child, 1):
            values[col] = WIN_SCORE + depth
        elif (child != 0).all():
            values[col] = 0.0
        else:
            values[col] = -_negamax(-child, depth - 1, q_values).max()
    return values


@pytest.mark.parametrize("depth, plies", [(1, 8), (2, 14), (3, 20), (3, 33)])
def test_the_batched_search_is_the_plain_negamax(depth, plies):
    boards, _ = positions(12, plies, seed=depth + plies)
    q_values = linear_q(depth)
    got = lookahead_values(q_values, observe(boards), depth)
    want = np.stack([_negamax(board, depth, q_values) for board in boards])
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_full_and_masked_columns_are_never_chosen():
    full_first = board_from_rows(["X......", "O......", "X......", "O......", "X...O..", "O...X.."])
    for depth in range(4):
        player = LookaheadPlayer(prefers(0), depth, seed=depth)
        assert all(act_on(player, full_first) != 0 for _ in range(20))
    # A mask may forbid more than the board does, even the only winning column.
    obs = observe(np.repeat(WIN_IN_ONE[None], 50, axis=0))
    mask = masks_of(WIN_IN_ONE[None]).repeat(50, axis=0)
    mask[:, [1, 3, 5]] = False
    for depth in range(4):
        actions = LookaheadPlayer(prefers(3), depth, seed=7).act(obs, mask)
        assert mask[np.arange(50), actions].all(), (depth, actions)
    boards, _ = positions(100, 25, seed=11)
    masks = masks_of(boards)
    assert (~masks).any()
    for depth in range(3):
        actions = LookaheadPlayer(linear_q(depth), depth, seed=depth).act(observe(boards), masks)
        assert masks[np.arange(len(boards)), actions].all()


def test_ties_are_broken_at_random_by_the_seed():
    empty = np.zeros((200, ROWS, COLS), np.int8)
    flat = lambda obs: np.zeros((len(obs), COLS), np.float32)  # noqa: E731  (every column ties)
    first = LookaheadPlayer(flat, 2, seed=5).act(observe(empty), masks_of(empty))
    again = LookaheadPlayer(flat, 2, seed=5).act(observe(empty), masks_of(empty))
    other = LookaheadPlayer(flat, 2, seed=6).act(observe(empty), masks_of(empty))
    np.testing.assert_array_equal(first, again)
    assert set(first.tolist()) == set(range(COLS)) and (first != other).any()


def test_every_leaf_of_a_search_goes_to_the_network_in_one_call():
    boards, _ = positions(10, 6, seed=2)
    calls = []

    def counted(obs):
        calls.append(len(obs))
        return linear_q(0)(obs)

    lookahead_values(counted, observe(boards), 2)
    assert len(calls) == 1 and 0 < calls[0] <= 10 * COLS * COLS, calls
    calls.clear()
    many, _ = positions(2 * LOOKAHEAD_LEAVES // COLS ** 3, 6, seed=4)  # more leaves than one call may take
    lookahead_values(counted, observe(many), 3)
    assert len(calls) >= 2 and max(calls) <= LOOKAHEAD_LEAVES, calls


# ---------------------------------------------------------------- python -m common.evaluate --search-depth

def checkpoint(path, env_id: str, network: torch.nn.Module) -> str:
    """A checkpoint as the scripts write it (weights, the network's spec, the env), untrained."""
    from common.checkpoint import save_checkpoint

    save_checkpoint({"model": network.state_dict(), "policy": network.spec, "env": {"id": env_id, "kwargs": {}},
                     "script": "parallel_train_dqn", "counters": {"global_step": 0}}, path)
    return str(path)


def spaces(env_id: str):
    import gymnasium as gym

    import common.envs  # noqa: F401  (registers ConnectFour-v0)

    env = gym.make(env_id)
    return env.observation_space, env.action_space


def run_evaluate(capsys, *args) -> tuple[int, str, str]:
    from common.evaluate import main

    try:
        code = main([str(a) for a in args])
    except SystemExit as stopped:
        code = stopped.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_evaluate_plays_through_the_lookahead_and_says_its_depth(tmp_path, capsys):
    from common.networks import QNetwork

    torch.manual_seed(0)
    path = checkpoint(tmp_path / "c4.pt", "ConnectFour-v0", QNetwork(*spaces("ConnectFour-v0"), (16,)))
    code, out, err = run_evaluate(capsys, path, "--episodes", "4", "--search-depth", "2", "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["search_depth"] == 2 and set(report["opponents"]) >= {"random", "search1"}
    code, out, err = run_evaluate(capsys, path, "--episodes", "2", "--search-depth", "2")
    assert code == 0 and "2 episodes through a depth-2 lookahead over the Q-network" in out.splitlines()[0], out
    code, out, err = run_evaluate(capsys, path, "--episodes", "2", "--json")
    assert code == 0 and json.loads(out)["search_depth"] == 0, err  # greedy unless asked


def test_search_depth_is_refused_in_one_line_where_no_lookahead_exists(tmp_path, capsys):
    from common.networks import ActorCritic, QNetwork

    cartpole = checkpoint(tmp_path / "cartpole.pt", "CartPole-v1", QNetwork(*spaces("CartPole-v1"), (8,)))
    actor_critic = checkpoint(tmp_path / "ppo.pt", "ConnectFour-v0", ActorCritic(*spaces("ConnectFour-v0"), (8,)))
    for path, depth, message in ((cartpole, 1, "CartPole-v1 offers no lookahead"),
                                 (actor_critic, 2, "searches over Q-values"),
                                 (cartpole, -1, "--search-depth -1: must be >= 0")):
        code, out, err = run_evaluate(capsys, path, "--episodes", "1", "--search-depth", depth)
        assert code == 2 and len(err.strip().splitlines()) == 1 and message in err, err
        assert out == ""


def test_random_openings_diversify_the_report_or_are_refused_in_one_line(tmp_path, capsys):
    """--random-opening N opens every game of the report with N random plies (reported as random_opening); a
    deterministic policy then meets a search player in many positions. Refused where the env has none, beyond
    the env's most, or below 0."""
    from common.networks import QNetwork

    torch.manual_seed(0)
    path = checkpoint(tmp_path / "c4.pt", "ConnectFour-v0", QNetwork(*spaces("ConnectFour-v0"), (16,)))
    code, out, err = run_evaluate(capsys, path, "--episodes", "40", "--random-opening", "4", "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["random_opening"] == 4 and set(report["opponents"]) >= {"random", "search1"}
    code, out, err = run_evaluate(capsys, path, "--episodes", "2", "--random-opening", "2")
    assert code == 0 and "each opened by 2 random plies" in out.splitlines()[0], out
    cartpole = checkpoint(tmp_path / "cartpole.pt", "CartPole-v1", QNetwork(*spaces("CartPole-v1"), (8,)))
    for where, plies, message in ((cartpole, 2, "CartPole-v1 has no random openings"),
                                  (path, 7, "at most 6 random plies"), (path, -1, "must be >= 0")):
        code, out, err = run_evaluate(capsys, where, "--episodes", "1", "--random-opening", plies)
        assert code == 2 and len(err.strip().splitlines()) == 1 and message in err, err
        assert out == ""
