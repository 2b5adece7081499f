"""FedSAM server (Qu et al. 2022, Alg. 1), also DP-FedSAM's (Shi et al. 2023): the FedAvg
server; SAM lives on the clients, DP in the clients' uploads (common/privacy.py)."""

from __future__ import annotations

from strategies.fedavg import FedAvg


class FedSAM(FedAvg):
    """Same server rule and communication as FedAvg (1 model down, 1 up)."""


class DPFedSAM(FedSAM):
    """The FedAvg server over the clients' clipped, noised updates (uniform mean: ``aggregation
    = uniform`` is required with ``dp.clip > 0``)."""
