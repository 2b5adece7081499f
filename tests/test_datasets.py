"""Tests for common/datasets.py (offline only: no downloads)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flatflower.common import datasets
from flatflower.common.datasets import (
    DATASETS,
    DEFAULT_MODEL,
    DatasetUnavailableError,
    FederatedDataset,
    Split,
    default_data_dir,
    load_dataset,
)
from flatflower.common.models import MODELS


def test_default_model_is_known_for_every_dataset() -> None:
    assert set(DEFAULT_MODEL) == set(DATASETS)
    assert set(DEFAULT_MODEL.values()) <= set(MODELS)


def test_digits_shapes_and_values() -> None:
    ds = load_dataset("digits")
    assert isinstance(ds, FederatedDataset)
    assert (len(ds.train), len(ds.test)) == (1437, 360)
    assert ds.num_classes == 10 and ds.input_shape == (1, 8, 8)
    assert ds.train.x.shape == (1437, 1, 8, 8) and ds.train.x.dtype == torch.float32
    assert ds.train.y.dtype == torch.int64
    x, y = ds.train.get(slice(None))
    assert x.min() >= 0.0 and x.max() <= 1.0 and x.max() == 1.0
    assert set(y.tolist()) == set(range(10)) == set(ds.test.y.tolist())


def test_digits_split_is_stratified() -> None:
    ds = load_dataset("digits")
    test_counts = torch.bincount(ds.test.y, minlength=10)
    assert test_counts.min() >= 35 and test_counts.max() <= 37


def test_digits_is_deterministic() -> None:
    a = datasets._digits()
    b = datasets._digits()
    assert torch.equal(a.train.x, b.train.x) and torch.equal(a.test.y, b.test.y)


def test_load_dataset_is_cached() -> None:
    assert load_dataset("digits") is load_dataset("digits")
    # a bundled or generated dataset lives in no folder: any data-dir gives the one loaded
    assert load_dataset("digits", "/nowhere/a") is load_dataset("digits", "~/elsewhere")


def test_synthetic_sizes_and_balance() -> None:
    ds = load_dataset("synthetic")
    assert ds.train.x.shape == (2000, 20) and ds.test.x.shape == (500, 20)
    assert ds.train.x.dtype == torch.float32 and ds.input_shape == (20,)
    assert torch.bincount(ds.train.y).tolist() == [200] * 10
    assert torch.bincount(ds.test.y).tolist() == [50] * 10
    assert not torch.equal(ds.train.y[:20], ds.train.y[:20].sort().values)  # shuffled


def test_synthetic_is_deterministic_and_independent_of_global_seed() -> None:
    np.random.seed(1)
    torch.manual_seed(1)
    a = datasets._synthetic()
    np.random.seed(2)
    torch.manual_seed(2)
    b = datasets._synthetic()
    assert torch.equal(a.train.x, b.train.x) and torch.equal(a.test.y, b.test.y)


def test_synthetic_is_learnable() -> None:
    """Class means are well separated: nearest train class mean classifies test well."""
    ds = load_dataset("synthetic")
    means = torch.stack([ds.train.x[ds.train.y == c].mean(0) for c in range(10)])
    pred = torch.cdist(ds.test.x, means).argmin(1)
    assert (pred == ds.test.y).float().mean() > 0.8


def test_synthetic_cifar10_is_stored_and_normalised_as_cifar10() -> None:
    ds = load_dataset("synthetic-cifar10")
    assert (len(ds.train), len(ds.test)) == (5000, 1000)
    assert ds.input_shape == (3, 32, 32) and ds.num_classes == 10
    assert ds.train.x.dtype == torch.uint8 and ds.train.x.shape == (5000, 3, 32, 32)
    assert (ds.train.mean, ds.train.std, ds.train.scale) == datasets._TORCHVISION["cifar10"][2:] + (255.0,)
    assert set(ds.train.y.tolist()) == set(range(10))
    x, y = ds.train.get(slice(0, 8))
    assert x.dtype == torch.float32 and x.shape == (8, 3, 32, 32) and y.dtype == torch.int64
    again = datasets._synthetic_cifar10()  # seeded: the same images in every process
    assert torch.equal(again.train.x, ds.train.x) and torch.equal(again.test.y, ds.test.y)


def _tiny_image_split() -> Split:
    x = torch.tensor([[[[0, 255]], [[51, 102]]], [[[255, 0]], [[0, 0]]]], dtype=torch.uint8)
    return Split(x, torch.tensor([1, 0]), mean=(0.5, 0.2), std=(0.5, 0.1), scale=255.0)


def test_split_get_normalises_per_channel() -> None:
    x, y = _tiny_image_split().get(slice(None))
    assert x.dtype == torch.float32 and x.shape == (2, 2, 1, 2)
    expected = torch.tensor(
        [[[[-1.0, 1.0]], [[0.0, 2.0]]], [[[1.0, -1.0]], [[-2.0, -2.0]]]]
    )
    torch.testing.assert_close(x, expected)
    assert y.dtype == torch.int64 and y.tolist() == [1, 0]


def test_split_get_with_tensor_index() -> None:
    x, y = _tiny_image_split().get(torch.tensor([1]))
    torch.testing.assert_close(x[0, 0, 0], torch.tensor([1.0, -1.0]))
    assert y.tolist() == [0]


def test_split_get_without_normalisation() -> None:
    split = Split(torch.tensor([[2.0, 4.0]]), torch.tensor([3]), scale=2.0)
    x, _ = split.get(slice(None))
    assert x.tolist() == [[1.0, 2.0]]


def test_subset_selects_rows_and_keeps_normalisation() -> None:
    split = _tiny_image_split()
    sub = split.subset(np.array([1]))
    assert len(sub) == 1 and sub.y.tolist() == [0]
    assert (sub.mean, sub.std, sub.scale) == (split.mean, split.std, split.scale)
    torch.testing.assert_close(sub.get(slice(None))[0], split.get(slice(1, 2))[0])
    assert len(split.subset([])) == 0


def test_missing_torchvision_dataset_gives_actionable_error(tmp_path) -> None:
    with pytest.raises(DatasetUnavailableError) as info:
        load_dataset("cifar10", data_dir=str(tmp_path), download=False)
    message = str(info.value)
    assert str(tmp_path) in message
    assert "cifar10" in message and "download" in message and "data-dir" in message


def test_default_data_dir(monkeypatch) -> None:
    monkeypatch.setenv("FLATFLOWER_DATA", "/some/where")
    assert default_data_dir() == "/some/where"
    monkeypatch.delenv("FLATFLOWER_DATA")
    assert default_data_dir().endswith("/.cache/flatflower/data")
    assert not default_data_dir().startswith("~")


def test_unknown_dataset_lists_names() -> None:
    with pytest.raises(ValueError, match="unknown dataset 'imagenet'") as info:
        load_dataset("imagenet")
    for name in DATASETS:
        assert name in str(info.value)


def _write_idx(path, magic: int, array: np.ndarray) -> None:
    header = np.array([magic, *array.shape], dtype=">i4").tobytes()
    path.write_bytes(header + array.astype(np.uint8).tobytes())


def test_mnist_from_local_files(tmp_path) -> None:
    """A tiny MNIST in torchvision's raw layout loads offline as uint8 NCHW."""
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for prefix, n in (("train", 6), ("t10k", 4)):
        _write_idx(raw / f"{prefix}-images-idx3-ubyte", 0x803, rng.integers(0, 256, (n, 28, 28)))
        _write_idx(raw / f"{prefix}-labels-idx1-ubyte", 0x801, np.arange(n) % 10)
    ds = load_dataset("mnist", data_dir=str(tmp_path), download=False)
    assert (len(ds.train), len(ds.test)) == (6, 4)
    assert ds.train.x.dtype == torch.uint8 and ds.train.x.shape == (6, 1, 28, 28)
    assert ds.input_shape == (1, 28, 28) and ds.num_classes == 10
    assert ds.test.y.dtype == torch.int64 and ds.test.y.tolist() == [0, 1, 2, 3]
    x, _ = ds.train.get(slice(0, 1))
    expected = (ds.train.x[:1].float() / 255 - 0.1307) / 0.3081
    torch.testing.assert_close(x, expected)


def test_cifar_layout_becomes_nchw() -> None:
    class FakeCifar:
        data = np.arange(2 * 4 * 4 * 3, dtype=np.uint8).reshape(2, 4, 4, 3)
        targets = [3, 7]

    split = datasets._tv_split(FakeCifar(), (0.0, 0.0, 0.0), (1.0, 1.0, 1.0))
    assert split.x.shape == (2, 3, 4, 4) and split.x.dtype == torch.uint8
    assert torch.equal(split.x[1, 2], torch.from_numpy(FakeCifar.data[1, :, :, 2]))
    assert split.y.dtype == torch.int64 and split.y.tolist() == [3, 7]


def test_synthetic_fedprox_is_generated_per_client() -> None:
    ds = load_dataset("synthetic-fedprox", clients=6, alpha=1.0, beta=1.0, seed=0)
    assert ds.input_shape == (60,) and ds.num_classes == 10 and ds.train.x.dtype == torch.float32
    assert set(ds.train_groups.tolist()) == set(ds.test_groups.tolist()) == set(range(6))
    train_sizes, test_sizes = np.bincount(ds.train_groups), np.bincount(ds.test_groups)
    assert train_sizes.min() >= 45 and np.all(test_sizes == (train_sizes + test_sizes) - train_sizes)
    assert np.all(train_sizes == ((train_sizes + test_sizes) * 0.9).astype(int))  # 90% / 10% per client
    # each client draws its own model: the clients' label distributions differ
    hists = np.stack([np.bincount(ds.train.y.numpy()[ds.train_groups == k], minlength=10)
                      for k in range(6)]).astype(float)
    hists /= hists.sum(1, keepdims=True)
    assert 0.5 * np.abs(hists[:, None] - hists[None]).sum(-1).max() > 0.5
    again = load_dataset("synthetic-fedprox", clients=6, alpha=1.0, beta=1.0, seed=0)
    assert torch.equal(ds.train.x, again.train.x)
    other = datasets.synthetic_fedprox(clients=6, alpha=1.0, beta=1.0, seed=1)
    assert not torch.equal(ds.train.x[:10], other.train.x[:10])


def test_synthetic_fedprox_beta_spreads_the_clients_inputs() -> None:
    def spread(beta: float) -> float:
        ds = datasets.synthetic_fedprox(clients=20, alpha=0.0, beta=beta, seed=0)
        means = [ds.train.x[ds.train_groups == k].mean().item() for k in range(20)]
        return float(np.std(means))

    assert spread(5.0) > 3 * spread(0.0)


def test_client_test_split_is_the_clients_held_out_data() -> None:
    from flatflower.common.config import RunConfig
    from flatflower.common.data import client_split, client_test_split

    cfg = RunConfig.from_mapping({"dataset": "synthetic-fedprox", "partition": "natural",
                                  "num-partitions": 5})
    ds = load_dataset("synthetic-fedprox", clients=5, alpha=1.0, beta=1.0, seed=0)
    held_out = client_test_split(cfg, 3, 5)
    assert len(held_out) == int((ds.test_groups == 3).sum()) > 0
    assert len(client_split(cfg, 3, 5)) == int((ds.train_groups == 3).sum())
    assert client_test_split(RunConfig.from_mapping({"dataset": "digits"}), 0, 4) is None


@pytest.mark.slow
def test_mnist1d_is_generated_offline_and_leaves_global_rngs_alone() -> None:
    import random

    np.random.seed(123)
    random.seed(123)
    expected = (np.random.random(), random.random())
    np.random.seed(123)
    random.seed(123)
    ds = datasets._mnist1d()
    assert (np.random.random(), random.random()) == expected
    assert (len(ds.train), len(ds.test)) == (4000, 1000)
    assert ds.input_shape == (40,) and ds.num_classes == 10
    assert torch.bincount(ds.train.y).min() > 350
    assert torch.equal(ds.train.x, datasets._mnist1d().train.x)


def test_missing_mnist_is_one_line_and_leaves_no_empty_folders(tmp_path, monkeypatch, capsys) -> None:
    """An offline download (simulated: torchvision makes its folders, prints each mirror, then
    raises a many-line error) is one line, prints nothing else and leaves no empty folders."""
    import torchvision.datasets as tvd

    def offline_download(self) -> None:
        (tmp_path / "data" / "MNIST" / "raw").mkdir(parents=True)
        print("Downloading https://mirror-1/...\nFailed to download (trying next):")
        raise RuntimeError("Error downloading train-images-idx3-ubyte.gz:\nTried mirror-1, got:\nno route")

    monkeypatch.setattr(tvd.MNIST, "download", offline_download)
    root = tmp_path / "data"
    with pytest.raises(DatasetUnavailableError) as info:
        load_dataset("mnist", data_dir=str(root), download=True)
    assert "\n" not in str(info.value) and "Error downloading train-images" in str(info.value)
    assert "mirror" not in capsys.readouterr().out
    assert not root.exists()


def test_data_check_says_what_is_usable_offline(tmp_path, capsys) -> None:
    from flatflower.tools.cli import main as cli

    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for prefix, n in (("train", 6), ("t10k", 4)):
        _write_idx(raw / f"{prefix}-images-idx3-ubyte", 0x803, np.zeros((n, 28, 28)))
        _write_idx(raw / f"{prefix}-labels-idx1-ubyte", 0x801, np.arange(n) % 10)
    assert cli(["data", "check", "--data-dir", str(tmp_path)]) == 0
    lines = {line.split()[1]: line for line in capsys.readouterr().out.splitlines()}
    assert set(lines) == set(DATASETS)
    for name in ("digits", "synthetic", "synthetic-fedprox", "mnist1d", "mnist"):
        assert lines[name].startswith("ok "), lines[name]
    assert "6 train / 4 test" in lines["mnist"]
    assert lines["cifar10"].startswith("missing ") and "needs a download" in lines["cifar10"]
    assert str(tmp_path / "cifar-10-batches-py") in lines["cifar10"]


# ---------------------------------------------------------------- Fashion-MNIST from the system package
SYSTEM_FASHION = "/usr/share/datasets/fashion-mnist"


def _write_idx_gz(path, magic: int, array: np.ndarray) -> None:
    import gzip

    header = np.array([magic, *array.shape], dtype=">i4").tobytes()
    with gzip.open(path, "wb") as f:
        f.write(header + array.astype(np.uint8).tobytes())


def _fake_system_package(base, n_train: int = 6, n_test: int = 4, seed: int = 0):
    """A tiny fashion-mnist in the system package's layout (gzipped idx) under ``base``."""
    folder = base / "fashion-mnist"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        _write_idx_gz(folder / f"{prefix}-images-idx3-ubyte.gz", 0x803, rng.integers(0, 256, (n, 28, 28)))
        _write_idx_gz(folder / f"{prefix}-labels-idx1-ubyte.gz", 0x801, np.arange(n) % 10)
    return folder


def test_fashion_mnist_comes_from_the_system_package_before_any_download(tmp_path, monkeypatch) -> None:
    """data-dir holds nothing and download is off: the package's idx files are read, exactly,
    and normalised with Fashion-MNIST's own mean and std."""
    folder = _fake_system_package(tmp_path / "system")
    monkeypatch.setenv("FLATFLOWER_SYSTEM_DATA", str(tmp_path / "system"))
    ds = load_dataset("fashion-mnist", data_dir=str(tmp_path / "empty"), download=False)
    assert (len(ds.train), len(ds.test)) == (6, 4) and ds.input_shape == (1, 28, 28)
    assert ds.train.x.dtype == torch.uint8 and ds.test.y.tolist() == [0, 1, 2, 3]
    assert torch.equal(ds.train.x[:, 0], torch.from_numpy(datasets.read_idx(
        str(folder / "train-images-idx3-ubyte.gz"), 3).copy()))
    x, _ = ds.train.get(slice(0, 2))
    torch.testing.assert_close(x, (ds.train.x[:2].float() / 255 - 0.2860) / 0.3530)
    assert not (tmp_path / "empty").exists()  # nothing was downloaded or created


def test_a_data_dir_in_torchvisions_layout_wins_over_the_system_package(tmp_path, monkeypatch) -> None:
    _fake_system_package(tmp_path / "system")
    monkeypatch.setenv("FLATFLOWER_SYSTEM_DATA", str(tmp_path / "system"))
    raw = tmp_path / "data" / "FashionMNIST" / "raw"
    raw.mkdir(parents=True)
    for prefix, n in (("train", 3), ("t10k", 2)):
        _write_idx(raw / f"{prefix}-images-idx3-ubyte", 0x803, np.zeros((n, 28, 28)))
        _write_idx(raw / f"{prefix}-labels-idx1-ubyte", 0x801, np.arange(n))
    ds = load_dataset("fashion-mnist", data_dir=str(tmp_path / "data"), download=False)
    assert (len(ds.train), len(ds.test)) == (3, 2)


@pytest.mark.parametrize("damage, message", [
    ("magic", "wrong magic number"),
    ("cut", "cut short"),
    ("not gzip", "cannot read"),
])
def test_a_damaged_idx_file_is_named_in_one_error(tmp_path, monkeypatch, damage, message) -> None:
    import gzip

    folder = _fake_system_package(tmp_path / "system")
    monkeypatch.setenv("FLATFLOWER_SYSTEM_DATA", str(tmp_path / "system"))
    path = folder / "train-images-idx3-ubyte.gz"
    data = gzip.decompress(path.read_bytes())
    if damage == "magic":
        path.write_bytes(gzip.compress(b"\x00\x00\x08\x01" + data[4:]))
    elif damage == "cut":
        path.write_bytes(gzip.compress(data[:-100]))
    else:
        path.write_bytes(b"this is no gzip stream")
    with pytest.raises(DatasetUnavailableError, match=message) as info:
        load_dataset("fashion-mnist", data_dir=str(tmp_path / "empty"), download=False)
    assert str(path) in str(info.value) and "\n" not in str(info.value)


def test_data_check_names_the_source_or_the_command_that_gives_one(tmp_path, monkeypatch, capsys) -> None:
    from flatflower.tools.cli import main as cli

    _fake_system_package(tmp_path / "system")
    monkeypatch.setenv("FLATFLOWER_SYSTEM_DATA", str(tmp_path / "system"))
    assert cli(["data", "check", "--data-dir", str(tmp_path / "data")]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.split()[1] == "fashion-mnist")
    assert line.startswith("ok ") and f"from the system package {tmp_path / 'system' / 'fashion-mnist'}" in line
    monkeypatch.setenv("FLATFLOWER_SYSTEM_DATA", str(tmp_path / "nowhere"))
    assert cli(["data", "check", "--data-dir", str(tmp_path / "data")]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.split()[1] == "fashion-mnist")
    assert line.startswith("missing ") and "apt-get install dataset-fashion-mnist" in line
    with pytest.raises(DatasetUnavailableError, match="apt-get install dataset-fashion-mnist"):
        load_dataset("fashion-mnist", data_dir=str(tmp_path / "data"), download=False)


def system_fashion_mnist() -> None:
    """Skip unless the system package is installed; `.ci/run` installs it and sets
    FLATFLOWER_REQUIRE_FASHION_MNIST=1, so there a missing package fails instead."""
    import os

    if not os.path.isfile(f"{SYSTEM_FASHION}/t10k-labels-idx1-ubyte.gz"):
        if os.environ.get("FLATFLOWER_REQUIRE_FASHION_MNIST") == "1":
            pytest.fail(f"{SYSTEM_FASHION} is missing: apt-get install dataset-fashion-mnist")
        pytest.skip("the system package dataset-fashion-mnist is not installed")


def test_the_system_packages_fashion_mnist_is_read_exactly(monkeypatch) -> None:
    """Debian's dataset-fashion-mnist: 60,000 + 10,000 grey 28x28 images, 6,000 / 1,000 of
    each class, byte for byte the idx files."""
    import gzip

    system_fashion_mnist()
    monkeypatch.delenv("FLATFLOWER_SYSTEM_DATA", raising=False)
    ds = load_dataset("fashion-mnist", data_dir="/nonexistent", download=False)
    assert ds.train.x.shape == (60000, 1, 28, 28) and ds.test.x.shape == (10000, 1, 28, 28)
    assert torch.bincount(ds.train.y).tolist() == [6000] * 10
    assert torch.bincount(ds.test.y).tolist() == [1000] * 10
    raw = gzip.decompress(open(f"{SYSTEM_FASHION}/t10k-images-idx3-ubyte.gz", "rb").read())
    assert bytes(ds.test.x.numpy().tobytes()) == raw[16:]
    labels = gzip.decompress(open(f"{SYSTEM_FASHION}/train-labels-idx1-ubyte.gz", "rb").read())
    assert ds.train.y.numpy().astype(np.uint8).tobytes() == labels[8:]
    x, _ = ds.train.get(slice(None))
    assert abs(float(x.mean())) < 1e-3 and abs(float(x.std()) - 1) < 1e-3  # its own mean and std
