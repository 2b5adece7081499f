"""Flower Datasets' partitioners as a partition backend (common/fds.py): a valid, seeded
partition, the run's values filled in, one-line errors, and a 2-round federation."""

from __future__ import annotations

import json

import numpy as np
import pytest

from flatflower.common.config import ConfigError, RunConfig
from flatflower.common.fds import parse_args, partition
from flatflower.common.partition import PartitionError
from tests.helpers import fast_config
from flatflower.runtime.engines.inprocess import run_inprocess

pytest.importorskip("flwr_datasets")

LABELS = np.repeat(np.arange(10), 60)  # 600 samples, 10 classes


def dirichlet(seed: int, n: int = 8, args: str = "alpha=0.5, min_partition_size=5") -> list[np.ndarray]:
    return partition(LABELS, n, "fds:DirichletPartitioner", args, seed)


def test_dirichlet_partitioner_is_a_valid_seeded_partition() -> None:
    parts = dirichlet(seed=3)
    assert len(parts) == 8 and all(p.dtype == np.int64 for p in parts)
    assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(len(LABELS)))  # every index once
    assert all(np.array_equal(p, np.sort(p)) and len(p) >= 5 for p in parts)
    again, other = dirichlet(seed=3), dirichlet(seed=4)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again))
    assert not all(np.array_equal(a, b) for a, b in zip(parts, other))
    # non-IID: alpha = 0.5 gives clients clearly different label mixes
    hist = np.stack([np.bincount(LABELS[p], minlength=10) / len(p) for p in parts])
    assert hist.max() > 0.3


def test_dirichlet_matches_flower_datasets_run_directly() -> None:
    """The indices are exactly Flower Datasets' own partitions of the same labels and seed."""
    from datasets import Dataset
    from flwr_datasets.partitioner import DirichletPartitioner

    ours = dirichlet(seed=11, n=5)
    theirs = DirichletPartitioner(num_partitions=5, partition_by="label", alpha=0.5, min_partition_size=5, seed=11)
    theirs.dataset = Dataset.from_dict({"label": LABELS, "index": np.arange(len(LABELS))})
    for i in range(5):
        assert np.array_equal(ours[i], np.sort(theirs.load_partition(i)["index"]))


def test_iid_partitioner_takes_no_seed_or_label() -> None:
    parts = partition(LABELS, 4, "fds:IidPartitioner", "", seed=0)
    assert [len(p) for p in parts] == [150] * 4


@pytest.mark.parametrize(("text", "expected"), [
    ("alpha=0.5, min_partition_size=5", {"alpha": 0.5, "min_partition_size": 5}),
    ("alpha=[0.1, 0.2], partition_by=label, shuffle=false", {"alpha": [0.1, 0.2], "partition_by": "label",
                                                             "shuffle": False}),
    ("  ", {}),
    ('partition_by="label"', {"partition_by": "label"}),
])
def test_partition_args_are_toml_values(text, expected) -> None:
    assert parse_args(text) == expected


@pytest.mark.parametrize(("scheme", "args", "match"), [
    ("fds:DirichletPartitionr", "alpha=0.5", "has no 'DirichletPartitionr' (did you mean 'DirichletPartitioner'?)"),
    ("fds:DirichletPartitioner", "alpha=0.5, bogus=1", "unexpected keyword argument 'bogus'"),
    ("fds:DirichletPartitioner", "", "missing 1 required positional argument: 'alpha'"),
    ("fds:DirichletPartitioner", "alpha=-1", "alpha"),
])
def test_bad_partitioner_or_args_is_one_line(scheme, args, match) -> None:
    with pytest.raises(PartitionError) as err:
        partition(LABELS, 4, scheme, args, 0)
    assert match in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(("values", "match"), [
    ({"partition": "fds:Dirichlet Partitioner"}, "name a class of flwr_datasets.partitioner"),
    ({"partition": "fds:DirichletPartitioner", "partition-args": "alpha"}, "'alpha' is not key=value"),
    ({"partition": "fds:IidPartitioner", "partition-args": "num_partitions=3"}, "set by the run"),
    ({"partition": "iid", "partition-args": "alpha=1"}, "read only by partition = fds:"),
])
def test_config_refuses_bad_fds_text(values, match) -> None:
    with pytest.raises(ConfigError, match=match):
        RunConfig.from_mapping(values)


def test_flower_datasets_missing_is_one_line(monkeypatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "flwr_datasets.partitioner", None)  # import fails as if not installed
    with pytest.raises(PartitionError, match=r"pip install 'flatflower\[fds\]'"):
        partition(LABELS, 4, "fds:IidPartitioner", "", 0)


def test_two_round_federation_on_a_dirichlet_partition(tmp_path) -> None:
    cfg = fast_config(partition="fds:DirichletPartitioner", partition_args="alpha=0.5, min_partition_size=20",
                      run_dir=str(tmp_path / "run"))
    run_dir, _ = run_inprocess(cfg, num_clients=4)
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "completed"
    saved = json.loads((run_dir / "partition.json").read_text())
    assert saved["scheme"] == "fds:DirichletPartitioner" and saved["partition_args"].startswith("alpha=0.5")
    assert saved["flwr_datasets"] not in ("", "unknown")
    indices = np.sort(np.concatenate([saved["partitions"][str(i)] for i in range(4)]))
    assert np.array_equal(indices, np.arange(2000))  # synthetic's 2000 training samples, each once
