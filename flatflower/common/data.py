"""The federated view of a dataset: run config -> partitions -> one client's split.

Every node computes the same partition from (dataset, scheme, num-partitions, seed), so no
coordination is needed; the server writes it to partition.json for the record.

``partition = local`` is no partition: every node trains on all of its own data (the training
split of the dataset in its node config's ``data-dir``) and holds its test split out for
federated evaluation; the server knows only ``input-shape`` and ``num-classes``, and each
node checks at its handshake that its data fits them (:func:`check_local_data`).
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from flatflower.common.config import ConfigError, RunConfig, parse_shape
from flatflower.common.datasets import FederatedDataset, Split, load_dataset
from flatflower.common import fds
from flatflower.common.partition import partition_indices
from flatflower.common.userdata import is_user_dataset


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
    """The run's dataset; a node's own ``data-dir`` wins over the run config's. With
    ``validation-fraction`` > 0 its test split is the validation split carved from its
    training split (:func:`carve_validation`), and its training split is what is left."""
    generator = tuple(sorted(dataset_options(cfg).items()))
    return _dataset(cfg.dataset, data_dir or cfg.data_dir, cfg.download, generator,
                    cfg.validation_fraction, cfg.data_seed())


@functools.lru_cache(maxsize=8)
def _dataset(dataset: str, data_dir: str, download: bool, generator: tuple, validation: float,
             seed: int) -> FederatedDataset:
    data = load_dataset(dataset, data_dir, download, **dict(generator))
    return carve_validation(data, validation, seed) if validation > 0 else data


def carve_validation(data: FederatedDataset, fraction: float, seed: int) -> FederatedDataset:
    """``data`` with a validation split in place of its test split: ``fraction`` of each class
    of the training split (rounded to the nearest whole example), drawn with ``seed`` (the
    partition seed, so every trial and every seed of a tune sees the same one), and the
    training split without those examples. The test split is not read: a tune's choices are
    made without it (``flatflower tune``). ConfigError when either side would be empty."""
    labels = data.train.y.numpy()
    rng = np.random.default_rng(seed)
    picked = [rng.permutation(np.flatnonzero(labels == c))[:int(round(fraction * np.sum(labels == c)))]
              for c in np.unique(labels)]
    held = np.sort(np.concatenate(picked)) if picked else np.zeros(0, dtype=np.int64)
    kept = np.setdiff1d(np.arange(len(labels)), held)
    if not len(held) or not len(kept):
        raise ConfigError(f"validation-fraction={fraction:g} of {len(labels)} training examples leaves "
                          f"{'no validation' if not len(held) else 'no training'} example")
    groups = data.train_groups
    return dataclasses.replace(data, train=data.train.subset(kept), test=data.train.subset(held),
                               train_groups=None if groups is None else groups[kept],
                               test_groups=None if groups is None else groups[held])


@functools.lru_cache(maxsize=8)
def _partitions(dataset: str, data_dir: str, download: bool, generator: tuple, scheme: str, n: int,
                seed: int, alpha: float, cpc: int, args: str, validation: float = 0.0) -> tuple[np.ndarray, ...]:
    data = _dataset(dataset, data_dir, download, generator, validation, seed)
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
                       cfg.partition_args, cfg.validation_fraction)


def model_shape(cfg: RunConfig, data_dir: str = "") -> tuple[tuple[int, ...], int]:
    """(input shape, number of classes) the run's model is built for: the run config's
    ``input-shape`` and ``num-classes`` with partition = local (the server has no data to
    read them from), else the dataset's."""
    if cfg.local_data():
        return parse_shape(cfg.input_shape), cfg.num_classes
    data = dataset_for(cfg, data_dir)
    return data.input_shape, data.num_classes


def check_local_data(cfg: RunConfig, data_dir: str = "", trains: bool = True) -> FederatedDataset:
    """partition = local: a node's own dataset, once it is seen to fit the run's model (its
    input shape, labels in [0, num-classes), a training split that is not empty unless it
    ``trains`` on none: the server's evaluation set); ValueError naming the node's folder and
    what differs otherwise."""
    data = dataset_for(cfg, data_dir)
    where = f"data-dir {data_dir or cfg.data_dir or '(none)'!r}"
    shape = parse_shape(cfg.input_shape)
    if tuple(data.input_shape) != shape:
        raise ValueError(f"{where}: examples of shape {','.join(map(str, data.input_shape))}, the run's "
                         f"input-shape is {','.join(map(str, shape))}")
    if trains and not len(data.train):
        raise ValueError(f"{where}: the training split is empty")
    for name, split in (("train", data.train), ("test", data.test)):
        if len(split) and not 0 <= int(split.y.min()) <= int(split.y.max()) < cfg.num_classes:
            raise ValueError(f"{where}: {name} labels span {int(split.y.min())}..{int(split.y.max())}, "
                             f"the run's num-classes={cfg.num_classes} allows 0..{cfg.num_classes - 1}")
    return data


def client_split(cfg: RunConfig, partition_id: int, num_partitions: int, data_dir: str = "") -> Split:
    """The training samples of one client (partition = local: all of its own)."""
    if not 0 <= partition_id < num_partitions:
        raise ValueError(
            f"partition-id {partition_id} is out of range for num-partitions={num_partitions}"
        )
    if cfg.local_data():
        return check_local_data(cfg, data_dir).train
    generator = tuple(sorted(dataset_options(cfg).items()))
    return _client_split(cfg.dataset, data_dir or cfg.data_dir, cfg.download, generator, cfg.partition,
                         num_partitions, cfg.data_seed(), cfg.dirichlet_alpha, cfg.classes_per_client,
                         cfg.partition_args, partition_id, cfg.validation_fraction)


@functools.lru_cache(maxsize=4096)
def _client_split(dataset: str, data_dir: str, download: bool, generator: tuple, scheme: str, n: int,
                  seed: int, alpha: float, cpc: int, args: str, partition_id: int,
                  validation: float = 0.0) -> Split:
    """A client's split, kept: clients call for it every round (its rows are copied once; a
    kept split is only read, every batch is a new tensor)."""
    indices = _partitions(dataset, data_dir, download, generator, scheme, n, seed, alpha, cpc, args,
                          validation)[partition_id]
    return _dataset(dataset, data_dir, download, generator, validation, seed).train.subset(indices)


def client_test_split(cfg: RunConfig, partition_id: int, num_partitions: int,
                      data_dir: str = "") -> Split | None:
    """A client's own held-out data, where the dataset has some (synthetic-fedprox: the 10%
    of its generated samples it does not train on; partition = local: its own test split,
    when not empty); None otherwise."""
    if cfg.local_data():
        test = check_local_data(cfg, data_dir).test
        return test if len(test) else None
    data = dataset_for(cfg, data_dir)
    if data.test_groups is None or cfg.partition != "natural":
        return None
    return data.test.subset(np.flatnonzero(data.test_groups == partition_id))
