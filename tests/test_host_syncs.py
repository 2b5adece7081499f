"""Issue 45, item 1: a local round synchronises the host with the device once per client, not
once per step. On a GPU every ``float(loss)``, ``.item()``, ``.cpu()``, ``.tolist()``,
``.numpy()`` or ``bool(tensor)`` waits for the device's queue to drain, so a sync per step
leaves the GPU idle between steps. On this CPU there is no queue, so the test counts those
calls instead: inside a client's local training (client/train.py's loop, and the vectorised
engine's group step) their number must not grow with the number of local steps."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

import flatflower.client.app as client_module
import flatflower.runtime.engines.vectorized as vec
from flatflower.client.train import host_losses, round_loss
from flatflower.runtime.engines.inprocess import run_inprocess
from flatflower.strategies.registry import ALGORITHMS

SYNCS = ("item", "__float__", "__int__", "__bool__", "cpu", "numpy", "tolist")
BASE = {"dataset": "digits", "model": "mlp", "partition": "iid", "batch-size": 16,
        "fraction-train": 1.0, "fraction-evaluate": 0.5, "num-server-rounds": 1, "tensorboard": False}
CLIENTS = 3


def counted(monkeypatch, target, name: str, counts: list[int]) -> None:
    """Wrap ``target.name`` so that host syncs made while it runs are counted (per call), in its
    own thread only (the in-process engine runs other clients' evaluation alongside)."""
    inner = getattr(target, name)
    state, lock = threading.local(), threading.Lock()
    for method in SYNCS:
        original = getattr(torch.Tensor, method)

        def spy(self, *args, __original=original, **kwargs):
            if getattr(state, "on", False):
                counts[state.index] += 1
            return __original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, method, spy)

    def wrapped(*args, **kwargs):
        with lock:
            state.index = len(counts)
            counts.append(0)
        state.on = True
        try:
            return inner(*args, **kwargs)
        finally:
            state.on = False

    monkeypatch.setattr(target, name, wrapped)


def syncs_per_client(monkeypatch, tmp_path, algorithm: str, steps: int, vectorized: bool) -> list[int]:
    """Host syncs counted inside each client's local training of a one-round run."""
    counts: list[int] = []
    with monkeypatch.context() as m:
        if vectorized:
            m.setattr(vec, "MIN_GROUP", 1)
            m.setattr(vec, "batching_pays", lambda call: True)
            counted(m, vec, "train_group", counts)
        else:
            counted(m, client_module, "local_train", counts)
        config = {**BASE, **ALGORITHMS[algorithm].example_config(), "local-steps": steps,
                  "run-dir": str(tmp_path / f"{algorithm}-{steps}-{vectorized}")}
        run_inprocess(config, CLIENTS, vectorized=vectorized)
    assert counts, "no local training was seen"
    return sorted(counts)


@pytest.mark.parametrize("vectorized", [False, True], ids=["inprocess", "vectorised"])
@pytest.mark.parametrize("algorithm", ["fedavg", "fedsam", "fedsmoo", "fedtoga", "scaffold", "fedlesam-s"])
def test_host_syncs_do_not_grow_with_local_steps(monkeypatch, tmp_path, algorithm, vectorized):
    """1 step and 6 steps: the same number of host syncs per client (or per vectorised group),
    so none is per step; in-process exactly the one copy of the round's losses (``.cpu()``,
    then its ``.numpy()`` view on the host). A first run warms up (a one-time lazy init on
    the first call of the process also reads a tensor)."""
    syncs_per_client(monkeypatch, tmp_path / "warm", algorithm, 1, vectorized)
    one = syncs_per_client(monkeypatch, tmp_path, algorithm, 1, vectorized)
    six = syncs_per_client(monkeypatch, tmp_path, algorithm, 6, vectorized)
    assert one == six, (one, six)
    if not vectorized:
        assert set(six) == {2}, six


def test_round_loss_is_the_mean_of_the_step_losses_as_floats():
    """The reported loss is numpy's mean of the float64 step losses, bit for bit what the mean
    of ``float(loss)`` per step gave; a non-finite loss raises the error at its first step."""
    torch.manual_seed(0)
    steps = [torch.rand((), dtype=torch.float32) * 3 for _ in range(37)]
    assert round_loss(host_losses(steps)) == float(np.mean([float(s) for s in steps]))
    steps[5] = torch.tensor(float("nan"))
    steps[9] = torch.tensor(float("inf"))
    with pytest.raises(FloatingPointError, match=r"^local loss became nan at step 6$"):
        round_loss(host_losses(steps))
