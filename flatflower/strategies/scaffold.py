"""SCAFFOLD server (Karimireddy et al. 2020, Alg. 1 lines 16-17), also FedGAMMA's and
FedLESAM-S's. It keeps and broadcasts the control variate c (c^0 = 0):

    x <- x + eta_g sum_i p_i (y_i - x)
    c <- c + (M/N) sum_i p_i (c_i^+ - c_i)      (uniform p_i: c + (1/N) sum_{i in S} Delta c_i)

N is the number of clients in the federation, M the number of accepted updates.
"""

from __future__ import annotations

from flatflower.common.protocol import CONTROL, CONTROL_DELTA
from flatflower.common.tensors import add_scaled, zeros_like
from flatflower.strategies.fedavg import FedAvg


class Scaffold(FedAvg):
    def init_records(self):
        self.records[CONTROL] = zeros_like(self.model)  # c^0 = 0, not the model's weights

    def update(self, server_round, updates, weights):
        m, n = len(updates), self.federation_size()
        control_step = self.aggregate([u.records[CONTROL_DELTA] for u in updates], weights)
        self.records[CONTROL] = add_scaled(self.records[CONTROL], m / n, control_step)
        super().update(server_round, updates, weights)
