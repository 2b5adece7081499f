"""clients.jsonl: one line per sampled client per round, what the server knows of each.

Server-side, computed from what it received and accepted: the examples and local steps it
assigned, the update norm ||w_i - w|| (w: the point the clients started from) and the cosine of
each update to the round's weighted mean update, the reason a reply was refused or a client
failed. Client-reported (validated like every metric, never aggregated): loss and accuracy on
its training data before and after training, accuracy on its own held-out data.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from flatflower.common import protocol as P
from flatflower.common.tensors import stacked_blocks
from flatflower.strategies.strategy import RoundRecord

REPORTED_FIELDS = {key: key.replace("-", "_") for key in P.SELF_REPORTS}  # client metric -> clients.jsonl field


def _deltas(start, models) -> torch.Tensor:
    """One float64 row per model: its floating-point tensors flattened in ``start``'s order,
    minus ``start``'s. Built a tensor at a time over a block of models (one stack, one exact
    cast, one subtraction), the same numbers as each model flattened and subtracted on its own."""
    keys = [k for k, t in start.items() if t.is_floating_point()]
    deltas = torch.empty((len(models), sum(start[k].numel() for k in keys)), dtype=torch.float64)
    column = 0
    for k in keys:
        size = start[k].numel()
        center = start[k].detach().reshape(-1).double()
        for first, block in stacked_blocks([m[k] for m in models]):
            deltas[first:first + len(block), column:column + size].copy_(block).sub_(center)
        column += size
    return deltas


def client_rows(record: RoundRecord, server_round: int) -> list[dict[str, Any]]:
    """The rows of a training round (``FlatStrategy.round_record()``), in the order the
    partitions were sampled."""
    start, updates = record.start, record.updates
    rows: dict[int, dict[str, Any]] = {}
    for pid in record.stats.sampled_partitions:
        rows[pid] = {"round": server_round, "partition": pid, "status": "failed",
                     "reason": record.failure_reasons.get(pid, "no accepted reply"),
                     "examples": record.examples[pid], "steps": record.steps[pid]}
    for refusal in record.stats.rejections:
        if refusal["stage"] == "train" and refusal["partition"] in rows:
            rows[refusal["partition"]].update(status="rejected", reason=refusal["reason"])
    if updates:
        deltas = _deltas(start, [u.model for u in updates])  # one row per update
        # in units of the largest entry where squares could overflow (float64 models): no norm
        # or cosine of a huge but finite update becomes Inf or NaN
        low, high = deltas.aminmax() if deltas.numel() else (torch.zeros(()), torch.zeros(()))
        scale = max(-float(low), float(high))
        if 1e150 < scale < math.inf:
            deltas /= scale
        else:
            scale = 1.0
        weights = record.weights
        mean = torch.tensor(weights, dtype=deltas.dtype) @ deltas
        mean_norm = float(mean.norm())
        norms, dots = torch.linalg.vector_norm(deltas, dim=1).tolist(), (deltas @ mean).tolist()
        for u, w, norm, dot in zip(updates, weights, norms, dots):
            cosine = dot / (norm * mean_norm) if norm > 0 and mean_norm > 0 else math.nan
            row = rows.setdefault(u.partition_id, {"round": server_round, "partition": u.partition_id,
                                                   "examples": u.num_examples, "steps": u.num_steps})
            row.update(status="accepted", reason=None, node=u.node_id, weight=float(w),
                       train_loss=u.train_loss, update_norm=scale * norm,
                       cosine_to_mean=max(-1.0, min(1.0, cosine)) if math.isfinite(cosine) else None)
            row.update({REPORTED_FIELDS[k]: v for k, v in u.reported.items()})
    for row in rows.values():
        for key in ("node", "weight", "train_loss", "update_norm", "cosine_to_mean", *REPORTED_FIELDS.values()):
            row.setdefault(key, None)
            if isinstance(row[key], float) and not math.isfinite(row[key]):
                row[key] = None
    return list(rows.values())
