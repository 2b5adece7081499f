"""The ``flatflower`` command: bad input before anything starts, existing and unwritable run
directories, a failed run (tests/test_bad_input.py has the full table of bad input)."""

from __future__ import annotations


import pytest

from common.config import RunConfig
from common.registry import ALGORITHMS
from tools.cli import main as cli
from tests.helpers import flower_pids


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
