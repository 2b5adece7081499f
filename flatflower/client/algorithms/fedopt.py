"""FedAdam's and FedYogi's clients (Reddi et al., ICLR 2021, Alg. 2): FedAvg's plain local SGD.
Their hyperparameters are the server's (strategies/fedopt.py).
"""

from __future__ import annotations

from flatflower.client.algorithms.fedavg import FedAvgClient


class FedOptClient(FedAvgClient):
    """The plain gradient step of FedAvg."""
