"""A task's deadline, for the warm worker (runtime/worker.py): work nobody waits for is not done.

Every train and evaluate message the server sends expires when the server stops waiting for
its reply (its TTL: strategies/participation.py, ``expire_after``). Before that, Flower's
default TTL of 12 hours let a node run messages of rounds that were long over, of runs that
had failed or were stopped, one after another, while the next run's handshake waited behind
them (issue 44: "every later run fails too, on a clean network").

The worker asks :func:`seconds_left` of each task's message (its ``created_at + ttl``, by the
server's clock, against this machine's, with ``CLOCK_SLACK`` for clocks that differ a little):

* a task whose message has expired is answered at once with an error reply (the SuperLink
  refuses it, as it refuses any reply after the TTL) and its ClientApp never runs;
* a task whose deadline passes while its ClientApp runs is abandoned: :class:`Watchdog` sends
  the error reply at the deadline and ends the worker process, which its supervisor restarts
  at once (a Python thread cannot be stopped, and the SuperNode takes its next message only
  once this one is answered). The client's state is untouched: a call commits its state
  only with its reply (client/state.py).

A message without a short TTL (the handshake's queries, other apps' messages: Flower's
12-hour default) is run as before.

And a task whose message the SuperNode gave up receiving is dropped (:class:`MovedOn`). This was
the wedge of issue 44: in Flower 1.39, when a run ends while a SuperNode is still receiving one
of its messages (over a slow link: while it fetches the app, then the message's objects), the
SuperNode has already made a task for it; the ``RunNotRunningException`` it then gets is a
``BaseException`` that skips its cleanup, so it only logs "Ignoring message" and takes its next
message, leaving the task behind with objects that never arrive. A worker that took that task
waited for them (Flower's object pull: 500 tries, minutes), and every later message queued
behind it: each failed run left one such task per node, so a restarted worker took the next.
The SuperNode takes a new message only when it is done with the last, so a task it made after
this one, while this one's objects are still missing, says that it gave up on this one: the
task is then ended at once, without a reply (nobody waits for one).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import datetime

CLOCK_SLACK = 5.0  # seconds a deadline is stretched on this machine: clocks may differ a little


def seconds_left(message, now: float | None = None) -> float:
    """Seconds until ``message`` expires (negative: expired that long ago), slack included."""
    meta = message.metadata
    now = time.time() if now is None else now
    return meta.created_at + meta.ttl + CLOCK_SLACK - now


def expired_reason(message, left: float) -> str:
    """The error reply's text for a task dropped or abandoned at its deadline."""
    meta = message.metadata
    round_ = f", round {meta.group_id}" if meta.group_id else ""
    return (f"not run: the server stopped waiting for this {meta.message_type} message (run "
            f"{meta.run_id}{round_}) {-left:.0f} s ago by this node's clock (TTL {meta.ttl:.0f} s); "
            "dropped so that the node takes its next message (if this node's clock is off, sync it)")


class Watchdog:
    """Calls ``on_deadline`` once, ``seconds`` from now, unless :meth:`claim` came first.

    Whoever claims first answers the task: the ClientApp's own reply (:meth:`claim` True) or
    the watchdog's error reply; the other side then does nothing."""

    def __init__(self, seconds: float, on_deadline: Callable[[], None]):
        self._lock = threading.Lock()
        self._claimed = False
        self._on_deadline = on_deadline
        self._timer = threading.Timer(max(0.0, seconds), self._fire)
        self._timer.daemon = True

    def start(self) -> Watchdog:
        self._timer.start()
        return self

    def claim(self) -> bool:
        """Take the task's answer for the caller: False if the watchdog already took it."""
        with self._lock:
            if self._claimed:
                return False
            self._claimed = True
        self._timer.cancel()
        return True

    def _fire(self) -> None:
        with self._lock:
            if self._claimed:
                return
            self._claimed = True
        self._on_deadline()


class GaveUp(Exception):
    """The SuperNode gave up receiving this task's message and took its next one."""


class MovedOn:
    """Raises :class:`GaveUp` from :meth:`check` once the SuperNode has made a task after
    ``task`` (``pending_tasks()``: its pending tasks, Flower's ``PullPendingTasks``), looking at
    most every ``every`` seconds (it is called on every retry of a missing object)."""

    def __init__(self, task, pending_tasks: Callable[[], list], every: float = 1.0):
        self.task, self.pending_tasks, self.every = task, pending_tasks, every
        self._lock = threading.Lock()
        self._next = 0.0

    def check(self) -> None:
        with self._lock:
            if time.monotonic() < self._next:
                return
            newer = [t for t in self.pending_tasks()
                     if t.task_id != self.task.task_id and _when(t.pending_at) > _when(self.task.pending_at)]
            self._next = time.monotonic() + self.every
        if newer:
            raise GaveUp(f"dropped a task of run {self.task.run_id}: the SuperNode gave up receiving "
                         f"its message (the run ended meanwhile) and took the next one (run {newer[0].run_id})")


def _when(stamp: str) -> datetime:
    return datetime.fromisoformat(stamp)
