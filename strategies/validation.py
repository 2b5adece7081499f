"""Validation of client replies: wrong records, keys, shapes, dtypes or non-finite values
reject the reply (the round goes on with the others)."""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from flwr.app import ArrayRecord, Message

from common import protocol as P

Layout = dict[str, tuple[tuple[int, ...], str]]


class RejectedReply(ValueError):
    """A reply that must not enter aggregation; the message says why."""


@dataclass
class ClientUpdate:
    """One accepted train reply, parsed."""

    node_id: int
    partition_id: int
    num_examples: int
    num_steps: int
    train_loss: float
    model: OrderedDict  # w_i, the local model after training
    records: dict[str, OrderedDict] = field(default_factory=dict)  # the algorithm's uploads


def layout_of(tensors: OrderedDict) -> Layout:
    """Name -> (shape, numpy dtype name) of a set of named tensors."""
    return {k: (tuple(v.shape), str(v.numpy().dtype)) for k, v in tensors.items()}


def _parse_record(name: str, record: ArrayRecord, layout: Layout) -> OrderedDict:
    missing = sorted(set(layout) - set(record))
    extra = sorted(set(record) - set(layout))
    if missing or extra:
        raise RejectedReply(f"record '{name}' has missing keys {missing} / unexpected keys {extra}")
    out = OrderedDict()
    for key, (shape, dtype) in layout.items():
        arr = record[key]
        if tuple(arr.shape) != shape or arr.dtype != dtype:
            raise RejectedReply(
                f"record '{name}' key '{key}' is {arr.dtype}{list(arr.shape)}, "
                f"expected {dtype}{list(shape)}"
            )
        tensor = torch.from_numpy(arr.numpy().copy())
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise RejectedReply(f"record '{name}' key '{key}' has NaN or Inf values")
        out[key] = tensor
    return out


def metric_value(metrics, key: str, minimum: float) -> float:
    """A finite metric >= minimum, or RejectedReply saying what is wrong."""
    if key not in metrics:
        raise RejectedReply(f"metrics lack '{key}'")
    value = float(metrics[key])
    if not math.isfinite(value) or value < minimum:
        raise RejectedReply(f"metric '{key}'={value} is invalid")
    return value


def parse_train_reply(
    msg: Message, node_id: int, partition_id: int, layout: Layout, uploads: tuple[str, ...]
) -> ClientUpdate:
    """Check a train reply against the protocol; raise RejectedReply with the reason."""
    content = msg.content
    expected = {P.MODEL, *uploads}
    got = set(content.array_records)
    if got != expected:
        raise RejectedReply(
            f"array records {sorted(got)} do not match the protocol {sorted(expected)}"
        )
    if P.METRICS not in content.metric_records:
        raise RejectedReply("reply has no 'metrics' record")
    metrics = content.metric_records[P.METRICS]
    reported = int(metric_value(metrics, "partition-id", 0))
    if reported != partition_id:
        raise RejectedReply(f"reply claims partition {reported}, node holds {partition_id}")
    num_examples = metric_value(metrics, "num-examples", 1)
    num_steps = metric_value(metrics, "num-steps", 1)
    train_loss = metric_value(metrics, "train-loss", 0)
    return ClientUpdate(
        node_id=node_id,
        partition_id=partition_id,
        num_examples=int(num_examples),
        num_steps=int(num_steps),
        train_loss=train_loss,
        model=_parse_record(P.MODEL, content.array_records[P.MODEL], layout),
        records={name: _parse_record(name, content.array_records[name], layout) for name in uploads},
    )
