"""progress.json: where a run is inside its current round, for the CLI's live display.

The ServerApp runs in another process than the CLI in a deployment, so it says where it is in
a small file of the run directory that any engine's CLI reads, as it reads metrics.jsonl:
``{"round", "rounds", "stage", "sampled", "replied", "started", "time"}``, replaced
(atomically) when a round's messages go out and when each reply arrives; ``stage`` is
``handshake`` (asking the connected nodes for their partitions, before a round's training) or
``train``. A reply's count is written at most every REWRITE seconds (and always when the
last one arrives): a round of small models takes a few tens of milliseconds, and the display
polls no faster. Best effort: a failed write never stops the run.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from flwr.app import Message, MessageType

from flatflower.server.rundir import open_file

PROGRESS_FILE = "progress.json"
REWRITE = 0.2  # seconds: the least time between two writes for replies within one stage
clock = time.monotonic


def write_progress(run_dir: Path, state: dict[str, Any]) -> None:
    path = run_dir / PROGRESS_FILE
    tmp = path.with_name(f".{PROGRESS_FILE}.{os.getpid()}.tmp")
    with contextlib.suppress(OSError):  # a link planted at either name is never written through
        tmp.unlink(missing_ok=True)
        with open_file(tmp, "x") as f:
            f.write(json.dumps({**state, "time": time.time()}))
        tmp.replace(path)


def read_progress(run_dir: Path) -> dict[str, Any] | None:
    """The latest progress state of a run directory (None if there is none yet)."""
    try:
        with open_file(run_dir / PROGRESS_FILE) as f:
            data = json.loads(f.read())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


class RoundProgress:
    """Watches ``grid`` for the run's handshake and train messages: when they are pushed (a new
    round, or a retry within one) and when their replies are pulled, and writes progress.json.

    It wraps the grid's own ``push_messages`` / ``pull_messages`` (instance attributes), which
    its ``send_and_receive`` calls: the grid keeps its own loop, pace and timeout (Flower's
    grids pull every 3 s in a deployment, 0.1 s in the Ray simulation; the in-process grid as
    each reply lands), and a grid that overrides ``send_and_receive`` keeps its override."""

    def __init__(self, grid: Any, run_dir: Path, rounds: int):
        self.run_dir, self.rounds = Path(run_dir), rounds
        self.state: dict[str, Any] = {}
        self.ids: set[str] = set()
        self.done = 0  # the last round whose training messages went out
        self.written = -REWRITE  # clock() at the last write
        push, pull = grid.push_messages, grid.pull_messages

        def push_messages(messages: Iterable[Message]) -> Iterable[str]:
            messages = list(messages)
            ids = list(push(messages))
            kinds = {m.metadata.message_type for m in messages}
            if MessageType.TRAIN in kinds:
                train = [m for m in messages if m.metadata.message_type == MessageType.TRAIN]
                self.sent(int(train[0].metadata.group_id or 0), "train", len(train), ids)
            elif MessageType.QUERY in kinds:  # the partition handshake, before a round's training
                self.sent(self.done + 1, "handshake", len(messages), ids)
            return ids

        def pull_messages(message_ids: Iterable[str]) -> Iterable[Message]:
            replies = list(pull(message_ids))
            mine = sum(r.metadata.reply_to_message_id in self.ids for r in replies)
            if mine:
                self.state["replied"] += mine
                if (self.state["replied"] >= self.state["sampled"]
                        or clock() - self.written >= REWRITE):
                    self.write()
            return replies

        grid.push_messages, grid.pull_messages = push_messages, pull_messages

    def sent(self, server_round: int, stage: str, count: int, ids: list[str]) -> None:
        if (self.state.get("round"), self.state.get("stage")) != (server_round, stage):
            self.state = {"round": server_round, "rounds": self.rounds, "stage": stage,
                          "sampled": 0, "replied": 0, "started": time.time()}
            self.ids = set()
        if stage == "train":
            self.done = server_round
        self.state["sampled"] += count  # a retry re-sends to clients that failed
        self.ids |= set(ids)
        self.write()

    def write(self) -> None:
        write_progress(self.run_dir, self.state)
        self.written = clock()
