"""Validation of everything a client sends (docs/reliability.md, "The principle").

The server checks what arrives, not what it claims: a reply must hold exactly the protocol's
records (any other ArrayRecord, ConfigRecord or MetricRecord, or metric key, is refused before
a value is read); every array is decoded and its decoded shape, dtype and values are checked
(not the header's), after a size check that refuses an array larger than the model's before it
is decoded; every number must be of its kind and in a meaningful range (a loss at most
:data:`MAX_LOSS`). Identity and weight come from the server: a reply must hold the
partition, the number of examples and of local steps the server assigned, and echo the nonce
of the message it answers (a replayed reply does not). Any exception while reading a reply is
that reply's rejection (:class:`RejectedReply`), never the run's end."""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from flatflower.common import codec
from flatflower.common import protocol as P

ArraySpecs = dict[str, tuple[tuple[int, ...], str]]  # array key -> (shape, dtype) a reply must hold
NPY_HEADER_BYTES = 4096  # an .npy header is at most a few hundred bytes
REASON_CHARS = 300  # how much of an unexpected error a rejection reason keeps
# The largest loss a reply may report. A cross-entropy is ln C for a uniform guess over C classes
# (2.3 for 10, 11.5 for 10^5) and float32 cannot hold a probability below e^-104: a loss of 10^6
# measures nothing but a diverged model, whose next steps overflow anyway (an honest client whose
# loss is not finite fails its round). It also keeps every loss far inside what TensorBoard bins.
MAX_LOSS = 1e6

T = TypeVar("T")


class RejectedReply(ValueError):
    """A reply that must not enter aggregation; the message says why."""


@dataclass
class ClientUpdate:
    """One accepted train reply, parsed. ``num_examples`` and ``num_steps`` are the server's
    own figures for the partition (the reply had to agree with them)."""

    node_id: int
    partition_id: int
    num_examples: int
    num_steps: int
    train_loss: float
    model: OrderedDict  # w_i, the local model after training
    records: dict[str, OrderedDict] = field(default_factory=dict)  # the algorithm's uploads
    reported: dict[str, float] = field(default_factory=dict)  # REPORTED metrics: for clients.jsonl only
    # the model's buffers (BatchNorm statistics), split off ``model`` by the strategy before its
    # rule sees the update (strategies/buffers.py); empty for a model without buffers
    buffers: OrderedDict = field(default_factory=OrderedDict)


@dataclass(frozen=True)
class Expected:
    """What the server knows a train or evaluate reply of one partition must say."""

    partition_id: int
    num_examples: int
    nonce: int
    num_steps: int = 0  # train replies only
    layout: ArraySpecs = field(default_factory=dict)
    uploads: tuple[str, ...] = ()


def layout_of(tensors: Mapping[str, torch.Tensor]) -> ArraySpecs:
    """Name -> (shape, numpy dtype name) of a set of named tensors."""
    return {k: (tuple(v.shape), str(v.numpy().dtype)) for k, v in tensors.items()}


def guarded(read: Callable[[], T]) -> T:
    """``read()``; any exception but RejectedReply becomes one, with a bounded reason."""
    try:
        return read()
    except RejectedReply:
        raise
    except Exception as err:  # noqa: BLE001 - a malformed reply may raise anything
        raise RejectedReply(f"unreadable: {type(err).__name__}: {str(err)[:REASON_CHARS]}") from None


# ---------------------------------------------------------------------------- arrays
def decode_array(where: str, arr: Any, shape: tuple[int, ...], dtype: str) -> torch.Tensor:
    """The array's decoded data as a tensor, if it is exactly ``dtype[shape]`` and finite."""
    if not isinstance(arr, Array) or arr.stype != codec.NUMPY_STYPE:
        raise RejectedReply(f"{where} is not a numpy array")
    expected = np.dtype(dtype)
    limit = expected.itemsize * math.prod(shape) + NPY_HEADER_BYTES
    if len(arr.data) > limit:
        raise RejectedReply(f"{where} holds {len(arr.data)} bytes, more than {dtype}{list(shape)} needs")
    value = codec.array_data(arr, dtype, shape)  # np.load unless the header is exactly np.save's
    if not isinstance(value, np.ndarray) or value.dtype != expected or value.shape != shape:
        got = f"{value.dtype}{list(value.shape)}" if isinstance(value, np.ndarray) else type(value).__name__
        raise RejectedReply(f"{where} is {got}, expected {dtype}{list(shape)}")
    if (str(arr.dtype), tuple(arr.shape)) != (dtype, shape):
        raise RejectedReply(f"{where}'s header says {arr.dtype}{list(arr.shape)}, its data "
                            f"{dtype}{list(shape)}")
    if value.dtype.kind == "f" and not np.isfinite(value).all():  # numpy's check: no torch op per array
        raise RejectedReply(f"{where} has NaN or Inf values")
    return torch.from_numpy(value.copy())


def parse_record(name: str, record: Any, layout: ArraySpecs) -> OrderedDict:
    """An ArrayRecord with exactly ``layout``'s keys, decoded and checked key by key."""
    keys = set(record.keys())
    missing, extra = sorted(set(layout) - keys), sorted(keys - set(layout))
    if missing or extra:
        raise RejectedReply(f"record '{name}' has missing keys {missing} / unexpected keys {extra[:5]}")
    return OrderedDict((key, decode_array(f"record '{name}' key '{key}'", record[key], shape, dtype))
                       for key, (shape, dtype) in layout.items())


# ---------------------------------------------------------------------------- metrics
def metric(metrics: Any, key: str, kind: type = float, low: float = -math.inf,
           high: float = math.inf, where: str = "metrics") -> float | int:
    """A finite number of ``kind`` (an int for ``int``; int or float for ``float``) in
    [low, high] under ``key`` of the record ``where`` (the reply's metrics, or its config),
    or RejectedReply saying what is wrong."""
    if key not in metrics:
        raise RejectedReply(f"{where} lack{'s' if where == 'config' else ''} '{key}'")
    value = metrics[key]
    allowed = (int,) if kind is int else (int, float)
    if isinstance(value, bool) or not isinstance(value, allowed):
        raise RejectedReply(f"metric '{key}'={str(value)[:40]} is not a "
                            f"{'whole number' if kind is int else 'number'}")
    if not math.isfinite(value) or not low <= value <= high:
        raise RejectedReply(f"metric '{key}'={value} is out of range [{low:g}, {high:g}]")
    return value


def check_identity(identity: Any, metrics: Any, expected: Expected) -> None:
    """The reply is for this message (the nonce its ``config`` echoes), this partition (its
    ``config``'s partition-id) and its size (its metrics' num-examples)."""
    if metric(identity, P.NONCE, int, where="config") != expected.nonce:
        raise RejectedReply("reply does not echo this message's nonce (a stale or replayed reply)")
    claimed = metric(identity, P.PARTITION_ID, int, where="config")
    if claimed != expected.partition_id:
        raise RejectedReply(f"reply claims partition {claimed}, node holds {expected.partition_id}")
    examples = metric(metrics, P.NUM_EXAMPLES, int)
    if examples != expected.num_examples:
        raise RejectedReply(f"reply claims {examples} examples, partition {expected.partition_id} "
                            f"has {expected.num_examples}")


# Optional train-reply metrics a client may add about itself (client/app.py): checked like every
# metric (a bad one refuses the reply), written to clients.jsonl, never used for aggregation.
REPORTED = {  # key -> upper bound (all >= 0)
    # loss and accuracy on its training data, accuracy on its own held-out data
    key: MAX_LOSS if key.startswith("loss-") else 1.0 for key in P.SELF_REPORTS
}


def reported_metrics(metrics: Any) -> dict[str, float]:
    """The REPORTED metrics present in a reply, each finite and in range (else RejectedReply)."""
    return {key: float(metric(metrics, key, float, 0.0, high)) for key, high in REPORTED.items()
            if key in metrics}


# ---------------------------------------------------------------------------- records
# What each reply holds (client/app.py); anything else is refused before a value is read.
# The metrics are what the client measured; which partition and which message a reply answers
# (bookkeeping, not a metric: a stock Flower strategy would average every metric) travel in the
# reply's ``config`` record, IDENTITY (docs/protocol.md).
TRAIN_METRICS = frozenset({P.NUM_EXAMPLES, P.NUM_STEPS, P.TRAIN_LOSS, *REPORTED})
EVALUATE_METRICS = frozenset({P.NUM_EXAMPLES, P.EVAL_LOSS, P.EVAL_ACCURACY})
HANDSHAKE_METRICS = frozenset({P.NUM_PARTITIONS, P.NUM_EXAMPLES, P.NUM_HELDOUT})
IDENTITY = frozenset({P.PARTITION_ID, P.NONCE})  # every reply's 'config' record
HANDSHAKE_CONFIGS = {P.NODE: frozenset({P.DEVICE})}  # what the node runs on (not used by the server)
CONFIG_CHARS = 100  # the longest text a protocol ConfigRecord value may be


def _few(names: Any) -> list[str]:
    """Up to five of ``names``, each cut to 40 characters (for a bounded reason)."""
    return [str(name)[:40] for name in sorted(names, key=str)[:5]]


def _by_kind(content: RecordDict) -> tuple[dict, dict, dict]:
    """The content's ArrayRecords, ConfigRecords and MetricRecords by name, in one pass
    (Flower's typed views, ``content.array_records`` and the like, each build a new checked
    dict from the whole content)."""
    kinds: tuple[dict, dict, dict] = ({}, {}, {})
    for name, record in content.items():
        for kind, into in zip((ArrayRecord, ConfigRecord, MetricRecord), kinds):
            if isinstance(record, kind):
                into[name] = record
    return kinds


def records_of(msg: Message, keys: frozenset, arrays: frozenset = frozenset(),
               texts: Mapping[str, frozenset] | None = None) -> tuple[Any, Any]:
    """The reply's ('metrics', 'config') records, once the reply is seen to hold exactly the
    protocol's records: the ArrayRecords ``arrays``, one MetricRecord 'metrics' whose keys are
    among ``keys``, one ConfigRecord 'config' whose keys are among :data:`IDENTITY`, and no
    other ConfigRecord but those of ``texts`` (name -> its keys, short texts)."""
    texts = texts or {}
    arrays_in, configs, metric_records = _by_kind(msg.content)
    got = set(arrays_in)
    if got != arrays:
        raise RejectedReply(f"array records {_few(got)} do not match the protocol {sorted(arrays)}"
                            if arrays else f"unexpected array records {_few(got)}")
    if extra := set(configs) - set(texts) - {P.CONFIG}:
        raise RejectedReply(f"unexpected config records {_few(extra)}")
    for name, allowed in texts.items():
        record = configs.get(name, {})
        if extra := set(record) - allowed:
            raise RejectedReply(f"config record '{name}' has unexpected keys {_few(extra)}")
        if any(not isinstance(v, str) or len(v) > CONFIG_CHARS for v in record.values()):
            raise RejectedReply(f"config record '{name}' holds other than texts of at most "
                                f"{CONFIG_CHARS} characters")
    if P.METRICS not in metric_records:
        raise RejectedReply("reply has no 'metrics' record")
    if extra := set(metric_records) - {P.METRICS}:
        raise RejectedReply(f"unexpected metric records {_few(extra)}")
    metrics = metric_records[P.METRICS]
    if extra := set(metrics) - keys:
        raise RejectedReply(f"metrics hold unexpected keys {_few(extra)}")
    if P.CONFIG not in configs:
        raise RejectedReply("reply has no 'config' record (its partition-id and the nonce it echoes)")
    identity = configs[P.CONFIG]
    if extra := set(identity) - IDENTITY:
        raise RejectedReply(f"config record '{P.CONFIG}' has unexpected keys {_few(extra)}")
    return metrics, identity


# ---------------------------------------------------------------------------- replies
def parse_train_reply(msg: Message, node_id: int, expected: Expected) -> ClientUpdate:
    """The reply as a ClientUpdate, or RejectedReply with the reason."""
    return guarded(lambda: _parse_train_reply(msg, node_id, expected))


def _parse_train_reply(msg: Message, node_id: int, expected: Expected) -> ClientUpdate:
    metrics, identity = records_of(msg, TRAIN_METRICS, arrays=frozenset({P.MODEL, *expected.uploads}))
    check_identity(identity, metrics, expected)
    steps = metric(metrics, P.NUM_STEPS, int)
    if steps != expected.num_steps:
        raise RejectedReply(f"reply claims {steps} local steps, the round asks for {expected.num_steps}")
    train_loss = float(metric(metrics, P.TRAIN_LOSS, float, 0.0, MAX_LOSS))
    return ClientUpdate(
        node_id=node_id,
        partition_id=expected.partition_id,
        num_examples=expected.num_examples,
        num_steps=expected.num_steps,
        train_loss=train_loss,
        reported=reported_metrics(metrics),
        # records_of saw that exactly these names hold ArrayRecords: read by name, no second typed view
        model=parse_record(P.MODEL, msg.content[P.MODEL], expected.layout),
        records={name: parse_record(name, msg.content[name], expected.layout)
                 for name in expected.uploads},
    )


def parse_evaluate_reply(msg: Message, expected: Expected) -> tuple[float, float]:
    """(eval-loss, eval-accuracy) of a federated-evaluation reply, or RejectedReply."""
    def read() -> tuple[float, float]:
        metrics, identity = records_of(msg, EVALUATE_METRICS)
        check_identity(identity, metrics, expected)
        return (float(metric(metrics, P.EVAL_LOSS, float, 0.0, MAX_LOSS)),
                float(metric(metrics, P.EVAL_ACCURACY, float, 0.0, 1.0)))

    return guarded(read)


@dataclass(frozen=True)
class Handshake:
    """What a valid handshake reply declares."""

    partition_id: int
    num_examples: int  # the training set's size
    num_heldout: int | None  # the held-out set's size, where the node holds data out (else None)


def parse_handshake_reply(msg: Message, nonce: int, num_partitions: int,
                          max_examples: int = 2**31 - 1) -> Handshake:
    """The declarations of a handshake reply, or RejectedReply: sizes are whole numbers in
    [1, ``max_examples``] (a held-out set may be empty: 0)."""
    def read() -> Handshake:
        metrics, identity = records_of(msg, HANDSHAKE_METRICS, texts=HANDSHAKE_CONFIGS)
        if metric(identity, P.NONCE, int, where="config") != nonce:
            raise RejectedReply("handshake reply does not echo its nonce (a stale or replayed reply)")
        n = metric(metrics, P.NUM_PARTITIONS, int)
        if n != num_partitions:
            raise RejectedReply(f"node is configured for num-partitions={n}, the run has {num_partitions}")
        pid = metric(identity, P.PARTITION_ID, int, 0, num_partitions - 1, where="config")
        examples = metric(metrics, P.NUM_EXAMPLES, int, 1)
        if examples > max_examples:
            raise RejectedReply(f"declares {examples} training examples, more than max-node-examples="
                                f"{max_examples}")
        heldout = metric(metrics, P.NUM_HELDOUT, int, 0) if P.NUM_HELDOUT in metrics else None
        if heldout is not None and heldout > max_examples:
            raise RejectedReply(f"declares {heldout} held-out examples, more than max-node-examples="
                                f"{max_examples}")
        return Handshake(int(pid), int(examples), None if heldout is None else int(heldout))

    return guarded(read)
