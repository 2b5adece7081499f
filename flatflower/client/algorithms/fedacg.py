"""FedACG client (Kim et al., CVPR 2024, eq. 6): FedProx's rule around the look-ahead model
x^t = theta^t + lambda m^t that the FedACG server sends as the model (strategies/fedacg.py),

    theta_{k+1} = theta_k - lr * ( g_k + beta (theta_k - x^t) )

with weight ``fedacg.beta``; beta = 0 is FedAvg from x^t.
"""

from __future__ import annotations

from dataclasses import dataclass

from flatflower.client.algorithms.fedprox import FedProxClient
from flatflower.common.params import NONNEGATIVE, Params, Range, key


@dataclass(frozen=True)
class FedACGParams(Params):
    beta: float = key("fedacg.beta", 0.01, "prox weight beta toward the look-ahead", NONNEGATIVE,
                      search=Range(0.001, 1.0, log=True))


class FedACGClient(FedProxClient):
    Params = FedACGParams

    def prox_weight(self) -> float:
        return self.params.beta
