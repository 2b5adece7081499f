"""A client's state across rounds (duals, control variates, EMA models), committed only when
the server accepted the round that produced it.

A train call never overwrites the state it starts from: it *stages* the state it ends with
under its round r. Every train message says which of this client's rounds the server last
accepted (``state-round`` a: the last round whose reply entered a server update, 0 = none;
server side in strategies/participation.py). The call starts from the state staged at round
a, or from nothing when a = 0, and drops what was staged after a. So a reply that came too
late (a straggler), was refused, or belonged to a skipped round, and the first answer to a
round the server re-sent (``too-few-replies = retry``), never change what later rounds start
from: the state a client trains with is the state after its accepted rounds, exactly as if
every other round had failed before training. A state the server accepted but the client no
longer has (deleted files, a SuperNode restarted without a ``state-dir``) is an error, never
a silent restart from zero.

Two stores, one behaviour:

* :class:`ContextState`: Flower's ``context.state`` (records ``<name>@<round>``);
* :class:`StateMirror`: files ``<dir>/partition-<i>/round-<r>.pt`` (node-config ``state-dir``
  or the run config's ``client-state-dir``), which survive a restarted SuperNode and a
  resumed run. Files are written atomically; older accepted ones are pruned, keeping the one
  a resume from the server's last checkpoint may ask for.
"""

from __future__ import annotations

import logging
import re
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path

import torch
from flwr.app import Context

from flatflower.common import codec

log = logging.getLogger("flwr.flatflower.client")
_FILE = re.compile(r"round-(\d+)\.pt$")
_RECORD = re.compile(r"(.+)@(\d+)$")

State = "dict[str, OrderedDict[str, torch.Tensor]]"


class MissingState(RuntimeError):
    """The server accepted a round of this client whose state the client does not have."""


def _kept(rounds: Iterable[int], staged: int, accepted: int, horizon: int) -> set[int]:
    """The staged rounds still needed once round ``staged`` is staged with ``accepted`` the
    server's last accepted round: ``staged`` and ``accepted``, every accepted round after
    ``staged - horizon``, and the newest one at or before it (a resumed run restarts from a
    checkpoint at most ``horizon`` rounds back). Rounds after ``accepted`` were not accepted
    (or belong to a run resumed from an earlier checkpoint) and are never needed."""
    older = sorted(r for r in rounds if r <= accepted)
    keep = {staged, accepted} | {r for r in older if r > staged - horizon}
    before = [r for r in older if r <= staged - horizon]
    return keep | set(before[-1:])


class ContextState:
    """The client's state in ``context.state``: one ArrayRecord ``<name>@<round>`` per record
    and staged round (at most the accepted round's and the newest)."""

    def __init__(self, context: Context):
        self.context = context

    def _staged(self) -> dict[int, list[str]]:
        rounds: dict[int, list[str]] = {}
        for key in self.context.state.array_records:
            if m := _RECORD.match(key):
                rounds.setdefault(int(m.group(2)), []).append(key)
        return rounds

    def load(self, accepted: int) -> dict:
        """The state staged at round ``accepted`` ({} for 0); MissingState if it is gone."""
        if accepted == 0:
            return {}
        keys = self._staged().get(accepted)
        if not keys:
            raise MissingState(f"this client's state after round {accepted}, which the server "
                               "accepted, is not in its context (a restarted SuperNode without a "
                               "state-dir?): its duals/control variates are lost")
        return {_RECORD.match(k).group(1): codec.from_record(self.context.state[k]) for k in keys}

    def stage(self, server_round: int, accepted: int, state: dict) -> None:
        for name, tensors in state.items():
            self.context.state[f"{name}@{server_round}"] = codec.to_record(tensors)
        for rnd, keys in self._staged().items():
            if rnd not in (server_round, accepted):
                for key in keys:
                    del self.context.state[key]


class StateMirror:
    """The client's state on disk: ``<root>/partition-<i>/round-<r>.pt``."""

    def __init__(self, root: str | Path, partition_id: int, checkpoint_every: int):
        self.dir = Path(root).expanduser() / f"partition-{partition_id}"
        self.horizon = 2 * max(checkpoint_every, 1)

    def path(self, server_round: int) -> Path:
        return self.dir / f"round-{server_round:06d}.pt"

    def rounds(self) -> list[int]:
        if not self.dir.is_dir():
            return []
        return sorted(int(m.group(1)) for p in self.dir.iterdir() if (m := _FILE.match(p.name)))

    def load(self, accepted: int) -> dict:
        """The state saved after round ``accepted`` ({} for 0); MissingState if the file is
        missing or unreadable."""
        if accepted == 0:
            return {}
        state = self.read(accepted)
        log.info("client state of round %d restored from %s", accepted, self.path(accepted))
        return state

    def read(self, server_round: int) -> dict:
        """The file of round ``server_round``'s records; MissingState if it is missing or
        unreadable."""
        path = self.path(server_round)
        if not path.is_file():
            raise MissingState(f"client state file {path} is missing (the server accepted round "
                               f"{server_round} of this client; its duals/control variates were in it)")
        return read_state_file(path)

    def stage(self, server_round: int, accepted: int, state: dict) -> None:
        """Write the state after ``server_round`` atomically, then drop the files no longer
        needed (:func:`_kept`)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.path(server_round)
        tmp = path.with_suffix(".tmp")
        tmp.unlink(missing_ok=True)  # never written through a link planted there
        with open(tmp, "xb") as f:
            torch.save({name: {k: own_storage(t) for k, t in tensors.items()} for name, tensors in state.items()}, f)
        tmp.replace(path)
        rounds = self.rounds()
        keep = _kept(rounds, server_round, accepted, self.horizon)
        for r in rounds:
            if r not in keep:
                self.path(r).unlink(missing_ok=True)


def own_storage(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a copy of it when it is a view of a larger tensor: torch.save writes a view's
    whole storage. The vectorised engine's clients hold rows of their group's stacked state, so
    a state record kept as it came (FedSMOO's) wrote all the group's rows into every client's
    file: 195 MB a file for 500 clients of a 100k-parameter MLP instead of 0.4 MB
    (docs/reliability.md, Scale)."""
    return t if t.untyped_storage().nbytes() == t.numel() * t.element_size() else t.clone()


def read_state_file(path: Path) -> dict:
    """A state file's records (name -> named tensors); MissingState if it cannot be read or
    is not such a mapping."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
        if not (isinstance(state, dict) and state and all(
                isinstance(t, dict) and t and all(isinstance(v, torch.Tensor) for v in t.values())
                for t in state.values())):
            raise ValueError("not a mapping of named tensors")
    except Exception as err:  # noqa: BLE001 - torch raises many types for a damaged file
        detail = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
        raise MissingState(f"client state file {path} is damaged or unreadable: {detail}") from None
    return {name: OrderedDict(tensors) for name, tensors in state.items()}


def check_state(state: dict, layout, where: str) -> None:
    """ValueError (one line naming ``where`` and the tensor) unless every record of a client's
    ``state`` holds exactly the model's trainable parameters (``local_buffers``: its buffers),
    each of the model's shape and dtype, with finite values: a damaged or edited state file
    (float64, another shape, NaN) is refused, never trained with."""
    from flatflower.common import protocol as P
    from flatflower.common import schema

    params = {n: (tuple(p.shape), str(p.dtype).removeprefix("torch.")) for n, p in zip(layout.names, layout.params)}
    buffers = {k: (tuple(layout.state[k].shape), str(layout.state[k].dtype).removeprefix("torch."))
               for k in layout.buffers}
    for name, tensors in state.items():
        schema.tensors(buffers if name == P.LOCAL_BUFFERS else params)(tensors, f"{where}: {name}")


def latest(context: Context) -> dict:
    """The newest state staged in ``context.state`` (for inspection and tests)."""
    store = ContextState(context)
    staged = store._staged()
    return store.load(max(staged)) if staged else {}
