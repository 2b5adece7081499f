"""An in-process Grid: the real ServerApp and ClientApp in one process, no ports, no Ray.

Each virtual node keeps its own Context (so ``context.state`` persists across rounds as on
a SuperNode); every message is deep-copied on the way out and back, like the wire (except
for flatflower's own ClientApp, which never holds on to what it receives or sends); a
ClientApp exception becomes an error reply (code 2), as in Flower's runtimes. Each message is
handled in its own thread, as nodes work in parallel (at most max(2, cores) of them compute at
once: :class:`Slots`); ``send_and_receive(timeout=...)`` returns the
replies that arrived in time and drops the rest, as Flower's grid does (a hung client keeps
its thread). Used by the tests and by ``flatflower simulate --engine inprocess``.
"""

from __future__ import annotations

import ast
import contextlib
import copy
import json
import logging
import os
import sys
import threading
import time
import traceback
import uuid
import weakref
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from flwr.app import Context, Error, Message, MessageType, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.supercore.task_identity import TaskIdentity

from flatflower.client.allowed_code import ALLOW_KEY  # one process, one person: its own code runs
from flatflower.client.app import TrainCall
from flatflower.client.app import app as default_client_app
from flatflower.common.config import RunConfig
from flatflower.common.data import model_shape
from flatflower.common.models import build_model
from flatflower.runtime.engines.vectorized import (adopt_batching, batching_choices, check_batchable, check_compilable,
                                           train_together)
from flatflower.server.app import app as default_server_app
from flatflower.server.rundir import RunWriteError, default_run_dir, write_recorded

log = logging.getLogger("flwr.flatflower.server")

CLIENT_APP_RAISED_EXCEPTION = 2
# seconds without progress after which calls are taken for stuck (a hung client): the
# in-process grid's waiting calls then run without a slot, the vectorised batch goes on
STRAGGLER_WAIT = 1.0
_AST_LOCK = threading.Lock()
# the name of every thread that runs a ClientApp here: one may outlive its run (a client the
# server stopped waiting for, round-timeout), and the CLI leaves without finalising then
CLIENT_THREAD = "flatflower-client"


def _one_ast_parse_at_a_time() -> None:
    """CPython before 3.13 keeps ``ast.parse``'s recursion depth in state shared by threads:
    two parses at once can fail with ``SystemError: AST constructor recursion depth mismatch``
    (python/cpython#106905). numpy's ``np.load`` parses every array header with it, so clients
    decoding their ArrayRecords in parallel threads hit it under load. One lock around
    ``ast.parse`` in this process (Flower's own runtimes run one ClientApp per process). Never
    undone: a grid's threads can outlive its run (a hung client), and the lock is uncontended
    outside them."""
    if sys.version_info >= (3, 13) or getattr(ast.parse, "one_at_a_time", False):
        return
    parse = ast.parse

    def locked(*args, **kwargs):
        with _AST_LOCK:
            return parse(*args, **kwargs)

    locked.one_at_a_time = True
    ast.parse = locked


class Slots:
    """At most ``n`` ClientApp calls at once: a hundred threads computing at once mostly wait
    for each other (the GIL). A call that sees no slot freed for ``patience`` seconds runs
    without one: the slots' holders are stuck (a hung client), and must not hold up the rest."""

    def __init__(self, n: int, patience: float):
        self.free, self.patience = n, patience
        self._changed = threading.Condition()
        self._last = time.monotonic()  # when a slot was last freed

    def acquire(self) -> bool:
        """True with a slot, False when going on without one."""
        with self._changed:
            while self.free == 0:
                left = self._last + self.patience - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(left)
            self.free -= 1
            return True

    def release(self) -> None:
        with self._changed:
            self.free += 1
            self._last = time.monotonic()
            self._changed.notify()


class InProcessGrid(Grid):
    engine = "inprocess"  # what config.json records as the run's engine (server/run.py engine_of)

    def __init__(self, client_app: ClientApp, num_nodes: int, run_config: Mapping[str, Any],
                 node_config: Mapping[str, Any] | None = None, first_node_id: int = 1000,
                 copy_messages: bool = True, node_configs: Mapping[int, Mapping[str, Any]] | None = None):
        """``node_config``: every node's; ``node_configs``: partition id -> one node's own keys
        on top (e.g. its ``data-dir``: partition = local)."""
        # Message() reads this process-wide identity; Flower's runtimes set it once per process too
        TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 0
        _one_ast_parse_at_a_time()
        self.client_app = client_app
        self.copy_messages = copy_messages  # False: only for a ClientApp known not to alias them
        self.contexts = {
            first_node_id + i: Context(
                run_id=1, node_id=first_node_id + i, state=RecordDict(), run_config=dict(run_config),
                node_config={"partition-id": i, "num-partitions": num_nodes, ALLOW_KEY: "*", **(node_config or {}),
                             **(node_configs or {}).get(i, {})},
            )
            for i in range(num_nodes)
        }
        self.offline: set[int] = set()  # node ids that get_node_ids() hides (failure tests)
        self._run = None
        self._pending: dict[str, Message] = {}
        self._workers: list[threading.Thread] = []
        self._arrived = threading.Condition()  # notified when a reply lands in _pending
        self._slots = Slots(max(2, os.cpu_count() or 1), STRAGGLER_WAIT)
        self.stopping = False  # set by stop_runs: no further message is sent
        LIVE.add(self)

    # -- Grid API
    def set_run(self, run) -> None:
        self._run = run

    @property
    def run(self):
        return self._run

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None) -> Message:
        return Message(content, dst_node_id=dst_node_id, message_type=message_type, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        return [n for n in self.contexts if n not in self.offline]

    def _deliver(self, msg: Message) -> Message:
        copied = copy.deepcopy if self.copy_messages else (lambda m: m)
        incoming = copied(msg)
        slot = self._slots.acquire()
        try:
            return copied(self._answer(
                msg, incoming, lambda: self.client_app(incoming, self.contexts[msg.metadata.dst_node_id])))
        finally:
            if slot:
                self._slots.release()

    @staticmethod
    def _answer(msg: Message, incoming: Message, make) -> Message:
        """``make()``'s reply to ``incoming``, or the error reply the runtime sends when the
        ClientApp raised; marked as coming from ``msg``'s destination."""
        try:
            reply = make()
        except Exception as err:  # the runtime turns ClientApp exceptions into error replies
            reason = f"{type(err)}:<'{err}'>\n{''.join(traceback.format_exception(err))}"
            reply = Message(Error(CLIENT_APP_RAISED_EXCEPTION, reason), reply_to=incoming)
        reply.metadata.__dict__["_src_node_id"] = msg.metadata.dst_node_id
        return reply

    def _land(self, replies: Mapping[str, Message]) -> None:
        with self._arrived:
            self._pending.update(replies)
            self._arrived.notify_all()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """Deliver each message in its own thread, as nodes work in parallel (replies land
        in _pending)."""
        if self.stopping:
            raise RunStopped("the run was interrupted")
        ids = []
        self._workers = [w for w in self._workers if w.is_alive()]  # the finished ones
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = uuid.uuid4().hex

            def work(msg=msg) -> None:
                self._land({msg.metadata.message_id: self._deliver(msg)})

            worker = threading.Thread(target=work, daemon=True, name=CLIENT_THREAD)
            worker.start()
            self._workers.append(worker)
            ids.append(msg.metadata.message_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        """The replies to ``message_ids`` that have landed, in no particular order (as Flower's
        grids). Each call costs what has landed, not what is asked for (given as a set): a
        handshake with thousands of nodes pulls once per reply (docs/reliability.md, Scale)."""
        wanted = message_ids if isinstance(message_ids, (set, frozenset)) else set(message_ids)
        with self._arrived:
            return [self._pending.pop(i) for i in [i for i in self._pending if i in wanted]]

    def wait_for_replies(self, message_ids: Iterable[str], timeout: float | None) -> None:
        """Return once a reply to one of ``message_ids`` waits to be pulled, or after
        ``timeout`` seconds: what the strategies' ``exchange`` does instead of sleeping between
        pulls (a reply is pulled the moment it lands)."""
        ids = message_ids if isinstance(message_ids, (set, frozenset)) else set(message_ids)
        with self._arrived:
            self._arrived.wait_for(lambda: any(i in ids for i in self._pending), timeout)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None):
        """Push, then pull each reply as it lands (as Flower's grids pull, without their
        sleep), until all replied or ``timeout``; the replies in the order of the messages."""
        ids = list(self.push_messages(messages))
        pending, replies = set(ids), []
        deadline = None if timeout is None else time.monotonic() + timeout
        while pending:
            got = list(self.pull_messages(pending))
            replies += got
            pending -= {r.metadata.reply_to_message_id for r in got}
            left = None if deadline is None else deadline - time.monotonic()
            if not pending or (left is not None and left <= 0):
                break
            self.wait_for_replies(pending, left)
        self._workers = [w for w in self._workers if w.is_alive()]  # hung clients
        order = {message_id: i for i, message_id in enumerate(ids)}
        return sorted(replies, key=lambda r: order[r.metadata.reply_to_message_id])


class VectorizedGrid(InProcessGrid):
    """The in-process grid, with the train messages of a push trained together
    (runtime/engines/vectorized.py): each is opened by the ClientApp's own ``TrainCall``, all train in
    batched passes in one worker thread, and each gets the reply its ClientApp would have sent
    (or its error reply). Other messages (query, evaluate) go to the ClientApp one by one.
    Messages are not deep-copied: the client side only reads them and builds new replies."""

    engine = "vectorized"
    CHOICES = "vectorized.json"  # in the run directory: which models it batched (flatflower.runtime.engines.vectorized)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        run_dir = next(iter(self.contexts.values())).run_config.get("run-dir") if self.contexts else ""
        self.choices_file = Path(run_dir) / self.CHOICES if run_dir else None
        if self.choices_file is not None and self.choices_file.is_file():  # a resumed run batches as before
            try:
                adopt_batching(json.loads(self.choices_file.read_text()))
            except (OSError, ValueError, AttributeError) as err:
                log.warning("%s is unreadable (%s): batching is measured again", self.choices_file, err)

    def _record_choices(self) -> None:
        choices = batching_choices()
        if self.choices_file is not None and choices:
            with contextlib.suppress(OSError, RunWriteError):  # a record, never the run's end
                write_recorded(self.choices_file, choices)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        messages = list(messages)
        is_train = [m.metadata.message_type == MessageType.TRAIN for m in messages]
        train = [m for m, t in zip(messages, is_train) if t]
        for msg in train:
            msg.metadata.__dict__["_message_id"] = uuid.uuid4().hex
        others = iter(super().push_messages([m for m, t in zip(messages, is_train) if not t]))
        if train:
            worker = threading.Thread(target=self._train_together, args=(train,), daemon=True, name=CLIENT_THREAD)
            worker.start()
            self._workers.append(worker)
        return [m.metadata.message_id if t else next(others) for m, t in zip(messages, is_train)]

    def _train_together(self, messages: list[Message]) -> None:
        """Open the messages one after another in an opener thread (a hundred threads opening
        at once would mostly wait for each other), train the calls that opened together, and
        reply. A call that does not finish opening within STRAGGLER_WAIT (a hung or very slow
        client) does not hold the batch: another opener takes the messages still waiting, and
        once none is waiting the batch goes on without it; a late call trains alone in its own
        thread when it opens (the same result: the engines agree), as a hung client stays
        hung alone."""
        arrived = threading.Condition()  # notified when the last message is opened
        waiting = list(range(len(messages)))
        opened: dict[int, Any] = {}  # message index -> its TrainCall, or the exception
        closed = False
        progress = time.monotonic()  # when the last open finished (or the batch began)

        def opener() -> None:
            nonlocal progress
            while True:
                with arrived:
                    if closed or not waiting:
                        return
                    i = waiting.pop(0)
                msg = messages[i]
                try:
                    outcome = TrainCall.open(msg, self.contexts[msg.metadata.dst_node_id], self_report=False)
                except Exception as err:  # its error reply
                    outcome = err
                with arrived:
                    if not closed:
                        opened[i], progress = outcome, time.monotonic()
                        if len(opened) == len(messages):  # (one wake-up, not one per message)
                            arrived.notify_all()
                        continue
                self._land({msg.metadata.message_id: self._answer(msg, msg, lambda: _run(outcome))})
                return

        def start_opener() -> None:
            threading.Thread(target=opener, daemon=True, name=CLIENT_THREAD).start()

        start_opener()
        with arrived:
            while len(opened) < len(messages):
                stalled = progress + STRAGGLER_WAIT - time.monotonic()  # no open finished since
                if stalled > 0:
                    arrived.wait(stalled)
                    continue
                if not waiting:
                    break  # only calls stuck in their open are left: go on without them
                start_opener()  # the last opener is stuck: another takes the waiting ones
                progress = time.monotonic()
            closed = True
            batch = dict(opened)
        calls = {i: o for i, o in batch.items() if not isinstance(o, Exception)}
        results = dict(zip(calls, train_together(list(calls.values()))))
        self._record_choices()

        def reply(i: int) -> Message:
            outcome = results.get(i, batch[i])  # the training's result, or the open's exception
            if isinstance(outcome, Exception):
                raise outcome
            return calls[i].reply(outcome)

        try:
            replies = {messages[i].metadata.message_id: self._answer(messages[i], messages[i],
                                                                     lambda i=i: reply(i))
                       for i in batch}
        finally:
            for call in calls.values():
                call.close()
        late = {messages[i].metadata.message_id: c.fault.late_by(c.server_round)
                for i, c in calls.items() if c.fault}
        for message_id, delay in late.items():  # a straggler (inject-fault late:S) lands alone
            if not delay:
                continue
            timer = threading.Timer(delay, self._land, args=({message_id: replies.pop(message_id)},))
            timer.daemon = True
            timer.start()
        self._land(replies)


LIVE: weakref.WeakSet = weakref.WeakSet()  # the in-process grids of this process


class RunStopped(KeyboardInterrupt):
    """Raised in the server's thread of an interrupted in-process run at its next message."""


def stop_runs(server: threading.Thread, wait: float) -> None:
    """Stop the in-process runs of this process: no new messages, and wait (at most ``wait``
    seconds) for ``server`` and the clients' calls in flight to end, so no thread is inside
    torch when the interpreter exits (a C++ abort, "terminate called without an active
    exception"). The run's files stay as its last round left them (written atomically)."""
    grids = list(LIVE)
    for grid in grids:
        grid.stopping = True
    deadline = time.monotonic() + wait
    server.join(max(0.0, deadline - time.monotonic()))
    for worker in (w for grid in grids for w in grid._workers):
        worker.join(max(0.0, deadline - time.monotonic()))


def _run(outcome) -> Message:
    """A call that opened too late for its batch: trained alone (or its open's exception)."""
    if isinstance(outcome, Exception):
        raise outcome
    return outcome.run()


def check_vectorizable(cfg) -> None:
    """ValueError (one line) before any round when the run's model cannot be batched by the
    vectorised engine (buffers such as BatchNorm's statistics, dropout: flatflower.runtime.engines.vectorized.
    check_batchable), or when ``compile = on`` and torch.compile does not work here
    (check_compilable): the engine refuses it itself, not only the CLI."""
    input_shape, num_classes = model_shape(cfg)  # partition = local: from the run config, no data here
    check_batchable(build_model(cfg.resolved_model(), input_shape, num_classes, seed=0), cfg.resolved_model())
    check_compilable(cfg)


def run_inprocess(run_config: Mapping[str, Any], num_clients: int,
                  node_config: Mapping[str, Any] | None = None,
                  server_app: ServerApp | None = None,
                  client_app: ClientApp | None = None,
                  vectorized: bool = False,
                  node_configs: Mapping[int, Mapping[str, Any]] | None = None) -> tuple[Path, InProcessGrid]:
    """Run the real ServerApp against ``num_clients`` in-process ClientApps (``vectorized``:
    their local training batched, :class:`VectorizedGrid`); ``node_configs``: partition id ->
    that node's own node-config keys (its ``data-dir``)."""
    cfg = RunConfig.from_mapping({"num-partitions": num_clients, **run_config})
    cfg = cfg.replace(run_dir=str(Path(cfg.run_dir or default_run_dir(cfg)).resolve()))
    if vectorized:
        check_vectorizable(cfg)
    kind = VectorizedGrid if vectorized else InProcessGrid
    # flatflower's ClientApp reads what it receives and builds fresh replies: no copies needed
    # (another ClientApp, e.g. the tests' malicious ones, gets copies, as over the wire)
    grid = kind(client_app or default_client_app, num_clients, cfg.to_dict(), node_config,
                copy_messages=client_app is not None, node_configs=node_configs)
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=cfg.to_dict())
    (server_app or default_server_app)(grid, context)
    return Path(cfg.run_dir), grid


RUN_LOGGERS = ("flwr", "flwr.flatflower.server", "flwr.flatflower.client")  # Flower's and both halves'


@contextlib.contextmanager
def logs_at(level: int) -> Iterator[None]:
    """Flower's and flatflower's loggers at ``level`` (e.g. WARNING: no per-round lines) while
    an in-process run lasts, as they were afterwards."""
    loggers = [logging.getLogger(name) for name in RUN_LOGGERS]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(level)
    try:
        yield
    finally:
        for lg, old in zip(loggers, levels):
            lg.setLevel(old)
