"""The per-call savings of the simulation engines change nothing but cost: npy blobs written and
read without np.save / np.load header work are the same bytes and values (and anything else
still goes through np.load and the server's checks), a pooled model is a fresh model's
function, a remembered run config is the parsed one, a kept client split is the split."""

from __future__ import annotations

import io
import threading
import time

import numpy as np
import pytest
import torch
from flwr.app import Array

from flatflower.common import codec
from flatflower.common.config import ConfigError, RunConfig
from flatflower.common.data import client_split
from flatflower.common.models import MODELS, ModelPool, build_model
import flatflower.strategies.registry  # noqa: F401 - registers the algorithms a RunConfig names
from flatflower.strategies.validation import RejectedReply, decode_array

ARRAYS = [np.arange(12, dtype=np.float32).reshape(3, 4), np.arange(5), np.full((), 2.5),
          np.zeros((0, 3), np.float32), np.ones((2, 3), dtype=">f4"), np.ones((2, 2, 2), np.int8)]


@pytest.mark.parametrize("value", ARRAYS, ids=lambda v: f"{v.dtype.str}{list(v.shape)}")
def test_as_array_writes_the_bytes_flower_writes_and_array_data_reads_them(value):
    ours, flowers = codec.as_array(value), Array(value)
    assert (ours.dtype, tuple(ours.shape), ours.stype, ours.data) == \
        (flowers.dtype, tuple(flowers.shape), flowers.stype, flowers.data)
    got = codec.array_data(flowers)
    assert got.dtype == value.dtype and got.shape == value.shape and np.array_equal(got, value)


def test_other_blobs_take_np_load_and_say_what_they_hold():
    fortran = np.asfortranarray(np.arange(6, dtype=np.float32).reshape(2, 3))
    blob = io.BytesIO()
    np.save(blob, fortran)
    arr = Array(dtype="float32", shape=(2, 3), stype=codec.NUMPY_STYPE, data=blob.getvalue())
    assert np.array_equal(codec.array_data(arr), fortran)  # Fortran order: np.load's path
    # a blob of another shape, declared as (2, 3): the value is what the blob holds
    lying = Array(dtype="float32", shape=(2, 3), stype=codec.NUMPY_STYPE, data=Array(np.zeros(7, np.float32)).data)
    assert codec.array_data(lying).shape == (7,)
    # the header np.save writes for (2, 3), with too few bytes after it: np.load refuses it
    header = codec.npy_header("float32", (2, 3))
    truncated = Array(dtype="float32", shape=(2, 3), stype=codec.NUMPY_STYPE, data=header + b"\0" * 8)
    with pytest.raises(ValueError):
        codec.array_data(truncated)


def test_the_server_still_refuses_what_it_refused():
    good = codec.as_array(np.ones((2, 3), np.float32))
    assert torch.equal(decode_array("x", good, (2, 3), "float32"), torch.ones(2, 3))
    for bad in (codec.as_array(np.ones((3, 2), np.float32)), codec.as_array(np.ones((2, 3), np.float64)),
                codec.as_array(np.full((2, 3), np.nan, np.float32))):
        with pytest.raises(RejectedReply):
            decode_array("x", bad, (2, 3), "float32")
    header_lies = Array(dtype="float32", shape=(6,), stype=codec.NUMPY_STYPE, data=good.data)
    with pytest.raises(RejectedReply, match="header says"):
        decode_array("x", header_lies, (2, 3), "float32")


def test_a_pooled_model_is_reused_and_holds_what_is_loaded_into_it():
    pool = ModelPool()
    key, first = pool.take("mlp", (1, 8, 8), 10, torch.device("cpu"))
    _, second = pool.take("mlp", (1, 8, 8), 10, torch.device("cpu"))
    assert first is not second  # two calls in flight: two models
    for p in first.parameters():
        p.grad = torch.ones_like(p)
    pool.give(key, first)
    _, again = pool.take("mlp", (1, 8, 8), 10, torch.device("cpu"))
    assert again is first and all(p.grad is None for p in again.parameters())
    stranger = build_model("mlp", (1, 8, 8), 10, seed=1)  # not built by this pool: its modules walked
    for p in stranger.parameters():
        p.grad = torch.ones_like(p)
    pool.give(key, stranger)
    _, back = pool.take("mlp", (1, 8, 8), 10, torch.device("cpu"))
    assert back is stranger and all(p.grad is None for p in back.parameters())
    other = build_model("mlp", (1, 8, 8), 10, seed=7).state_dict()
    again.load_state_dict(other)
    x = torch.randn(5, 1, 8, 8)
    fresh = build_model("mlp", (1, 8, 8), 10, seed=7)
    assert torch.equal(again(x), fresh(x))


def test_a_seeded_build_is_torch_manual_seed_build_and_leaves_the_global_rng_alone():
    state = torch.random.get_rng_state()
    model = build_model("cnn", (1, 8, 8), 10, seed=3)
    assert torch.equal(torch.random.get_rng_state(), state)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        reference = MODELS["cnn"]((1, 8, 8), 10)
    for a, b in zip(model.state_dict().values(), reference.state_dict().values()):
        assert torch.equal(a, b)


def test_a_remembered_run_config_is_the_parsed_one_and_errors_are_not_remembered():
    values = {"algorithm": "fedsam", "dataset": "digits", "sam.rho": 0.05, "local-epochs": 2}
    cfg = RunConfig.parsed(values)
    assert cfg == RunConfig.from_mapping(values) and RunConfig.parsed(dict(values)) is cfg
    for bad in ({"local-epochs": 0}, {"local-epochs": 0}):  # raised every time, not cached
        with pytest.raises(ConfigError):
            RunConfig.parsed(bad)
    # 1 and 1.0 hash alike; the type is part of what is remembered
    assert RunConfig.parsed({"lr": 1}).lr == RunConfig.parsed({"lr": 1.0}).lr == 1.0
    assert RunConfig.parsed({"local-epochs": 1}).local_epochs == 1
    with pytest.raises(ConfigError, match="local-epochs=True is not a valid int"):  # True == 1, yet refused
        RunConfig.parsed({"local-epochs": True})
    assert RunConfig.parsed(dict(reversed(values.items()))) == cfg  # another order: the same config


def test_remembered_node_settings_are_the_read_ones_and_errors_are_not_remembered():
    from flatflower.client.node import NodeSettings

    good = {"partition-id": 1, "num-partitions": 2, "threads": 1}
    settings = NodeSettings.from_node_config(good)
    assert settings == NodeSettings(partition_id=1, num_partitions=2, threads=1)
    assert NodeSettings.from_node_config(dict(good)) is settings
    for _ in range(2):  # True == 1 and hashes alike, yet refused, every time
        with pytest.raises(ValueError, match="'partition-id' must be a whole number"):
            NodeSettings.from_node_config({**good, "partition-id": True})
    with pytest.raises(ValueError, match="out of range"):
        NodeSettings.from_node_config({**good, "partition-id": 2})
    assert NodeSettings.from_node_config({**good, "data-dir": ["unhashable"]}).data_dir == "['unhashable']"


def test_a_kept_client_split_is_the_split_and_is_not_shared_with_others():
    cfg = RunConfig.from_mapping({"dataset": "digits", "partition": "dirichlet", "num-partitions": 5})
    splits = [client_split(cfg, i, 5) for i in range(5)]
    assert client_split(cfg, 2, 5) is splits[2]
    assert sum(len(s) for s in splits) == 1437
    other = client_split(cfg.replace(partition_seed=9), 2, 5)
    assert other is not splits[2]


def test_slots_bound_the_calls_at_once_and_a_stuck_holder_holds_nobody_up():
    from flatflower.runtime.engines.inprocess import Slots

    slots = Slots(1, patience=0.2)
    assert slots.acquire()  # the one slot, then held "forever"
    t0 = time.monotonic()
    assert slots.acquire() is False  # nothing freed for 0.2 s: going on without a slot
    assert time.monotonic() - t0 >= 0.2
    slots.release()
    assert slots.acquire()  # freed: taken again, at once
    got = []
    waiter = threading.Thread(target=lambda: got.append(slots.acquire()))
    waiter.start()
    time.sleep(0.05)
    slots.release()  # a holder that finishes in time hands its slot on
    waiter.join(5)
    assert got == [True]
