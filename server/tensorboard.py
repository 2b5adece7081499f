"""TensorBoard event files in the run directory (``tensorboard --logdir runs/``).

Every number of a metrics.jsonl line as a scalar (``metrics/<field>``), the round's clients
as histograms (``clients/<field>``: update norm, cosine to the mean update, losses and
accuracies before/after) and their drift summary as scalars (``drift/...``). On when the
run config's ``tensorboard`` is true and the package is installed; otherwise a no-op.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger("flwr.flatflower.server")

HISTOGRAMS = ("update_norm", "cosine_to_mean", "train_loss", "loss_before", "loss_after",
              "accuracy_before", "accuracy_after", "heldout_accuracy_before", "heldout_accuracy_after")


def drift(clients: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Client drift of one round from its clients.jsonl rows: mean and min cosine of the
    accepted updates to their mean, and the spread of their norms (std / mean)."""
    cos = [r["cosine_to_mean"] for r in clients if r.get("cosine_to_mean") is not None]
    norms = [r["update_norm"] for r in clients if r.get("update_norm") is not None]
    out = {}
    if cos:
        out.update(cosine_mean=float(np.mean(cos)), cosine_min=float(np.min(cos)))
    if norms and np.mean(norms) > 0:
        out.update(norm_mean=float(np.mean(norms)), norm_spread=float(np.std(norms) / np.mean(norms)))
    return out


class Board:
    """Writes one run's curves; every method is a no-op when disabled."""

    def __init__(self, run_dir: Path, enabled: bool):
        self.writer = None
        if not enabled:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            log.info("tensorboard is not installed: no event files (pip install tensorboard)")
            return
        self.writer = SummaryWriter(log_dir=str(run_dir), flush_secs=30)

    def add_round(self, row: Mapping[str, Any], clients: Sequence[Mapping[str, Any]] = ()) -> None:
        if self.writer is None:
            return
        step = int(row["round"])
        for key, value in row.items():
            if key != "round" and isinstance(value, (int, float)) and not isinstance(value, bool) \
                    and math.isfinite(value):
                self.writer.add_scalar(f"metrics/{key}", value, step)
        for key in HISTOGRAMS:
            values = [r[key] for r in clients if r.get(key) is not None]
            if values:
                self.writer.add_histogram(f"clients/{key}", np.asarray(values, dtype=np.float64), step)
        for key, value in drift(clients).items():
            self.writer.add_scalar(f"drift/{key}", value, step)
        self.writer.flush()  # a TensorBoard open on the run sees each round as it ends

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
