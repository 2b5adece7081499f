"""Nodes that recover by themselves (issue 44, item 4): work nobody waits for is never done.

Fast: the server gives every train and evaluate message a TTL that ends when it stops waiting
(strategies/participation.py), the handshake's queries keep Flower's (a slow node joins late),
and the worker's deadline (runtime/deadline.py). Slow, on loopback: a run that is stopped while
its nodes train does not hold them past its round's deadline, so the next run goes through
without restarting anything. The network-namespace versions (a throttled link, a cut one) are
in tests/test_netns.py."""

from __future__ import annotations

import threading
import time

import pytest
from flwr.app import DEFAULT_TTL, ConfigRecord, Message, MessageType, RecordDict

from flatflower.client.app import app as client_app
from flatflower.common.config import RunConfig
from flatflower.runtime.deadline import (
    CLOCK_SLACK,
    GaveUp,
    MovedOn,
    Watchdog,
    expired_reason,
    seconds_left,
)
from flatflower.runtime.engines.inprocess import InProcessGrid
from flatflower.server.run import run_server
from flatflower.strategies.participation import TTL_MARGIN, UNFINISHED, exchange
from tests.conftest import set_task_identity
from tests.helpers import ROOT, fast_config, round_deadline


class TTLGrid(InProcessGrid):
    """Records (type, seconds the message has left when pushed) of every message sent."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.sent: list[tuple[str, float]] = []

    def push_messages(self, messages):
        messages = list(messages)
        now = time.time()
        self.sent += [(m.metadata.message_type, m.metadata.created_at + m.metadata.ttl - now)
                      for m in messages]
        return super().push_messages(messages)


def test_a_rounds_messages_expire_when_the_server_stops_waiting_and_queries_do_not(tmp_path):
    cfg = RunConfig.from_mapping(fast_config(round_timeout=37.0, node_wait_timeout=11.0,
                                             fraction_evaluate=1.0, run_dir=str(tmp_path / "run")))
    grid = TTLGrid(client_app, 3, cfg.to_dict())
    run_server(grid, cfg)
    kinds = {kind for kind, _ in grid.sent}
    assert kinds == {MessageType.QUERY, MessageType.TRAIN, MessageType.EVALUATE}
    for kind, left in grid.sent:
        if kind == MessageType.QUERY:  # a late answer is still taken at a later round
            assert left > DEFAULT_TTL - 60
        else:  # round-timeout, and the margin for the server's last pull
            assert 37.0 + TTL_MARGIN - 1.0 < left <= 37.0 + TTL_MARGIN + 1e-6


def _message(created_at: float, ttl: float) -> Message:
    set_task_identity()
    msg = Message(RecordDict({"config": ConfigRecord({"x": 1})}), dst_node_id=7,
                  message_type=MessageType.TRAIN, group_id="4", ttl=ttl)
    msg.metadata.created_at = created_at
    return msg


class UploadingGrid:
    """Replies reach the SuperLink as Flower 1.39's do: first the header, which the SuperLink
    hands the server once (and forgets), then the content, which the server's grid pulls with
    ``pull_objects``, one reply after another, making an error reply of a pull that gives up
    (flwr/superlink/grid/http_grid.py). ``arrivals``: for the i-th message, the seconds after
    it was sent at which its reply's header and its content arrive (None: never)."""

    def __init__(self, *arrivals: tuple[float | None, float | None]):
        self.arrivals, self.sent, self.handed = arrivals, [], set()

    def push_messages(self, messages):
        self.sent, self.t0 = list(messages), time.monotonic()
        for i, msg in enumerate(self.sent):
            msg.metadata.__dict__["_message_id"] = f"m{i}"
        return [m.metadata.message_id for m in self.sent]

    def _in(self, at):
        return at is not None and time.monotonic() - self.t0 >= at

    def pull_messages(self, message_ids):
        from flwr.app import Error
        from flwr.common.constant import ErrorCode
        from flwr.superlink.grid import http_grid
        from flwr.supercore.inflatable.inflatable_utils import ObjectPullError, ObjectUnavailableError

        arrived = [(msg, content) for msg, (header, content) in zip(self.sent, self.arrivals)
                   if msg.metadata.message_id in message_ids and msg.metadata.message_id not in self.handed
                   and self._in(header)]
        self.handed |= {msg.metadata.message_id for msg, _ in arrived}
        replies = []
        for msg, content in arrived:

            def pull_one(object_id, content=content):
                if not self._in(content):
                    raise ObjectUnavailableError(object_id)
                return b""

            try:  # the name the grid calls, as the grid calls it
                http_grid.pull_objects([f"{msg.metadata.message_id}-model"], pull_one)
                replies.append(Message(RecordDict(), reply_to=msg))
            except ObjectPullError as err:
                replies.append(Message(Error(code=ErrorCode.MESSAGE_UNAVAILABLE, reason=f"Reply "
                                             f"message objects are unavailable. {err}"), reply_to=msg))
        return replies


def _exchange_in_thread(grid, nodes, timeout):
    """``exchange`` of one train message per node, in a thread (it must not hang the test), and
    the seconds it took."""
    set_task_identity()
    msgs = [Message(RecordDict(), dst_node_id=node, message_type=MessageType.TRAIN, group_id="3")
            for node in nodes]
    done: list = []
    t0 = time.monotonic()
    thread = threading.Thread(target=lambda: done.append(exchange(grid, msgs, timeout)), daemon=True)
    thread.start()
    thread.join(60)
    assert done, "the exchange waited past its deadline for content that never comes"
    return done[0], time.monotonic() - t0


def test_replies_still_uploading_at_the_deadline_do_not_hold_the_round():
    """Replies whose headers reached the SuperLink but whose content does not arrive (a slow or
    cut link mid-upload) end the exchange at its deadline, as error replies that say so. Before,
    Flower's pull waited for each up to 500 tries backing off to 10 s (two hours), and then
    (issue 58 item 6) each of them for the whole round-timeout, one after another."""
    from flwr.superlink.grid import http_grid
    from flwr.supercore.inflatable.inflatable_utils import pull_objects

    defaults = dict(pull_objects.__kwdefaults__)
    replies, took = _exchange_in_thread(UploadingGrid(*[(0.0, None)] * 4), (5, 6, 7, 8), 1.5)
    assert took < 1.5 + 2.5  # one more try each after the deadline, retried within 1 s
    assert [r.metadata.src_node_id for r in replies] == [5, 6, 7, 8]
    assert all(r.error.reason == f"{UNFINISHED} (1.5s)" for r in replies)
    # Flower's own pull and limits, outside the exchange
    assert http_grid.pull_objects is pull_objects and pull_objects.__kwdefaults__ == defaults


def test_a_reply_that_arrives_while_another_uploads_is_taken():
    """Node 5's reply is still uploading at the deadline; node 6's arrives, whole, while the
    server waits for node 5's content, and node 7's arrives after node 5's header, in the same
    pull: both are taken. Before, the pull that waited for node 5 ended at the deadline and no
    pull came after it, so node 6 failed the round too (a test-slow run lost all three nodes'
    round 3 to one node's 256 kbit/s upload)."""
    grid = UploadingGrid((0.0, None), (0.3, 0.3), (0.0, 0.0))
    replies, _ = _exchange_in_thread(grid, (5, 6, 7), 1.5)
    assert [r.metadata.src_node_id for r in replies] == [5, 6, 7]
    assert replies[0].error.reason == f"{UNFINISHED} (1.5s)"
    assert not replies[1].has_error() and not replies[2].has_error()


def test_a_tasks_deadline_is_its_messages_ttl_stretched_by_the_clock_slack():
    msg = _message(created_at=1000.0, ttl=30.0)
    assert seconds_left(msg, now=1000.0) == 30.0 + CLOCK_SLACK
    assert seconds_left(msg, now=1030.0 + CLOCK_SLACK) == 0.0
    left = seconds_left(msg, now=1100.0)
    assert left == -(70.0 - CLOCK_SLACK)
    reason = expired_reason(msg, left)
    assert "stopped waiting for this train message" in reason and "round 4" in reason
    assert f"{70.0 - CLOCK_SLACK:.0f} s ago" in reason and "TTL 30 s" in reason


def test_the_watchdog_answers_a_task_once_whoever_comes_first():
    fired = []
    early = Watchdog(0.2, lambda: fired.append("early")).start()
    assert early.claim()  # the ClientApp answered in time: the watchdog never fires
    time.sleep(0.4)
    assert fired == [] and not early.claim()

    done = threading.Event()
    late = Watchdog(0.05, lambda: (fired.append("late"), done.set())).start()
    assert done.wait(5)
    assert fired == ["late"] and not late.claim()  # the ClientApp's reply comes too late: dropped


@pytest.mark.integration
@pytest.mark.slow
def test_a_stopped_run_does_not_hold_its_nodes_past_its_rounds_deadline(tmp_path):
    """Run 1's clients train for minutes; it is stopped mid-round. Its train messages expire
    at round-timeout (+ margin): the workers abandon them then, so run 2's handshake, asked
    right away with a node-wait-timeout of twice that, is answered by every node and run 2
    completes, nothing restarted. Before, each worker trained run 1's round to its end
    (and run 2 failed: "no node passed the partition handshake")."""
    from flatflower.runtime.engines.federation import COMPLETED, FINISHED, LocalFederation

    timeout = 20.0
    base = {"dataset": "digits", "model": "cnn", "partition": "iid", "batch-size": 64,
            "num-partitions": 2, "min-available-nodes": 2, "round-timeout": timeout}
    slow = {**base, "local-steps": 1_000_000, "num-server-rounds": 5, "run-dir": str(tmp_path / "run1")}
    quick = {**base, "local-steps": 2, "num-server-rounds": 2, "run-dir": str(tmp_path / "run2"),
             "round-timeout": round_deadline(), "node-wait-timeout": 2 * (timeout + TTL_MARGIN) + 30}
    with LocalFederation(2, tmp_path / "work", tmp_path / "logs") as fed:
        run1 = fed.submit(ROOT, slow)
        deadline = time.monotonic() + 240
        while "Receiving: train message" not in _log(tmp_path, "supernode-0") + _log(tmp_path, "supernode-1"):
            assert time.monotonic() < deadline, "run 1 never reached training"
            assert not fed.status(run1)["status"].startswith(FINISHED)
            time.sleep(1)
        time.sleep(3)  # the workers are training run 1
        fed.stop_run(run1)
        t0 = time.monotonic()
        run2 = fed.submit(ROOT, quick)
        row = fed.wait(run2, 400, poll=1)
        assert row["status"] == COMPLETED, row
        assert time.monotonic() - t0 < 2 * (timeout + TTL_MARGIN) + 200
    workers = _log(tmp_path, "supernode-0-worker") + _log(tmp_path, "supernode-1-worker")
    assert "abandoned: the server stopped waiting for this train message" in workers


def _log(tmp_path, name: str) -> str:
    path = tmp_path / "logs" / f"{name}.log"
    return path.read_text(errors="replace") if path.exists() else ""


def _task(task_id: int, run_id: int, pending_at: str):
    from flwr.proto.task_pb2 import Task  # pylint: disable=E0611

    return Task(task_id=task_id, run_id=run_id, pending_at=pending_at)


def test_a_task_whose_message_the_supernode_gave_up_is_dropped_once_it_took_the_next():
    """The SuperNode takes a new message only when done with the last: a task made after ours,
    while our message's objects are missing, means it gave up ours (issue 44's wedge)."""
    mine = _task(1, 11, "2026-11-28T20:00:00.000001+00:00")
    older = _task(0, 10, "2026-11-28T19:59:00+00:00")  # an earlier leftover: says nothing
    pending = [older]
    asked = []

    def pending_tasks():
        asked.append(1)
        return list(pending)

    moved_on = MovedOn(mine, pending_tasks, every=0.0)
    moved_on.check()  # only older work pending: keep waiting for the objects
    pending.append(_task(2, 12, "2026-11-28T20:00:03+00:00"))
    with pytest.raises(GaveUp, match="dropped a task of run 11: the SuperNode gave up receiving "
                                     r"its message .* took the next one \(run 12\)"):
        moved_on.check()
    assert len(asked) == 2

    slow = MovedOn(mine, pending_tasks, every=60.0)  # asked at most every `every` seconds
    with pytest.raises(GaveUp):
        slow.check()
    slow.check()
    assert len(asked) == 3


def test_a_handshake_nobody_answers_names_the_nodes_and_why_in_one_line(tmp_path):
    """Six nodes silent past node-wait-timeout: the run's error names four, says how many more,
    and why a connected node may not answer."""
    from flatflower.strategies.participation import NoNodesError

    cfg = RunConfig.from_mapping(fast_config(node_wait_timeout=0.3, num_partitions=6,
                                             run_dir=str(tmp_path / "run")))
    grid = InProcessGrid(client_app, 6, cfg.to_dict())
    for node in grid.contexts:
        grid.contexts[node].node_config["inject-fault"] = "mute:2"
    with pytest.raises(NoNodesError) as err:
        run_server(grid, cfg)
    text = str(err.value)
    assert "\n" not in text and text.startswith("no node passed the partition handshake: node 100")
    assert text.count("no answer to the partition handshake within node-wait-timeout=0.3s") == 4
    assert "although the SuperLink sees it connected" in text and text.endswith("; and 2 more (the run log names each)")
    time.sleep(2)  # the muted ClientApps answer and end
