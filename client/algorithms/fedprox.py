"""FedProx client (Li et al. 2020) and FedACG's client (Kim et al. 2024), which is the same
rule around the look-ahead model the FedACG server broadcasts.

Local objective  F_i(w) + (mu/2) ||w - w^t||^2  (squared: its gradient is mu (w - w^t)),

    w_{k+1} = w_k - lr * ( g_k + mu (w_k - w^t) )

with w^t the model received this round. mu = 0 is FedAvg.
"""

from __future__ import annotations

from client.algorithms.base import ClientAlgorithm
from client.sam import loss_and_grad, trainable


class FedProxClient(ClientAlgorithm):
    def __init__(self, cfg, model, broadcast, state, **kwargs):
        super().__init__(cfg, model, broadcast, state, **kwargs)
        self.start = [p.detach().clone() for p in trainable(model)]  # w^t

    def prox_weight(self) -> float:
        return self.cfg.fedprox_mu

    def direction(self, model, x, y):
        loss, g = loss_and_grad(model, x, y)
        mu = self.prox_weight()
        return loss, [gi + mu * (p.detach() - p0) for gi, p, p0 in zip(g, trainable(model), self.start)]


class FedACGClient(FedProxClient):
    """FedACG: the prox term pulls towards the received look-ahead model w^t + lambda m^t,
    with weight ``fedacg-beta`` (the local penalty of Kim et al. 2024, eq. 6)."""

    def prox_weight(self) -> float:
        return self.cfg.fedacg_beta
