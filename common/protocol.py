"""The wire protocol: record names and tensor <-> ArrayRecord conversion.

Every train message carries ``arrays`` (the global model) and ``config`` (round, lr), plus
the extra ArrayRecords its algorithm declares in ``common.registry`` (``down``). Every train
reply carries ``arrays`` (the local model after training), ``metrics`` (num-examples,
num-steps, train-loss, partition-id) and the algorithm's ``up`` records.
"""

from __future__ import annotations

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

NUMPY_STYPE = "numpy.ndarray"  # the only array serialisation the server decodes

Tensors = "OrderedDict[str, torch.Tensor]"


def to_record(tensors: Mapping[str, torch.Tensor]) -> ArrayRecord:
    """Named tensors -> ArrayRecord (order kept, copied to CPU numpy)."""
    return ArrayRecord(
        {name: Array(np.ascontiguousarray(t.detach().cpu().numpy())) for name, t in tensors.items()}
    )


def from_record(record: ArrayRecord) -> OrderedDict[str, torch.Tensor]:
    """ArrayRecord -> named tensors (CPU, writable copies)."""
    return OrderedDict((name, torch.from_numpy(arr.numpy().copy())) for name, arr in record.items())


def payload_bytes(content: RecordDict) -> int:
    """Bytes of all array payloads in a message (what the model traffic costs)."""
    return sum(rec.count_bytes() for rec in content.array_records.values())
