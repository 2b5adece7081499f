"""TensorBoard event files in the run directory (``tensorboard --logdir runs/``).

Every number of a metrics.jsonl line as a scalar (``metrics/<field>``: ``metrics/test_accuracy``, and
``metrics/federated_accuracy`` / ``federated_loss`` where federated evaluation ran; the flatness fields of
common/flatness.py as ``flatness/<field>``), the round's clients
as histograms (``clients/<field>``: update norm, cosine to the mean update, losses and
accuracies before/after) and their drift summary as scalars (``drift/...``). On when the
run config's ``tensorboard`` is true and the package is installed; otherwise a no-op.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from flatflower.common.flatness import ROUND_FIELDS

log = logging.getLogger("flwr.flatflower.server")

HISTOGRAMS = ("update_norm", "cosine_to_mean", "train_loss", "loss_before", "loss_after",
              "accuracy_before", "accuracy_after", "heldout_accuracy_before", "heldout_accuracy_after")
HISTOGRAM_LIMIT = 1e19  # inside SummaryWriter's last histogram bucket (just below 1e20; all beyond: it raises)
SCALAR_LIMIT = float(np.finfo(np.float32).max)  # an event file stores each scalar as a float32


def numbers(values: Iterable[Any]) -> list[float]:
    """The finite real numbers among ``values`` (a bool, text, None, NaN or Inf is left out)."""
    out = []
    for v in values:
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            try:
                v = float(v)
            except OverflowError:  # an int beyond any float
                continue
            if math.isfinite(v):
                out.append(v)
    return out


def drift(clients: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Client drift of one round from its clients.jsonl rows: mean and min cosine of the
    accepted updates to their mean, and the spread of their norms (std / mean). Only finite
    numbers count; norms are scaled by the largest, so no size overflows."""
    cos = numbers(r.get("cosine_to_mean") for r in clients)
    norms = numbers(r.get("update_norm") for r in clients)
    out = {}
    if cos:
        out.update(cosine_mean=float(np.mean(cos)), cosine_min=float(np.min(cos)))
    scale = max(map(abs, norms), default=0.0)
    if scale > 0:
        x = np.asarray(norms) / scale
        if x.mean() > 0:
            out.update(norm_mean=float(scale * x.mean()), norm_spread=float(x.std() / x.mean()))
    return out


class Board:
    """Writes one run's curves; every method is a no-op when disabled. Nothing a round holds
    can make it raise: a number TensorBoard cannot hold is left out of a scalar (beyond
    float32) or clipped in a histogram (to +-1e19; clients.jsonl keeps the exact value), and a
    writer's error is logged once and skips that curve, never the run."""

    def __init__(self, run_dir: Path, enabled: bool):
        self.writer = None
        self.warned: set[str] = set()
        if not enabled:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            log.info("tensorboard is not installed: no event files (pip install tensorboard)")
            return
        self.writer = SummaryWriter(log_dir=str(run_dir), flush_secs=30)

    def warn_once(self, kind: str, message: str) -> None:
        if kind not in self.warned:
            self.warned.add(kind)
            log.warning("TensorBoard: %s", message)

    def write(self, method: str, *args: Any) -> None:
        """``writer.method(*args)``; an error is logged once (per method) and skipped."""
        try:
            getattr(self.writer, method)(*args)
        except Exception as err:  # noqa: BLE001 - event files must never end a run
            self.warn_once(method, f"{method} failed, skipped ({type(err).__name__}: {str(err)[:200]})")

    def scalar(self, tag: str, value: Any, step: int) -> None:
        found = numbers([value])
        if not found:
            return
        number = found[0]
        if abs(number) > SCALAR_LIMIT:
            self.warn_once("scalar", f"{tag}={number:g} is beyond float32: left out of the event file")
            return
        self.write("add_scalar", tag, number, step)

    def add_round(self, row: Mapping[str, Any], clients: Sequence[Mapping[str, Any]] = ()) -> None:
        if self.writer is None:
            return
        step = int(row["round"])
        for key, value in row.items():
            if key != "round":
                self.scalar(f"{'flatness' if key in ROUND_FIELDS else 'metrics'}/{key}", value, step)
        for key in HISTOGRAMS:
            values = np.asarray(numbers(r.get(key) for r in clients), dtype=np.float64)
            if values.size:
                if np.abs(values).max() > HISTOGRAM_LIMIT:
                    self.warn_once("histogram", f"clients/{key} holds values beyond +-{HISTOGRAM_LIMIT:g}: "
                                   "clipped there in its histogram (clients.jsonl has them exactly)")
                self.write("add_histogram", f"clients/{key}",
                           np.clip(values, -HISTOGRAM_LIMIT, HISTOGRAM_LIMIT), step)
        for key, value in drift(clients).items():
            self.scalar(f"drift/{key}", value, step)
        self.write("flush")  # a TensorBoard open on the run sees each round as it ends

    def close(self) -> None:
        if self.writer is not None:
            self.write("close")
            self.writer = None
