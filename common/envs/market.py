"""``Market-v0``: trading items over a price/volume history, and the market-data cache behind it.

The cache holds ``prices`` and ``volumes`` as ``items x timesteps`` float32 arrays. It comes
either from a deterministic synthetic market (seeded: price levels spanning orders of
magnitude, drift, mean reversion, volatility clusters, volume that rises with price moves)
or from a CSV file ``timestamp,item,price,volume``. It is written once to a cache directory
as ``.npy`` files, so later runs load it instead of rebuilding it. A training coordinator
copies it into shared memory once and every environment attaches to that memory
(``data_specs=``) instead of loading its own copy.

An episode is a random window of the history (training windows come from the first part of
it, evaluation windows from the held-out last ``holdout_fraction``). The agent holds cash and
whole lots of the ``top_n_items`` most traded items. Actions: 0 = hold, ``1..N`` = buy one lot
of item ``i``, ``N+1..2N`` = sell one lot of item ``i``. Buying pays the ask (mid price plus half
the item's spread) and a fee; a buy that cash cannot cover, or beyond ``max_lots`` lots of an
item, and a sell with nothing held are refused (counted in ``info["invalid_actions"]``). The
reward is the change in net worth (cash + lots at mid price) in percent of the initial cash.

Both forms share one implementation (:class:`_MarketCore`, all numpy over a batch of
copies): :class:`MarketEnv` is a single Gymnasium env, :class:`MarketVectorEnv` steps
``num_envs`` copies at once with same-step autoreset.

Render modes of the single env: ``"ansi"`` (one line: step, net worth, cash, lots) and
``"rgb_array"``, a uint8 ``(240, 320, 3)`` chart: on top each traded item's price relative to
its price at the episode's start (from the observation window before it up to now), in the
middle the net worth against the initial cash (grey line), at the bottom the lots held of
each item (a bar per item, in its price line's colour, full height = ``max_lots``).
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
import os
import shutil
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.utils import seeding
from gymnasium.vector import AutoresetMode
from gymnasium.vector.utils import batch_space

from common.shm import ArraySpec, SharedArray, SharedArrays

CACHE_ARRAYS = ("prices", "volumes")
CSV_COLUMNS = ("timestamp", "item", "price", "volume")
DEFAULT_CACHE_DIR = "runs/cache/market"  # under runs/, which version control ignores
GENERATOR_VERSION = 2  # bump when synthetic_market changes, so old caches are not reused


class MarketDataError(ValueError):
    """Unusable market data (corrupt cache, bad CSV, impossible selection); the message is one line."""


# ------------------------------------------------------------------------------------ data

@dataclass
class MarketData:
    """A price and volume history: ``prices``/``volumes`` are ``[items, timesteps]`` float32."""

    prices: np.ndarray
    volumes: np.ndarray
    item_names: list[str]
    source: str = "synthetic"

    @property
    def num_items(self) -> int:
        return int(self.prices.shape[0])

    @property
    def num_steps(self) -> int:
        return int(self.prices.shape[1])

    @property
    def nbytes(self) -> int:
        return int(self.prices.nbytes + self.volumes.nbytes)

    def __deepcopy__(self, memo) -> MarketData:
        # Gymnasium deep-copies env specs (and with them the kwargs); the history is
        # read-only and may live in shared memory, so a copy would only waste memory.
        return self

    def top_items(self, n: int) -> np.ndarray:
        """Indices of the ``n`` items with the largest total traded volume, most traded first."""
        if not 1 <= n <= self.num_items:
            raise MarketDataError(f"top_n_items {n}: must be between 1 and the {self.num_items} items "
                                  f"available in {self.source}")
        totals = self.volumes.sum(axis=1, dtype=np.float64)
        return np.argsort(-totals, kind="stable")[:n].astype(np.int64)


def check_arrays(prices: np.ndarray, volumes: np.ndarray, where: str, rows: np.ndarray | None = None) -> None:
    """Raise MarketDataError unless the arrays form a usable history (``rows`` limits the value checks)."""
    if prices.ndim != 2 or volumes.shape != prices.shape:
        raise MarketDataError(f"{where}: prices {prices.shape} and volumes {volumes.shape} must be two "
                              "[items, timesteps] arrays of the same shape")
    if prices.dtype != np.float32 or volumes.dtype != np.float32:
        raise MarketDataError(f"{where}: arrays must be float32, not {prices.dtype}/{volumes.dtype}")
    if prices.shape[0] < 1 or prices.shape[1] < 2:
        raise MarketDataError(f"{where}: needs at least 1 item and 2 timesteps, has shape {prices.shape}")
    p = prices if rows is None else prices[rows]
    v = volumes if rows is None else volumes[rows]
    if not (np.isfinite(p).all() and (p > 0).all()):
        raise MarketDataError(f"{where}: prices must be finite and > 0")
    if not (np.isfinite(v).all() and (v >= 0).all()):
        raise MarketDataError(f"{where}: volumes must be finite and >= 0")


def synthetic_market(num_items: int, num_steps: int, seed: int) -> MarketData:
    """A deterministic synthetic market of ``num_items`` items over ``num_steps`` timesteps.

    Log prices follow a slowly drifting anchor with item-specific mean reversion;
    returns are slightly negatively autocorrelated (a little predictability to find)
    and their volatility clusters (log volatility is an AR(1) process). Without the
    predictable part, prices are a martingale: buying and holding earns nothing on average. Price levels
    span 0.1 to 10 000; cheap items trade in larger quantities, and volume rises with
    the size of the price move.
    """
    if num_items < 1 or num_steps < 2:
        raise MarketDataError(f"synthetic market needs >= 1 item and >= 2 timesteps, not {num_items}x{num_steps}")
    rng = np.random.default_rng(seed)
    n = num_items
    log_level = rng.uniform(-1.0, 4.0, n) * math.log(10.0)
    base_vol = rng.uniform(0.004, 0.02, n)
    drift = rng.normal(0.0, 2e-5, n)
    kappa = rng.uniform(0.002, 0.02, n)
    rho = rng.uniform(0.05, 0.35, n)
    phi, vol_of_vol = 0.98, 0.15
    base_volume = 10.0 ** (5.0 - 0.7 * log_level / math.log(10.0) + rng.normal(0.0, 0.3, n))

    prices = np.empty((n, num_steps), dtype=np.float32)
    volumes = np.empty((n, num_steps), dtype=np.float32)
    x, anchor = log_level.copy(), log_level.copy()
    h, r = np.zeros(n), np.zeros(n)
    chunk = 2048
    for start in range(0, num_steps, chunk):
        width = min(chunk, num_steps - start)
        eta, eps = rng.standard_normal((2, width, n))
        walk = rng.normal(0.0, 1e-3, (width, n))
        abs_moves = np.empty((width, n))
        logs = np.empty((width, n))
        for k in range(width):
            h = phi * h + vol_of_vol * eta[k]
            sigma = base_vol * np.exp(h)
            r = -rho * r + sigma * eps[k]
            anchor += drift + walk[k]
            # -sigma^2/2 keeps the expected *price* (not log price) flat: holding alone earns nothing.
            x = x + kappa * (anchor - x) + r - 0.5 * sigma * sigma
            logs[k] = x
            abs_moves[k] = np.abs(r)
        prices[:, start:start + width] = np.exp(logs).T
        noise = np.exp(0.4 * rng.standard_normal((width, n)))
        volumes[:, start:start + width] = (base_volume * noise * (1.0 + 2.0 * abs_moves / base_vol)).T
    names = [f"item_{i:05d}" for i in range(n)]
    return MarketData(prices, volumes, names, source=f"synthetic(seed={seed})")


@lru_cache(maxsize=2)
def _synthetic_market_once(num_items: int, num_steps: int, seed: int) -> MarketData:
    """``synthetic_market``, built once per process for the same settings: a validation that writes nothing
    (``--validate-only``, the launcher checking a command) and the run that follows share one build, which
    takes about a second for the default 200 x 20 000. The arrays are read-only, as the cache's are."""
    data = synthetic_market(num_items, num_steps, seed)
    data.prices.flags.writeable = data.volumes.flags.writeable = False
    return data


def read_market_csv(path: str | Path) -> MarketData:
    """Build a history from a ``timestamp,item,price,volume`` CSV (header required, any column order).

    Timestamps are sorted numerically when they are all numbers, else as text (ISO dates sort
    correctly). An item without a row at some timestamp keeps its last price (its first price
    before it first trades) and has volume 0 there. A repeated (timestamp, item) keeps the last row.
    """
    path = Path(path)
    if not path.is_file():
        raise MarketDataError(f"{path}: no such CSV file")
    with open(path, newline="") as f:
        reader = csv.reader(f)
        header = [h.strip().lower() for h in next(reader, [])]
        missing = [c for c in CSV_COLUMNS if c not in header]
        if missing:
            raise MarketDataError(f"{path}: missing column(s) {', '.join(missing)}; the header must name "
                                  f"{','.join(CSV_COLUMNS)}")
        col = {c: header.index(c) for c in CSV_COLUMNS}
        rows = []
        for line_no, row in enumerate(reader, start=2):
            if not row or all(not cell.strip() for cell in row):
                continue
            try:
                price, volume = float(row[col["price"]]), float(row[col["volume"]])
                stamp, item = row[col["timestamp"]].strip(), row[col["item"]].strip()
            except (ValueError, IndexError):
                raise MarketDataError(f"{path}:{line_no}: expected {','.join(CSV_COLUMNS)} with numeric "
                                      f"price and volume, got {','.join(row)[:80]!r}") from None
            if not (math.isfinite(price) and price > 0 and math.isfinite(volume) and volume >= 0):
                raise MarketDataError(f"{path}:{line_no}: price must be > 0 and volume >= 0, "
                                      f"got price {price}, volume {volume}")
            rows.append((stamp, item, price, volume))
    stamps = sorted({r[0] for r in rows}, key=_timestamp_key({r[0] for r in rows}))
    items = sorted({r[1] for r in rows})
    if len(stamps) < 2:
        raise MarketDataError(f"{path}: needs rows at >= 2 distinct timestamps, found {len(stamps)}")
    t_index = {s: i for i, s in enumerate(stamps)}
    i_index = {s: i for i, s in enumerate(items)}
    prices = np.full((len(items), len(stamps)), np.nan, dtype=np.float64)
    volumes = np.zeros((len(items), len(stamps)), dtype=np.float64)
    for stamp, item, price, volume in rows:
        prices[i_index[item], t_index[stamp]] = price
        volumes[i_index[item], t_index[stamp]] = volume
    _fill_gaps(prices)
    return MarketData(prices.astype(np.float32), volumes.astype(np.float32), items, source=str(path))


def _timestamp_key(stamps: set[str]):
    try:
        for s in stamps:
            float(s)
        return float
    except ValueError:
        return str


def _fill_gaps(prices: np.ndarray) -> None:
    """Forward-fill missing prices along time; before an item's first row, use its first price."""
    valid = np.isfinite(prices)
    idx = np.where(valid, np.arange(prices.shape[1]), 0)
    np.maximum.accumulate(idx, axis=1, out=idx)
    filled = prices[np.arange(prices.shape[0])[:, None], idx]
    first = np.argmax(valid, axis=1)
    first_price = prices[np.arange(prices.shape[0]), first]
    prices[:] = np.where(np.isfinite(filled), filled, first_price[:, None])


# ----------------------------------------------------------------------------------- cache

def cache_path(cache_dir: str | Path, data_source: str, num_items: int, history_steps: int, data_seed: int) -> Path:
    """Directory that holds (or will hold) the cache for these settings."""
    cache_dir = Path(cache_dir)
    if data_source == "synthetic":
        return cache_dir / f"synthetic_v{GENERATOR_VERSION}_seed{data_seed}_{num_items}x{history_steps}"
    source = Path(data_source)
    try:
        stat = source.stat()
        ident = f"{source.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    except OSError:
        ident = str(source)
    return cache_dir / f"csv_{source.stem}_{hashlib.sha1(ident.encode()).hexdigest()[:12]}"


def write_cache(data: MarketData, directory: str | Path) -> Path:
    """Write ``data`` as ``prices.npy``, ``volumes.npy`` and ``meta.json``; all or nothing."""
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = directory.with_name(f".{directory.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        for name in CACHE_ARRAYS:
            np.save(tmp / f"{name}.npy", getattr(data, name), allow_pickle=False)
        meta = {"shape": list(data.prices.shape), "item_names": data.item_names, "source": data.source,
                "generator_version": GENERATOR_VERSION}
        (tmp / "meta.json").write_text(json.dumps(meta))
        try:
            os.rename(tmp, directory)
        except OSError:  # another run finished building the same cache first: keep theirs
            if not (directory / "meta.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return directory


def read_cache(directory: str | Path) -> MarketData:
    """Map a cache directory's arrays read-only (no copy until pages are touched); validate the layout."""
    directory = Path(directory)
    try:
        meta = json.loads((directory / "meta.json").read_text())
        shape = tuple(int(s) for s in meta["shape"])
        names = list(meta["item_names"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise MarketDataError(f"{directory / 'meta.json'}: corrupt cache metadata ({type(err).__name__}); "
                              f"delete {directory} to rebuild it") from None
    arrays = {}
    for name in CACHE_ARRAYS:
        file = directory / f"{name}.npy"
        try:
            arrays[name] = np.load(file, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError, EOFError) as err:
            reason = str(err).splitlines()[0][:100] if str(err) else type(err).__name__
            raise MarketDataError(f"{file}: corrupt cache file ({reason}); delete {directory} to rebuild it") \
                from None
        if arrays[name].shape != shape or len(names) != shape[0]:
            raise MarketDataError(f"{file}: wrong shape {arrays[name].shape}, the cache metadata says {shape} "
                                  f"with {len(names)} items; delete {directory} to rebuild it")
    check_arrays(arrays["prices"], arrays["volumes"], str(directory), rows=np.arange(0))
    return MarketData(arrays["prices"], arrays["volumes"], names, source=str(meta.get("source", directory)))


def load_market_data(data_source: str = "synthetic", cache_dir: str | Path = DEFAULT_CACHE_DIR,
                     num_items: int = 200, history_steps: int = 20_000, data_seed: int = 0, write: bool = True
                     ) -> tuple[MarketData, dict[str, Any]]:
    """Load the cache for these settings, building it first if it does not exist.

    Returns the data (memory-mapped from the cache files) and ``{"path", "built", "seconds"}``. With
    ``write=False`` a cache that does not exist yet is built in memory only (checked all the same) and
    nothing is written: a caller that goes on writes it with :func:`write_cache` (``info["path"]``).
    """
    started = time.perf_counter()
    directory = cache_path(cache_dir, data_source, num_items, history_steps, data_seed)
    built = False
    if not (directory / "meta.json").is_file():
        if data_source == "synthetic":
            data = _synthetic_market_once(num_items, history_steps, data_seed)
        else:
            data = read_market_csv(data_source)
        check_arrays(data.prices, data.volumes, data.source)
        if not write:
            return data, {"path": str(directory), "built": True, "seconds": time.perf_counter() - started}
        write_cache(data, directory)
        built = True
    data = read_cache(directory)
    return data, {"path": str(directory), "built": built, "seconds": time.perf_counter() - started}


def share_market_data(data: MarketData) -> tuple[SharedArrays, dict[str, ArraySpec]]:
    """Copy the history into shared memory once (coordinator side); returns the owner and the specs."""
    shared = SharedArrays()
    try:
        for name in CACHE_ARRAYS:
            source = getattr(data, name)
            target = shared.create(f"market_{name}", source.shape, np.float32, fill=None)
            _copy_into(target, source)
    except BaseException:
        shared.unlink_all()
        raise
    return shared, {name: spec for name, spec in zip(CACHE_ARRAYS, shared.specs().values())}


def _copy_into(target: np.ndarray, source: np.ndarray) -> None:
    """Fill ``target`` from ``source``; a cache file is read straight into it, never mapped.

    Copying from the memory map would map every page of the file into this process as well,
    briefly doubling its memory (and its PSS) for a large cache.
    """
    if isinstance(source, np.memmap) and source.filename and source.flags.c_contiguous:
        buffer = memoryview(target.reshape(-1).view(np.uint8))
        with open(source.filename, "rb") as f:
            f.seek(source.offset)
            done = 0
            while done < len(buffer):
                count = f.readinto(buffer[done:])
                if not count:
                    raise MarketDataError(f"{source.filename}: file ends early; delete its directory to rebuild it")
                done += count
        return
    for start in range(0, source.shape[0], 64):  # row blocks: bounded extra memory while copying
        target[start:start + 64] = source[start:start + 64]


def attach_market_data(specs: dict[str, ArraySpec], item_names: list[str] | None = None
                       ) -> tuple[MarketData, list[SharedArray]]:
    """Map the shared history without copying it; close the returned handles when done."""
    handles = [SharedArray.attach(specs[name]) for name in CACHE_ARRAYS]
    prices, volumes = (h.array for h in handles)
    names = item_names or [f"item_{i:05d}" for i in range(prices.shape[0])]
    return MarketData(prices, volumes, names, source="shared memory"), handles


# ------------------------------------------------------------------------------- rendering

CHART_WIDTH, PRICE_ROWS, WORTH_ROWS, LOTS_ROWS = 320, 128, 80, 32
CHART_BACKGROUND, CHART_AXIS = (255, 255, 255), (170, 170, 170)
ITEM_COLOURS = np.array([(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189),
                         (140, 86, 75), (227, 119, 194), (127, 127, 127), (188, 189, 34), (23, 190, 207)],
                        dtype=np.uint8)


def plot_line(panel: np.ndarray, values: np.ndarray, slots: int, lo: float, hi: float, colour) -> None:
    """Draw ``values`` (the first of ``slots`` evenly spaced points across ``panel``) as a connected line."""
    rows, width = panel.shape[:2]
    if len(values) == 0:
        return
    position = np.arange(width) * (max(slots - 1, 1) / max(width - 1, 1))
    drawn = position <= len(values) - 1
    value = np.interp(position[drawn], np.arange(len(values)), values)
    y = np.clip(np.round((rows - 1) * (hi - value) / max(hi - lo, 1e-12)), 0, rows - 1).astype(np.int64)
    previous = np.concatenate([y[:1], y[:-1]])
    top, bottom = np.minimum(y, previous), np.maximum(y, previous)
    row = np.arange(rows)[:, None]
    mask = np.zeros((rows, width), dtype=bool)
    mask[:, drawn] = (row >= top) & (row <= bottom)
    panel[mask] = colour


def _value_range(*series: np.ndarray) -> tuple[float, float]:
    values = np.concatenate([np.ravel(s) for s in series])
    lo, hi = float(values.min()), float(values.max())
    margin = max(0.1 * (hi - lo), 1e-3 * max(abs(hi), 1.0))
    return lo - margin, hi + margin


def draw_chart(prices: np.ndarray, slots: int, worth: np.ndarray, steps: int, lots: np.ndarray,
               max_lots: int) -> np.ndarray:
    """The rgb_array picture: ``prices`` [items, points so far of ``slots``] relative to their episode-start
    value, net ``worth`` [points so far of ``steps`` + 1] relative to the initial cash, ``lots`` per item."""
    chart = np.full((PRICE_ROWS + WORTH_ROWS + LOTS_ROWS, CHART_WIDTH, 3), CHART_BACKGROUND, dtype=np.uint8)
    price_panel = chart[:PRICE_ROWS]
    worth_panel = chart[PRICE_ROWS:PRICE_ROWS + WORTH_ROWS]
    lots_panel = chart[PRICE_ROWS + WORTH_ROWS:]
    lo, hi = _value_range(prices, np.ones(1))
    plot_line(price_panel, np.ones(slots), slots, lo, hi, CHART_AXIS)
    for i, series in enumerate(prices):
        plot_line(price_panel, series, slots, lo, hi, ITEM_COLOURS[i % len(ITEM_COLOURS)])
    lo, hi = _value_range(worth, np.ones(1))
    plot_line(worth_panel, np.ones(steps + 1), steps + 1, lo, hi, CHART_AXIS)
    plot_line(worth_panel, worth, steps + 1, lo, hi, (0, 0, 0))
    chart[PRICE_ROWS - 1] = chart[PRICE_ROWS + WORTH_ROWS - 1] = CHART_AXIS
    bar = CHART_WIDTH // max(len(lots), 1)
    for i, held in enumerate(lots):
        height = int(round((LOTS_ROWS - 4) * held / max(max_lots, 1)))
        if height:
            lots_panel[LOTS_ROWS - height:, i * bar + 2:(i + 1) * bar - 2] = ITEM_COLOURS[i % len(ITEM_COLOURS)]
    return chart


# ------------------------------------------------------------------------------ simulation

@dataclass(frozen=True)
class MarketParams:
    top_n_items: int = 10  # trade the N most traded items of the history
    window: int = 16  # past timesteps of price and volume in each observation
    episode_length: int = 256  # steps per episode (one window of the history)
    initial_cash: float = 10_000.0  # cash at the start of an episode
    fee: float = 0.001  # fee per trade, as a fraction of the traded value
    lot_fraction: float = 0.1  # one lot of an item is worth this fraction of initial cash at episode start
    max_lots: int = 5  # at most this many lots of one item may be held
    holdout_fraction: float = 0.2  # the last part of the history, kept for evaluation windows
    split: str = "train"  # train | eval | all: which part of the history episodes are drawn from


class _MarketCore:
    """The market simulation for a batch of ``n`` independent copies, all in numpy."""

    def __init__(self, n: int, data: MarketData, params: MarketParams, item_indices=None):
        self.n, self.p = n, params
        self.prices, self.volumes = data.prices, data.volumes
        self.items = (np.asarray(item_indices, dtype=np.int64) if item_indices is not None
                      else data.top_items(params.top_n_items))
        if len(self.items) != params.top_n_items:
            raise MarketDataError(f"item_indices has {len(self.items)} entries, top_n_items is {params.top_n_items}")
        if self.items.min() < 0 or self.items.max() >= data.num_items:
            raise MarketDataError(f"item_indices must lie in [0, {data.num_items})")
        self.start_range = self._start_range(data.num_steps)
        check_arrays(self.prices, self.volumes, data.source, rows=self.items)
        self._item_statistics()
        k = params.top_n_items
        self.num_actions = 1 + 2 * k
        self.obs_dim = 2 * k * params.window + k + 3
        self.t = np.zeros(n, dtype=np.int64)
        self.end = np.zeros(n, dtype=np.int64)
        self.cash = np.zeros(n)
        self.lots = np.zeros((n, k), dtype=np.int64)
        self.lot_units = np.zeros((n, k))
        self.net_worth = np.zeros(n)
        self.trades = np.zeros(n, dtype=np.int64)
        self.invalid = np.zeros(n, dtype=np.int64)
        self.fees = np.zeros(n)

    def _start_range(self, num_steps: int) -> tuple[int, int]:
        """First and last timestep an episode may start at (it then runs ``episode_length`` steps)."""
        p = self.p
        boundary = int(num_steps * (1.0 - p.holdout_fraction))
        lo, hi = {"train": (0, boundary), "eval": (boundary, num_steps), "all": (0, num_steps)}[p.split]
        first, last = lo + p.window, hi - 1 - p.episode_length
        if last < first:
            raise MarketDataError(f"the {p.split} part of the history ({hi - lo} of {num_steps} timesteps) is too "
                                  f"short for window {p.window} + episode_length {p.episode_length}")
        return first, last

    def _item_statistics(self) -> None:
        """Per-item scales for observations and spreads, from the training part of the history."""
        boundary = max(self.p.window + 2, int(self.prices.shape[1] * (1.0 - self.p.holdout_fraction)))
        prices = np.asarray(self.prices[self.items, :boundary], dtype=np.float64)
        volumes = np.asarray(self.volumes[self.items, :boundary], dtype=np.float64)
        self.volatility = np.maximum(np.diff(np.log(prices), axis=1).std(axis=1), 1e-4)
        self.log_mean_volume = np.log1p(volumes.mean(axis=1))
        # Thinly traded items are dearer to trade: the spread widens as volume falls.
        self.half_spread = 0.5 * np.clip(2e-3 * (1e4 / np.maximum(volumes.mean(axis=1), 1e-9)) ** 0.25, 2e-4, 2e-2)
        self._lags = np.arange(self.p.window + 1)

    def mid(self, rows: np.ndarray, t: np.ndarray) -> np.ndarray:
        return self.prices[self.items[None, :], t[rows, None]].astype(np.float64)

    def reset(self, rows: np.ndarray, rngs: list[np.random.Generator]) -> None:
        first, last = self.start_range
        for row in rows:
            self.t[row] = rngs[row].integers(first, last + 1)
        self.end[rows] = self.t[rows] + self.p.episode_length
        self.cash[rows] = self.p.initial_cash
        self.lots[rows] = 0
        self.lot_units[rows] = self.p.lot_fraction * self.p.initial_cash / self.mid(rows, self.t)
        self.net_worth[rows] = self.p.initial_cash
        self.trades[rows] = 0
        self.invalid[rows] = 0
        self.fees[rows] = 0.0

    def step(self, actions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Apply one action per copy at the current prices, advance time; returns rewards and dones."""
        k, p, rows = self.p.top_n_items, self.p, np.arange(self.n)
        actions = np.asarray(actions, dtype=np.int64).reshape(self.n)
        if ((actions < 0) | (actions >= self.num_actions)).any():
            raise ValueError(f"actions must be in [0, {self.num_actions}), got {actions}")
        mid = self.mid(rows, self.t)
        item = np.clip(np.where(actions > k, actions - k, actions) - 1, 0, k - 1)
        units = self.lot_units[rows, item]
        buy, sell = (actions >= 1) & (actions <= k), actions > k

        ask = mid[rows, item] * (1.0 + self.half_spread[item])
        cost = units * ask
        buy_fee = cost * p.fee
        buy_ok = buy & (self.cash >= cost + buy_fee) & (self.lots[rows, item] < p.max_lots)
        bid = mid[rows, item] * (1.0 - self.half_spread[item])
        proceeds = units * bid
        sell_fee = proceeds * p.fee
        sell_ok = sell & (self.lots[rows, item] > 0)

        self.cash += np.where(buy_ok, -(cost + buy_fee), 0.0) + np.where(sell_ok, proceeds - sell_fee, 0.0)
        self.lots[rows, item] += buy_ok.astype(np.int64) - sell_ok.astype(np.int64)
        self.fees += np.where(buy_ok, buy_fee, 0.0) + np.where(sell_ok, sell_fee, 0.0)
        self.trades += buy_ok | sell_ok
        self.invalid += (buy & ~buy_ok) | (sell & ~sell_ok)

        self.t += 1
        worth = self.cash + (self.lots * self.lot_units * self.mid(rows, self.t)).sum(axis=1)
        rewards = (worth - self.net_worth) * (100.0 / p.initial_cash)
        self.net_worth = worth
        return rewards.astype(np.float32), self.t >= self.end

    def observe(self) -> np.ndarray:
        """``[n, obs_dim]`` float32: scaled log-price moves and log volumes over the window, lots, cash..."""
        p = self.p
        cols = self.t[:, None, None] - self._lags[None, None, :]  # t, t-1, ..., t-window
        rows = self.items[None, :, None]
        prices = self.prices[rows, cols].astype(np.float64)  # [n, k, window + 1]
        moves = np.log(prices[:, :, 1:] / prices[:, :, :1]) / (self.volatility[None, :, None] * math.sqrt(p.window))
        volumes = np.log1p(self.volumes[rows, cols[:, :, :-1]]) - self.log_mean_volume[None, :, None]
        scalars = np.stack([self.cash / p.initial_cash, self.net_worth / p.initial_cash - 1.0,
                            (self.end - self.t) / p.episode_length], axis=1)
        obs = np.concatenate([np.clip(moves, -5, 5).reshape(self.n, -1), np.clip(volumes, -5, 5).reshape(self.n, -1),
                              self.lots / p.max_lots, scalars], axis=1)
        return obs.astype(np.float32)

    def info(self) -> dict[str, np.ndarray]:
        return {"net_worth": self.net_worth.copy(), "cash": self.cash.copy(), "trades": self.trades.copy(),
                "fees": self.fees.copy(), "invalid_actions": self.invalid.copy()}


def _resolve_data(data: MarketData | None, data_specs: dict | None, data_source: str, cache_dir: str,
                  num_items: int, history_steps: int, data_seed: int) -> tuple[MarketData, list[SharedArray]]:
    """The history to trade on: given arrays, shared memory to attach to, or the on-disk cache."""
    if data is not None:
        return data, []
    if data_specs is not None:
        return attach_market_data(data_specs)
    return load_market_data(data_source, cache_dir, num_items, history_steps, data_seed)[0], []


def _spaces(core: _MarketCore) -> tuple[gym.spaces.Box, gym.spaces.Discrete]:
    return (gym.spaces.Box(-np.inf, np.inf, shape=(core.obs_dim,), dtype=np.float32),
            gym.spaces.Discrete(core.num_actions))


class MarketEnv(gym.Env):
    """One trading account over a window of the history (see the module docstring).

    Where the history comes from, in order: ``data`` (a :class:`MarketData`), ``data_specs``
    (shared-memory specs from :func:`share_market_data`; attached, never copied), or the
    cache for ``data_source``/``cache_dir``/``num_items``/``history_steps``/``data_seed``.
    ``item_indices`` overrides the top-``top_n_items`` selection.
    """

    metadata = {"render_modes": ["ansi", "rgb_array"], "render_fps": 30}

    def __init__(self, data: MarketData | None = None, data_specs: dict[str, ArraySpec] | None = None,
                 data_source: str = "synthetic", cache_dir: str = DEFAULT_CACHE_DIR, num_items: int = 200,
                 history_steps: int = 20_000, data_seed: int = 0, item_indices=None,
                 render_mode: str | None = None, **params: Any):
        self.data, self._handles = _resolve_data(data, data_specs, data_source, cache_dir, num_items,
                                                 history_steps, data_seed)
        self.params = MarketParams(**params)
        self.core = _MarketCore(1, self.data, self.params, item_indices)
        self.observation_space, self.action_space = _spaces(self.core)
        self.render_mode = render_mode
        self._worth: list[float] = []  # net worth after each step of this episode (for rendering)

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self.core.reset(np.array([0]), [self.np_random])
        self._worth = [float(self.core.net_worth[0])]
        return self.core.observe()[0], self._info()

    def step(self, action):
        rewards, done = self.core.step(np.asarray([action]))
        self._worth.append(float(self.core.net_worth[0]))
        return self.core.observe()[0], float(rewards[0]), bool(done[0]), False, self._info()

    def render(self):
        core, p = self.core, self.params
        if self.render_mode != "rgb_array":
            return (f"step {len(self._worth) - 1}/{p.episode_length}: net worth {core.net_worth[0]:.2f}, "
                    f"cash {core.cash[0]:.2f}, lots {core.lots[0].tolist()}")
        start = int(core.end[0]) - p.episode_length
        shown = np.asarray(core.prices[core.items, start - p.window:int(core.t[0]) + 1], dtype=np.float64)
        return draw_chart(shown / shown[:, p.window:p.window + 1], p.window + p.episode_length + 1,
                          np.asarray(self._worth) / p.initial_cash, p.episode_length, core.lots[0], p.max_lots)

    def _info(self) -> dict[str, Any]:
        return {key: value[0].item() for key, value in self.core.info().items()}

    def close(self) -> None:
        self.core = None
        self.data = None
        for handle in self._handles:
            handle.close()
        self._handles = []


class MarketVectorEnv(gym.vector.VectorEnv):
    """``num_envs`` copies of :class:`MarketEnv` stepped together, same-step autoreset.

    Copy ``i`` reset with ``seed`` behaves exactly like ``MarketEnv`` reset with ``seed + i``.
    On a step that ends an episode, ``info["final_obs"]``/``info["_final_obs"]`` hold the last
    observation and ``info["final_info"]`` the episode's final net worth, trades and fees.
    """

    metadata = {"render_modes": [], "autoreset_mode": AutoresetMode.SAME_STEP}

    def __init__(self, num_envs: int = 1, data: MarketData | None = None,
                 data_specs: dict[str, ArraySpec] | None = None, data_source: str = "synthetic",
                 cache_dir: str = DEFAULT_CACHE_DIR, num_items: int = 200, history_steps: int = 20_000,
                 data_seed: int = 0, item_indices=None, **params: Any):
        self.data, self._handles = _resolve_data(data, data_specs, data_source, cache_dir, num_items,
                                                 history_steps, data_seed)
        self.params = MarketParams(**params)
        self.num_envs = num_envs
        self.core = _MarketCore(num_envs, self.data, self.params, item_indices)
        self.single_observation_space, self.single_action_space = _spaces(self.core)
        self.observation_space = batch_space(self.single_observation_space, num_envs)
        self.action_space = batch_space(self.single_action_space, num_envs)
        self._rngs = [seeding.np_random(None)[0] for _ in range(num_envs)]

    def reset(self, *, seed: int | list[int] | None = None, options: dict | None = None):
        if seed is not None:
            seeds = seed if isinstance(seed, (list, tuple)) else [seed + i for i in range(self.num_envs)]
            self._rngs = [seeding.np_random(s)[0] for s in seeds]
            self.action_space.seed(seeds[0])
        self.core.reset(np.arange(self.num_envs), self._rngs)
        return self.core.observe(), self._vector_info(self.core.info())

    def step(self, actions):
        rewards, done = self.core.step(actions)
        obs = self.core.observe()
        finished = done.any()
        if finished:
            final_obs, final_info = obs, self._vector_info(self.core.info(), mask=done)
            self.core.reset(np.flatnonzero(done), self._rngs)
            obs = self.core.observe()
        info = self._vector_info(self.core.info())  # a reset copy reports its fresh account
        if finished:
            info.update(final_obs=final_obs, _final_obs=done.copy(), final_info=final_info, _final_info=done.copy())
        return obs, rewards, done.copy(), np.zeros(self.num_envs, dtype=bool), info

    def _vector_info(self, values: dict[str, np.ndarray], mask: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """Gymnasium's vector info layout: one array per key plus a ``_key`` mask of valid entries."""
        out: dict[str, np.ndarray] = {}
        for key, value in values.items():
            out[key] = value
            out[f"_{key}"] = np.ones(self.num_envs, dtype=bool) if mask is None else mask.copy()
        return out

    def close_extras(self, **kwargs) -> None:
        self.core = None
        self.data = None
        for handle in self._handles:
            handle.close()
        self._handles = []
