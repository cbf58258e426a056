"""Market-v0: determinism, vectorized == single, accounting, the cache, and sharing it without copies."""

from __future__ import annotations

import multiprocessing as mp

import gymnasium as gym
import numpy as np
import pytest

import common.envs  # noqa: F401  (registers Market-v0)
from common.envs import make_vec_env
from common.envs.market import (
    MarketDataError,
    MarketEnv,
    MarketVectorEnv,
    load_market_data,
    read_market_csv,
    share_market_data,
    synthetic_market,
)

SMALL = dict(top_n_items=4, window=8, episode_length=40)


@pytest.fixture(scope="module")
def data():
    return synthetic_market(num_items=12, num_steps=1500, seed=3)


def rollout(env, seed: int, actions) -> list:
    obs, info = env.reset(seed=seed)
    trace = [(obs, info["net_worth"])]
    for action in actions:
        obs, reward, terminated, truncated, info = env.step(int(action))
        trace.append((obs, reward, terminated, info["net_worth"], info["trades"]))
        if terminated or truncated:
            obs, info = env.reset()
    return trace


def test_synthetic_market_is_deterministic_and_realistic():
    a, b, c = synthetic_market(8, 600, seed=5), synthetic_market(8, 600, seed=5), synthetic_market(8, 600, seed=6)
    assert np.array_equal(a.prices, b.prices) and np.array_equal(a.volumes, b.volumes)
    assert not np.array_equal(a.prices, c.prices)
    assert a.prices.dtype == np.float32 and a.prices.shape == (8, 600)
    levels = np.log10(a.prices.mean(axis=1))
    assert levels.max() - levels.min() > 1.5  # price levels span orders of magnitude
    moves = np.abs(np.diff(np.log(a.prices), axis=1))
    corr = [np.corrcoef(moves[i], a.volumes[i, 1:])[0, 1] for i in range(8)]
    assert np.mean(corr) > 0.2  # volume rises with the size of the price move


def test_env_is_deterministic_per_seed(data):
    actions = np.random.default_rng(0).integers(0, 9, 120)
    first = rollout(MarketEnv(data=data, **SMALL), 11, actions)
    again = rollout(MarketEnv(data=data, **SMALL), 11, actions)
    other = rollout(MarketEnv(data=data, **SMALL), 12, actions)
    for x, y in zip(first, again):
        assert np.array_equal(x[0], y[0]) and x[1:] == y[1:]
    assert not np.array_equal(first[0][0], other[0][0])  # another seed, another window


def test_vectorized_matches_single_step_for_step(data):
    n = 3
    vec = MarketVectorEnv(num_envs=n, data=data, **SMALL)
    singles = [MarketEnv(data=data, **SMALL) for _ in range(n)]
    obs, _ = vec.reset(seed=7)
    assert np.array_equal(obs, np.stack([env.reset(seed=7 + i)[0] for i, env in enumerate(singles)]))
    rng = np.random.default_rng(1)
    resets = 0
    for _ in range(130):  # several episodes of 40 steps: exercises same-step autoreset
        actions = rng.integers(0, vec.single_action_space.n, n)
        obs, rewards, terminations, truncations, info = vec.step(actions)
        for i, env in enumerate(singles):
            s_obs, s_reward, s_term, s_trunc, s_info = env.step(int(actions[i]))
            assert s_term == terminations[i] and s_trunc == truncations[i]
            if s_term:
                resets += 1
                assert np.array_equal(info["final_obs"][i], s_obs) and info["_final_obs"][i]
                assert info["final_info"]["net_worth"][i] == s_info["net_worth"]
                s_obs, s_info = env.reset()
            assert np.array_equal(obs[i], s_obs)
            assert rewards[i] == np.float32(s_reward)
            assert info["net_worth"][i] == s_info["net_worth"]
    assert resets == 3 * n


def test_accounting_net_worth_fees_and_limits(data):
    fee = 0.01
    env = MarketEnv(data=data, fee=fee, initial_cash=1000.0, lot_fraction=0.3, max_lots=2, **SMALL)
    env.reset(seed=0)
    core = env.core
    k = env.params.top_n_items
    rng = np.random.default_rng(4)
    fees_seen = 0.0
    for _ in range(39):
        cash, lots = core.cash[0], core.lots[0].copy()
        mid = core.prices[core.items, core.t[0]].astype(np.float64)
        action = int(rng.integers(0, 2 * k + 1))
        _, reward, _, _, info = env.step(action)
        item = (action - 1) % k
        units = core.lot_units[0, item]
        if 1 <= action <= k and core.lots[0, item] == lots[item] + 1:  # a buy went through
            cost = units * mid[item] * (1 + core.half_spread[item])
            assert np.isclose(cash - core.cash[0], cost * (1 + fee))
            fees_seen += cost * fee
        elif action > k and core.lots[0, item] == lots[item] - 1:  # a sell went through
            proceeds = units * mid[item] * (1 - core.half_spread[item])
            assert np.isclose(core.cash[0] - cash, proceeds * (1 - fee))
            fees_seen += proceeds * fee
        else:  # hold, or refused: nothing changes
            assert core.cash[0] == cash and np.array_equal(core.lots[0], lots)
        now = core.prices[core.items, core.t[0]].astype(np.float64)
        assert np.isclose(info["net_worth"], core.cash[0] + (core.lots[0] * core.lot_units[0] * now).sum())
        assert core.cash[0] >= 0 and (core.lots[0] <= 2).all() and (core.lots[0] >= 0).all()
        assert np.isclose(info["fees"], fees_seen)
    # 0.3 of the cash per lot: at most three buys fit, the fourth is refused for lack of cash
    env.reset(seed=1)
    for item in (1, 2, 3, 4):
        env.step(item)
    assert core.lots[0].sum() == 3 and core.invalid[0] == 1
    env.step(2 * k)  # sell a lot of an item not held: refused
    assert core.invalid[0] == 2


def test_registered_and_made_through_gymnasium_without_copying(data):
    env = gym.make("Market-v0", data=data, **SMALL)
    obs, _ = env.reset(seed=0)
    assert env.observation_space.contains(obs)
    assert np.shares_memory(env.unwrapped.core.prices, data.prices)
    vec = make_vec_env("Market-v0", 4, seed=0, data=data, **SMALL)
    assert isinstance(vec.env, MarketVectorEnv) and np.shares_memory(vec.env.core.prices, data.prices)
    vec.reset()
    result = None
    for _ in range(40):
        result = vec.step(np.zeros(4, dtype=np.int64))
    assert len(result.episodes) == 4 and all(e["net_worth"] == 10_000.0 for e in result.episodes)


def test_cache_is_built_once_then_loaded(tmp_path):
    first, info1 = load_market_data("synthetic", tmp_path, num_items=6, history_steps=500, data_seed=2)
    second, info2 = load_market_data("synthetic", tmp_path, num_items=6, history_steps=500, data_seed=2)
    assert info1["built"] and not info2["built"]
    shared, _ = share_market_data(second)  # read from the cache file straight into shared memory
    try:
        assert np.array_equal(shared["market_prices"], first.prices)
        assert np.array_equal(shared["market_volumes"], first.volumes)
    finally:
        shared.unlink_all()
    assert np.array_equal(first.prices, synthetic_market(6, 500, 2).prices)
    assert np.array_equal(first.volumes, second.volumes)
    assert sorted(p.name for p in (tmp_path / info1["path"].split("/")[-1]).iterdir()) == \
        ["meta.json", "prices.npy", "volumes.npy"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left


def test_corrupt_or_wrong_shape_cache_is_one_clear_error(tmp_path):
    _, info = load_market_data("synthetic", tmp_path, num_items=6, history_steps=500, data_seed=2)
    prices = tmp_path / info["path"].split("/")[-1] / "prices.npy"
    np.save(prices, np.ones((5, 500), dtype=np.float32))
    with pytest.raises(MarketDataError, match="wrong shape"):
        load_market_data("synthetic", tmp_path, num_items=6, history_steps=500, data_seed=2)
    prices.write_bytes(prices.read_bytes()[:100])
    with pytest.raises(MarketDataError, match="corrupt cache file") as err:
        load_market_data("synthetic", tmp_path, num_items=6, history_steps=500, data_seed=2)
    assert "\n" not in str(err.value)


def test_csv_import_pivots_fills_and_ranks(tmp_path):
    csv_file = tmp_path / "prices.csv"
    csv_file.write_text("item,timestamp,price,volume,extra\n"
                        "b,1,10.0,5,x\n" "a,1,2.0,100,x\n" "a,2,2.5,300,x\n" "c,2,1000,1,x\n"
                        "b,3,11.0,7,x\n" "a,3,2.4,50,x\n" "\n")
    data = read_market_csv(csv_file)
    assert data.item_names == ["a", "b", "c"]
    np.testing.assert_allclose(data.prices, [[2.0, 2.5, 2.4], [10.0, 10.0, 11.0], [1000, 1000, 1000]])
    np.testing.assert_allclose(data.volumes, [[100, 300, 50], [5, 0, 7], [0, 1, 0]])
    assert list(data.top_items(2)) == [0, 1]
    with pytest.raises(MarketDataError, match="top_n_items 4"):
        data.top_items(4)


@pytest.mark.parametrize("text, message", [
    ("timestamp,item,price\n1,a,2.0\n", "missing column\\(s\\) volume"),
    ("timestamp,item,price,volume\n1,a,abc,3\n2,a,1,1\n", ":2: expected"),
    ("timestamp,item,price,volume\n1,a,-1,3\n2,a,1,1\n", ":2: price must be > 0"),
])
def test_bad_csv_is_one_clear_error(tmp_path, text, message):
    csv_file = tmp_path / "bad.csv"
    csv_file.write_text(text)
    with pytest.raises(MarketDataError, match=message):
        read_market_csv(csv_file)


def _child_reads_shared_cache(specs, conn):
    env = MarketVectorEnv(num_envs=2, data_specs=specs, **SMALL)
    env.reset(seed=0)
    conn.send("attached")
    conn.recv()  # the parent writes into its buffer now
    conn.send(float(env.core.prices[0, 0]))
    env.close()


def test_cache_is_attached_not_copied(data):
    shared, specs = share_market_data(data)
    try:
        local = MarketVectorEnv(num_envs=2, data_specs=specs, **SMALL)
        assert np.shares_memory(local.core.prices, local.data.prices)
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        process = ctx.Process(target=_child_reads_shared_cache, args=(specs, child))
        process.start()
        assert parent.poll(60) and parent.recv() == "attached"
        shared["market_prices"][0, 0] = 12345.0  # the coordinator's buffer
        parent.send("read")
        assert parent.poll(30) and parent.recv() == 12345.0  # the worker sees it: same memory
        assert local.core.prices[0, 0] == 12345.0
        process.join(30)
        assert process.exitcode == 0
        local.close()
    finally:
        shared.unlink_all()


def test_rgb_array_chart_follows_prices_net_worth_and_lots(data):
    env = gym.make("Market-v0", render_mode="rgb_array", data=data, **SMALL)
    assert "rgb_array" in env.metadata["render_modes"] and env.metadata["render_fps"] > 0
    env.reset(seed=0)
    first = env.render()
    assert first.dtype == np.uint8 and first.shape == (240, 320, 3)
    lots_panel = first[208:]
    assert (lots_panel == 255).all()  # nothing held: no bars
    env.step(2)  # buy a lot of item 1 (the second of four)
    frame = env.render()
    assert env.unwrapped.core.lots[0].tolist() == [0, 1, 0, 0]
    assert (frame != first).any()
    bars = np.flatnonzero((frame[208:] != 255).any(axis=(0, 2)))
    assert bars.min() >= 80 and bars.max() < 160  # 80 pixels a bar

    def rightmost_line_pixel(f):  # price and net-worth lines: neither background white nor axis grey
        line = ~((f[:208] == 255).all(axis=2) | (f[:208] == 170).all(axis=2))
        return np.flatnonzero(line.any(axis=0)).max()

    assert rightmost_line_pixel(frame) > rightmost_line_pixel(first)  # one step further to the right
    text = MarketEnv(data=data, render_mode="ansi", **SMALL)
    text.reset(seed=0)
    assert text.render().startswith("step 0/40: net worth 10000.00")  # and a text mode
