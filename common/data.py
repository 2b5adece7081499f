"""The federated view of a dataset: run config -> partitions -> one client's split.

Every node computes the same partition from (dataset, scheme, num-partitions, seed), so no
coordination is needed; the server writes it to partition.json for the record.
"""

from __future__ import annotations

import functools

import numpy as np

from common.config import RunConfig
from common.datasets import FederatedDataset, Split, load_dataset
from common.partition import partition_indices


def dataset_for(cfg: RunConfig, data_dir: str = "") -> FederatedDataset:
    """The run's dataset; a node's own ``data-dir`` wins over the run config's."""
    return load_dataset(cfg.dataset, data_dir or cfg.data_dir, cfg.download)


@functools.lru_cache(maxsize=8)
def _partitions(dataset: str, data_dir: str, download: bool, scheme: str, n: int,
                seed: int, alpha: float, cpc: int) -> tuple[np.ndarray, ...]:
    labels = load_dataset(dataset, data_dir, download).train.y.numpy()
    return tuple(partition_indices(labels, n, scheme, seed, alpha=alpha, classes_per_client=cpc))


def partitions_for(cfg: RunConfig, num_partitions: int, data_dir: str = "") -> tuple[np.ndarray, ...]:
    """Indices into the training split, one array per partition id."""
    return _partitions(cfg.dataset, data_dir or cfg.data_dir, cfg.download, cfg.partition,
                       num_partitions, cfg.data_seed(), cfg.dirichlet_alpha, cfg.classes_per_client)


def client_split(cfg: RunConfig, partition_id: int, num_partitions: int, data_dir: str = "") -> Split:
    """The training samples of one client."""
    if not 0 <= partition_id < num_partitions:
        raise ValueError(
            f"partition-id {partition_id} is out of range for num-partitions={num_partitions}"
        )
    indices = partitions_for(cfg, num_partitions, data_dir)[partition_id]
    return dataset_for(cfg, data_dir).train.subset(indices)
