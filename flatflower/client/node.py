"""Per-node settings from ``context.node_config`` (``flower-supernode --node-config``).

Keys: ``partition-id`` and ``num-partitions`` (required; the simulation engine injects
them), ``device`` (``auto`` = CUDA when present, else CPU; or ``cpu``, ``cuda``, ``cuda:1``,
``mps``; one this machine lacks is refused at the handshake, in one line),
``data-dir`` (where this node keeps its datasets; overrides the run config's),
``state-dir`` (a node-local directory where the client mirrors its state, so a restarted
SuperNode or a resumed run continues from it; overrides the run config's
``client-state-dir``) and ``threads`` (CPU threads for torch, default 1 so runs are
reproducible across runtimes). ``inject-fault`` makes the client misbehave, for tests
(client/faults.py).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from flatflower.client.faults import Fault
from flatflower.common.config import remembered_by_items

@dataclass(frozen=True)
class NodeSettings:
    partition_id: int
    num_partitions: int
    device: str = "auto"
    data_dir: str = ""
    state_dir: str = ""
    threads: int = 1
    inject_fault: str = ""  # testing only: client/faults.py

    @classmethod
    def from_node_config(cls, node_config: Mapping[str, Any]) -> NodeSettings:
        """The settings, or ValueError in one line; remembered (common/config.py
        remembered_by_items: a client reads the same node config at every call)."""
        return _remembered(node_config)

    @classmethod
    def _read(cls, node_config: Mapping[str, Any]) -> NodeSettings:
        for key in ("partition-id", "num-partitions"):
            if key not in node_config:
                raise ValueError(
                    f"node config lacks '{key}': start the SuperNode with "
                    '--node-config "partition-id=<i> num-partitions=<N>"'
                )
        for key in ("partition-id", "num-partitions", "threads"):
            value = node_config.get(key, 1)
            if (isinstance(value, bool) or (isinstance(value, float) and not value.is_integer())
                    or (isinstance(value, str) and not value.strip().lstrip("-").isdigit())):
                raise ValueError(f"node config '{key}' must be a whole number (got {value!r})")
        device = str(node_config.get("device", "auto"))
        if not re.fullmatch(DEVICES, device):
            raise ValueError(f"node config device={device!r} is not one of: auto, cpu, cuda, cuda:<i>, mps")
        try:
            settings = cls(
                partition_id=int(node_config["partition-id"]),
                num_partitions=int(node_config["num-partitions"]),
                device=str(node_config.get("device", "auto")),
                data_dir=str(node_config.get("data-dir", "")),
                state_dir=str(node_config.get("state-dir", "")),
                threads=int(node_config.get("threads", 1)),
                inject_fault=str(node_config.get("inject-fault", "")),
            )
            Fault.parse(settings.inject_fault)
        except (TypeError, ValueError) as err:
            raise ValueError(f"invalid node config {dict(node_config)}: {err}") from None
        if settings.num_partitions < 1:
            raise ValueError(f"num-partitions must be >= 1 (got {settings.num_partitions})")
        if not 0 <= settings.partition_id < settings.num_partitions:
            raise ValueError(
                f"partition-id {settings.partition_id} is out of range "
                f"[0, {settings.num_partitions - 1}] for num-partitions={settings.num_partitions}"
            )
        if settings.threads < 1:
            raise ValueError(f"threads must be >= 1 (got {settings.threads})")
        return settings

    def torch_device(self) -> torch.device:
        """The device to train on; ``auto`` picks CUDA when available."""
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        missing = device_missing(self.device)
        if missing:
            raise ValueError(f"partition {self.partition_id}: device={self.device!r} requested but {missing} "
                             "on this node")
        return torch.device(self.device)


_remembered = remembered_by_items(maxsize=8192)(NodeSettings._read)


DEVICES = r"auto|cpu|cuda(:\d+)?|mps"  # what a node config's device (and `flatflower local --device`) may say


def device_missing(text: str) -> str:
    """Why this machine cannot train on device ``text`` (one of DEVICES), or "" when it can: the
    CLI asks before anything starts, a SuperNode at the handshake (instead of failing in round 1)."""
    device = torch.device("cpu" if text == "auto" else text)
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if not count:
            return "CUDA is not available"
        if (device.index or 0) >= count:
            return f"there is no CUDA device {device.index} ({count} GPU{'s' if count > 1 else ''}: cuda:0..{count - 1})"
    if device.type == "mps" and not torch.backends.mps.is_available():
        return "MPS (Apple's GPU) is not available"
    return ""
