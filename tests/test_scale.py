"""Scale (issue 58, item 6; docs/reliability.md, Scale): thousands of clients in one process,
with client state, in both in-process engines; a partition of thousands of clients that cannot
be drawn, refused quickly; a 50 MB model over a real deployment, equal to the in-process run.
Expectations come from in-process runs and invariants, never from stored numbers."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from flatflower.client.state import StateMirror, own_storage
from flatflower.common.partition import PartitionError, _class_indices, partition_indices
from tests.helpers import deployed, run_with_faults, same, user_module_file

DATA = """
import numpy as np

def load():
    # 10,000 training rows: 5,000 clients hold 2 each (digits' 1,437 rows allow 1,437 clients)
    rng = np.random.default_rng(0)
    means = rng.normal(size=(10, 20)) * 1.5

    def sample(n):
        y = np.arange(n) % 10
        return (means[y] + rng.normal(size=(n, 20))).astype(np.float32), y

    return sample(10_000), sample(1_000)
"""

# ~12.5M float32 parameters (50 MB) for digits (64 inputs, 10 classes): a wide hidden layer
BIG_MODEL = """
import torch.nn as nn

PARAMETERS = 12_500_000

def make(input_shape, num_classes):
    inputs = 1
    for size in input_shape:
        inputs *= size
    hidden = PARAMETERS // (inputs + 1 + num_classes)
    return nn.Sequential(nn.Flatten(), nn.Linear(inputs, hidden), nn.ReLU(), nn.Linear(hidden, num_classes))
"""


@pytest.fixture
def data_module(tmp_path, monkeypatch):
    yield from user_module_file(tmp_path, monkeypatch, "scale_data", DATA)


@pytest.fixture
def big_model(tmp_path, monkeypatch):
    yield from user_module_file(tmp_path, monkeypatch, "scale_model", BIG_MODEL)


# ---------------------------------------------------------------- 5,000 clients in one process
def _state_files(run_dir: Path) -> dict[str, int]:
    return {str(p.relative_to(run_dir)): p.stat().st_size for p in (run_dir / "client-state").rglob("*.pt")}


@pytest.mark.slow
def test_five_thousand_clients_keep_their_state_in_both_in_process_engines(tmp_path, data_module):
    """5,000 clients, 20 sampled a round, FedSMOO (two state records a client): both engines
    complete, give the same model, and write the same client-state files, each of one client's
    records: the vectorised engine once wrote its whole group's rows into every client's file
    (a 0.4 MB state file was 195 MB for 500 clients; 46 GB filled the disk)."""
    from flatflower.runtime.engines.inprocess import run_inprocess

    clients = 5000
    runs = {}
    for engine in ("inprocess", "vectorized"):
        run_dir = tmp_path / engine
        config = {"algorithm": "fedsmoo", "dataset": f"{data_module}:load", "model": "mlp", "partition": "iid",
                  "fraction-train": 20 / clients, "local-steps": 2, "batch-size": 2, "num-server-rounds": 2,
                  "run-dir": str(run_dir), "client-state-dir": str(run_dir / "client-state")}
        run_inprocess(config, clients, vectorized=engine == "vectorized")
        runs[engine] = run_dir
    a, b = (torch.load(runs[e] / "model_final.pt") for e in ("inprocess", "vectorized"))
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6)
    files = {e: _state_files(d) for e, d in runs.items()}
    assert files["inprocess"] and files["inprocess"].keys() == files["vectorized"].keys()
    assert len({p.split("/")[1] for p in files["inprocess"]}) <= 40  # only the sampled clients keep state
    model_bytes = sum(t.numel() * t.element_size() for t in a.values())
    for engine, sizes in files.items():
        assert max(sizes.values()) < 3 * model_bytes, (engine, max(sizes.values()), model_bytes)


def _dirichlet_every_draw_split(labels, n, alpha, rng, tries=1000):
    """The draw as it was before it checked sizes first: every draw split into chunks."""
    min_size = max(1, min(10, len(labels) // (4 * n)))
    for _ in range(tries):
        chunks = [[] for _ in range(n)]
        for idx in _class_indices(labels, rng):
            cuts = (np.cumsum(rng.dirichlet(np.full(n, alpha)))[:-1] * len(idx)).astype(int)
            for client, chunk in enumerate(np.split(idx, cuts)):
                chunks[client].append(chunk)
        parts = [np.concatenate(c) for c in chunks]
        if min(len(p) for p in parts) >= min_size:
            return [np.sort(p) for p in parts]
    return None


@pytest.mark.parametrize("n, alpha, seed", [(5, 0.1, 0), (20, 0.5, 1), (50, 0.3, 2), (100, 1.0, 3), (10, 0.05, 4)])
def test_dirichlet_sizes_first_draws_the_same_partition(n, alpha, seed):
    """Sizes first, chunks for the kept draw only: the same partitions as splitting every draw
    (honest runs' partitions, hence their numbers, do not move)."""
    labels = np.random.default_rng(seed).integers(0, 10, 2000)
    want = _dirichlet_every_draw_split(labels, n, alpha, np.random.default_rng(seed))
    assert want is not None
    got = partition_indices(labels, n, "dirichlet", seed, alpha=alpha)
    assert all(np.array_equal(g, w) for g, w in zip(got, want, strict=True))


def test_a_dirichlet_partition_of_thousands_of_clients_is_refused_in_seconds(monkeypatch):
    """1,000 clients of 2,000 examples cannot all get one (alpha 0.5): the refusal, after its
    1,000 draws, names the way out, and comes before a run starts. No draw is split into
    chunks until it is kept (splitting every one took minutes for 5,000 clients of
    Fashion-MNIST: 191 s, now 10 s)."""
    splits = []
    split = np.split
    monkeypatch.setattr(np, "split", lambda *a, **k: splits.append(1) or split(*a, **k))
    labels = np.arange(2000) % 10
    start = time.monotonic()
    with pytest.raises(PartitionError, match="use a larger alpha or fewer partitions .or dirichlet-balanced"):
        partition_indices(labels, 1000, "dirichlet", 0)
    assert not splits and time.monotonic() - start < 60


def test_a_client_state_file_holds_only_its_own_rows(tmp_path):
    """A state record that is a row of a larger tensor (the vectorised engine's clients hold
    rows of their group's stacked state) is written as that row alone."""
    stacked = torch.randn(500, 1000)
    mirror = StateMirror(tmp_path, 7, checkpoint_every=1)
    mirror.stage(1, 0, {"mu": {"w": stacked[3]}})
    assert mirror.path(1).stat().st_size < 100 * 1000
    assert torch.equal(mirror.read(1)["mu"]["w"], stacked[3])
    whole = torch.randn(3)
    assert own_storage(whole) is whole and own_storage(stacked[3]).untyped_storage().nbytes() == 4000


# ---------------------------------------------------------------- a 50 MB model, deployed
@pytest.mark.slow
@pytest.mark.integration
def test_a_50_mb_model_over_two_real_supernodes_equals_the_in_process_run(tmp_path, monkeypatch, big_model):
    """A user's model of 12.5M float32 parameters (a reference the nodes allow: allow-code),
    two SuperNodes on loopback, two rounds of FedAvg: it completes within the default
    deadlines, every round moves 100 MB each way, and its final model is the in-process run's."""
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # the SuperNodes' ClientApps import it from there
    config = {"algorithm": "fedavg", "dataset": "digits", "model": f"{big_model}:make", "partition": "iid",
              "local-steps": 1, "batch-size": 32, "num-server-rounds": 2}
    allow = {"allow-code": big_model}
    _, run_dir = deployed(tmp_path, "deployed", config, nodes=2, node_configs={0: allow, 1: allow})
    _, final = run_with_faults(tmp_path, "inprocess", clients=2, **{k.replace("-", "_"): v for k, v in config.items()})
    model = torch.load(run_dir / "model_final.pt")
    parameters = sum(t.numel() for t in model.values())
    assert 12_400_000 <= parameters <= 12_500_000
    assert same(model, final) and model.keys() == final.keys()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["clients_replied"] for r in rows[1:]] == [2, 2]
    assert all(r["bytes_down"] >= 2 * 4 * parameters and r["bytes_up"] >= 2 * 4 * parameters for r in rows[1:])
