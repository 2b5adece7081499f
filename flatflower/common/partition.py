"""Split a dataset's sample indices among federated clients.

Every scheme returns disjoint, sorted int64 index arrays that together cover all
samples, and is a deterministic function of its arguments (seeded numpy Generators only).
"""

from __future__ import annotations

import numpy as np

PARTITIONS = ("iid", "dirichlet", "dirichlet-balanced", "pathological", "natural")
# No partition at all: every node trains on all of its own data (common/data.py, docs/local-data.md)
LOCAL = "local"

_MAX_DIRICHLET_TRIES = 1000


class PartitionError(ValueError):
    """The requested partition is invalid or cannot be drawn."""


def partition_indices(
    labels: np.ndarray,
    num_partitions: int,
    scheme: str,
    seed: int,
    alpha: float = 0.5,
    classes_per_client: int = 2,
    groups: np.ndarray | None = None,
) -> list[np.ndarray]:
    """Indices into ``labels`` for each of ``num_partitions`` clients under ``scheme``;
    ``natural``: partition i = the samples whose ``groups`` entry is i (a dataset generated per
    client). Flower Datasets' partitioners (``fds:<Partitioner>``) are common/fds.py's."""
    labels = np.asarray(labels)
    _validate(labels, num_partitions, scheme, alpha, classes_per_client)
    rng = np.random.default_rng(seed)
    if scheme == "natural":
        if groups is None:
            raise PartitionError("partition 'natural' needs a dataset generated per client "
                                 "(synthetic-fedprox); use iid, dirichlet, ... for this one")
        groups = np.asarray(groups)
        if len(groups) != len(labels) or groups.max() >= num_partitions:
            raise PartitionError(f"partition 'natural': the dataset was generated for "
                                 f"{int(groups.max()) + 1} clients, not {num_partitions}")
        parts = [np.flatnonzero(groups == i) for i in range(num_partitions)]
    elif scheme == "iid":
        parts = np.array_split(rng.permutation(len(labels)), num_partitions)
    elif scheme == "dirichlet":
        parts = _dirichlet(labels, num_partitions, alpha, rng)
    elif scheme == "dirichlet-balanced":
        parts = _dirichlet_balanced(labels, num_partitions, alpha, rng)
    else:
        parts = _pathological(labels, num_partitions, classes_per_client, rng)
    return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]


def label_histogram(labels: np.ndarray, parts: list[np.ndarray], num_classes: int) -> np.ndarray:
    """(num_partitions, num_classes) matrix of per-client label counts."""
    labels = np.asarray(labels)
    return np.stack([np.bincount(labels[p], minlength=num_classes) for p in parts])


def _validate(
    labels: np.ndarray, n: int, scheme: str, alpha: float, classes_per_client: int
) -> None:
    if scheme == LOCAL:
        raise PartitionError("partition 'local' cuts nothing: each node trains on all of its own data "
                             "(common/data.py), and no tool computes a partition of it")
    if scheme not in PARTITIONS:
        raise PartitionError(f"unknown partition scheme {scheme!r}; valid: {', '.join(PARTITIONS)}")
    if labels.ndim != 1:
        raise PartitionError(f"labels must be a 1-D array, got shape {labels.shape}")
    if not 1 <= n <= len(labels):
        raise PartitionError(
            f"the number of clients (num-partitions, --clients) must be between 1 and the number of "
            f"samples ({len(labels)}), got {n}"
        )
    if not alpha > 0:
        raise PartitionError(f"alpha must be > 0, got {alpha}")
    if classes_per_client < 1:
        raise PartitionError(f"classes_per_client must be >= 1, got {classes_per_client}")


def _class_indices(labels: np.ndarray, rng: np.random.Generator) -> list[np.ndarray]:
    """Shuffled sample indices of each class present, in sorted class order."""
    return [rng.permutation(np.flatnonzero(labels == c)) for c in np.unique(labels)]


def _dirichlet(
    labels: np.ndarray, n: int, alpha: float, rng: np.random.Generator
) -> list[np.ndarray]:
    """Per-class client shares ~ Dir(alpha) (Hsu et al. 2019); redrawn while a client is tiny."""
    min_size = max(1, min(10, len(labels) // (4 * n)))
    for _ in range(_MAX_DIRICHLET_TRIES):
        # a draw's client sizes first, in numpy; its chunks only for the draw that is kept (the
        # same draws and result: thousands of clients redrawn a thousand times cost seconds, not
        # the minutes that splitting every draw into n x classes arrays took)
        draws = [(idx, (np.cumsum(rng.dirichlet(np.full(n, alpha)))[:-1] * len(idx)).astype(int))
                 for idx in _class_indices(labels, rng)]
        sizes = sum(np.diff(np.clip(cuts, 0, len(idx)), prepend=0, append=len(idx)) for idx, cuts in draws)
        if sizes.min() < min_size:
            continue
        chunks: list[list[np.ndarray]] = [[] for _ in range(n)]
        for idx, cuts in draws:
            for client, chunk in enumerate(np.split(idx, cuts)):
                chunks[client].append(chunk)
        return [np.concatenate(c) for c in chunks]
    raise PartitionError(
        f"dirichlet partition: after {_MAX_DIRICHLET_TRIES} draws some client still had fewer "
        f"than {min_size} samples (alpha={alpha}, {n} partitions, {len(labels)} samples); "
        f"use a larger alpha or fewer partitions (or dirichlet-balanced: equal-size clients)"
    )


def _dirichlet_balanced(
    labels: np.ndarray, n: int, alpha: float, rng: np.random.Generator
) -> list[np.ndarray]:
    """Equal-size clients, each filled from its own label prior q_i ~ Dir(alpha) (FedDyn code)."""
    pools = [list(idx) for idx in _class_indices(labels, rng)]
    left = np.array([len(p) for p in pools], dtype=np.float64)
    priors = rng.dirichlet(np.full(len(pools), alpha), size=n)
    quota = np.full(n, len(labels) // n)
    quota[: len(labels) % n] += 1
    active = list(range(n))
    parts: list[list[int]] = [[] for _ in range(n)]
    for u_client, u_class in rng.random((len(labels), 2)):
        pos = min(int(u_client * len(active)), len(active) - 1)
        client = active[pos]
        k = _draw_class(priors[client], left, u_class)
        parts[client].append(pools[k].pop())
        left[k] -= 1
        quota[client] -= 1
        if quota[client] == 0:  # swap-remove the full client
            active[pos] = active[-1]
            active.pop()
    return [np.asarray(p) for p in parts]


def _draw_class(prior: np.ndarray, left: np.ndarray, u: float) -> int:
    """Class drawn by uniform ``u`` from ``prior`` restricted to classes with samples left."""
    available = left > 0
    weights = prior * available
    if weights.sum() <= 0:
        weights = available.astype(np.float64)
    cdf = np.cumsum(weights)
    k = int(np.searchsorted(cdf, u * cdf[-1], side="right"))
    if k >= len(cdf) or not available[k]:  # only reachable through rounding at the top end
        k = int(np.flatnonzero(available)[-1])
    return k


def _pathological(
    labels: np.ndarray, n: int, c: int, rng: np.random.Generator
) -> list[np.ndarray]:
    """Each client holds ``c`` classes; each class is split evenly among its holders."""
    classes = np.unique(labels)
    num_classes = len(classes)
    if c > num_classes:
        raise PartitionError(
            f"pathological partition: classes_per_client={c} exceeds the {num_classes} classes"
        )
    if n * c < num_classes:
        raise PartitionError(
            f"pathological partition: {n} clients x {c} classes each cannot cover all "
            f"{num_classes} classes; use at least {-(-num_classes // c)} clients or a larger "
            f"classes_per_client"
        )
    perm = rng.permutation(num_classes)
    holders: list[list[int]] = [[] for _ in range(num_classes)]
    for client in range(n):
        for j in range(c):
            holders[perm[(client * c + j) % num_classes]].append(client)
    chunks: list[list[np.ndarray]] = [[] for _ in range(n)]
    for k, idx in enumerate(_class_indices(labels, rng)):
        for client, chunk in zip(holders[k], np.array_split(idx, len(holders[k]))):
            chunks[client].append(chunk)
    parts = [np.concatenate(ch) for ch in chunks]
    if min(len(p) for p in parts) == 0:
        raise PartitionError(
            "pathological partition: some client would get no samples (too few samples per "
            "class for this many clients); use fewer partitions"
        )
    return parts
