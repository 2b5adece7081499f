"""FedProx server (Li et al. 2020): the FedAvg server; the prox term lives on the clients."""

from __future__ import annotations

from flatflower.strategies.fedavg import FedAvg


class FedProx(FedAvg):
    """Same server rule and communication as FedAvg (1 model down, 1 up)."""
