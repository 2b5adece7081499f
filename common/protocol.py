"""The wire protocol: record names and tensor <-> ArrayRecord conversion.

Every train message carries ``arrays`` (the model the clients start from: the global model,
or the strategy's ``start_point``, e.g. FedACG's look-ahead theta + lambda m) and ``config``
(``server-round``, ``nonce``, ``state-round``: the client's last accepted round), plus the
extra ArrayRecords its algorithm declares in strategies/registry.py (``down``). Every train reply
carries ``arrays`` (the local model after training), ``metrics`` (num-examples, num-steps,
train-loss, partition-id, the echoed nonce, and optional self-reports) and the algorithm's
``up`` records. Learning rates are not sent: each client derives the round's lr from the run
config and ``server-round``.
"""

from __future__ import annotations

import functools
import io
import math
from collections import OrderedDict
from collections.abc import Mapping

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, RecordDict

# Record names. One constant per name, so a typo is an import error, not a silent miss.
MODEL = "arrays"
CONFIG = "config"
METRICS = "metrics"
GLOBAL_UPDATE = "global_update"  # FedCM / MoFedSAM / FedTOGA: the server's global update Delta
EMA_MODEL = "ema_model"  # FedGMT: the server's EMA ("trajectory") model e
MOMENTUM = "server_momentum"  # FedNSAM: the server's Nesterov momentum m
CONTROL = "control_variate"  # SCAFFOLD family: the server control variate c
GLOBAL_PERTURBATION = "global_perturbation"  # FedSMOO: the server's global perturbation s

# Uploads besides the local model.
CONTROL_DELTA = "control_delta"  # SCAFFOLD family: c_i^+ - c_i
PERTURBATION_CORRECTION = "perturbation_correction"  # FedSMOO: s~_i = mu_i - s^_{i,K}

# Server-side state (never sent) and client-side state (``context.state``) record names.
DUAL = "dual"  # FedDyn family: server dual h / client dual h_i (FedGMT: u, u_m)
CLIENT_EMA = "ema"  # FedGMT-v2: the client's own EMA model e_m
CLIENT_CONTROL = "control"  # SCAFFOLD family: the client control variate c_i
PERTURBATION_DUAL = "perturbation_dual"  # FedSMOO: the client's perturbation dual mu_i
PREVIOUS_GLOBAL = "previous_global"  # FedLESAM: the global model of the client's last round
ADAPTIVE_M = "adaptive_m"  # FedAdam / FedYogi: server first moment
ADAPTIVE_V = "adaptive_v"  # FedAdam / FedYogi: server second moment

# Keys inside the records (a message's wire vocabulary, used by both sides).
SERVER_ROUND = "server-round"  # config: the round this message belongs to
NONCE = "nonce"  # config: a fresh random number per round; every reply's metrics echo it
STATE_ROUND = "state-round"  # config of a train message: the client's last round the server accepted
NUM_EXAMPLES = "num-examples"  # metrics: the client's examples (the server checks it against its own)
NUM_STEPS = "num-steps"  # metrics of a train reply: local steps run
TRAIN_LOSS = "train-loss"  # metrics of a train reply: mean local training loss
PARTITION_ID = "partition-id"  # metrics: the partition the client holds
NUM_PARTITIONS = "num-partitions"  # metrics of a handshake reply: the N the node was configured for
EVAL_LOSS = "eval-loss"  # metrics of an evaluate reply
EVAL_ACCURACY = "eval-accuracy"  # metrics of an evaluate reply
NODE = "node"  # a handshake reply's ConfigRecord: what the node runs on (not used by the server)
DEVICE = "device"  # NODE's one key: the torch device the client trains on
# ``client-eval`` self-reports a train reply may add (checked, written to clients.jsonl, never
# aggregated): "<measure>-before" / "<measure>-after" training, for each measure.
SELF_REPORT_MEASURES = ("loss", "accuracy", "heldout-accuracy")
SELF_REPORTS = tuple(f"{m}-{when}" for m in SELF_REPORT_MEASURES for when in ("before", "after"))


def self_report_key(measure: str, when: str) -> str:
    """The metric name of a self-report: ``loss-before``, ``heldout-accuracy-after``, ..."""
    key = f"{measure}-{when}"
    if key not in SELF_REPORTS:
        raise ValueError(f"no self-report {key!r}; the protocol has {', '.join(SELF_REPORTS)}")
    return key


NUMPY_STYPE = "numpy.ndarray"  # the only array serialisation the server decodes


@functools.lru_cache(maxsize=1024)
def npy_header(dtype: str, shape: tuple[int, ...]) -> bytes:
    """The bytes ``np.save`` writes before the data of a C-ordered ``dtype[shape]`` array."""
    blob = io.BytesIO()
    value = np.empty(shape, dtype=np.dtype(dtype))
    np.save(blob, value, allow_pickle=False)
    return blob.getvalue()[: len(blob.getvalue()) - value.nbytes]


def as_array(value: np.ndarray) -> Array:
    """A numpy array -> the Array ``Array(value)`` makes (an npy blob), without np.save's
    per-call header formatting."""
    if not value.flags.c_contiguous:
        value = np.ascontiguousarray(value)  # (ascontiguousarray makes a 0-d array 1-d)
    header = npy_header(str(value.dtype), tuple(value.shape))
    return Array(dtype=str(value.dtype), shape=tuple(value.shape), stype=NUMPY_STYPE,
                 data=header + value.tobytes())


def array_data(arr: Array, dtype: str | None = None, shape: tuple[int, ...] | None = None) -> np.ndarray:
    """An Array's numpy value (read-only). An npy blob whose header is exactly the one np.save
    writes for ``dtype[shape]`` (default: what the Array declares) is read in place, without
    np.load's header parse; any other blob goes through ``np.load`` (no pickles)."""
    dtype = str(arr.dtype) if dtype is None else dtype
    shape = tuple(arr.shape) if shape is None else shape
    try:
        header = npy_header(dtype, shape)
        size = np.dtype(dtype).itemsize * math.prod(shape)
    except (TypeError, ValueError):  # not a dtype or shape numpy knows: the general path
        header, size = None, -1
    data = arr.data
    if header is not None and len(data) == len(header) + size and data.startswith(header):
        return np.frombuffer(data, dtype=np.dtype(dtype), offset=len(header)).reshape(shape)
    return np.load(io.BytesIO(data), allow_pickle=False)


def to_record(tensors: Mapping[str, torch.Tensor]) -> ArrayRecord:
    """Named tensors -> ArrayRecord (order kept, copied to CPU numpy)."""
    return ArrayRecord({name: as_array(t.detach().cpu().numpy()) for name, t in tensors.items()})


def from_record(record: ArrayRecord) -> OrderedDict[str, torch.Tensor]:
    """ArrayRecord -> named tensors (CPU, writable copies)."""
    return OrderedDict((name, torch.from_numpy(array_data(arr).copy())) for name, arr in record.items())


def payload_bytes(content: RecordDict) -> int:
    """Bytes of all array payloads in a message (what the model traffic costs)."""
    return sum(rec.count_bytes() for rec in content.array_records.values())
