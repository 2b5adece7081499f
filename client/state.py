"""The client's state mirrored to disk: ``<dir>/partition-<i>/round-<r>.pt``.

Each file holds the client's complete state after it trained round r. A train call for
round r reads the newest file of a round before r, so the state a round starts from does not
depend on what happened after the server's last checkpoint: a resumed run (which redoes the
rounds after its checkpoint) and a restarted SuperNode see exactly the state of an
uninterrupted run, and a round that is re-sent to a client (``too-few-replies = retry``)
starts again from the same state. Files are written atomically; older ones are pruned, but
the newest file at or before any round a checkpoint may still be resumed from is kept.
"""

from __future__ import annotations

import logging
import re
from collections import OrderedDict
from pathlib import Path

import torch

log = logging.getLogger("flwr.flatflower.client")
_FILE = re.compile(r"round-(\d+)\.pt$")

State = "dict[str, OrderedDict[str, torch.Tensor]]"


class StateMirror:
    def __init__(self, root: str | Path, partition_id: int, checkpoint_every: int):
        self.dir = Path(root).expanduser() / f"partition-{partition_id}"
        self.horizon = 2 * max(checkpoint_every, 1)

    def rounds(self) -> list[int]:
        if not self.dir.is_dir():
            return []
        return sorted(int(m.group(1)) for p in self.dir.iterdir() if (m := _FILE.match(p.name)))

    def load_before(self, server_round: int) -> dict:
        """The state after the client's last round before ``server_round`` ({} if none)."""
        earlier = [r for r in self.rounds() if r < server_round]
        if not earlier:
            return {}
        path = self.dir / f"round-{earlier[-1]:06d}.pt"
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:
            raise RuntimeError(f"client state file {path} is unreadable: {err}") from None
        log.info("client state of round %d restored from %s", earlier[-1], path)
        return {name: OrderedDict(tensors) for name, tensors in state.items()}

    def save(self, server_round: int, state: dict) -> None:
        """Write the state after ``server_round`` atomically, then prune old files."""
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / f"round-{server_round:06d}.pt"
        tmp = path.with_suffix(".tmp")
        torch.save({name: dict(tensors) for name, tensors in state.items()}, tmp)
        tmp.replace(path)
        rounds = self.rounds()
        old = [r for r in rounds if r <= server_round - self.horizon]
        for r in old[:-1]:  # keep the newest one at or before the horizon
            (self.dir / f"round-{r:06d}.pt").unlink(missing_ok=True)
