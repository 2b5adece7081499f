"""FedSAM server (Qu et al. 2022, Alg. 1): the FedAvg server; SAM lives on the clients.
DP-FedSAM's server (strategies/dp_fedsam.py) is this one."""

from __future__ import annotations

from flatflower.strategies.fedavg import FedAvg


class FedSAM(FedAvg):
    """Same server rule and communication as FedAvg (1 model down, 1 up)."""
