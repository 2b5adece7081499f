"""FedNSAM server (Liu et al., ACM MM 2025, Alg. 1 lines 15-18):

    Delta^t = sum_i p_i (theta_i - theta^{t-1})      (the paper's uniform 1/S: aggregation=uniform)
    m^t     = lambda m^{t-1} + Delta^t              (m^0 = 0)
    theta^t = theta^{t-1} + eta_g m^t               (eta_g = 1 in the paper)

m^t is broadcast with theta^t (the clients' next round uses m^{t-1}: notes §8.1).
"""

from __future__ import annotations

from flatflower.client.algorithms.fednsam import MomentumParams
from flatflower.common.protocol import MOMENTUM
from flatflower.common.tensors import add_scaled, scale, zeros_like
from flatflower.strategies.fedavg import FedAvg


class FedNSAM(FedAvg):
    Params = MomentumParams  # fednsam.lambda, declared by the client half that reads it too

    def init_records(self):
        self.records[MOMENTUM] = zeros_like(self.model)

    def momentum_coefficient(self) -> float:
        return self.params.lam

    def update(self, server_round, updates, weights):
        lam = self.momentum_coefficient()
        m = add_scaled(scale(self.records[MOMENTUM], lam), 1.0, self.mean_delta(updates, weights))
        self.records[MOMENTUM] = m
        self.model = add_scaled(self.model, self.cfg.server_lr, m)
