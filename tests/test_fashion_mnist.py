"""Real images offline: Fashion-MNIST from Debian's dataset-fashion-mnist package (`.ci/run`
installs it; elsewhere these tests skip unless FLATFLOWER_REQUIRE_FASHION_MNIST=1)."""

from __future__ import annotations

import json

import pytest

from tests.helpers import metrics
from tests.test_datasets import system_fashion_mnist
from flatflower.tools.cli import main as cli


@pytest.mark.slow
def test_a_short_federated_run_on_the_full_dirichlet_split_learns(tmp_path, capsys):
    """FedAvg, LeNet-5, all 60,000 training images split over 10 clients by Dirichlet(0.5), 3
    rounds of 20 local steps of 50 images: 49.4% test accuracy on the 10,000 test images when
    measured (seed 0, this machine; chance is 10%); the bar is 40%."""
    system_fashion_mnist()
    run_dir = tmp_path / "run"
    assert cli(["simulate", "--engine", "inprocess", "-a", "fedavg", "-n", "10", "-r", "3",
                "--dataset", "fashion-mnist", "--model", "lenet5", "--partition", "dirichlet",
                "--set", "dirichlet-alpha=0.5", "--set", "local-steps=20", "--set", "batch-size=50",
                "--set", "lr=0.1", "--set", "client-eval=false", "--no-tensorboard",
                "--run-dir", str(run_dir)]) == 0
    capsys.readouterr()
    rows = metrics(run_dir)
    assert rows[-1]["test_accuracy"] > 0.40, [r["test_accuracy"] for r in rows]
    parts = json.loads((run_dir / "partition.json").read_text())["partitions"]
    assert sum(len(p) for p in parts.values()) == 60000  # the full training set, split
