"""End to end: the real ServerApp and ClientApp in-process, in Flower's Ray simulation
engine, and over real SuperLink/SuperNode processes on 127.0.0.1 (gRPC Fleet API)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from common.config import RunConfig
from common.registry import ALGORITHMS
from tools.cli import main as cli
from tools.inprocess import run_inprocess

FLOWER_PROCESSES = ("flower-superlink", "flower-supernode", "flower-superexec",
                    "flwr-serverapp", "flwr-clientapp", "flwr-simulation")
RUN_FILES = ("config.json", "partition.json", "metrics.jsonl", "model_init.pt",
             "model_final.pt", "summary.json")
ROUND_FIELDS = ("round", "test_accuracy", "test_loss", "train_loss", "clients_sampled",
                "clients_replied", "clients_rejected", "bytes_down", "bytes_up", "seconds")


def flower_pids() -> set[int]:
    """Flower processes started by this pytest process (they inherit its
    ``FLATFLOWER_TEST_PROCESS``, see conftest)."""
    tag = f"FLATFLOWER_TEST_PROCESS={os.environ['FLATFLOWER_TEST_PROCESS']}".encode()
    pids = set()
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            cmd = (entry / "cmdline").read_bytes().decode(errors="replace")
            if any(name in cmd for name in FLOWER_PROCESSES) and \
                    tag in (entry / "environ").read_bytes().split(b"\0"):
                pids.add(int(entry.name))
        except OSError:
            continue
    return pids


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def check_run_dir(run_dir: Path, rounds: int, clients: int, num_train: int) -> list[dict]:
    for name in RUN_FILES:
        assert (run_dir / name).is_file(), f"{name} missing from {run_dir}"
    config = json.loads((run_dir / "config.json").read_text())
    assert config["config"]["num-server-rounds"] == rounds and "versions" in config
    parts = json.loads((run_dir / "partition.json").read_text())["partitions"]
    assert len(parts) == clients
    all_idx = np.concatenate([np.array(p) for p in parts.values()])
    assert len(all_idx) == num_train == len(set(all_idx.tolist()))  # disjoint and complete
    rows = metrics(run_dir)
    assert [r["round"] for r in rows] == list(range(rounds + 1))
    for row in rows[1:]:
        assert all(field in row for field in ROUND_FIELDS)
        assert row["bytes_down"] > 0 and row["bytes_up"] > 0
    init, final = (torch.load(run_dir / f) for f in ("model_init.pt", "model_final.pt"))
    assert init.keys() == final.keys()
    return rows


DIGITS = {"dataset": "digits", "model": "mlp", "partition": "dirichlet", "local-epochs": 2}


def test_inprocess_real_apps_learn_and_fill_run_dir(tmp_path):
    run_dir, grid = run_inprocess({**DIGITS, "num-server-rounds": 3, "run-dir": str(tmp_path / "r"),
                                   "algorithm": "mofedsam", "fraction-evaluate": 1.0}, num_clients=3)
    rows = check_run_dir(run_dir, rounds=3, clients=3, num_train=1437)
    assert rows[-1]["test_accuracy"] > rows[0]["test_accuracy"] + 0.3
    assert 0 < rows[-1]["eval_accuracy"] <= 1  # federated evaluation ran on the clients
    # MoFedSAM sends the model and its global update: 2 model-sized records down, 1 up
    assert rows[1]["bytes_down"] == pytest.approx(2 * rows[1]["bytes_up"], rel=0.01)


# The Ray simulation and the real SuperLink/SuperNode deployment are exercised, with the
# stateful seed algorithms, in tests/test_seed_integration.py and tests/test_reliability.py.


# ---------------------------------------------------------------- CLI bad input (no processes)
@pytest.mark.parametrize("argv, message", [
    (["--algorithm", "fedbogus"], ", ".join(sorted(ALGORITHMS))),
    (["--set", "lr=-1"], "lr must be a finite number > 0"),
    (["--set", "sam.rho=-0.1"], "sam.rho must be a finite number >= 0"),
    (["--fraction", "0"], "fraction-train must be in (0, 1]"),
    (["--dataset", "imagenet"], "is not one of"),
    (["--set", "nonsense=1"], "unknown run-config key"),
    (["--set", "lr"], "key=value"),
    (["--clients", "0"], "--clients must be >= 1"),
    (["--partition", "pathological", "--clients", "2"], "classes"),
    (["--dataset", "cifar10", "--set", "download=false", "--set", "data-dir=\"{tmp}\""], "cifar10"),
])
def test_cli_rejects_bad_input_before_starting(tmp_path, capsys, argv, message):
    argv = [a.replace("{tmp}", str(tmp_path / "nodata")) for a in argv]
    before = flower_pids()
    code = cli(["local", *argv, "--run-dir", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("error: ") and message in err and "Traceback" not in err
    assert flower_pids() - before == set()


def test_cli_refuses_to_overwrite_a_run(tmp_path, capsys):
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "metrics.jsonl").write_text('{"round": 0}\n')
    assert cli(["simulate", "--engine", "inprocess", "--run-dir", str(tmp_path / "r")]) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert (tmp_path / "r" / "metrics.jsonl").read_text() == '{"round": 0}\n'


def test_cli_reports_a_failed_run_with_nonzero_exit(tmp_path, capsys):
    """Pass/fail comes from the `flwr ls` status, not from `flwr run`'s exit code."""
    from tools.progress import EXIT_FAILED, Progress, finish

    cfg = RunConfig.from_mapping({"run-dir": str(tmp_path)})
    code = finish(cfg, False, Progress(tmp_path, 3), "ServerApp failed with exception: boom")
    assert code == EXIT_FAILED
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("error: run failed: ServerApp failed with exception: boom")
    assert str(tmp_path) in err[0]


def test_cli_unwritable_run_dir_is_a_clear_error(tmp_path, capsys):
    (tmp_path / "file").write_text("not a directory")
    code = cli(["simulate", "--engine", "inprocess", "--run-dir", str(tmp_path / "file" / "run")])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and "Traceback" not in err
