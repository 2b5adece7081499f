"""The federated view of a dataset: run config -> partitions -> one client's split.

Every node computes the same partition from (dataset, scheme, num-partitions, seed), so no
coordination is needed; the server writes it to partition.json for the record.
"""

from __future__ import annotations

import functools

import numpy as np

from common.config import RunConfig
from common.datasets import FederatedDataset, Split, load_dataset
from common import fds
from common.partition import partition_indices
from common.userdata import is_user_dataset


def dataset_options(cfg: RunConfig) -> dict[str, float | str]:
    """The options of the run's dataset: synthetic-fedprox makes one client per partition,
    from ``synthetic-alpha``, ``synthetic-beta`` and the partition seed; the user's own data
    (common/userdata.py) reads ``csv-label``, ``classes``, ``image-size`` and ``num-classes``."""
    if is_user_dataset(cfg.dataset):
        return {"csv_label": cfg.csv_label, "classes": cfg.classes, "image_size": cfg.image_size,
                "num_classes": cfg.num_classes}
    if cfg.dataset != "synthetic-fedprox":
        return {}
    return {"clients": cfg.num_partitions, "alpha": cfg.synthetic_alpha,
            "beta": cfg.synthetic_beta, "seed": cfg.data_seed()}


def dataset_for(cfg: RunConfig, data_dir: str = "") -> FederatedDataset:
    """The run's dataset; a node's own ``data-dir`` wins over the run config's."""
    return load_dataset(cfg.dataset, data_dir or cfg.data_dir, cfg.download, **dataset_options(cfg))


@functools.lru_cache(maxsize=8)
def _partitions(dataset: str, data_dir: str, download: bool, generator: tuple, scheme: str, n: int,
                seed: int, alpha: float, cpc: int, args: str) -> tuple[np.ndarray, ...]:
    data = load_dataset(dataset, data_dir, download, **dict(generator))
    labels = data.train.y.numpy()
    if fds.is_fds(scheme):  # Flower Datasets' partitioner, with its keyword arguments ``args``
        return tuple(fds.partition(labels, n, scheme, args, seed))
    return tuple(partition_indices(labels, n, scheme, seed, alpha=alpha, classes_per_client=cpc,
                                   groups=data.train_groups))


def partitions_for(cfg: RunConfig, num_partitions: int, data_dir: str = "") -> tuple[np.ndarray, ...]:
    """Indices into the training split, one array per partition id."""
    generator = tuple(sorted(dataset_options(cfg).items()))
    return _partitions(cfg.dataset, data_dir or cfg.data_dir, cfg.download, generator, cfg.partition,
                       num_partitions, cfg.data_seed(), cfg.dirichlet_alpha, cfg.classes_per_client,
                       cfg.partition_args)


def client_split(cfg: RunConfig, partition_id: int, num_partitions: int, data_dir: str = "") -> Split:
    """The training samples of one client."""
    if not 0 <= partition_id < num_partitions:
        raise ValueError(
            f"partition-id {partition_id} is out of range for num-partitions={num_partitions}"
        )
    generator = tuple(sorted(dataset_options(cfg).items()))
    return _client_split(cfg.dataset, data_dir or cfg.data_dir, cfg.download, generator, cfg.partition,
                         num_partitions, cfg.data_seed(), cfg.dirichlet_alpha, cfg.classes_per_client,
                         cfg.partition_args, partition_id)


@functools.lru_cache(maxsize=4096)
def _client_split(dataset: str, data_dir: str, download: bool, generator: tuple, scheme: str, n: int,
                  seed: int, alpha: float, cpc: int, args: str, partition_id: int) -> Split:
    """A client's split, kept: clients call for it every round (its rows are copied once; a
    kept split is only read, every batch is a new tensor)."""
    indices = _partitions(dataset, data_dir, download, generator, scheme, n, seed, alpha, cpc, args)[partition_id]
    data = load_dataset(dataset, data_dir, download, **dict(generator))
    return data.train.subset(indices)


def client_test_split(cfg: RunConfig, partition_id: int, num_partitions: int,
                      data_dir: str = "") -> Split | None:
    """A client's own held-out data, where the dataset has some (synthetic-fedprox: the 10%
    of its generated samples it does not train on); None otherwise."""
    data = dataset_for(cfg, data_dir)
    if data.test_groups is None or cfg.partition != "natural":
        return None
    return data.test.subset(np.flatnonzero(data.test_groups == partition_id))
