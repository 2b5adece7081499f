"""A client's state commits only with a round the server accepted (client/state.py), and a
run directory carries its clients' state with it: a straggler's late round, a refused reply
and a retried round leave the state where a failed round leaves it, in every engine; resume
refuses missing or damaged client state, and a moved or copied run directory resumes from its
own files."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import torch

from flatflower.client.app import app as client_app
from flatflower.common.config import RunConfig
from flatflower.server.run import run_server
from tests.helpers import (DEPLOYED, FIRST_NODE, deployed, fast_config, measure_startup, metrics,
                           run_with_faults, same)
from flatflower.runtime.engines.inprocess import InProcessGrid, VectorizedGrid

STATEFUL = ["scaffold", "feddyn"]  # a control variate and a dual: both change every round


def run_grid(tmp_path, name, kind, faults, client=None, clients=3, **overrides):
    """A 3-round run on an in-process ``kind`` grid, ``faults``: partition -> inject-fault;
    (metrics rows, final model, seconds of its last round)."""
    cfg = RunConfig.from_mapping(fast_config(run_dir=str(tmp_path / name), num_partitions=clients,
                                             num_server_rounds=3, **overrides))
    grid = kind(client or client_app, clients, cfg.to_dict())
    for pid, fault in faults.items():
        grid.contexts[FIRST_NODE + pid].node_config["inject-fault"] = fault
    run_server(grid, cfg)
    rows = metrics(Path(cfg.run_dir))
    return rows, torch.load(Path(cfg.run_dir) / "model_final.pt"), rows[-1]["seconds"]


@pytest.mark.parametrize("kind", [InProcessGrid, VectorizedGrid], ids=["inprocess", "vectorized"])
@pytest.mark.parametrize("algorithm", STATEFUL)
def test_a_stragglers_late_round_leaves_its_state_as_a_failed_round_does(tmp_path, kind, algorithm):
    """Client 1 finishes round 2 (its state staged), but its reply leaves after the round's
    deadline: the final model is that of the run in which client 1 failed round 2."""
    rows, failed, slowest = run_grid(tmp_path, "failed", kind, {1: "raise@2-2"}, algorithm=algorithm)
    timeout = max(3.0, 10 * slowest)  # an honest round, measured here and now, x 10
    late, straggled, _ = run_grid(tmp_path, "late", kind, {1: f"late:{1.5 * timeout:g}@2-2"},
                                  algorithm=algorithm, round_timeout=timeout)
    for a in (rows, late):
        assert [r["failed_partitions"] for r in a[1:]] == [[], [1], []], a
    assert "no reply within round-timeout" in late[2]["failures"][0]["reason"]
    assert same(straggled, failed), "the straggler's late round changed the model"


@pytest.mark.parametrize("algorithm", STATEFUL)
def test_a_round_re_sent_after_a_late_reply_starts_from_the_same_state(tmp_path, algorithm):
    """too-few-replies = retry: client 1's first answer to round 2 is late, the re-sent round
    is answered in time. The result is the run without any failure (the late answer's state
    is not applied under the retry's)."""
    _, clean, slowest = run_grid(tmp_path, "clean", InProcessGrid, {}, algorithm=algorithm)
    timeout = max(3.0, 10 * slowest)
    first = {"late": True}

    def straggling_once(msg, context):
        reply = client_app(msg, context)
        config = msg.content.config_records.get("config", {})
        if context.node_config["partition-id"] == 1 and config.get("server-round") == 2 \
                and first.pop("late", False):
            time.sleep(1.5 * timeout)  # its state is staged; its reply misses the deadline
        return reply

    rows, retried, _ = run_grid(tmp_path, "retried", InProcessGrid, {}, client=straggling_once,
                                algorithm=algorithm, round_timeout=timeout, min_replies=3,
                                too_few_replies="retry")
    assert [r["retries"] for r in rows[1:]] == [0, 1, 0]
    assert same(retried, clean)


@pytest.mark.parametrize("algorithm", STATEFUL)
def test_a_refused_reply_and_a_skipped_round_leave_the_state_as_a_failed_round_does(tmp_path, algorithm):
    """A NaN reply is refused after the client staged its state; a round with too few accepted
    replies is skipped after all of them did: neither round counts for the clients' state."""
    kw = {"algorithm": algorithm, "num_server_rounds": 4}
    _, failed = run_with_faults(tmp_path, "failed", {0: "raise@2-2"}, **kw)
    rows, refused = run_with_faults(tmp_path, "refused", {0: "nan@2-2"}, **kw)
    assert [r["rejected_partitions"] for r in rows[1:]] == [[], [0], [], []]
    assert same(refused, failed)
    _, none = run_with_faults(tmp_path, "none", {p: "raise@2-2" for p in range(3)}, **kw)
    rows, skipped = run_with_faults(tmp_path, "skipped", {2: "raise@2-2"}, min_replies=3, **kw)
    assert [r["skipped"] for r in rows[1:]] == [0, 1, 0, 0]
    assert same(skipped, none)


@pytest.mark.integration
@pytest.mark.slow
def test_a_deployed_straggler_leaves_its_state_as_a_failed_round_does(tmp_path):
    """Over a real SuperLink and SuperNodes: SCAFFOLD, node 1's round-2 reply comes after the
    deadline; the final model is the in-process run's in which client 1 failed round 2."""
    timeout = max(10.0, 10 * measure_startup())
    config = {**DEPLOYED, "algorithm": "scaffold", "round-timeout": timeout}
    _, run_dir = deployed(tmp_path, "dep", config, 3,
                          node_configs={1: {"inject-fault": f"late:{timeout:g}@2-2"}})
    rows = metrics(run_dir)
    assert [r["failed_partitions"] for r in rows[1:]] == [[], [1], []]
    _, failed = run_with_faults(tmp_path, "inp", {1: "raise@2-2"}, clients=3,
                                **{k.replace("-", "_"): v for k, v in config.items()})
    assert same(torch.load(run_dir / "model_final.pt"), failed)


# ---------------------------------------------------------------- a run directory carries its clients' state
RUN = ["simulate", "--engine", "inprocess", "--algorithm", "scaffold", "--clients", "3",
       "--fraction", "0.67", "--dataset", "digits", "--set", "local-steps=3", "--set", "checkpoint-every=1"]


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory):
    """A 3-round SCAFFOLD run (to be resumed to 5 rounds) and the uninterrupted 5-round run."""
    from flatflower.tools.cli import main as cli

    root = tmp_path_factory.mktemp("runs")
    assert cli([*RUN, "--rounds", "5", "--run-dir", str(root / "full")]) == 0
    assert cli([*RUN, "--rounds", "3", "--run-dir", str(root / "a")]) == 0
    config = json.loads((root / "a" / "config.json").read_text())["config"]
    assert config["client-state-dir"] == "client-state"  # inside the run directory, relative
    return root


def resumed(cli, run_dir: Path) -> int:
    return cli(["simulate", "--engine", "inprocess", "--resume", str(run_dir), "--rounds", "5"])


def listing(path: Path) -> dict:
    return {str(p.relative_to(path)): p.stat().st_mtime_ns for p in sorted(path.rglob("*"))}


@pytest.mark.parametrize("how", ["move", "copy"])
def test_a_moved_or_copied_run_directory_resumes_from_its_own_files(stopped_run, tmp_path, how):
    from flatflower.tools.cli import main as cli

    src = tmp_path / "a"
    shutil.copytree(stopped_run / "a", src)
    before = listing(src)
    dst = tmp_path / "b"
    (shutil.move if how == "move" else shutil.copytree)(src, dst)
    assert resumed(cli, dst) == 0
    assert same(torch.load(dst / "model_final.pt"), torch.load(stopped_run / "full" / "model_final.pt"))
    if how == "move":
        assert not src.exists(), "the resume recreated the old run directory"
    else:
        assert listing(src) == before, "the resume of a copy wrote into the original"


@pytest.mark.parametrize("damage", ["all", "partition", "file", "foreign"])
def test_resume_refuses_missing_or_damaged_client_state_in_one_line(stopped_run, tmp_path, capsys, damage):
    from flatflower.tools.cli import main as cli

    run_dir = tmp_path / "a"
    shutil.copytree(stopped_run / "a", run_dir)
    state = run_dir / "client-state"
    files = sorted(state.rglob("round-*.pt"))
    if damage == "all":
        shutil.rmtree(state)
    elif damage == "partition":
        shutil.rmtree(files[0].parent)
    elif damage == "file":
        files[-1].write_bytes(b"")
    else:  # a state file of another algorithm
        torch.save({"dual": torch.load(files[-1])["control"]}, files[-1])
    capsys.readouterr()
    before = listing(run_dir)
    assert resumed(cli, run_dir) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: cannot resume: client "), err
    assert listing(run_dir) == before, "a refused resume changed the run directory"
