"""FedProx client (Li et al. 2020) and FedACG's client (Kim et al. 2024), which is the same
rule around the look-ahead model the FedACG server broadcasts.

Local objective  F_i(w) + (mu/2) ||w - w^t||^2  (squared: its gradient is mu (w - w^t)),

    w_{k+1} = w_k - lr * ( g_k + mu (w_k - w^t) )

with w^t the model received this round. mu = 0 is FedAvg.
"""

from __future__ import annotations

from dataclasses import dataclass

from client.algorithms.base import ClientRule
from client.tensors import add, scale, sub
from common.params import FRACTION, NONNEGATIVE, Params, key


@dataclass(frozen=True)
class FedProxParams(Params):
    mu: float = key("fedprox.mu", 0.01, "prox weight mu in (mu/2)||w - w^t||^2", NONNEGATIVE)


@dataclass(frozen=True)
class FedACGParams(Params):
    lam: float = key("fedacg.lambda", 0.85, "server momentum and look-ahead lambda (server)", FRACTION)
    beta: float = key("fedacg.beta", 0.01, "prox weight beta toward the look-ahead (client)", NONNEGATIVE)


class FedProxClient(ClientRule):
    def prox_weight(self) -> float:
        return self.params.mu

    def direction(self, w, batch):
        loss, g = self.gradient(w, batch)
        return loss, add(g, scale(sub(w, self.start), self.prox_weight()))


class FedACGClient(FedProxClient):
    """FedACG: the prox term pulls towards the received look-ahead model w^t + lambda m^t,
    with weight ``fedacg.beta`` (the local penalty of Kim et al. 2024, eq. 6)."""

    def prox_weight(self) -> float:
        return self.params.beta
