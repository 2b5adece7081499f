"""The user's own data (common/userdata.py): NPZ, CSV, an image folder and a callable, each
checked against what was written, every bad input one line; and a 2-round federation on each."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from flatflower.common.config import ConfigError, RunConfig
from flatflower.common.datasets import load_dataset
from flatflower.common.userdata import DataError, load
from tests.helpers import fast_config, user_module_file
from flatflower.runtime.engines.inprocess import run_inprocess


def write_npz(folder: Path, xtr, ytr, xte, yte) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    np.savez(folder / "train.npz", x=xtr, y=ytr)
    np.savez(folder / "test.npz", x=xte, y=yte)
    return folder


def blobs(n: int, dim: int = 6, classes: int = 3, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    y = np.arange(n) % classes
    x = rng.normal(size=(n, dim)) + 3.0 * np.eye(classes, dim)[y]
    return x.astype(np.float32), y


def write_csv(path: Path, header: list[str], rows: list[list]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join([",".join(header)] + [",".join(str(v) for v in r) for r in rows]) + "\n")


def one_line(excinfo) -> str:
    text = str(excinfo.value)
    assert "\n" not in text and text
    return text


# ----------------------------------------------------------------------------- npz
def test_npz_loads_as_written(tmp_path) -> None:
    xtr, ytr = blobs(40)
    xte, yte = blobs(10, seed=1)
    d = write_npz(tmp_path / "d", xtr, ytr, xte, yte)
    ds = load("npz", str(d))
    assert ds.input_shape == (6,) and ds.num_classes == 3 and len(ds.train) == 40 and len(ds.test) == 10
    x, y = ds.train.get(slice(None))
    assert torch.equal(x, torch.from_numpy(xtr)) and torch.equal(y, torch.from_numpy(ytr))
    assert ds.train.y.dtype == torch.int64
    assert load("npz", str(d)) is ds  # cached per process
    assert load("npz", str(d), num_classes=7).num_classes == 7


def test_npz_uint8_images_stay_compact(tmp_path) -> None:
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (8, 1, 5, 5), dtype=np.uint8)
    d = write_npz(tmp_path, x, np.arange(8) % 2, x[:3], np.array([0, 1, 1]))
    ds = load("npz", str(d))
    assert ds.train.x.dtype == torch.uint8 and ds.input_shape == (1, 5, 5)
    assert torch.equal(ds.train.get(slice(None))[0], torch.from_numpy(x).float())


@pytest.mark.parametrize(("train", "test", "match"), [
    ({"x": np.zeros((4, 2))}, None, "has no array 'y'"),
    ({"x": np.zeros((4, 2)), "y": np.zeros(3, int)}, None, "x has 4 rows and y 3 labels"),
    ({"x": np.zeros((4, 2)), "y": np.array([0, 1, -1, 0])}, None, "integers >= 0, found -1"),
    ({"x": np.zeros((4, 2)), "y": np.array([0, 1, 0.5, 0])}, None, "integers >= 0, found 0.5"),
    ({"x": np.array([[0, 1], [np.nan, 0]]), "y": np.array([0, 1])}, None, "non-finite"),
    ({"x": np.zeros((0, 2)), "y": np.zeros(0, int)}, None, "holds no samples"),
    ({"x": np.zeros((4, 2)), "y": np.zeros(4, int)}, {"x": np.zeros((4, 3)), "y": np.zeros(4, int)},
     "samples of shape (3,), but the train split's"),
    ({"x": np.array(["a", "b"]).reshape(2, 1), "y": np.zeros(2, int)}, None, "x must be numeric"),
    ({"x": np.zeros(4), "y": np.zeros(4, int)}, None, "x must have shape (N, *input_shape)"),
])
def test_npz_bad_input_is_one_line_naming_the_file(tmp_path, train, test, match) -> None:
    good = {"x": np.zeros((2, 2)), "y": np.array([0, 1])}
    np.savez(tmp_path / "train.npz", **train)
    np.savez(tmp_path / "test.npz", **(test or good))
    with pytest.raises(DataError) as err:
        load("npz", str(tmp_path))
    assert match in one_line(err) and ".npz" in str(err.value)


def test_npz_missing_file_damaged_file_and_no_data_dir(tmp_path) -> None:
    np.savez(tmp_path / "train.npz", x=np.zeros((2, 2)), y=np.array([0, 1]))
    with pytest.raises(DataError) as err:
        load("npz", str(tmp_path))
    assert f"{tmp_path / 'test.npz'} is missing" in one_line(err)
    (tmp_path / "test.npz").write_bytes(b"not a zip")
    with pytest.raises(DataError) as err:
        load("npz", str(tmp_path))
    assert "is not a readable .npz file" in one_line(err)
    with pytest.raises(DataError, match="set data-dir"):
        load("npz", "")


def test_num_classes_must_exceed_every_label(tmp_path) -> None:
    d = write_npz(tmp_path, np.zeros((3, 2)), np.array([0, 1, 4]), np.zeros((1, 2)), np.array([0]))
    assert load("npz", str(d)).num_classes == 5
    with pytest.raises(DataError) as err:
        load("npz", str(d), num_classes=3)
    assert "label 4 is not below num-classes=3" in one_line(err) and "train.npz" in str(err.value)


# ----------------------------------------------------------------------------- csv
def test_csv_loads_with_its_label_column(tmp_path) -> None:
    write_csv(tmp_path / "train.csv", ["a", "target", "b"], [[0.5, 1, 2], [1.5, 0, -3], [2, 2, 4]])
    write_csv(tmp_path / "test.csv", ["a", "target", "b"], [[7, 1, 8]])
    ds = load("csv", str(tmp_path), csv_label="target")
    assert ds.input_shape == (2,) and ds.num_classes == 3
    assert ds.train.x.tolist() == [[0.5, 2.0], [1.5, -3.0], [2.0, 4.0]]
    assert ds.train.y.tolist() == [1, 0, 2] and ds.test.y.tolist() == [1]


@pytest.mark.parametrize(("rows", "header", "match"), [
    ([[1, 0]], ["a", "klass"], "has no label column 'label'"),
    ([[1, "x"]], ["a", "label"], "the label column 'label' holds class names, "),  # test.csv's: numbers
    ([["x", 1]], ["a", "label"], "every column but 'label' must be numeric (column 'a' holds 'x' in data row 1)"),
    ([["x", "cat"]], ["a", "label"], "every column but 'label' must be numeric (column 'a' holds 'x' in data row 1)"),
    ([[1, 2, "cat"], [1, "zz", "dog"]], ["a", "b", "label"],
     "every column but 'label' must be numeric (column 'b' holds 'zz' in data row 2)"),
    ([[1, ""]], ["a", "label"], "the label column 'label' has an empty cell"),
    ([[1, 0.5]], ["a", "label"], "integers >= 0, found 0.5"),
    ([[1]], ["label"], "no feature column"),
    ([], ["a", "label"], "holds no samples"),
    ([[1, 2, 0]], ["a", "label"], "rows have 3 values, the header names 2 columns"),
])
def test_csv_bad_input_is_one_line_naming_the_file(tmp_path, rows, header, match) -> None:
    write_csv(tmp_path / "train.csv", header, rows)
    write_csv(tmp_path / "test.csv", ["a", "label"], [[1, 0]])
    with pytest.raises(DataError) as err:
        load("csv", str(tmp_path))
    assert match in one_line(err) and "train.csv" in str(err.value)


def test_csv_class_names_become_class_indices(tmp_path) -> None:
    """Issue 57, item 7: a label column of class names was refused as "column 11 is not numeric"
    (the label column itself). Names are class indices: their position in ``classes`` when it is
    set, else in the sorted names of both files."""
    write_csv(tmp_path / "train.csv", ["f", "species"], [[1, "setosa"], [2, "virginica"], [3, "versicolor"]])
    write_csv(tmp_path / "test.csv", ["f", "species"], [[4, '"virginica"'], [5, " setosa"]])
    ds = load("csv", str(tmp_path), csv_label="species")
    assert ds.num_classes == 3 and ds.input_shape == (1,)
    assert ds.train.y.tolist() == [0, 2, 1] and ds.test.y.tolist() == [2, 0]  # setosa, versicolor, virginica
    assert ds.train.x.tolist() == [[1.0], [2.0], [3.0]]
    named = load("csv", str(tmp_path), csv_label="species", classes="virginica, versicolor, setosa, hybrid")
    assert named.num_classes == 4 and named.train.y.tolist() == [2, 0, 1] and named.test.y.tolist() == [0, 2]
    for options, match in (({"classes": "setosa,virginica"}, "train.csv: label 'versicolor' is not one of "
                                                             "classes (setosa, virginica)"),
                           ({"num_classes": 5}, "num-classes=5, but the label column 'species' names 3 classes"),
                           ({"classes": "a,a"}, "classes='a,a' names a class twice")):
        with pytest.raises(DataError) as err:
            load("csv", str(tmp_path), csv_label="species", **options)
        assert match in one_line(err)


# ----------------------------------------------------------------------- imagefolder
def write_images(root: Path, layout: dict[str, dict[str, list]], mode: str = "RGB") -> Path:
    from PIL import Image

    for split, classes in layout.items():
        for cls, images in classes.items():
            (root / split / cls).mkdir(parents=True, exist_ok=True)
            for i, pixels in enumerate(images):
                Image.fromarray(np.asarray(pixels, dtype=np.uint8), mode=mode).save(root / split / cls / f"{i}.png")
    return root


def test_imagefolder_rgb_labels_and_normalisation(tmp_path) -> None:
    red = np.zeros((4, 5, 3)); red[..., 0] = 255
    blue = np.zeros((4, 5, 3)); blue[..., 2] = 200
    root = write_images(tmp_path, {"train": {"cat": [red, red], "ant": [blue]}, "test": {"cat": [red]}})
    ds = load("imagefolder", str(root))
    assert ds.num_classes == 2 and ds.input_shape == (3, 4, 5)  # C, H, W
    assert ds.train.x.dtype == torch.uint8 and ds.train.scale == 255.0
    assert sorted(ds.train.y.tolist()) == [0, 1, 1]  # ant = 0, cat = 1 (sorted folders)
    ant = int(np.flatnonzero(ds.train.y.numpy() == 0)[0])
    assert ds.train.x[ant, 2].unique().tolist() == [200] and ds.train.x[ant, 0].unique().tolist() == [0]
    # per-channel mean/std of the train split's x / 255
    assert ds.train.mean == pytest.approx((2 / 3, 0.0, 200 / 255 / 3))
    assert ds.train.std[1] == 1.0  # a constant channel is not divided by zero
    x, _ = ds.train.get(slice(None))
    assert x[:, 0].mean().item() == pytest.approx(0.0, abs=1e-6) and x[:, 0].std(unbiased=False).item() == pytest.approx(1.0, abs=1e-5)
    assert ds.test.mean == ds.train.mean and ds.test.y.tolist() == [1]


def test_imagefolder_classes_key_grayscale_and_resize(tmp_path) -> None:
    g = np.full((6, 6), 10)
    root = write_images(tmp_path, {"train": {"b": [g], "a": [g * 2]}, "test": {"a": [g]}}, mode="L")
    ds = load("imagefolder", str(root), classes="b,a,c")  # c is on no node here: still a class
    assert ds.num_classes == 3 and ds.input_shape == (1, 6, 6)
    assert sorted(ds.train.y.tolist()) == [0, 1] and ds.test.y.tolist() == [1]
    resized = load("imagefolder", str(root), classes="b,a,c", image_size=3)
    assert resized.input_shape == (1, 3, 3) and resized.train.x.unique().tolist() in ([10, 20], [20, 10])


@pytest.mark.parametrize(("layout", "options", "match"), [
    ({"train": {"a": [np.zeros((4, 4, 3))], "b": [np.zeros((5, 4, 3))]}, "test": {"a": [np.zeros((4, 4, 3))]}},
     {}, "set image-size"),
    ({"train": {"a": [np.zeros((4, 4, 3))], "zz": [np.zeros((4, 4, 3))]}, "test": {"a": [np.zeros((4, 4, 3))]}},
     {"classes": "a,b"}, "class folder 'zz' is not one of classes"),
    ({"train": {"a": [np.zeros((4, 4, 3))]}, "test": {"q": [np.zeros((4, 4, 3))]}},
     {}, "class folder 'q' is not one of classes"),
    ({"train": {"a": [np.zeros((4, 4, 3))]}, "test": {"a": []}}, {}, "holds no images"),
    ({"train": {"a": [np.zeros((4, 4, 3))]}}, {}, "test is missing"),
    ({"train": {"a": [np.zeros((4, 4, 3))]}, "test": {"a": [np.zeros((4, 4, 3))]}},
     {"num_classes": 3}, "num-classes=3, but the image folder has 1 classes"),
    # issue 57, item 7: one class trained to "100.00%", an empty class folder to "50.00%", silently
    ({"train": {"a": [np.zeros((4, 4, 3))]}, "test": {"a": [np.zeros((4, 4, 3))]}},
     {}, "train: the image folder has 1 class ('a'): a classifier needs at least 2 classes"),
    ({"train": {"a": [np.zeros((4, 4, 3))]}, "test": {"a": [np.zeros((4, 4, 3))]}},
     {"classes": "a"}, "the image folder has 1 class ('a')"),
    ({"train": {"a": [np.zeros((4, 4, 3))], "b": []}, "test": {"a": [np.zeros((4, 4, 3))]}},
     {}, "train/b: class folder 'b' holds no images"),
    ({"train": {"a": [np.zeros((4, 4, 3))], "b": [np.zeros((4, 4, 3))]},
      "test": {"a": [np.zeros((4, 4, 3))], "b": []}}, {}, "test/b: class folder 'b' holds no images"),
])
def test_imagefolder_bad_input_is_one_line(tmp_path, layout, options, match) -> None:
    root = write_images(tmp_path, layout)
    with pytest.raises(DataError) as err:
        load("imagefolder", str(root), **options)
    assert match in one_line(err)


TWO_CLASSES = {"train": {"a": [np.zeros((4, 4, 3))], "b": [np.zeros((4, 4, 3))]}, "test": {"a": [np.zeros((4, 4, 3))]}}


@pytest.mark.parametrize(("layout", "message"), [
    ({"train": {"cat": [np.zeros((4, 4, 3))] * 4}, "test": {"cat": [np.zeros((4, 4, 3))]}},
     "the image folder has 1 class ('cat')"),
    ({"train": {"cat": [np.zeros((4, 4, 3))] * 4, "dog": []}, "test": {"cat": [np.zeros((4, 4, 3))],
                                                                      "dog": [np.zeros((4, 4, 3))]}},
     "class folder 'dog' holds no images"),
])
def test_an_image_folder_a_classifier_cannot_learn_is_refused_before_anything_starts(tmp_path, capsys, layout,
                                                                                    message) -> None:
    """Issue 57, item 7: `flatflower simulate` on one class trained to "100.00%", with an empty
    class folder to "50.00%", and said nothing; now one error line (exit 2) and no run directory."""
    from flatflower.tools.cli import main

    root = write_images(tmp_path / "data", layout)
    code = main(["simulate", "--engine", "inprocess", "--clients", "2", "--dataset", "imagefolder",
                 "--set", f"data-dir={root}", "--partition", "iid", "--rounds", "1",
                 "--run-dir", str(tmp_path / "run")])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines
    assert not (tmp_path / "run").exists()


def test_imagefolder_unreadable_image_names_it(tmp_path) -> None:
    root = write_images(tmp_path, TWO_CLASSES)
    (root / "test" / "a" / "broken.png").write_bytes(b"not a png")
    with pytest.raises(DataError) as err:
        load("imagefolder", str(root))
    assert "broken.png is not a readable image" in one_line(err)


def test_imagefolder_mixed_modes_become_rgb(tmp_path) -> None:
    from PIL import Image

    root = write_images(tmp_path, TWO_CLASSES)
    Image.fromarray(np.full((4, 4), 90, dtype=np.uint8), mode="L").save(root / "train" / "a" / "gray.png")
    ds = load("imagefolder", str(root))
    assert ds.input_shape == (3, 4, 4) and ds.train.x.amax().item() == 90


# ------------------------------------------------------------------------- callable
MODULE = '''
import numpy as np
import torch

def pair(data_dir):
    rng = np.random.default_rng(0)
    y = np.arange(60) % 3
    x = rng.normal(size=(60, 5)).astype(np.float32) + 2.0 * np.eye(3, 5, dtype=np.float32)[y]
    return (x[:48], y[:48]), (torch.from_numpy(x[48:]), torch.from_numpy(y[48:]))

def as_dict():
    train, test = pair("")
    return {"train": train, "test": test, "num_classes": 4}

class Items(torch.utils.data.Dataset):
    def __init__(self, n):
        self.n = n
    def __len__(self):
        return self.n
    def __getitem__(self, i):
        return torch.full((1, 2, 2), float(i)), i % 2

def datasets():
    return Items(6), Items(2)

def seen(data_dir):
    return (np.full((2, 1), len(data_dir), dtype=np.float32), np.array([0, 1])), (np.zeros((1, 1)), np.array([0]))

def wrong():
    return [1, 2, 3]

def bad_labels():
    return (np.zeros((2, 2)), np.array([0.0, 1.5])), (np.zeros((1, 2)), np.array([0]))

def raises():
    raise RuntimeError("no data today")
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    yield from user_module_file(tmp_path, monkeypatch, "userdata", MODULE)


def test_callable_pair_dict_and_dataset(user_module) -> None:
    ds = load(f"{user_module}:pair", "")
    assert (len(ds.train), len(ds.test), ds.num_classes, ds.input_shape) == (48, 12, 3, (5,))
    assert load(f"{user_module}:as_dict", "").num_classes == 4
    items = load(f"{user_module}:datasets", "")
    assert items.input_shape == (1, 2, 2) and items.train.y.tolist() == [0, 1, 0, 1, 0, 1]
    assert items.train.x[:, 0, 0, 0].tolist() == [0, 1, 2, 3, 4, 5]
    assert load(f"{user_module}:seen", "/some/where").train.x[0, 0].item() == len("/some/where")


@pytest.mark.parametrize(("attr", "match"), [
    ("wrong", "returned list; it must return (train, test)"),
    ("bad_labels", "the train split: labels must be integers >= 0, found 1.5"),
    ("raises", "calling it raised RuntimeError: no data today"),
    ("missing", "has no attribute 'missing'"),
])
def test_callable_bad_input_is_one_line(user_module, attr, match) -> None:
    with pytest.raises(DataError) as err:
        load(f"{user_module}:{attr}", "")
    assert match in one_line(err)


# --------------------------------------------------------------------- config and runs
def test_config_accepts_the_formats_and_references() -> None:
    for name in ("npz", "csv", "imagefolder", "mypkg.data:load"):
        cfg = RunConfig.from_mapping({"dataset": name})
        assert cfg.resolved_model() == ("cnn" if name == "imagefolder" else "mlp")
    with pytest.raises(ConfigError, match="dataset='npzz' is not one of.*did you mean 'npz'"):
        RunConfig.from_mapping({"dataset": "npzz"})
    for bad, match in (({"image-size": -1}, "image-size"), ({"num-classes": -2}, "num-classes"),
                       ({"csv-label": " "}, "csv-label"),
                       ({"num-classes": 5}, "num-classes is read only for your own data")):
        with pytest.raises(ConfigError, match=match):
            RunConfig.from_mapping(bad)


def test_load_dataset_dispatches_with_the_options(tmp_path) -> None:
    write_csv(tmp_path / "train.csv", ["y", "f"], [[0, 1.0], [1, 2.0]])
    write_csv(tmp_path / "test.csv", ["y", "f"], [[1, 3.0]])
    ds = load_dataset("csv", str(tmp_path), csv_label="y", classes="", image_size=0, num_classes=0)
    assert ds.train.x.tolist() == [[1.0], [2.0]]


@pytest.mark.parametrize("fmt", ["npz", "csv", "csv-names"])
def test_two_round_federation_on_a_folder(tmp_path, fmt) -> None:
    xtr, ytr = blobs(120)
    xte, yte = blobs(30, seed=1)
    data = tmp_path / "data"
    label = (lambda c: ("ant", "bee", "cat")[c]) if fmt == "csv-names" else int
    if fmt == "npz":
        write_npz(data, xtr, ytr, xte, yte)
    else:
        header = [f"f{i}" for i in range(6)] + ["label"]
        write_csv(data / "train.csv", header, [list(r) + [label(c)] for r, c in zip(xtr.tolist(), ytr)])
        write_csv(data / "test.csv", header, [list(r) + [label(c)] for r, c in zip(xte.tolist(), yte)])
    cfg = fast_config(dataset=fmt[:3], data_dir=str(data), model="auto", run_dir=str(tmp_path / "run"),
                      local_steps=5, lr=0.2)
    run_dir, _ = run_inprocess(cfg, num_clients=3)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rounds = [r for r in rows if r.get("round")]
    assert [r["round"] for r in rounds][-1] == 2
    final = rounds[-1]
    accuracy = final.get("accuracy", final.get("test_accuracy"))
    assert accuracy is not None and accuracy > 0.6  # three well-separated blobs
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "completed"
