"""Client failures, bad updates, checkpoints and exact resume.

In-process runs use the real ServerApp and ClientApp; faults come from the ClientApp's
``inject-fault`` node setting (client/faults.py) or a wrapper around the real ClientApp.
The process-level tests kill real Flower processes on 127.0.0.1."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch
from flwr.app import Error, Message, MessageType
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode

from flatflower.client.app import app as client_app
from flatflower.client.app import query as client_query
from flatflower.client.app import train as client_train
from flatflower.client.faults import Fault
from flatflower.client.state import MissingState, StateMirror
from flatflower.common import codec
from flatflower.common import protocol as P
from flatflower.common.config import RunConfig
from flatflower.tools.cli import main as cli
from flatflower.runtime.engines.federation import _cmdline
from flatflower.runtime.engines.inprocess import InProcessGrid
from flatflower.server.rundir import RunDirError, load_checkpoint
from flatflower.server.run import RunFailed, run_server
from flatflower.strategies.participation import NoNodesError
from tests.helpers import (DEPLOYED, RAY_RETRY, ROOT, deployed, fast_config, flower_pids, make_strategy, metrics,
                           round_deadline, run_with_faults, same, set_flags,
                           startup_seconds)


# ---------------------------------------------------------------- client failures
def test_a_hung_client_is_lost_at_the_round_deadline_and_the_round_goes_on(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="flwr.flatflower.server")
    crashed_rows, crashed = run_with_faults(tmp_path, "crashed", {1: "raise"})
    # a deadline the honest clients meet on this machine now: 5x their slowest round here
    timeout = float(max(3, math.ceil(5 * max(r["seconds"] for r in crashed_rows[1:]))))
    rows, hung = run_with_faults(tmp_path, "hung", {1: "hang"}, round_timeout=timeout)
    for row in rows[1:]:
        assert row["clients_failed"] == 1 and row["failed_partitions"] == [1], rows
        assert row["seconds"] < 2 * timeout + 5  # the round ends at its deadline
    assert (f"client 1 (node 1001) failed: no reply within round-timeout={timeout:g}s (client lost)"
            in caplog.text)
    assert same(hung, crashed), "the lost client must simply be left out of the round"


def test_too_few_replies_skips_the_round_and_keeps_the_model(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="flwr.flatflower.server")
    rows, final = run_with_faults(tmp_path, "r", {2: "raise@2"}, min_replies=3)
    init = torch.load(tmp_path / "r" / "model_init.pt")
    assert [r["skipped"] for r in rows[1:]] == [0, 1] and rows[2]["clients_failed"] == 1
    after_round_1 = torch.load(tmp_path / "r" / "checkpoint.pt")["strategy"]["model"]
    assert same(final, after_round_1) and not same(final, init)
    assert ("round 2 skipped: 2 accepted client updates < 3 (min-replies=3, aggregator mean "
            "needs 1)") in caplog.text


def test_a_run_whose_every_round_was_skipped_fails_with_its_reason(tmp_path):
    with pytest.raises(RunFailed, match=r"every round \(1-2\) was skipped"):
        run_with_faults(tmp_path, "r", {1: "raise", 2: "raise"}, min_replies=2)
    rows = metrics(tmp_path / "r")
    assert all(r["skipped"] == 1 and r["clients_failed"] == 2 for r in rows[1:])
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["status"] == "failed" and "every round (1-2) was skipped" in summary["error"]
    assert not (tmp_path / "r" / "model_final.pt").exists()


def flaky_client(fail_once: dict):
    """The real ClientApp, except that partition p fails the first time it gets round r."""
    def app(msg, context):
        rnd = msg.content["config"].get("server-round", 0)  # 0: the handshake
        key = (context.node_config["partition-id"], int(rnd))
        if fail_once.pop(key, False):
            raise ConnectionError(f"transient failure of client {key[0]} in round {key[1]}")
        return client_app(msg, context)
    return app


def test_retry_resends_to_the_clients_that_failed_and_gives_the_clean_result(tmp_path):
    _, clean = run_with_faults(tmp_path, "clean")
    rows, retried = run_with_faults(tmp_path, "retried", client=flaky_client({(1, 1): True, (2, 2): True}),
                        min_replies=3, too_few_replies="retry")
    assert [r["retries"] for r in rows[1:]] == [1, 1]
    assert [r["failed_partitions"] for r in rows[1:]] == [[1], [2]]
    assert same(clean, retried), "a retried round must equal a round without the failure"
    rows, skipped = run_with_faults(tmp_path, "skipped", client=flaky_client({(1, 1): True}), min_replies=3)
    assert [r["skipped"] for r in rows[1:]] == [1, 0]


def test_flowers_start_loop_retries_as_the_server_app_does(tmp_path):
    """One round driver: under Flower's own ``strategy.start`` a failed client is re-sent its
    message too, and the run ends with the model of a run without the failure."""
    _, clean = run_with_faults(tmp_path, "clean", algorithm="fedavg")
    cfg = RunConfig.from_mapping(fast_config(algorithm="fedavg", num_partitions=3, min_replies=3,
                                             too_few_replies="retry", run_dir=str(tmp_path / "start")))
    strategy = make_strategy(cfg)
    grid = InProcessGrid(flaky_client({(1, 1): True, (2, 2): True}), 3, cfg.to_dict())
    result = strategy.start(grid=grid, initial_arrays=codec.to_record(strategy.model),
                            num_rounds=cfg.num_server_rounds)
    assert sorted(result.train_metrics_clientapp) == list(range(1, cfg.num_server_rounds + 1))
    assert all(m["retries"] == 1 for m in result.train_metrics_clientapp.values())
    assert same(clean, codec.from_record(result.arrays))


def test_failed_client_keeps_its_state_uncorrupted(tmp_path):
    """A client that raises after round 1 keeps the dual of its last successful round."""
    cfg = RunConfig.from_mapping(fast_config(algorithm="feddyn", run_dir=str(tmp_path / "r"),
                                             num_server_rounds=3))
    grid = InProcessGrid(client_app, 2, cfg.to_dict())
    grid.contexts[1001].node_config["inject-fault"] = "raise@2"
    run_server(grid, cfg)
    meta = grid.contexts[1001].state.metric_records["client-meta"]
    assert (int(meta["rounds-trained"]), int(meta["last-round"])) == (1, 1)


# ---------------------------------------------------------------- bad updates
@pytest.mark.parametrize("fault", ["nan", "scale:50"])
def test_bad_update_is_rejected_and_the_model_is_that_of_a_run_without_it(tmp_path, fault, caplog):
    caplog.set_level(logging.WARNING, logger="flwr.flatflower.server")
    kw = {"outlier_norm_factor": 5.0} if fault.startswith("scale") else {}
    rows, bad = run_with_faults(tmp_path, "bad", {0: fault}, clients=4, **kw)
    _, without = run_with_faults(tmp_path, "without", {0: "raise"}, clients=4, **kw)
    assert all(r["clients_rejected"] == 1 and r["rejected_partitions"] == [0] for r in rows[1:])
    assert all(torch.isfinite(v).all() for v in bad.values())
    assert same(bad, without)
    assert "train reply of client 0 (node 1000) refused" in caplog.text


def test_outlier_check_keeps_ordinary_updates(tmp_path):
    rows, _ = run_with_faults(tmp_path, "r", clients=4, outlier_norm_factor=5.0)
    assert all(r["clients_rejected"] == 0 for r in rows[1:])


def test_fault_specs_are_validated():
    assert Fault.parse("scale:100@3") == Fault("scale", 3, 100.0)
    assert Fault.parse("") is None
    for bad in ("explode", "scale", "nan:2", "raise@0", "scale:x"):
        with pytest.raises(ValueError, match="inject-fault"):
            Fault.parse(bad)


def test_fault_specs_mute_the_handshake_for_ever_or_for_seconds():
    assert Fault.parse("mute") == Fault("mute", 1, 24 * 3600.0)
    assert Fault.parse("mute:2.5") == Fault("mute", 1, 2.5)
    for bad in ("mute:-1", "mute:nan", "mute:x"):
        with pytest.raises(ValueError, match="inject-fault"):
            Fault.parse(bad)


# ---------------------------------------------------------------- a node that never answers its handshake
class CountingGrid(InProcessGrid):
    """The in-process grid, counting the handshake queries each node is sent."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.queries: dict[int, list[str]] = {}  # node id -> message ids of its queries

    def push_messages(self, messages):
        messages = list(messages)
        ids = list(super().push_messages(messages))
        for msg, message_id in zip(messages, ids):
            if msg.metadata.message_type == MessageType.QUERY:
                self.queries.setdefault(msg.metadata.dst_node_id, []).append(message_id)
        return ids


def _handshake_run(tmp_path, name, grid_class=CountingGrid, client=None, faults=None,
                   offline=(), **overrides):
    """4 rounds of 3 in-process clients, all sampled; a node's handshake is waited for at most
    the measured start-up of a Python process with torch (far longer than an in-process
    answer takes)."""
    cfg = RunConfig.from_mapping(fast_config(
        run_dir=str(tmp_path / name), algorithm="fedavg", num_partitions=3, num_server_rounds=4,
        node_wait_timeout=round(startup_seconds(), 1), **overrides))
    grid = grid_class(client or client_app, 3, cfg.to_dict())
    grid.offline = {1000 + p for p in offline}
    for pid, fault in (faults or {}).items():
        grid.contexts[1000 + pid].node_config["inject-fault"] = fault
    run_server(grid, cfg)
    return metrics(Path(cfg.run_dir)), torch.load(Path(cfg.run_dir) / "model_final.pt"), grid


def _handshake_refusals(rows: list[dict]) -> list[tuple[int, dict]]:
    return [(r["round"], e) for r in rows[1:] for e in r["rejections"] if e["stage"] == "handshake"]


@pytest.mark.slow
def test_a_node_that_never_answers_its_handshake_is_reported_once_and_waited_for_once(tmp_path, caplog):
    """Node 2 never answers its query: round 1 waits node-wait-timeout for it once, records it
    (with its node id) under `rejections` and the log, and no later round (train or evaluate)
    asks it again and waits; the run is that of a federation without it."""
    caplog.set_level(logging.WARNING)
    rows, final, grid = _handshake_run(tmp_path, "mute", faults={2: "mute"}, fraction_evaluate=1.0)
    refusals = _handshake_refusals(rows)
    assert len(refusals) == 1 and refusals[0][0] == 1, refusals
    assert refusals[0][1]["node"] == 1002 and "no answer to the partition handshake" in refusals[0][1]["reason"]
    assert "node 1002" in caplog.text and "no answer to the partition handshake" in caplog.text
    assert len(grid.queries[1002]) == 1  # one query, one wait: not one per round
    assert all(r["sampled_partitions"] == [0, 1] and r["skipped"] == 0 for r in rows[1:]), rows
    _, without, _ = _handshake_run(tmp_path, "offline", offline=[2], fraction_evaluate=1.0)
    assert same(final, without)


class ReleaseAtRound(CountingGrid):
    """Holds node 2's handshake answer until round 2's train messages go out, then lets it
    land (the server takes it at its next look, round 3)."""

    release = threading.Event()

    def push_messages(self, messages):
        messages = list(messages)
        if any(m.metadata.message_type == MessageType.TRAIN for m in messages) \
                and int(messages[0].content[P.CONFIG]["server-round"]) == 2:
            self.release.set()
            with self._arrived:
                assert self._arrived.wait_for(lambda: self.queries[1002][0] in self._pending, 60)
        return super().push_messages(messages)


def test_a_node_that_answers_its_handshake_late_joins_without_holding_up_a_round(tmp_path):
    late = ClientApp()
    late.train()(client_train)

    @late.query()
    def query(msg, context):
        if context.node_config["partition-id"] == 2:
            ReleaseAtRound.release.wait()
        return client_query(msg, context)

    ReleaseAtRound.release.clear()
    rows, _, grid = _handshake_run(tmp_path, "late", ReleaseAtRound, client=late)
    assert [r["sampled_partitions"] for r in rows[1:]] == [[0, 1], [0, 1], [0, 1, 2], [0, 1, 2]]
    assert len(_handshake_refusals(rows)) == 1 and len(grid.queries[1002]) == 1
    assert all(r["skipped"] == 0 for r in rows[1:])


# ---------------------------------------------------------------- checkpoints and resume
def test_checkpoint_holds_every_piece_of_server_state(tmp_path):
    run_with_faults(tmp_path, "r", algorithm="fedtoga", num_server_rounds=3, checkpoint_every=2)
    ckpt = load_checkpoint(tmp_path / "r")
    assert ckpt["round"] == 3  # the last round is always checkpointed
    assert set(ckpt["strategy"]["records"]) == {"dual", "global_update"}
    final = torch.load(tmp_path / "r" / "model_final.pt")
    assert same(ckpt["strategy"]["model"], final)


def test_missing_or_corrupt_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(RunDirError, match="no checkpoint"):
        load_checkpoint(tmp_path)
    (tmp_path / "checkpoint.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(RunDirError, match="corrupt or unreadable"):
        load_checkpoint(tmp_path)


QUICK = ["simulate", "--engine", "inprocess", "--clients", "3", "--dataset", "synthetic", "--model",
         "logreg", "--partition", "iid", "--rounds", "2", "--set", "local-steps=1"]


def one_error_line(capfd) -> str:
    err = [line for line in capfd.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def test_a_full_disk_is_one_error_line_and_the_last_checkpoint_resumes(tmp_path, capfd, monkeypatch):
    """ENOSPC (writes into /dev/full) while saving the final model: exit 1, one line; the
    checkpoint of the last round is intact, and the resume finishes the run. (The final
    model's temporary file is /dev/full: a link planted there would never be written through.)"""
    from flatflower.server import files

    run_dir = tmp_path / "run"
    real_open = files.open_file

    def full_disk(path, mode="r", **kwargs):
        if Path(path) == run_dir / "model_final.pt.tmp":
            return open("/dev/full", "wb")
        return real_open(path, mode, **kwargs)

    monkeypatch.setattr(files, "open_file", full_disk)
    assert cli([*QUICK, "--run-dir", str(run_dir)]) == 1
    monkeypatch.undo()
    line = one_error_line(capfd)
    assert f"cannot write {run_dir / 'model_final.pt'}: No space left on device" in line
    assert not (run_dir / "model_final.pt.tmp").exists()
    assert load_checkpoint(run_dir)["round"] == 2
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "failed"
    assert cli(["simulate", "--engine", "inprocess", "--resume", str(run_dir)]) == 0
    assert (run_dir / "model_final.pt").is_file()


def test_an_unwritable_file_is_one_error_line_naming_it():
    from flatflower.server.rundir import RunWriteError, write_json

    with pytest.raises(RunWriteError, match=r"^cannot write /proc/flatflower/x.json: "):
        write_json(Path("/proc/flatflower/x.json"), {})  # /proc refuses new files, even to root


def test_a_run_whose_every_round_fails_exits_1_with_its_reason(tmp_path, capfd):
    """lr=1e38: every client's loss overflows after its first step, every round is skipped."""
    assert cli([*QUICK, "--set", "lr=1e38", "--set", "local-steps=3", "--run-dir", str(tmp_path / "r")]) == 1
    assert "every round (1-2) was skipped" in one_error_line(capfd)
    assert not (tmp_path / "r" / "model_final.pt").exists()


def test_a_run_directory_in_use_is_refused_by_the_server(tmp_path):
    from flatflower.server.rundir import hold_lock

    cfg = RunConfig.from_mapping(fast_config(run_dir=str(tmp_path / "r")))
    (tmp_path / "r").mkdir()
    with hold_lock(tmp_path / "r" / ".lock", "held by the test"):
        with pytest.raises(RunDirError, match="is in use by another flatflower run or resume"):
            run_server(InProcessGrid(client_app, 2, cfg.to_dict()), cfg)
    assert not (tmp_path / "r" / "metrics.jsonl").exists()


def test_state_mirror_loads_the_accepted_round_and_keeps_what_a_resume_needs(tmp_path):
    """Round r staged with accepted round a: r and a stay, rounds after a (never accepted, or
    left by a run resumed from an earlier checkpoint) go, and of the accepted rounds those a
    resume from the last checkpoint may need (newer than r - 2, and the newest before)."""
    mirror = StateMirror(tmp_path, 3, checkpoint_every=1)

    def state(rnd):
        return {"dual": {"w": torch.full((2,), float(rnd))}}

    for rnd, accepted in ((1, 0), (4, 1), (5, 4), (6, 5)):
        mirror.stage(rnd, accepted, state(rnd))
    assert mirror.rounds() == [4, 5, 6]  # 1 is older than 4 <= 6 - 2
    mirror.stage(7, 6, state(7))  # a straggler: round 7 is not accepted
    mirror.stage(9, 6, state(9))
    assert mirror.rounds() == [6, 9]
    assert float(mirror.load(6)["dual"]["w"][0]) == 6.0
    assert mirror.load(0) == {}
    with pytest.raises(MissingState, match="round-000007.pt is missing"):
        mirror.load(7)
    mirror.stage(7, 6, state(70))  # resumed from round 6's checkpoint: 9 is the old run's
    assert mirror.rounds() == [6, 7]
    (mirror.dir / "round-000006.pt").write_bytes(b"")
    with pytest.raises(MissingState, match="damaged or unreadable"):
        mirror.load(6)


SIM = ["--algorithm", "fedtoga", "--clients", "6", "--rounds", "12", "--fraction", "0.5",
       "--dataset", "digits", "--set", "local-epochs=3"]


def _checkpointed(run_dir: Path, round_: int) -> bool:
    """The run directory holds a readable checkpoint of round ``round_`` or later."""
    try:
        return (run_dir / "checkpoint.pt").exists() and load_checkpoint(run_dir)["round"] >= round_
    except Exception:  # noqa: BLE001 - not there yet
        return False


def _kill_when(proc: subprocess.Popen, run_dir: Path, round_: int, sig=signal.SIGKILL,
               within: float = 300, before=lambda: None, checkpointed: bool = False) -> None:
    """Send ``sig`` to ``proc`` as soon as metrics.jsonl has round ``round_``'s row (with
    ``checkpointed``: and its checkpoint, which the server writes just after the row) (fails if
    that takes over ``within`` seconds; ``before()`` runs just before) and wait for it to end."""
    deadline = time.monotonic() + within
    path = run_dir / "metrics.jsonl"
    while (f'"round": {round_}' not in (path.read_text() if path.exists() else "")
           or (checkpointed and not _checkpointed(run_dir, round_))):
        assert proc.poll() is None, "the run ended before it could be killed"
        assert time.monotonic() < deadline
        time.sleep(0.01)
    before()
    proc.send_signal(sig)
    proc.wait(120)


def _cli_process(args: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "flatflower.tools.cli", *args], cwd=ROOT,
                            stdout=log.open("w"), stderr=subprocess.STDOUT, env=os.environ.copy())


class LeavingGrid(InProcessGrid):
    """Every node leaves as round 3's train messages go out: each gets the error reply the
    SuperLink gives for a node that is gone, and ``get_node_ids`` finds none ``looks`` times."""

    def __init__(self, *args, looks: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.looks, self.gone = looks, False

    def get_node_ids(self):
        if self.gone and self.looks > 0:
            self.looks -= 1
            return []
        return super().get_node_ids()

    def push_messages(self, messages):
        messages = list(messages)
        if self.gone or not any(m.metadata.message_type == MessageType.TRAIN
                                and int(m.content[P.CONFIG]["server-round"]) == 3 for m in messages):
            return super().push_messages(messages)
        self.gone = True
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = uuid.uuid4().hex
            self._land({msg.metadata.message_id: self._answer(msg, msg, lambda: Message(
                Error(ErrorCode.NODE_UNAVAILABLE, "node unavailable"), reply_to=msg))})
        return [m.metadata.message_id for m in messages]


@pytest.mark.parametrize("back", [False, True], ids=["for-good", "and-back"])
def test_a_round_that_every_node_left_is_never_recorded(tmp_path, back):
    """All nodes leave during round 3 (a federation shut down under its ServerApp). That round
    is not recorded as skipped: when they come back it runs again, else the run fails after
    node-wait-timeout with round 2's checkpoint; either way the model is the uninterrupted one."""
    config = fast_config(algorithm="fedsam", num_partitions=2, num_server_rounds=4,
                         node_wait_timeout=round(startup_seconds(), 1))
    full = RunConfig.from_mapping({**config, "run-dir": str(tmp_path / "full")})
    run_server(InProcessGrid(client_app, 2, full.to_dict()), full)
    cfg = RunConfig.from_mapping({**config, "run-dir": str(tmp_path / "cut")})
    grid = LeavingGrid(client_app, 2, cfg.to_dict(), looks=1 if back else math.inf)
    if back:
        run_server(grid, cfg)
    else:
        with pytest.raises(NoNodesError, match="node-wait-timeout"):
            run_server(grid, cfg)
        assert load_checkpoint(Path(cfg.run_dir))["round"] == 2
        assert [r["round"] for r in metrics(Path(cfg.run_dir))] == [0, 1, 2]
        cfg = cfg.replace(resume=True)
        run_server(InProcessGrid(client_app, 2, cfg.to_dict()), cfg)
    assert all(r["skipped"] == 0 for r in metrics(Path(cfg.run_dir))[1:])
    assert same(torch.load(Path(cfg.run_dir) / "model_final.pt"),
                torch.load(Path(full.run_dir) / "model_final.pt"))


@pytest.mark.slow
def test_killed_inprocess_run_resumes_to_the_uninterrupted_model(tmp_path):
    assert cli(["simulate", "--engine", "inprocess", *SIM, "--run-dir", str(tmp_path / "full")]) == 0
    cut = tmp_path / "cut"
    proc = _cli_process(["simulate", "--engine", "inprocess", *SIM, "--run-dir", str(cut)],
                        tmp_path / "cut.log")
    _kill_when(proc, cut, 4)
    assert not (cut / "model_final.pt").exists()
    assert cli(["simulate", "--engine", "inprocess", "--resume", str(cut)]) == 0
    full, resumed = (torch.load(d / "model_final.pt") for d in (tmp_path / "full", cut))
    assert same(full, resumed)
    assert [r["round"] for r in metrics(cut)] == list(range(13))
    assert [r["test_loss"] for r in metrics(cut)] == [r["test_loss"] for r in metrics(tmp_path / "full")]


def test_a_run_of_code_before_a_new_key_resumes_as_that_keys_default(tmp_path):
    """A checkpoint written before a run-config key existed (here ``batching``) lacks it; the
    code that wrote it ran as the key's default, so the run resumes; a checkpoint that holds
    another value is still refused."""
    run = tmp_path / "run"
    base = ["simulate", "--engine", "inprocess", "--algorithm", "fedavg", "--clients", "3",
            "--set", "local-steps=2", "--no-tensorboard"]
    assert cli([*base, "--rounds", "2", "--run-dir", str(run)]) == 0

    def rewrite(edit) -> None:
        ckpt = torch.load(run / "checkpoint.pt", weights_only=True)
        edit(ckpt["config"])
        torch.save(ckpt, run / "checkpoint.pt")

    rewrite(lambda config: config.update(batching="on"))
    with pytest.raises(RunDirError, match="batching: 'on' -> 'auto'"):
        _check_resumable_from_files(run)
    rewrite(lambda config: config.pop("batching"))
    config = json.loads((run / "config.json").read_text())
    config["config"].pop("batching")
    (run / "config.json").write_text(json.dumps(config))
    (run / "manifest.json").unlink()  # that code kept no manifest either (else: refused as edited)
    assert cli(["simulate", "--engine", "inprocess", "--resume", str(run), "--rounds", "3", "--trust-run-dir"]) == 0
    assert [r["round"] for r in metrics(run)] == [0, 1, 2, 3]


def _check_resumable_from_files(run: Path) -> None:
    from flatflower.server.rundir import check_resumable

    config = json.loads((run / "config.json").read_text())["config"]
    check_resumable(RunConfig.from_mapping(config), load_checkpoint(run))


@pytest.mark.integration
@pytest.mark.ray
@pytest.mark.slow
def test_ray_simulation_stopped_mid_run_resumes_to_the_uninterrupted_model(tmp_path):
    # Rounds long enough (and enough of them) that the stop lands well before the last one.
    # A round whose Ray actors fail (ActorUnavailableError, seen at load 10) is re-sent to its
    # clients, as a SuperNode's lost message is: the same model as an uninterrupted run.
    args = ["--algorithm", "fedgmt-v2", "--clients", "4", "--rounds", "8", "--fraction", "0.5",
            "--dataset", "digits", "--set", "local-epochs=10", *set_flags(RAY_RETRY)]
    before = flower_pids()
    cut = tmp_path / "cut"
    proc = _cli_process(["simulate", "--engine", "ray", *args, "--run-dir", str(cut)], tmp_path / "cut.log")
    _kill_when(proc, cut, 2, signal.SIGTERM)
    assert flower_pids() - before == set(), "a stopped run left Flower processes behind"
    assert not (cut / "model_final.pt").exists()
    assert cli(["simulate", "--resume", str(cut)]) == 0  # on Ray again: the engine config.json names
    assert json.loads((cut / "config.json").read_text())["engine"] == "ray"
    assert cli(["simulate", "--engine", "inprocess", *args, "--run-dir", str(tmp_path / "full")]) == 0
    full, resumed = (torch.load(d / "model_final.pt") for d in (tmp_path / "full", cut))
    assert same(full, resumed)
    assert flower_pids() - before == set()


def _descendants_alive(tag: str) -> set[int]:
    """Live processes (not zombies) other than this one whose environment holds ``tag``."""
    found = set()
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if (int(entry.name) != os.getpid() and tag.encode() in (entry / "environ").read_bytes().split(b"\0")
                    and (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"):
                found.add(int(entry.name))
        except OSError:
            continue
    return found


def test_a_federations_processes_are_found_by_its_mark_or_its_session(tmp_path):
    """runtime/engines/federation.py ``_marked``, which the reaper and ``stop`` kill: a process
    holding the federation's mark, and one in its session whose environment lacks it (as a Ray
    agent's, renamed over its environment's memory), also once the marked one is gone (the
    sessions a reaper remembers); never a process of another session, nor this one's."""
    from flatflower.runtime.engines.federation import MARK, _marked

    mark = f"test-{os.getpid()}-{time.monotonic_ns()}"
    child_pid = tmp_path / "child.pid"
    # a session leader with the mark, whose child runs with an environment without it
    leader = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys, time; "
         f"c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], env={{}}); "
         f"open({str(child_pid)!r}, 'w').write(str(c.pid)); time.sleep(60)"],
        env={**os.environ, MARK: mark}, start_new_session=True)
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    neighbour = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # this session
    try:
        deadline = time.monotonic() + 10 * startup_seconds()
        while not (child_pid.exists() and child_pid.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        child = int(child_pid.read_text())
        assert MARK.encode() not in Path(f"/proc/{child}/environ").read_bytes()
        sessions: set[int] = set()
        assert sorted(_marked(mark, sessions)) == sorted([leader.pid, child]) and sessions == {leader.pid}
        # a spared session (the reaper's owner's: a user's shell, a CI job) is never swept, and
        # never remembered: only what holds the mark is taken there
        spared: set[int] = set()
        assert _marked(mark, spared, frozenset({leader.pid})) == [leader.pid] and spared == set()
        leader.kill()
        leader.wait()
        assert _marked(mark) == [] and _marked(mark, sessions) == [child]  # remembered: still found
        assert stranger.pid not in _marked(mark, sessions) and neighbour.pid not in _marked(mark, sessions)
    finally:
        for proc in (leader, stranger, neighbour):
            proc.kill()
            proc.wait()
        if child_pid.exists() and child_pid.read_text():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(child_pid.read_text()), signal.SIGKILL)


@pytest.mark.integration
@pytest.mark.ray
@pytest.mark.slow
def test_a_killed_ray_simulation_takes_its_processes_with_it(tmp_path):
    """`kill -9` of `flatflower simulate` (Ray) mid-run: the SuperLink, the ServerApp and every
    Ray process (GCS, raylet, agents, actors) end with it, not a minute later or never."""
    tag = f"FLATFLOWER_KILL_TEST={os.getpid()}-{time.monotonic_ns()}"
    run = tmp_path / "r"
    env = {**os.environ, tag.split("=")[0]: tag.split("=")[1]}
    proc = subprocess.Popen([sys.executable, "-m", "flatflower.tools.cli", "simulate", "--engine", "ray", "--algorithm", "fedavg",
                             "--clients", "4", "--rounds", "20", "--dataset", "digits", "--set",
                             "local-epochs=3", "--run-dir", str(run)], cwd=ROOT, env=env,
                            stdout=(tmp_path / "out.log").open("w"), stderr=subprocess.STDOUT)
    seen: list[bytes] = []
    try:
        _kill_when(proc, run, 1, signal.SIGKILL, within=20 * round_deadline(),
                   before=lambda: seen.extend(_cmdline(p) for p in _descendants_alive(tag)))
        assert any(b"raylet" in cmd for cmd in seen) and any(b"flwr-simulation" in cmd for cmd in seen)
        deadline = time.monotonic() + 10 * startup_seconds()  # a bound: they go within about a second

        def left() -> set[int]:
            # Ray's agents too: under load they were seen to outlive the run when the reaper
            # looked for the mark alone (their renaming writes over their environment)
            return _descendants_alive(tag)

        while left() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not left(), [_cmdline(p)[:80] for p in left()]
    finally:
        for pid in _descendants_alive(tag):
            os.kill(pid, signal.SIGKILL)


# ---------------------------------------------------------------- real processes on loopback


@pytest.mark.integration
@pytest.mark.slow
def test_deployment_goes_on_without_a_killed_supernode_and_a_nan_client(tmp_path):
    """3 SuperNodes: client 1 returns NaN every round, SuperNode 2 is killed after round 1.
    The run completes; the log names both; the model is that of an in-process run in which
    those clients fail (NaN rejected, the lost client left out)."""
    before = flower_pids()
    config = {**DEPLOYED, "algorithm": "fedsam", "num-server-rounds": 3}
    cfg, run_dir = deployed(tmp_path, "dep", config, 3, kill_after=1, kill="supernode-2",
                            node_configs={1: {"inject-fault": "nan"}})
    assert flower_pids() - before == set(), "Flower processes left behind"
    rows = metrics(run_dir)
    assert all(r["rejected_partitions"] == [1] for r in rows[1:]), rows
    lost = [r["round"] for r in rows[1:] if r["failed_partitions"] == [2]]
    assert lost, ("the killed client was never lost at a deadline", rows)
    first = lost[0]  # the round after the kill (or the one it interrupted)
    assert all(not r["failed_partitions"] for r in rows[1:first]), rows
    # from then on it is lost at the deadline, or (once the SuperLink marks it offline) not sampled
    assert all(r["failed_partitions"] == [2] or 2 not in r["sampled_partitions"] for r in rows[first:]), rows
    log = (run_dir / "logs" / "run.log").read_text()
    # lost at the round deadline, or earlier when the SuperLink answers for the silent node
    assert f"round {first}: client 2 (node" in log
    assert "(client lost)" in log or "Node Unavailable" in log
    assert "train reply of client 1" in log and "refused" in log and "NaN" in log
    _, inproc = run_with_faults(tmp_path, "inp", {1: "nan", 2: f"raise@{first}"},
                                **{k.replace("-", "_"): v for k, v in config.items()})
    assert same(torch.load(run_dir / "model_final.pt"), inproc)  # as if the NaN client were absent
    assert all(r["test_accuracy"] > rows[0]["test_accuracy"] + 0.1 for r in rows[1:])  # it learns


@pytest.mark.integration
@pytest.mark.parametrize("sig, after", [(signal.SIGINT, 1), (signal.SIGTERM, 2)], ids=["SIGINT", "SIGTERM"])
@pytest.mark.slow
def test_an_interrupted_local_run_resumes_to_the_uninterrupted_model(tmp_path, sig, after):
    """Ctrl-C or `kill` of `flatflower local` once round `after`'s row and checkpoint are
    written (the next round starting; a kill between the row and the first checkpoint leaves
    nothing to resume): the ServerApp is stopped before the SuperNodes, so no round runs
    against none of them; `--resume` trains every round and ends with the model of an
    uninterrupted run."""
    args = ["--algorithm", "fedsam", "--clients", "2", "--rounds", "4", "--dataset", "digits",
            "--set", "local-epochs=1"]
    before = flower_pids()
    cut = tmp_path / "cut"
    proc = _cli_process(["local", *args, "--run-dir", str(cut)], tmp_path / "cut.log")
    _kill_when(proc, cut, after, sig, within=(after + 1) * round_deadline(), checkpointed=True)
    out = (tmp_path / "cut.log").read_text()
    assert proc.returncode == 130 and "interrupted; all Flower processes were stopped" in out, out
    assert flower_pids() - before == set(), "Flower processes left behind"
    assert not (cut / "model_final.pt").exists()
    assert load_checkpoint(cut)["round"] <= after
    assert cli(["local", "--resume", str(cut)]) == 0
    assert cli(["simulate", "--engine", "inprocess", *args, "--run-dir", str(tmp_path / "full")]) == 0
    full, resumed = (torch.load(d / "model_final.pt") for d in (tmp_path / "full", cut))
    assert same(full, resumed)
    rows = metrics(cut)
    assert [r["round"] for r in rows] == list(range(5)) and all(r["skipped"] == 0 for r in rows[1:]), rows
    assert flower_pids() - before == set()


@pytest.mark.integration
@pytest.mark.slow
def test_a_real_node_that_never_answers_its_handshake_costs_one_wait_and_is_recorded(tmp_path):
    """3 SuperNodes; SuperNode 2's ClientApp never answers its partition handshake. Round 1
    waits node-wait-timeout for it once and records it with its node id; later rounds do not
    ask it again; the run is that of the 2 other clients."""
    config = {**DEPLOYED, "algorithm": "fedavg", "num-server-rounds": 3,
              "node-wait-timeout": round(max(10.0, 5 * startup_seconds()), 1)}
    _, run_dir = deployed(tmp_path, "mute", config, 3, node_configs={2: {"inject-fault": "mute"}})
    rows = metrics(run_dir)
    refusals = _handshake_refusals(rows)
    assert len(refusals) == 1 and refusals[0][0] == 1, refusals
    node = refusals[0][1]["node"]
    assert "no answer to the partition handshake" in refusals[0][1]["reason"]
    assert f"(node {node}) refused: no answer" in (run_dir / "logs" / "run.log").read_text()
    assert all(r["sampled_partitions"] == [0, 1] and r["skipped"] == 0 for r in rows[1:]), rows
    alone = RunConfig.from_mapping({**config, "num-partitions": 3, "run-dir": str(tmp_path / "inp")})
    grid = InProcessGrid(client_app, 3, alone.to_dict())
    grid.offline = {1002}  # the in-process federation without partition 2's node
    run_server(grid, alone)
    assert same(torch.load(run_dir / "model_final.pt"), torch.load(tmp_path / "inp" / "model_final.pt"))


@pytest.mark.integration
@pytest.mark.slow
def test_a_killed_superlink_is_one_error_line_and_the_checkpoint_resumes(tmp_path):
    """SIGKILL of the SuperLink mid-run: `flatflower local` stops everything it started, exits 1
    with one `error:` line (no traceback), and the run resumes from its last checkpoint."""
    from flatflower.runtime.engines.federation import _children

    before = flower_pids()
    run_dir = tmp_path / "r"
    out, err = tmp_path / "out.log", tmp_path / "err.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "flatflower.tools.cli", "local", "--clients", "2", "--rounds", "4", "--dataset",
         "digits", "--set", "local-epochs=1", "--run-dir", str(run_dir)],
        cwd=ROOT, stdout=out.open("w"), stderr=err.open("w"), env=os.environ.copy())
    deadline = time.monotonic() + 300
    while '"round": 1' not in ((run_dir / "metrics.jsonl").read_text()
                               if (run_dir / "metrics.jsonl").exists() else ""):
        assert proc.poll() is None and time.monotonic() < deadline, out.read_text() + err.read_text()
        time.sleep(0.2)
    superlink = [p for p in _children(proc.pid)
                 if b"flower-superlink" in Path(f"/proc/{p}/cmdline").read_bytes()]
    os.kill(superlink[0], signal.SIGKILL)
    assert proc.wait(300) == 1
    lines = [line for line in err.read_text().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: superlink exited with code -9"), lines
    assert "Traceback" not in out.read_text()
    assert flower_pids() - before == set(), "Flower processes left behind"
    assert load_checkpoint(run_dir)["round"] >= 1
    assert cli(["simulate", "--engine", "inprocess", "--resume", str(run_dir)]) == 0
    assert [r["round"] for r in metrics(run_dir)] == list(range(5))


@pytest.mark.integration
@pytest.mark.slow
def test_restarted_supernode_keeps_its_identity_and_client_state(tmp_path):
    """TLS + node auth. SuperNode 0 is killed after round 2 and restarted with the same key:
    it gets the same node id, reloads its dual from its state mirror, and the run ends with
    the model of an uninterrupted run (a round message the dead process took is re-sent)."""
    config = {**DEPLOYED, "algorithm": "feddyn", "num-server-rounds": 4, "min-replies": 2,
              "too-few-replies": "retry", "max-retries": 8}
    cfg, run_dir = deployed(tmp_path, "tls", config, 2, kill_after=2, kill="supernode-0",
                             restart=0, tls=True)
    restarted = "".join(p.read_text() for p in (run_dir / "logs").glob("supernode-0-restart*.log"))
    assert "client state of round" in restarted and "restored" in restarted
    assert all(r["skipped"] == 0 for r in metrics(run_dir)[1:])
    _, inproc = run_with_faults(tmp_path, "inp", clients=2, **{k.replace("-", "_"): v for k, v in config.items()})
    assert same(torch.load(run_dir / "model_final.pt"), inproc)


@pytest.mark.integration
@pytest.mark.slow
def test_killed_server_of_a_tls_deployment_resumes_to_the_uninterrupted_model(tmp_path):
    """`flatflower local --tls`: the ServerApp process is killed after round 2 (the run fails
    within seconds, not at the SuperLink's heartbeat expiry: the command sees no ServerApp
    process, stops the run, exits 1 and stops everything); `--resume` finishes it with the
    same model as an uninterrupted run."""
    from flatflower.runtime.engines.federation import _children

    args = ["--algorithm", "fedtoga", "--clients", "2", "--rounds", "4", "--dataset", "digits",
            "--set", "local-epochs=1", "--tls"]
    before = flower_pids()
    cut = tmp_path / "cut"
    proc = _cli_process(["local", *args, "--run-dir", str(cut)], tmp_path / "cut.log")
    deadline = time.monotonic() + 300
    while '"round": 2' not in ((cut / "metrics.jsonl").read_text() if (cut / "metrics.jsonl").exists() else ""):
        assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "cut.log").read_text()
        time.sleep(0.2)
    server = [p for p in _children(proc.pid)
              if b"flwr-serverapp" in Path(f"/proc/{p}/cmdline").read_bytes()]
    assert server, "no ServerApp process found"
    os.kill(server[0], signal.SIGKILL)
    assert proc.wait(300) == 1
    out = (tmp_path / "cut.log").read_text()
    assert "over TLS with SuperNode authentication" in out and "run failed" in out
    assert "its ServerApp process ended without finishing the run" in out
    superlink = (cut / "logs" / "superlink.log").read_text()
    assert "Uvicorn running on https://127.0.0.1:" in superlink  # Control/Runtime API over TLS
    assert "insecure" not in superlink.lower()  # Flower warns loudly when --insecure is set
    assert superlink.count("[ControlServicer.RegisterNode] Created node_id=") == 2
    assert superlink.count("[Fleet.ActivateNode] Activated node_id=") == 2
    assert flower_pids() - before == set()
    assert cli(["local", "--resume", str(cut), "--tls"]) == 0
    assert cli(["simulate", "--engine", "inprocess", *args[:-1], "--run-dir", str(tmp_path / "full")]) == 0
    full, resumed = (torch.load(d / "model_final.pt") for d in (tmp_path / "full", cut))
    assert same(full, resumed)
    assert [r["round"] for r in metrics(cut)] == list(range(5))
    assert flower_pids() - before == set()
