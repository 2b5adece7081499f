"""The examples/ an adopter copies, run as their READMEs say, on a tiny scale (so they cannot rot).

Each example's README holds its commands in a ```bash block; a test runs those very lines from
the example's folder (a ``module:callable`` reference is looked up in the current directory), with
flags appended that shrink the run (later flags win: argparse keeps a repeated option's last
value, ``--set`` its last assignment of a key), and checks what the example promises.
"""

from __future__ import annotations

import json
import math
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers import ROOT, flower_pids, metrics
from flatflower.tools.cli import main as cli

EXAMPLES = ROOT / "examples"


def commands(example: str) -> list[list[str]]:
    """The command lines of the example's README (its ```bash blocks), as argument lists."""
    text = (EXAMPLES / example / "README.md").read_text()
    blocks = [b.split("```", 1)[0] for b in text.split("```bash\n")[1:]]
    lines = [line for block in blocks for line in block.splitlines() if line.strip()]
    return [shlex.split(line) for line in lines]


def run_example(example: str, tmp_path: Path, monkeypatch, tiny: list[str], make_args: list[str],
                command: str | None = None) -> Path:
    """Run the README's commands: the data script into ``tmp_path``, the ``flatflower`` command
    from the example's folder with ``tiny`` appended (``command``: another subcommand in place of
    the README's, e.g. simulate for local); the run directory."""
    monkeypatch.chdir(EXAMPLES / example)
    data = tmp_path / "data"
    run_dir = None
    for argv in commands(example):
        argv = [str(data) if a in ("data", "sites") else a for a in argv]
        argv = [a.replace("sites/", f"{data}/") for a in argv]
        if argv[0] == "python":
            subprocess.run([sys.executable, *argv[1:], *make_args], check=True, capture_output=True)
        elif argv[:2] == ["flatflower", "report"]:
            assert cli(["report", str(run_dir), "--out", str(tmp_path / "report.png")]) == 0
        else:
            assert argv[0] == "flatflower"
            args = [command or argv[1], *argv[2:]]
            for i, a in enumerate(args):
                if a == "data-dir=data" or a.startswith("data-dir="):
                    args[i] = f"data-dir={data}"
            run_dir = tmp_path / "run"
            assert cli([*args, *tiny, "--run-dir", str(run_dir)]) == 0
    assert run_dir is not None
    return run_dir


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def test_resnet18_with_batchnorm_on_an_image_folder_with_crop_flip(tmp_path, monkeypatch):
    run_dir = run_example("resnet18_imagefolder", tmp_path, monkeypatch,
                          ["--clients", "2", "--rounds", "1", "--set", "local-steps=1", "--set", "batch-size=8",
                           "--partition", "iid"], ["--per-class", "6"])
    assert summary(run_dir)["status"] == "completed"
    config = json.loads((run_dir / "config.json").read_text())
    assert config["config"]["model"] == "my_resnet:resnet18" and config["config"]["train-transform"] == "crop-flip"
    final = torch.load(run_dir / "model_final.pt", weights_only=True)
    variances = [v for k, v in final.items() if k.endswith("running_var")]
    assert len(variances) == 20 and all(bool((v >= 0).all()) for v in variances)  # ResNet-18's 20 BatchNorms
    assert math.isfinite(metrics(run_dir)[-1]["test_loss"])


def test_a_csv_table_with_the_users_mlp(tmp_path, monkeypatch):
    run_dir = run_example("tabular_csv", tmp_path, monkeypatch, ["--rounds", "3"], [])
    rows = metrics(run_dir)
    assert summary(run_dir)["status"] == "completed"
    assert rows[-1]["test_loss"] < rows[0]["test_loss"]  # it learns the table
    header = (tmp_path / "data" / "train.csv").read_text().splitlines()[0].split(",")
    first = torch.load(run_dir / "model_final.pt", weights_only=True)["0.weight"]
    assert first.shape[1] == len(header) - 1  # every column but the label is a feature


@pytest.mark.parametrize("command", [
    pytest.param("local", marks=[pytest.mark.slow, pytest.mark.integration]),  # ~45 s on 2 cores
    "simulate",
])
def test_three_sites_each_on_its_own_folder(tmp_path, monkeypatch, command):
    """The README's command (flatflower local: a real SuperLink and three SuperNodes, each on its
    own folder; and the same flags in one process): federated evaluation, no data on the server."""
    before = flower_pids()
    run_dir = run_example("three_sites", tmp_path, monkeypatch, ["--rounds", "2", "--set", "local-epochs=1"], [],
                          command)
    assert flower_pids() - before == set()
    rows = metrics(run_dir)
    assert [r["round"] for r in rows] == [1, 2]  # no round 0: there is no server test set
    assert all("test_accuracy" not in r and 0 <= r["federated_accuracy"] <= 1 for r in rows)
    partition = json.loads((run_dir / "partition.json").read_text())
    for site in range(3):  # the sizes the server learned at the handshakes are the folders' own
        for split, learned in (("train", "sizes"), ("test", "heldout_sizes")):
            with np.load(tmp_path / "data" / f"site{site}" / f"{split}.npz") as f:
                assert partition[learned][str(site)] == len(f["y"])
    assert summary(run_dir)["status"] == "completed"


pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
