"""common/torch_file.py writes torch.save's format by hand, through private corners of pickle and torch
(``pickle._Pickler``, ``torch._utils._rebuild_tensor_v2``, torch's storage classes by name). These tests fail
as soon as torch's own ``torch.load(..., weights_only=True)`` stops accepting what it writes, or reads back
anything but the values written: run them on any torch the requirements admit (requirements.txt).

tests/test_common.py compares the file with the one torch.save writes for the same state.
"""

from __future__ import annotations

import io
import pickle
import random

import gymnasium as gym
import numpy as np
import pytest
import torch

from common import torch_file
from common.checkpoint import rng_state, set_rng_state
from common.normalize import Normalizer
from common.ppo_learner import PPOSettings, make_learner

DTYPES = (np.float32, np.float64, np.float16, np.int64, np.int32, np.int16, np.int8, np.uint8, np.bool_)


class Network:  # a PPO script's config, as far as make_learner reads it
    hidden_sizes, activation, log_std_init = [8, 8], "tanh", -0.5


def numpy_run_checkpoint() -> dict:
    """What train_parallel_timed.py's numpy learner saves after an update: model, Adam's state, the policy's
    description, the normalization statistics, counters and the RNG states of a process without torch."""
    spaces = gym.spaces.Box(-1, 1, (3,), np.float32), gym.spaces.Box(-2, 2, (2,), np.float32)
    learner = make_learner("numpy", *spaces, Network, 1e-3, PPOSettings(2, 16, 0.2, True, 0.01, 0.5, 0.5), seed=0,
                           shuffle_seed=0)
    rng = np.random.default_rng(1)
    learner.update({"obs": rng.standard_normal((32, 3)).astype(np.float32),
                    "actions": rng.standard_normal((32, 2)).astype(np.float32),
                    "logprobs": rng.standard_normal(32).astype(np.float32) - 2.0,
                    "values": rng.standard_normal(32).astype(np.float32),
                    "advantages": rng.standard_normal(32).astype(np.float32),
                    "returns": rng.standard_normal(32).astype(np.float32)})
    normalizer = Normalizer((3,), True, True, 10.0, 10.0, 0.99)
    normalizer.update(rng.standard_normal((64, 3)), rng.standard_normal(64))
    rng_states = {key: value for key, value in rng_state().items() if key in ("python", "numpy")}
    return {**learner.state_dict(), **normalizer.state_dict(), "rng": rng_states,
            "counters": {"global_step": 2048, "updates": 2, "wall_time": 3.25, "recent_returns": [-120.5, -99.0],
                         "best_mean_return": np.float64(-99.0), "done": False, "target": None}}


def assert_loaded(loaded, written, where="state"):
    """``loaded`` (torch.load's) holds ``written``'s values exactly: arrays as CPU tensors of the same dtype, shape
    and bytes, numpy scalars as Python numbers, every container of the same type."""
    if isinstance(written, np.ndarray):
        assert isinstance(loaded, torch.Tensor) and loaded.device.type == "cpu", where
        assert loaded.numpy().dtype == written.dtype and loaded.shape == written.shape, where
        assert np.array_equal(loaded.numpy(), written, equal_nan=written.dtype.kind == "f"), where
    elif isinstance(written, np.generic):
        assert type(loaded) is type(written.item()) and loaded == written.item(), where
    elif isinstance(written, dict):
        assert type(loaded) is dict and list(loaded) == list(written), where
        for key in written:
            assert_loaded(loaded[key], written[key], f"{where}[{key!r}]")
    elif isinstance(written, (list, tuple)):
        assert type(loaded) is type(written) and len(loaded) == len(written), where
        for i, (a, b) in enumerate(zip(loaded, written)):
            assert_loaded(a, b, f"{where}[{i}]")
    else:
        assert type(loaded) is type(written) and loaded == written, where


def write(state, path):
    with open(path, "wb") as f:
        torch_file.write(state, f)
    return path


@pytest.mark.parametrize("mmap", [False, True])
def test_torch_loads_a_numpy_learners_checkpoint_value_for_value(tmp_path, mmap):
    state = numpy_run_checkpoint()
    loaded = torch.load(write(state, tmp_path / "latest.pt"), weights_only=True, mmap=mmap)
    assert_loaded(loaded, state)
    # the RNG states continue the same streams
    random.seed(5)
    np.random.seed(5)
    set_rng_state(loaded["rng"])
    draws = random.random(), np.random.random(3)
    set_rng_state(state["rng"])
    assert draws[0] == random.random() and np.array_equal(draws[1], np.random.random(3))


def test_every_dtype_shape_and_layout_round_trips(tmp_path):
    rng = np.random.default_rng(0)
    arrays = {}
    for dtype in DTYPES:
        name = np.dtype(dtype).name
        values = rng.standard_normal((3, 4)) * 50
        arrays[name] = (values > 0) if dtype is np.bool_ else values.astype(dtype)
        arrays[f"{name}_scalar"] = np.array(arrays[name][0, 0])  # 0-d, as Adam's step count
        arrays[f"{name}_transposed"] = arrays[name].T  # not contiguous: written as a contiguous copy
        arrays[f"{name}_empty"] = np.zeros((0, 2), dtype)
    arrays["float32_special"] = np.array([np.nan, np.inf, -np.inf, -0.0, 1e-45], np.float32)
    state = {"arrays": arrays, "nested": [{"a": (1, 2.5, "x", None, True)}, [np.arange(3)]], "big": 2 ** 62,
             "numpy_numbers": [np.float32(1.5), np.int64(-3), np.bool_(True)]}
    assert_loaded(torch.load(write(state, tmp_path / "all.pt"), weights_only=True), state)


def test_what_weights_only_would_refuse_is_refused_when_written():
    """An array torch has no storage for is an error at writing, not a checkpoint torch cannot load later."""
    with pytest.raises(TypeError, match="uint16"):
        torch_file.write({"x": np.zeros(2, np.uint16)}, io.BytesIO())


# torch names a storage's dtype by these classes in the files torch.save writes too, and warns that they are deprecated
@pytest.mark.filterwarnings("ignore:TypedStorage is deprecated")
def test_the_private_names_the_writer_relies_on_still_exist():
    """What torch_file names without importing (a rename in torch or pickle shows here first, by name)."""
    import torch._utils

    assert issubclass(torch_file._Pickler, pickle._Pickler) and pickle._Pickler.dispatch
    assert callable(torch._utils._rebuild_tensor_v2)
    for dtype, storage in torch_file.STORAGE_GLOBALS.items():
        assert getattr(torch, storage.name).dtype == torch.from_numpy(np.zeros(1, dtype)).dtype, storage.name
