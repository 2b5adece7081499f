"""Fault injection for testing a federation (node-config ``inject-fault``; never set it in a
real run). ``KIND``, ``KIND@R`` (from round R on) or ``KIND@R-S`` (rounds R to S):

    raise      the ClientApp raises before training (an error reply; state untouched)
    exit       the ClientApp process dies (os._exit): a crashed client
    hang       the ClientApp sleeps far past any round deadline: a hung client
    nan        the reply's model is all NaN (after training)
    scale:F    the reply's update w_i - w is multiplied by F (an outlier), e.g. scale:100
    late:S     the reply leaves S seconds after the call finished (its state staged): a
               straggler, e.g. late:30@2-2
    mute       the ClientApp never answers the partition handshake (query); ``mute:S``: it
               answers after S seconds (a node that joins late)
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from dataclasses import dataclass

KINDS = ("raise", "exit", "hang", "nan", "scale", "late", "mute")
FOREVER = 24 * 3600.0  # seconds: far past any deadline


@dataclass(frozen=True)
class Fault:
    kind: str
    from_round: int = 1
    factor: float = 1.0  # scale's F, late's and mute's seconds
    to_round: int = 0  # the last round it acts in (0: every round from from_round on)

    @classmethod
    def parse(cls, text: str) -> Fault | None:
        """``""`` -> None; otherwise a Fault or ValueError naming the valid forms."""
        if not text:
            return None
        spec, _, rounds = text.partition("@")
        kind, _, arg = spec.partition(":")
        first, _, last = rounds.partition("-")
        takes_arg = {"scale": (True,), "late": (True,), "mute": (False, True)}.get(kind, (False,))
        try:
            fault = cls(kind, int(first) if first else 1,
                        float(arg) if arg else FOREVER if kind == "mute" else 1.0, int(last) if last else 0)
        except ValueError:
            fault = None
        if (fault is None or kind not in KINDS or bool(arg) not in takes_arg or fault.from_round < 1
                or (last and fault.to_round < fault.from_round)
                or (kind in ("late", "mute") and not 0 <= fault.factor <= FOREVER)):
            raise ValueError(f"inject-fault={text!r} is not one of: raise, exit, hang, nan, "
                             "scale:F, late:SECONDS, each optionally @ROUND or @FIRST-LAST; "
                             "mute, mute:SECONDS")
        return fault

    def active(self, server_round: int) -> bool:
        return server_round >= self.from_round and (not self.to_round or server_round <= self.to_round)

    def late_by(self, server_round: int) -> float:
        """Seconds the reply of this round is held back after the call finished."""
        return self.factor if self.kind == "late" and self.active(server_round) else 0.0

    def before_training(self, server_round: int) -> None:
        if not self.active(server_round):
            return
        if self.kind == "raise":
            raise RuntimeError(f"injected fault: raise (round {server_round})")
        if self.kind == "exit":
            os._exit(17)
        if self.kind == "hang":
            time.sleep(FOREVER)

    def before_query(self) -> None:
        """``mute``: the handshake's answer comes after ``factor`` seconds (never, by default)."""
        if self.kind == "mute":
            time.sleep(self.factor)

    def corrupt(self, server_round: int, start: OrderedDict, local: OrderedDict) -> OrderedDict:
        """The model the client reports instead of ``local``."""
        if not self.active(server_round) or self.kind not in ("nan", "scale"):
            return local
        local = OrderedDict((k, v.detach().cpu()) for k, v in local.items())
        if self.kind == "nan":
            return OrderedDict((k, v * float("nan")) for k, v in local.items())
        return OrderedDict((k, start[k] + self.factor * (v - start[k])) for k, v in local.items())
