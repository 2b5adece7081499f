"""FedAvg client (FedSAM paper Alg. 1, FedAvg branch): w_{k+1} = w_k - lr * grad F(w_k)."""

from __future__ import annotations

from flatflower.client.algorithms.base import ClientRule


class FedAvgClient(ClientRule):
    """The plain gradient step; no hyperparameters of its own."""
