"""FedSOL server (Lee et al., CVPR 2024; Lee-Gihun/FedSOL @ebc3f64 BaseServer.py L164-176):
the FedAvg server. FedSOL's proximal perturbation lives on the clients."""

from __future__ import annotations

from flatflower.strategies.fedavg import FedAvg


class FedSOL(FedAvg):
    """Same server rule and communication as FedAvg (1 model down, 1 up)."""
