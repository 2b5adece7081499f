"""FedACG server (Kim et al., CVPR 2024, Alg. 1; geehokim/FedACG ServerM): server momentum
whose look-ahead is what the clients receive and start from.

    broadcast   x^t = theta^t + lambda m^t                       (m^0 = 0)
    Delta^t     = sum_i p_i (theta_i - x^t)                      (measured from the look-ahead)
    m^{t+1}     = lambda m^t + Delta^t
    theta^{t+1} = theta^t + eta_g m^{t+1}     (eta_g = 1: the mean of the clients' models)

The momentum is the one FedNSAM's server keeps; FedACG sends the look-ahead model instead of
m (1 model down). The clients add the prox term (beta/2)||theta - x^t||^2 (client/algorithms/
fedacg.py). lambda = beta = 0 is FedAvg.
"""

from __future__ import annotations

from dataclasses import dataclass

from flatflower.common.params import FRACTION, Params, Range, key
from flatflower.common.protocol import MOMENTUM
from flatflower.common.tensors import add_scaled
from flatflower.strategies.fednsam import FedNSAM


@dataclass(frozen=True)
class FedACGServerParams(Params):
    lam: float = key("fedacg.lambda", 0.85, "server momentum and look-ahead lambda", FRACTION, search=Range(0.5, 0.95))


class FedACG(FedNSAM):
    Params = FedACGServerParams

    def start_point(self):
        return add_scaled(self.model, self.momentum_coefficient(), self.records[MOMENTUM])
