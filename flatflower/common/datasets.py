"""Datasets: name -> train/test splits held compactly in memory.

Offline, no files: ``digits`` (scikit-learn's bundled images), ``synthetic`` (Gaussian
classes), ``synthetic-fedprox`` (Synthetic(alpha, beta) of Li et al. 2020, generated per
client), ``mnist1d`` (generated from templates by the ``mnist1d`` package) and
``synthetic-cifar10`` (random CIFAR-10-shaped images, for timing). The torchvision datasets
are read from ``data_dir`` (downloaded there when allowed); ``fashion-mnist`` is also read
from the system package's idx files (Debian/Ubuntu ``dataset-fashion-mnist``) before any
download: see :func:`sources`. The user's own data (files in ``data_dir`` or a
``package.module:callable``) is common/userdata.py's; :func:`load_dataset` serves both.
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import numpy as np
import torch

from flatflower.common.splits import DatasetUnavailableError, FederatedDataset, Split  # noqa: F401 - re-exported

DATASETS = ("digits", "synthetic", "synthetic-fedprox", "mnist1d", "synthetic-cifar10", "mnist",
            "fashion-mnist", "cifar10", "cifar100")

DEFAULT_MODEL = {
    "digits": "mlp",
    "synthetic": "logreg",
    "synthetic-fedprox": "logreg",  # FedProx's multinomial logistic regression
    "mnist1d": "mlp",
    "synthetic-cifar10": "lenet",
    "mnist": "cnn",
    "fashion-mnist": "cnn",
    "cifar10": "lenet",
    "cifar100": "lenet",
}

# name -> (torchvision class, num_classes, mean, std)
_TORCHVISION = {
    "mnist": ("MNIST", 10, (0.1307,), (0.3081,)),
    "fashion-mnist": ("FashionMNIST", 10, (0.2860,), (0.3530,)),
    "cifar10": ("CIFAR10", 10, (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ("CIFAR100", 100, (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
}


TORCHVISION_FOLDER = {"mnist": "MNIST", "fashion-mnist": "FashionMNIST", "cifar10": "cifar-10-batches-py",
                      "cifar100": "cifar-100-python"}  # under data-dir
# Datasets a system package ships as the original idx files (gzipped): name -> (directory,
# the package, the command that installs it). Read before any download.
SYSTEM_PACKAGES = {
    "fashion-mnist": ("/usr/share/datasets/fashion-mnist", "dataset-fashion-mnist",
                      "sudo apt-get install dataset-fashion-mnist"),
}
IDX_FILES = {True: ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
             False: ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")}


def default_model(name: str) -> str:
    """The model ``model = auto`` builds for dataset ``name``: the built-ins' own; a CNN for an
    image folder; an MLP (any input shape) for the user's other data."""
    return DEFAULT_MODEL.get(name) or ("cnn" if name == "imagefolder" else "mlp")


def default_data_dir() -> str:
    """``$FLATFLOWER_DATA`` if set, else ``~/.cache/flatflower/data``."""
    return os.path.expanduser(os.environ.get("FLATFLOWER_DATA") or "~/.cache/flatflower/data")


def register_dataset(name: str, fn) -> None:
    """Make ``dataset = name`` call ``fn`` (the contract of flatflower.common.userdata.from_callable) **in
    this process only**, as flatflower.common.models.register_model does for models: for the in-process
    engines and the Python API. A name is bound once: loads are cached by name, so a second
    callable under it would be served the first's data."""
    from flatflower.common import userdata
    from flatflower.common.references import is_reference

    if (not isinstance(name, str) or not name or name in DATASETS or name in userdata.FORMATS
            or is_reference(name) or not name.isprintable()):
        raise ValueError(f"register_dataset: {name!r} is not a new dataset name (not a built-in, not a "
                         "file format, not of the form package.module:callable)")
    if not callable(fn):
        raise ValueError(f"register_dataset: the dataset {name!r} is not callable")
    if userdata.REGISTERED.get(name, fn) is not fn:
        raise ValueError(f"register_dataset: {name!r} is already registered to another callable")
    userdata.REGISTERED[name] = fn


def load_dataset(name: str, data_dir: str = "", download: bool = True,
                 **options: float | str) -> FederatedDataset:
    """Load dataset ``name`` (cached per process); torchvision data lives in ``data_dir``.
    ``options``: the options of a generated dataset (synthetic-fedprox: ``clients``,
    ``alpha``, ``beta``, ``seed``) or of the user's own data (common/userdata.py: a file
    format in ``data_dir`` or a ``package.module:callable``)."""
    from flatflower.common import userdata

    if userdata.is_user_dataset(name):
        return userdata.load(name, data_dir, **options)
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; valid names: {', '.join(DATASETS + userdata.FORMATS)}, "
                         "or a package.module:callable")
    generator = options
    # only torchvision's datasets live in a folder (the others are generated or bundled)
    root = os.path.abspath(os.path.expanduser(data_dir or default_data_dir())) if name in TORCHVISION_FOLDER else ""
    return _load_cached(name, root, bool(download), tuple(sorted(generator.items())), system_dir(name))


@functools.lru_cache(maxsize=8)
def _load_cached(name: str, root: str, download: bool, generator: tuple,
                 system: str | None) -> FederatedDataset:
    if name == "digits":
        return _digits()
    if name == "synthetic":
        return _synthetic()
    if name == "synthetic-fedprox":
        return synthetic_fedprox(**dict(generator))
    if name == "mnist1d":
        return _mnist1d()
    if name == "synthetic-cifar10":
        return _synthetic_cifar10()
    return _torchvision(name, root, download)


def system_dir(name: str) -> str | None:
    """The system package's directory of ``name`` (``$FLATFLOWER_SYSTEM_DATA/<name>`` when that
    variable is set), or None when no package ships it."""
    if name not in SYSTEM_PACKAGES:
        return None
    base = os.environ.get("FLATFLOWER_SYSTEM_DATA")
    return os.path.join(base, name) if base else SYSTEM_PACKAGES[name][0]


def sources(name: str, root: str, download: bool) -> list[tuple[str, str, bool]]:
    """Where a torchvision dataset is looked for, in order: (kind, place, present here).
    ``data-dir`` in torchvision's layout; the system package's idx files (fashion-mnist);
    torchvision's download, when ``download`` allows it (present = allowed)."""
    folder = os.path.join(root, TORCHVISION_FOLDER[name])
    out = [("data-dir", folder, _torchvision_files(name, root))]
    if (directory := system_dir(name)) is not None:
        out.append(("system package", directory, _idx_files_in(directory)))
    out.append(("download", f"torchvision's mirrors, into {root}", download))
    return out


def _idx_files_in(directory: str) -> bool:
    return all(os.path.isfile(os.path.join(directory, f)) for pair in IDX_FILES.values() for f in pair)


def read_idx(path: str, dims: int) -> np.ndarray:
    """An idx file (LeCun's MNIST format; gzipped when it ends in .gz) of unsigned bytes with
    ``dims`` dimensions, checked: its magic number, its dimensions and its exact length.
    DatasetUnavailableError naming the file when it is damaged."""
    import gzip

    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            raw = f.read()
    except (OSError, EOFError) as err:  # EOFError: a cut gzip stream
        raise DatasetUnavailableError(f"cannot read {path}: {err}") from None
    header = 4 + 4 * dims
    if len(raw) < header or raw[:4] != bytes([0, 0, 0x08, dims]):
        raise DatasetUnavailableError(f"{path} is not an idx file of unsigned bytes with {dims} "
                                      "dimension(s) (wrong magic number): damaged or another file")
    shape = tuple(int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(dims))
    if len(raw) != header + int(np.prod(shape)):
        raise DatasetUnavailableError(f"{path} holds {len(raw) - header} bytes of data, not the "
                                      f"{int(np.prod(shape))} its header says {shape}: damaged or cut short")
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(shape)


def _idx_split(directory: str, train: bool, mean: tuple[float, ...], std: tuple[float, ...]) -> Split:
    images, labels = (os.path.join(directory, f) for f in IDX_FILES[train])
    x, y = read_idx(images, 3), read_idx(labels, 1)
    if len(x) != len(y) or (y.size and y.max() > 9):
        raise DatasetUnavailableError(f"{images} and {labels} do not match ({len(x)} images, "
                                      f"{len(y)} labels, labels up to {y.max() if y.size else '-'})")
    return Split(torch.from_numpy(x.copy()).unsqueeze(1), torch.from_numpy(y.astype(np.int64)),
                 mean=mean, std=std, scale=255.0)


def _digits() -> FederatedDataset:
    """scikit-learn's 8x8 handwritten digits, fixed stratified 80/20 split (1437 / 360).

    The CSV that scikit-learn ships is read directly: importing sklearn costs more than a
    second, and every ClientApp message in a deployment is a fresh process.
    """
    import gzip
    import importlib.util

    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise DatasetUnavailableError("dataset 'digits' needs scikit-learn (pip install scikit-learn)")
    path = os.path.join(spec.submodule_search_locations[0], "datasets", "data", "digits.csv.gz")
    with gzip.open(path, "rt") as f:
        raw = np.loadtxt(f, delimiter=",", dtype=np.float32)
    x, y = raw[:, :-1].reshape(-1, 1, 8, 8) / 16.0, raw[:, -1].astype(np.int64)
    test = _stratified_test_indices(y, test_fraction=0.2, seed=0)
    train = np.setdiff1d(np.arange(len(y)), test)
    return FederatedDataset("digits", _split(x[train], y[train]), _split(x[test], y[test]), 10, (1, 8, 8))


def _stratified_test_indices(y: np.ndarray, test_fraction: float, seed: int) -> np.ndarray:
    """ceil(fraction * n) test indices, each class contributing in proportion (largest remainder)."""
    rng = np.random.default_rng(seed)
    classes, counts = np.unique(y, return_counts=True)
    n_test = int(np.ceil(test_fraction * len(y)))
    exact = counts * n_test / len(y)
    quota = np.floor(exact).astype(int)
    quota[np.argsort(-(exact - quota), kind="stable")[: n_test - quota.sum()]] += 1
    picks = [rng.permutation(np.flatnonzero(y == c))[:q] for c, q in zip(classes, quota)]
    return np.sort(np.concatenate(picks))


def _synthetic(
    num_classes: int = 10, dim: int = 20, n_train: int = 2000, n_test: int = 500
) -> FederatedDataset:
    """Fixed (seed 0) Gaussian classes: mean ~ 1.5 N(0, I), sample = mean + N(0, I)."""
    rng = np.random.default_rng(0)
    means = rng.normal(size=(num_classes, dim)) * 1.5

    def sample(n: int) -> Split:
        y = rng.permutation(np.repeat(np.arange(num_classes), n // num_classes))
        x = means[y] + rng.normal(size=(len(y), dim))
        return _split(x.astype(np.float32), y.astype(np.int64))

    train = sample(n_train)
    return FederatedDataset("synthetic", train, sample(n_test), num_classes, (dim,))


def synthetic_fedprox(clients: int = 30, alpha: float = 1.0, beta: float = 1.0, seed: int = 0,
                      dim: int = 60, num_classes: int = 10) -> FederatedDataset:
    """Synthetic(alpha, beta) of Li et al. 2020 (FedProx, Sec. 5.1), as its generator
    (``generate_synthetic.py``) draws it: client k has its own model and inputs,
    u_k ~ N(0, alpha^2), W_k, b_k ~ N(u_k, 1); B_k ~ N(0, beta^2), v_k ~ N(B_k, 1);
    x ~ N(v_k, diag(j^-1.2)); y = argmax(W_k x + b_k); lognormal(4, 2) + 50 samples, 90% of them
    its training data and 10% its held-out test data. alpha: how much the clients' models
    differ, beta: how much their inputs differ (the code draws with standard deviation alpha
    and beta; the paper says variance). The test split is the union of the clients' held-out
    data; ``train_groups`` / ``test_groups`` say whose each sample is."""
    rng = np.random.default_rng([seed, clients])
    sizes = rng.lognormal(4, 2, clients).astype(int) + 50
    mean_w = rng.normal(0, alpha, clients)
    mean_x = rng.normal(rng.normal(0, beta, clients)[:, None], 1, (clients, dim))
    sd_x = np.arange(1, dim + 1) ** -0.6  # sqrt of the diagonal covariance j^-1.2
    parts: dict[str, list[np.ndarray]] = {k: [] for k in ("xtr", "ytr", "gtr", "xte", "yte", "gte")}
    for k in range(clients):
        w = rng.normal(mean_w[k], 1, (dim, num_classes))
        b = rng.normal(mean_w[k], 1, num_classes)
        x = mean_x[k] + sd_x * rng.normal(size=(sizes[k], dim))
        y = np.argmax(x @ w + b, axis=1)
        cut = int(0.9 * sizes[k])
        for tag, rows in (("tr", slice(None, cut)), ("te", slice(cut, None))):
            parts["x" + tag].append(x[rows])
            parts["y" + tag].append(y[rows])
            parts["g" + tag].append(np.full(len(y[rows]), k))
    cat = {k: np.concatenate(v) for k, v in parts.items()}
    train = _split(cat["xtr"].astype(np.float32), cat["ytr"].astype(np.int64))
    test = _split(cat["xte"].astype(np.float32), cat["yte"].astype(np.int64))
    return FederatedDataset("synthetic-fedprox", train, test, num_classes, (dim,),
                            train_groups=cat["gtr"], test_groups=cat["gte"])


def _mnist1d() -> FederatedDataset:
    """MNIST-1D (Greydanus 2020): 4000 train / 1000 test sequences of 40 values, 10 classes,
    generated from the package's templates with its default arguments (seed 42), no
    download. The package seeds numpy's and Python's global RNGs; they are restored."""
    import random

    try:
        from mnist1d.data import get_dataset_args, make_dataset
    except ImportError:
        raise DatasetUnavailableError("dataset 'mnist1d' needs the mnist1d package "
                                      "(pip install mnist1d)") from None
    np_state, py_state = np.random.get_state(), random.getstate()
    try:
        data = make_dataset(get_dataset_args())
    finally:
        np.random.set_state(np_state)
        random.setstate(py_state)
    train = _split(data["x"].astype(np.float32), data["y"].astype(np.int64))
    test = _split(data["x_test"].astype(np.float32), data["y_test"].astype(np.int64))
    return FederatedDataset("mnist1d", train, test, 10, (data["x"].shape[1],))


def _synthetic_cifar10(n_train: int = 5000, n_test: int = 1000) -> FederatedDataset:
    """Random images stored and normalised as CIFAR-10's (uint8 3x32x32, its channel means and
    standard deviations) with uniform random labels, seed 0; a tenth of CIFAR-10's size. For
    timing CIFAR-shaped training offline (``flatflower bench``): there is nothing to learn."""
    rng = np.random.default_rng(0)
    _, num_classes, mean, std = _TORCHVISION["cifar10"]

    def sample(n: int) -> Split:
        x = torch.from_numpy(rng.integers(0, 256, (n, 3, 32, 32), dtype=np.uint8))
        y = torch.from_numpy(rng.integers(0, num_classes, n).astype(np.int64))
        return Split(x, y, mean=mean, std=std, scale=255.0)

    train = sample(n_train)
    return FederatedDataset("synthetic-cifar10", train, sample(n_test), num_classes, (3, 32, 32))


def _split(x: np.ndarray, y: np.ndarray) -> Split:
    x_t, y_t = (torch.from_numpy(np.ascontiguousarray(a)) for a in (x, y))
    return Split(x_t, y_t)


def _torchvision(name: str, root: str, download: bool) -> FederatedDataset:
    """MNIST / Fashion-MNIST / CIFAR as uint8 NCHW, normalised on ``Split.get`` with the
    dataset's own training-set mean and std. From the first of :func:`sources` that holds it:
    ``data-dir`` (torchvision's layout), the system package's idx files, torchvision's download."""
    directory = system_dir(name)
    if directory is None or not _idx_files_in(directory):
        return _from_torchvision(name, root, download)
    try:  # data-dir first, read once: no download while the system package has it
        return _from_torchvision(name, root, download=False)
    except DatasetUnavailableError:
        pass
    _, num_classes, mean, std = _TORCHVISION[name]
    splits = [_idx_split(directory, flag, mean, std) for flag in (True, False)]
    return FederatedDataset(name, splits[0], splits[1], num_classes, tuple(splits[0].x.shape[1:]))


def _from_torchvision(name: str, root: str, download: bool) -> FederatedDataset:
    """torchvision's dataset class on ``root`` (downloading there when ``download``)."""
    import torchvision.datasets as tvd

    cls_name, num_classes, mean, std = _TORCHVISION[name]
    cls = getattr(tvd, cls_name)
    before = _existing_dirs(root)
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # torchvision prints every mirror it tries
            train, test = (cls(root, train=flag, download=download) for flag in (True, False))
        splits = [_tv_split(ds, mean, std) for ds in (train, test)]
    except Exception as exc:  # torchvision raises RuntimeError, OSError, URLError, ...
        _remove_new_empty_dirs(root, before)
        raise DatasetUnavailableError(_unavailable_message(name, root, download, exc)) from None
    shape = tuple(splits[0].x.shape[1:])
    return FederatedDataset(name, splits[0], splits[1], num_classes, shape)


def _torchvision_files(name: str, root: str) -> bool:
    """Whether ``root`` holds ``name`` in torchvision's layout (read without a download)."""
    import torchvision.datasets as tvd

    try:
        with contextlib.redirect_stdout(io.StringIO()):
            getattr(tvd, _TORCHVISION[name][0])(root, train=False, download=False)
    except Exception:  # noqa: BLE001 - torchvision's "Dataset not found" is a RuntimeError, others OSError
        return False
    return True


def _tv_split(ds, mean: tuple[float, ...], std: tuple[float, ...]) -> Split:
    data = torch.as_tensor(np.asarray(ds.data), dtype=torch.uint8)
    x = data.unsqueeze(1) if data.dim() == 3 else data.permute(0, 3, 1, 2)
    y = torch.as_tensor(np.asarray(ds.targets), dtype=torch.int64)
    return Split(x.contiguous(), y, mean=mean, std=std, scale=255.0)


def _existing_dirs(root: str) -> set[str]:
    return {d for d, _, _ in os.walk(root)} if os.path.isdir(root) else set()


def _remove_new_empty_dirs(root: str, before: set[str]) -> None:
    """Remove the empty folders a failed torchvision load created (deepest first)."""
    for d in sorted(_existing_dirs(root) - before, key=len, reverse=True):
        try:
            os.rmdir(d)
        except OSError:
            pass  # not empty: something was downloaded
    if root not in before and os.path.isdir(root):
        try:
            os.rmdir(root)
        except OSError:
            pass


def _unavailable_message(name: str, root: str, download: bool, exc: Exception) -> str:
    how = (
        "the download failed - this machine may be offline"
        if download
        else "downloading is disabled (download=false)"
    )
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    cause = f"{type(exc).__name__}: {lines[0][:160]}" if lines else type(exc).__name__
    package = ""
    if name in SYSTEM_PACKAGES:
        package = (f" nor in {system_dir(name)} (the system package {SYSTEM_PACKAGES[name][1]}; "
                   f"`{SYSTEM_PACKAGES[name][2]}` gives it, offline from Debian's or Ubuntu's mirror)")
    return (
        f"dataset {name!r} is not available: it was not found in {root}{package} and {how} "
        f"({cause}). To fix: "
        + (f"`{SYSTEM_PACKAGES[name][2]}`, or " if name in SYSTEM_PACKAGES else "")
        + f"put the dataset files in {root} "
        f"(the layout torchvision expects), or set data-dir / $FLATFLOWER_DATA to a "
        f"directory that holds them, or allow download (download=true) on a machine "
        f"with network access."
    )
