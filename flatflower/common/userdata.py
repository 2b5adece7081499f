"""The user's own data: files in ``data-dir`` (NPZ, CSV, an image folder) or a callable.

``dataset`` names one of :data:`FORMATS` or a ``package.module:callable`` reference; the files
live in ``data-dir`` (the run config's, or a SuperNode's own node-config ``data-dir``, which
wins: common/data.py). Every node and the server read the same contract:

- ``npz``: ``train.npz`` and ``test.npz``, each with arrays ``x`` (N, *input_shape), numeric,
  and ``y`` (N,), integer labels >= 0.
- ``csv``: ``train.csv`` and ``test.csv``, comma-separated with a header row; the column named
  by ``csv-label`` (default ``label``) holds the labels, every other column is a numeric
  feature (input shape (features,)). Labels are integers >= 0, or class names: each name's
  index in ``classes`` (as an image folder's), default the sorted names of both files.
- ``imagefolder``: torchvision's ImageFolder layout, ``train/<class>/*`` and
  ``test/<class>/*``. Labels follow ``classes`` (comma-separated names in label order;
  default: the sorted folder names under ``train/``), so nodes holding different classes
  agree when they name them (a class may be absent from a node's folders; a class folder that
  is there must hold images, and there must be at least 2 classes). Images are kept as uint8
  N x C x H x W, RGB, or grayscale when every image is; ``image-size`` > 0 resizes them to a
  square, else all must share one size.
  Normalised as the built-in image sets: x / 255, then the train split's per-channel mean/std.
- ``package.module:callable``: see :func:`from_callable`.

The training split must hold examples; the test split may be empty (0 rows, a ``test.csv``
with its header only, a ``test/`` folder without class folders): a node that holds nothing
out trains and is not evaluated (docs/local-data.md). The server's evaluation set must not be.

NPZ, CSV and callable data are used as given (converted to float32; uint8 arrays stay uint8
and are read as their values): flatflower does not rescale a user's features.

``num_classes``: ``num-classes`` when > 0 (every label must be below it), else max label + 1
over both splits (an image folder: the number of classes). Set it when nodes hold their own
data, so that every node builds the same model.

Every bad input is one :class:`DataError` line naming the file. Loading is cached per process.
"""

from __future__ import annotations

import functools
import os
import re
import warnings
from typing import Any

import numpy as np
import torch

from flatflower.common.splits import DatasetUnavailableError, FederatedDataset, Split

FORMATS = ("npz", "csv", "imagefolder")
_GRAY_MODES = ("1", "L")


class DataError(DatasetUnavailableError, ValueError):
    """The user's data cannot be used as given (one line, naming the file or the reference)."""


# name -> callable added by flatflower.common.datasets.register_dataset: this process only (the in-process
# engines and the Python API, flatflower/); a reference is what crosses processes
REGISTERED: dict[str, Any] = {}


def is_user_dataset(name: str) -> bool:
    """Whether ``dataset`` names the user's own data (a file format, a reference or a
    registered name)."""
    from flatflower.common.references import is_reference

    return name in FORMATS or is_reference(name) or name in REGISTERED


def load(name: str, data_dir: str, csv_label: str = "label", classes: str = "", image_size: int = 0,
         num_classes: int = 0) -> FederatedDataset:
    """The user's dataset ``name`` from ``data_dir`` (cached per process; the options are the
    run-config keys csv-label, classes, image-size, num-classes)."""
    root = os.path.abspath(os.path.expanduser(data_dir)) if data_dir else ""
    return _load(name, root, csv_label, classes, int(image_size), int(num_classes))


@functools.lru_cache(maxsize=8)
def _load(name: str, root: str, csv_label: str, classes: str, image_size: int,
          num_classes: int) -> FederatedDataset:
    if name not in FORMATS:
        return from_callable(name, root, num_classes)
    if not root:
        raise DataError(f"dataset {name!r} reads its files from data-dir: set data-dir (the run config's, "
                        "or a SuperNode's own node config)")
    if not os.path.isdir(root):
        raise DataError(f"dataset {name!r}: data-dir {root} is not a directory")
    if name == "imagefolder":
        return _imagefolder(root, classes, image_size, num_classes)
    read = _read_npz if name == "npz" else functools.partial(_read_csv, label=csv_label)
    paths = [os.path.join(root, f"{split}.{name}") for split in ("train", "test")]
    (xtr, ytr), (xte, yte) = (read(p) for p in paths)
    if name == "csv" and (_named(ytr) or _named(yte)):
        ytr, yte, num_classes = _class_indices(paths, ytr, yte, csv_label, classes, num_classes)
    return _assemble(name, paths, xtr, ytr, xte, yte, num_classes)


# ------------------------------------------------------------------------ arrays
def _read_npz(path: str) -> tuple[np.ndarray, np.ndarray]:
    if not os.path.isfile(path):
        raise DataError(f"{path} is missing (dataset 'npz' needs train.npz and test.npz in data-dir)")
    try:
        with np.load(path, allow_pickle=False) as f:
            missing = [k for k in ("x", "y") if k not in f.files]
            if missing:
                raise DataError(f"{path} has no array {missing[0]!r} (it holds: {', '.join(f.files) or 'nothing'}); "
                                "dataset 'npz' needs arrays x (N, *input_shape) and y (N,)")
            return f["x"], f["y"]
    except DataError:
        raise
    except Exception as err:  # noqa: BLE001 - a damaged zip raises BadZipFile, ValueError, OSError
        raise DataError(f"{path} is not a readable .npz file ({type(err).__name__}: {_first(err)})") from None


def _read_csv(path: str, label: str) -> tuple[np.ndarray, np.ndarray]:
    import csv

    if not os.path.isfile(path):
        raise DataError(f"{path} is missing (dataset 'csv' needs train.csv and test.csv in data-dir)")
    try:
        with open(path, newline="", encoding="utf-8") as f:
            header = [h.strip() for h in next(csv.reader(f), [])]
    except (OSError, UnicodeDecodeError, csv.Error) as err:
        raise DataError(f"{path} cannot be read ({type(err).__name__}: {_first(err)})") from None
    if label not in header:
        raise DataError(f"{path} has no label column {label!r} (its header: {', '.join(header)[:200]}); "
                        "name it with csv-label")
    if len(header) < 2:
        raise DataError(f"{path} has no feature column besides the label {label!r}")
    col = header.index(label)
    try:
        with warnings.catch_warnings():  # a header-only file (an empty test split) is no reason to warn
            warnings.filterwarnings("ignore", "loadtxt: input contained no data", UserWarning)
            table = np.loadtxt(path, delimiter=",", skiprows=1, dtype=np.float64, ndmin=2, encoding="utf-8")
    except ValueError:  # a text or empty cell, a short row; or class names in the label column
        return _read_named_labels(path, header, col)
    if table.size == 0:
        table = np.zeros((0, len(header)))
    if table.shape[1] != len(header):
        raise DataError(f"{path}: rows have {table.shape[1]} values, the header names {len(header)} columns")
    return np.delete(table, col, axis=1), table[:, col]


def _read_named_labels(path: str, header: list[str], col: int) -> tuple[np.ndarray, np.ndarray]:
    """A CSV that is not all numbers: numeric features with class names in the label column
    (texts, mapped to class indices by :func:`_class_indices`), or the DataError that names
    the feature column and row that is not numeric."""
    import csv

    label = header[col]
    with open(path, newline="", encoding="utf-8") as f:
        for i, row in enumerate(csv.reader(f)):
            if i and row and len(row) != len(header):
                raise DataError(f"{path}: row {i} has {len(row)} values, the header names {len(header)} columns")
    options = {"delimiter": ",", "skiprows": 1, "encoding": "utf-8", "quotechar": '"'}
    try:
        names = np.loadtxt(path, dtype=str, ndmin=1, usecols=col, **options)
        x = np.loadtxt(path, dtype=np.float64, ndmin=2, usecols=[i for i in range(len(header)) if i != col],
                       **options)
    except ValueError as bad:  # a feature cell (numpy counts the file's columns from 1, its rows from 0)
        cell = re.search(r"string (.*) to float64 at row (\d+), column (\d+)", str(bad))
        where = (f"column {header[int(cell[3]) - 1]!r} holds {cell[1]} in data row {int(cell[2]) + 1}"
                 if cell and 0 < int(cell[3]) <= len(header) else _first(bad))
        raise DataError(f"{path}: every column but {label!r} must be numeric ({where})") from None
    names = np.char.strip(names)
    if any(not n for n in names):
        raise DataError(f"{path}: the label column {label!r} has an empty cell")
    try:
        return x, names.astype(np.float64)  # numbers after all (quoted): class indices, checked as such
    except ValueError:
        return x, names


def _named(y: np.ndarray) -> bool:
    """Whether a CSV's labels are class names (texts) rather than numbers."""
    return y.dtype.kind in "US"


def _class_indices(paths: list[str], ytr: np.ndarray, yte: np.ndarray, label: str, classes: str,
                   num_classes: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Class names in a CSV's label column as class indices: their position in ``classes``
    (comma-separated names in label order) when it is set, else in the sorted names of both
    files (so the same files give the same indices on every machine); and the number of
    classes. Both files must name their classes."""
    if not (_named(ytr) and _named(yte)):
        numbers, texts = (paths[0], paths[1]) if _named(yte) else (paths[1], paths[0])
        raise DataError(f"{texts}: the label column {label!r} holds class names, {numbers}'s holds numbers: "
                        "give both files class names, or both class indices 0..K-1")
    if classes:
        order = [c.strip() for c in classes.split(",") if c.strip()]
        if len(set(order)) != len(order):
            raise DataError(f"classes={classes!r} names a class twice")
    else:
        order = sorted(set(ytr.tolist()) | set(yte.tolist()))
    if num_classes > 0 and num_classes != len(order):
        raise DataError(f"num-classes={num_classes}, but the label column {label!r} names {len(order)} classes "
                        f"({', '.join(order)[:200]}): leave num-classes at 0 or name the classes with classes")
    index = {c: i for i, c in enumerate(order)}
    out = []
    for path, y in zip(paths, (ytr, yte)):
        unknown = sorted(set(y.tolist()) - set(index))
        if unknown:
            raise DataError(f"{path}: label {unknown[0]!r} is not one of classes ({', '.join(order)[:200]})")
        out.append(np.array([index[c] for c in y.tolist()], dtype=np.int64))
    return out[0], out[1], len(order)


def _as_array(value: Any, what: str) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    try:
        return np.asarray(value)
    except Exception as err:  # noqa: BLE001 - ragged lists, objects
        raise DataError(f"{what} is not an array ({type(err).__name__}: {_first(err)})") from None


def _features(x: Any, where: str) -> torch.Tensor:
    """x checked (numeric, (N, ...), finite) and stored compactly: uint8 as it is, the rest float32."""
    x = _as_array(x, f"{where}: x")
    if x.dtype == np.bool_ or not (np.issubdtype(x.dtype, np.integer) or np.issubdtype(x.dtype, np.floating)):
        raise DataError(f"{where}: x must be numeric, not {x.dtype}")
    if x.ndim < 2:
        raise DataError(f"{where}: x must have shape (N, *input_shape), got {x.shape}")
    if x.dtype != np.uint8:
        x = x.astype(np.float32)
        if not np.isfinite(x).all():
            raise DataError(f"{where}: x holds non-finite values (NaN or inf, or beyond float32's range)")
    return torch.from_numpy(np.ascontiguousarray(x))


def _labels(y: Any, where: str) -> torch.Tensor:
    """y checked: (N,), whole numbers >= 0 (floats holding whole numbers are accepted: a CSV)."""
    y = _as_array(y, f"{where}: y")
    if y.ndim != 1:
        raise DataError(f"{where}: y must have shape (N,), got {y.shape}")
    if y.dtype == np.bool_ or not (np.issubdtype(y.dtype, np.integer) or np.issubdtype(y.dtype, np.floating)):
        raise DataError(f"{where}: labels must be integers >= 0, not {y.dtype}")
    if np.issubdtype(y.dtype, np.floating) and not (np.isfinite(y).all() and (y == np.round(y)).all()):
        bad = y[~(np.isfinite(y) & (y == np.round(y)))][0]
        raise DataError(f"{where}: labels must be integers >= 0, found {float(bad)!r}")
    if y.size and y.min() < 0:
        raise DataError(f"{where}: labels must be integers >= 0, found {int(y.min())}")
    if y.size and y.max() > 2**31 - 1:
        raise DataError(f"{where}: label {int(y.max())} is too large (labels are class indices)")
    return torch.from_numpy(y.astype(np.int64))


def _assemble(name: str, where: list[str], xtr: Any, ytr: Any, xte: Any, yte: Any, num_classes: int,
              mean: tuple[float, ...] | None = None, std: tuple[float, ...] | None = None,
              scale: float = 1.0) -> FederatedDataset:
    """The checked splits as a FederatedDataset (``where``: the train and test sources, named
    in the errors)."""
    splits = []
    for place, x, y, empty_ok in ((where[0], xtr, ytr, False), (where[1], xte, yte, True)):
        xs, ys = _features(x, place), _labels(y, place)
        if len(xs) != len(ys):
            raise DataError(f"{place}: x has {len(xs)} rows and y {len(ys)} labels")
        if len(ys) == 0 and not empty_ok:  # a test split may be empty: a node that holds none out
            raise DataError(f"{place} holds no samples")
        splits.append(Split(xs, ys, mean=mean, std=std, scale=scale))
    train, test = splits
    if train.x.shape[1:] != test.x.shape[1:]:
        raise DataError(f"{where[1]}: samples of shape {tuple(test.x.shape[1:])}, but the train split's "
                        f"({where[0]}) are {tuple(train.x.shape[1:])}")
    top = int(max(train.y.max(), test.y.max())) if len(test) else int(train.y.max())
    if num_classes > 0 and top >= num_classes:
        place = where[0] if int(train.y.max()) == top else where[1]
        raise DataError(f"{place}: label {top} is not below num-classes={num_classes}")
    return FederatedDataset(name, train, test, num_classes if num_classes > 0 else top + 1,
                            tuple(train.x.shape[1:]))


# ------------------------------------------------------------------ image folder
def _imagefolder(root: str, classes: str, image_size: int, num_classes: int) -> FederatedDataset:
    """torchvision's ImageFolder layout, read with its file discovery (extensions, class
    folders) and PIL; see the module docstring for labels, modes and sizes."""
    from torchvision.datasets.folder import IMG_EXTENSIONS, make_dataset

    dirs = [os.path.join(root, split) for split in ("train", "test")]
    for d in dirs:
        if not os.path.isdir(d):
            raise DataError(f"{d} is missing (dataset 'imagefolder' needs data-dir/train/<class>/* and "
                            "data-dir/test/<class>/*)")
    names = [c.strip() for c in classes.split(",") if c.strip()] if classes else sorted(_subdirs(dirs[0]))
    if not names:
        raise DataError(f"{dirs[0]} holds no class folders (expected train/<class>/<image files>)")
    if len(set(names)) != len(names):
        raise DataError(f"classes={classes!r} names a class twice")
    if num_classes > 0 and num_classes != len(names):
        raise DataError(f"num-classes={num_classes}, but the image folder has {len(names)} classes "
                        f"({', '.join(names)[:200]}): leave num-classes at 0 or name the classes with classes")
    index = {c: i for i, c in enumerate(names)}
    files = []
    for d in dirs:
        unknown = sorted(set(_subdirs(d)) - set(index))
        if unknown:
            raise DataError(f"{os.path.join(d, unknown[0])}: class folder {unknown[0]!r} is not one of "
                            f"classes ({', '.join(names)[:200]})")
        found = make_dataset(d, index, extensions=IMG_EXTENSIONS, allow_empty=True)
        if not found and d == dirs[1] and not _subdirs(d):  # no test images: a node that holds none out
            files.append([])
            continue
        if not found:
            raise DataError(f"{d} holds no images (extensions: {', '.join(IMG_EXTENSIONS)})")
        held = {label for _, label in found}
        empty = [c for c in sorted(_subdirs(d)) if index[c] not in held]
        if empty:  # a class no image teaches (or tests): its accuracy would mean nothing
            raise DataError(f"{os.path.join(d, empty[0])}: class folder {empty[0]!r} holds no images "
                            f"(extensions: {', '.join(IMG_EXTENSIONS)}): add its images or remove the folder")
        files.append(found)
    if len(names) < 2:  # one class: every prediction is right, "100.00%" says nothing
        raise DataError(f"{dirs[0]}: the image folder has 1 class ({names[0]!r}): a classifier needs at least "
                        "2 classes, one folder of images each (train/<class>/*)")
    images = [[_open_image(path) for path, _ in split] for split in files]
    gray = all(im.mode in _GRAY_MODES for split in images for im in split)
    mode = "L" if gray else "RGB"
    if image_size > 0:
        from PIL import Image

        images = [[im.convert(mode).resize((image_size, image_size), Image.BILINEAR) for im in split]
                  for split in images]
    else:
        sizes = {}
        for split, found in zip(images, files):
            for im, (path, _) in zip(split, found):
                sizes.setdefault(im.size, path)
        if len(sizes) > 1:
            (s1, p1), (s2, p2) = list(sizes.items())[:2]
            raise DataError(f"the images differ in size ({s1[0]}x{s1[1]}: {p1}; {s2[0]}x{s2[1]}: {p2}): "
                            "set image-size to resize them all to one square size")
    arrays = []
    for split in images:
        if not split:  # an empty test folder: no images of the train split's shape
            arrays.append(np.zeros((0, *arrays[0].shape[1:]), dtype=np.uint8))
            continue
        stack = np.stack([np.asarray(im.convert(mode), dtype=np.uint8) for im in split])
        arrays.append(stack[:, None] if gray else stack.transpose(0, 3, 1, 2))
    channels = arrays[0].astype(np.float64) / 255.0
    mean = tuple(float(m) for m in channels.mean(axis=(0, 2, 3)))
    std = tuple(float(s) if s > 0 else 1.0 for s in channels.std(axis=(0, 2, 3)))
    labels = [np.array([t for _, t in split], dtype=np.int64) for split in files]
    data = _assemble("imagefolder", dirs, arrays[0], labels[0], arrays[1], labels[1], len(names),
                     mean=mean, std=std, scale=255.0)
    return data


def _subdirs(path: str) -> list[str]:
    return [e.name for e in os.scandir(path) if e.is_dir()]


def _open_image(path: str):
    from PIL import Image

    try:
        with Image.open(path) as im:
            im.load()
            return im.copy() if im.mode in _GRAY_MODES else im.convert("RGB")
    except Exception as err:  # noqa: BLE001 - PIL raises UnidentifiedImageError, OSError, SyntaxError...
        raise DataError(f"{path} is not a readable image ({type(err).__name__}: {_first(err)})") from None


# ---------------------------------------------------------------------- callable
def from_callable(text: str, data_dir: str, num_classes: int = 0) -> FederatedDataset:
    """``dataset = package.module:callable`` (or a name registered in this process:
    flatflower.common.datasets.register_dataset): the user's function returns the data.

    The contract: the callable takes ``(data_dir)`` (the run's data-dir, a node's own winning,
    as an absolute path, or "" when none is set) or nothing, and returns either ``(train,
    test)`` or a dict ``{"train": ..., "test": ..., "num_classes": K}`` (num_classes optional).
    Each split is ``(x, y)``, numpy arrays or tensors, x of shape (N, *input_shape) and
    numeric, y of shape (N,) holding integer labels >= 0; or a ``torch.utils.data.Dataset``
    whose items are ``(x, y)`` pairs (read once, item by item, and stacked). x is used as given
    (float32; uint8 stays uint8): normalise it in the callable. Classes: ``num_classes`` of
    the dict, else the run's ``num-classes`` when > 0, else max label + 1. It is called once
    per process (cached), on the server and on every node: it must return the same data
    everywhere (seed any randomness), or each node its own when data lives on the nodes.
    """
    from flatflower.common.references import BadReference, call, resolve

    try:
        out = call(REGISTERED.get(text) or resolve(text, "dataset"), (data_dir,), "dataset", text)
    except BadReference as err:
        raise DataError(str(err)) from None
    where = f"dataset={text!r}"
    if isinstance(out, dict):
        extra = sorted(set(out) - {"train", "test", "num_classes"})
        if extra or not {"train", "test"} <= set(out):
            raise DataError(f"{where} returned a dict with keys {sorted(out)}; it must have 'train' and 'test' "
                            "(and optionally 'num_classes')")
        train, test = out["train"], out["test"]
        given = out.get("num_classes", 0)
        if isinstance(given, bool) or not isinstance(given, (int, np.integer)) or given < 0:
            raise DataError(f"{where}: num_classes must be a whole number >= 1, got {given!r}")
        num_classes = int(given) or num_classes
    elif isinstance(out, (tuple, list)) and len(out) == 2:
        train, test = out
    else:
        raise DataError(f"{where} returned {type(out).__name__}; it must return (train, test) or a dict "
                        "with 'train' and 'test', each (x, y) or a torch Dataset of (x, y) pairs")
    parts = [_split_arrays(s, f"{where}: the {tag} split") for s, tag in ((train, "train"), (test, "test"))]
    return _assemble(text, [f"{where}: the train split", f"{where}: the test split"],
                     *parts[0], *parts[1], num_classes)


def _split_arrays(split: Any, where: str) -> tuple[Any, Any]:
    """(x, y) of a split given as a pair or as a torch Dataset of (x, y) items."""
    if isinstance(split, torch.utils.data.Dataset):
        try:
            items = [split[i] for i in range(len(split))]
        except Exception as err:  # noqa: BLE001 - the user's dataset may raise anything
            raise DataError(f"{where}: reading the Dataset raised {type(err).__name__}: {_first(err)}") from None
        if not all(isinstance(it, (tuple, list)) and len(it) == 2 for it in items):
            raise DataError(f"{where}: a Dataset's items must be (x, y) pairs")
        if not items:
            raise DataError(f"{where} holds no samples")
        try:
            x = np.stack([_as_array(it[0], where) for it in items])
        except ValueError as err:
            raise DataError(f"{where}: the Dataset's x differ in shape ({_first(err)})") from None
        try:
            y = np.array([_as_array(it[1], where).item() for it in items])
        except ValueError:
            raise DataError(f"{where}: a Dataset's labels y must be single numbers") from None
        return x, y
    if isinstance(split, (tuple, list)) and len(split) == 2:
        return split[0], split[1]
    raise DataError(f"{where} is a {type(split).__name__}; it must be (x, y) or a torch Dataset of (x, y) pairs")


def _first(err: BaseException) -> str:
    lines = str(err).splitlines()
    return lines[0][:200] if lines else type(err).__name__
