"""FedProx client (Li et al. 2020).

Local objective  F_i(w) + (mu/2) ||w - w^t||^2  (squared: its gradient is mu (w - w^t)),

    w_{k+1} = w_k - lr * ( g_k + mu (w_k - w^t) )

with w^t the model received this round. mu = 0 is FedAvg. FedACG's client
(client/algorithms/fedacg.py) is this rule around the look-ahead model.
"""

from __future__ import annotations

from dataclasses import dataclass

from flatflower.client.algorithms.base import ClientRule
from flatflower.common.tensors import add, scale, sub
from flatflower.common.params import NONNEGATIVE, Params, Range, key


@dataclass(frozen=True)
class FedProxParams(Params):
    mu: float = key("fedprox.mu", 0.01, "prox weight mu in (mu/2)||w - w^t||^2", NONNEGATIVE,
                    search=Range(0.001, 1.0, log=True))


class FedProxClient(ClientRule):
    Params = FedProxParams

    def prox_weight(self) -> float:
        return self.params.mu

    def direction(self, w, batch):
        loss, g = self.gradient(w, batch)
        return loss, add(g, scale(sub(w, self.start), self.prox_weight()))

