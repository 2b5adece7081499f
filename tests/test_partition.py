"""Tests for common/partition.py: validity, determinism, skew and error messages."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.datasets import load_digits

from flatflower.common.partition import PARTITIONS, PartitionError, label_histogram, partition_indices

SYNTHETIC = np.random.default_rng(42).integers(0, 10, size=2000)
DIGITS = load_digits().target
LABEL_SETS = {"synthetic": SYNTHETIC, "digits": DIGITS}


LABEL_SCHEMES = [s for s in PARTITIONS if s != "natural"]  # natural: the dataset's own clients


def _cases():
    for scheme in LABEL_SCHEMES:
        for name in LABEL_SETS:
            yield pytest.param(scheme, name, id=f"{scheme}-{name}")


@pytest.mark.parametrize(("scheme", "labels_name"), list(_cases()))
def test_partition_is_valid_and_deterministic(scheme: str, labels_name: str) -> None:
    labels = LABEL_SETS[labels_name]
    parts = partition_indices(labels, 10, scheme, seed=0)
    assert len(parts) == 10
    assert all(p.dtype == np.int64 and np.all(np.diff(p) > 0) for p in parts)  # sorted, unique
    everything = np.concatenate(parts)
    assert len(everything) == len(labels)  # disjoint ...
    assert np.array_equal(np.sort(everything), np.arange(len(labels)))  # ... and complete
    again = partition_indices(labels, 10, scheme, seed=0)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again))
    other = partition_indices(labels, 10, scheme, seed=1)
    assert not all(np.array_equal(a, b) for a, b in zip(parts, other))


@pytest.mark.parametrize("scheme", LABEL_SCHEMES)
def test_single_partition_holds_everything(scheme: str) -> None:
    (part,) = partition_indices(DIGITS, 1, scheme, seed=0, classes_per_client=10)
    assert np.array_equal(part, np.arange(len(DIGITS)))


@pytest.mark.parametrize("scheme", ["iid", "dirichlet-balanced"])
@pytest.mark.parametrize("num_partitions", [7, 10, 33])
def test_equal_size_schemes(scheme: str, num_partitions: int) -> None:
    parts = partition_indices(DIGITS, num_partitions, scheme, seed=3)
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1
    assert sum(sizes) == len(DIGITS)


def test_dirichlet_respects_minimum_size() -> None:
    parts = partition_indices(SYNTHETIC, 20, "dirichlet", seed=0, alpha=0.1)
    assert min(len(p) for p in parts) >= 10  # min(10, 2000 // (4 * 20))


@pytest.mark.parametrize(("num_partitions", "c"), [(10, 2), (5, 2), (7, 3), (4, 10)])
def test_pathological_classes(num_partitions: int, c: int) -> None:
    parts = partition_indices(
        SYNTHETIC, num_partitions, "pathological", seed=0, classes_per_client=c
    )
    hist = label_histogram(SYNTHETIC, parts, 10)
    assert ((hist > 0).sum(axis=1) == c).all()
    assert (hist.sum(axis=0) == np.bincount(SYNTHETIC)).all()  # every class fully used


def test_pathological_splits_classes_evenly() -> None:
    parts = partition_indices(DIGITS, 5, "pathological", seed=0, classes_per_client=2)
    hist = label_histogram(DIGITS, parts, 10)
    for k in range(10):
        counts = hist[:, k][hist[:, k] > 0]
        assert counts.max() - counts.min() <= 1


def _mean_major_classes(labels: np.ndarray, scheme: str, alpha: float) -> float:
    """Average number of classes holding >= 5% of a client's samples."""
    parts = partition_indices(labels, 10, scheme, seed=0, alpha=alpha)
    hist = label_histogram(labels, parts, 10)
    share = hist / hist.sum(axis=1, keepdims=True)
    return float((share >= 0.05).sum(axis=1).mean())


@pytest.mark.parametrize("scheme", ["dirichlet", "dirichlet-balanced"])
@pytest.mark.parametrize("labels_name", sorted(LABEL_SETS))
def test_small_alpha_skews_labels(scheme: str, labels_name: str) -> None:
    labels = LABEL_SETS[labels_name]
    skewed = _mean_major_classes(labels, scheme, alpha=0.1)
    uniform = _mean_major_classes(labels, scheme, alpha=100.0)
    assert uniform >= 9.0  # near-uniform label mix
    assert skewed <= 0.6 * uniform  # clearly fewer dominant classes


def test_label_histogram() -> None:
    labels = np.array([0, 1, 1, 2, 2, 2])
    hist = label_histogram(labels, [np.array([0, 1]), np.array([2, 3, 4, 5])], 4)
    assert hist.tolist() == [[1, 1, 0, 0], [0, 1, 3, 0]]


def test_unknown_scheme_lists_names() -> None:
    with pytest.raises(PartitionError, match="unknown partition scheme 'shards'") as info:
        partition_indices(DIGITS, 10, "shards", seed=0)
    assert all(name in str(info.value) for name in PARTITIONS)


@pytest.mark.parametrize("num_partitions", [0, len(DIGITS) + 1])
def test_bad_partition_count(num_partitions: int) -> None:
    with pytest.raises(PartitionError, match=r"the number of clients \(num-partitions, --clients\) must be between 1 and"):
        partition_indices(DIGITS, num_partitions, "iid", seed=0)


def test_bad_alpha() -> None:
    with pytest.raises(PartitionError, match="alpha must be > 0"):
        partition_indices(DIGITS, 10, "dirichlet", seed=0, alpha=0.0)


def test_pathological_with_too_few_clients() -> None:
    with pytest.raises(PartitionError, match="cannot cover all 10 classes; use at least 5 clients"):
        partition_indices(DIGITS, 4, "pathological", seed=0, classes_per_client=2)


def test_pathological_with_too_many_classes_per_client() -> None:
    with pytest.raises(PartitionError, match="classes_per_client=11 exceeds the 10 classes"):
        partition_indices(DIGITS, 10, "pathological", seed=0, classes_per_client=11)


def test_dirichlet_gives_up_with_advice() -> None:
    labels = np.repeat(np.arange(2), 50)
    with pytest.raises(PartitionError, match="larger alpha or fewer partitions"):
        partition_indices(labels, 100, "dirichlet", seed=0, alpha=0.01)


def test_partition_error_is_a_value_error() -> None:
    assert issubclass(PartitionError, ValueError)


def test_natural_partition_is_the_generated_clients() -> None:
    groups = np.array([2, 0, 1, 2, 0, 2])
    parts = partition_indices(np.zeros(6, dtype=int), 3, "natural", seed=0, groups=groups)
    assert [p.tolist() for p in parts] == [[1, 4], [2], [0, 3, 5]]
    with pytest.raises(PartitionError, match="generated for 3 clients, not 2"):
        partition_indices(np.zeros(6, dtype=int), 2, "natural", seed=0, groups=groups)
    with pytest.raises(PartitionError, match="needs a dataset generated per client"):
        partition_indices(np.zeros(6, dtype=int), 3, "natural", seed=0)
