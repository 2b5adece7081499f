"""A model AND a dataset defined in the user's own file train with FedGMT, FedSAM, SCAFFOLD and
FedDyn in every engine: in-process and vectorised (here), and ``flatflower local`` (a real
SuperLink and SuperNodes) and Ray (slow), which find the file through the PYTHONPATH the engine
hands the processes it starts; every engine ends with the in-process engine's final model."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.helpers import flower_pids, metrics
from flatflower.tools.cli import main as cli

ALGORITHMS = ("fedgmt", "fedsam", "scaffold", "feddyn")

USER_CODE = textwrap.dedent('''
    """An adopter's own file: a model and a dataset (common/references.py's contract)."""
    import numpy as np
    from torch import nn


    def net(input_shape, num_classes):
        (features,) = input_shape
        return nn.Sequential(nn.Linear(features, 12), nn.Tanh(), nn.Linear(12, num_classes))


    def blobs():
        """Three Gaussian classes in 6 dimensions: (train, test), each (x, y)."""
        rng = np.random.default_rng(7)
        centres = rng.normal(0, 2, (3, 6))

        def draw(n):
            y = rng.integers(0, 3, n)
            return (centres[y] + rng.normal(0, 1, (n, 6))).astype(np.float32), y
        return draw(240), draw(60)
''')


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """The user's file, importable from this process's working directory only; its name is
    unique to the test (modules are cached per process)."""
    name = f"adopter_{tmp_path.name.replace('-', '_')}"
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / f"{name}.py").write_text(USER_CODE)
    monkeypatch.chdir(folder)
    yield name
    sys.modules.pop(name, None)


def args_for(module: str, algorithm: str, clients: int = 3) -> list[str]:
    return ["--algorithm", algorithm, "--clients", str(clients), "--rounds", "2", "--model", f"{module}:net",
            "--dataset", f"{module}:blobs", "--partition", "iid", "--set", "local-steps=2", "--set", "batch-size=16"]


def final_model(run_dir: Path) -> dict:
    return torch.load(run_dir / "model_final.pt", weights_only=True)


def same_model(a: Path, b: Path) -> bool:
    x, y = final_model(a), final_model(b)
    return list(x) == list(y) and all(torch.equal(x[k], y[k]) for k in x)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_the_users_model_and_dataset_in_process_and_vectorised(user_module, tmp_path, algorithm):
    runs = {}
    for engine in ("inprocess", "vectorized"):
        runs[engine] = tmp_path / engine
        assert cli(["simulate", "--engine", engine, *args_for(user_module, algorithm),
                    "--set", "batching=on", "--run-dir", str(runs[engine])]) == 0
    rows = metrics(runs["inprocess"])
    assert rows[-1]["test_loss"] < rows[0]["test_loss"]
    a, b = final_model(runs["inprocess"]), final_model(runs["vectorized"])
    assert all(torch.allclose(a[k], b[k], atol=1e-5) for k in a)  # batched kernels' rounding only


@pytest.mark.integration
@pytest.mark.slow
def test_the_users_model_and_dataset_in_flatflower_local(user_module, tmp_path):
    """A real SuperLink and 3 SuperNodes per algorithm (~30 s each on 2 cores)."""
    before = flower_pids()
    for algorithm in ALGORITHMS:
        dep, inp = tmp_path / f"{algorithm}-local", tmp_path / f"{algorithm}-inp"
        assert cli(["local", "--fast-poll", *args_for(user_module, algorithm), "--run-dir", str(dep),
                    "--timeout", "300"]) == 0
        assert cli(["simulate", "--engine", "inprocess", *args_for(user_module, algorithm),
                    "--run-dir", str(inp)]) == 0
        assert same_model(dep, inp), algorithm
    assert flower_pids() - before == set()


@pytest.mark.integration
@pytest.mark.ray
@pytest.mark.slow
def test_the_users_model_and_dataset_in_ray(user_module, tmp_path, monkeypatch):
    """Flower's simulation engine (Ray): its workers resolve the user's references too."""
    import tempfile

    monkeypatch.setenv("RAY_TMPDIR", tempfile.mkdtemp(prefix="ray-"))  # Ray's socket paths stay short
    for algorithm in ("fedgmt", "scaffold"):
        ray, inp = tmp_path / f"{algorithm}-ray", tmp_path / f"{algorithm}-inp"
        assert cli(["simulate", "--engine", "ray", *args_for(user_module, algorithm), "--run-dir", str(ray),
                    "--timeout", "600"]) == 0
        assert cli(["simulate", "--engine", "inprocess", *args_for(user_module, algorithm),
                    "--run-dir", str(inp)]) == 0
        assert same_model(ray, inp), algorithm
