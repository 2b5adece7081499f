"""FedAvg client (FedSAM paper Alg. 1, FedAvg branch): w_{k+1} = w_k - lr * grad F(w_k)."""

from __future__ import annotations

from client.algorithms.base import ClientAlgorithm
from client.sam import loss_and_grad


class FedAvgClient(ClientAlgorithm):
    def direction(self, model, x, y):
        return loss_and_grad(model, x, y)
