"""FedDyn server (Acar et al. 2021), shared by FedSpeed, FedTOGA and FedGMT (ADMM server).

With u = sum_i p_i (theta_i - theta^t) over the M accepted clients (p_i uniform: the papers'
1/M; weighted: by sample count) and a the dual coefficient:

    h^{t+1}     = h^t - a (M/D) u            (= h^t - (a/D) sum_{i in S} (theta_i - theta^t) when uniform)
    theta^{t+1} = theta^t + eta_g (u - h^{t+1}/a)   (eta_g = 1: mean_i theta_i - h^{t+1}/a)

D = N, all clients (FedDyn; FedGMT's 1/(beta M) over all clients), or M (FedTOGA's literal
rule, ``fedtoga.dual-divisor``). h is server state only; clients keep their own h_i.
"""

from __future__ import annotations

from flatflower.client.algorithms.feddyn import DualParams
from flatflower.common.protocol import DUAL
from flatflower.common.tensors import add_scaled, zeros_like
from flatflower.strategies.fedavg import FedAvg


class FedDyn(FedAvg):
    Params = DualParams  # feddyn.alpha, declared by the client half that reads it too

    def init_records(self):
        self.records[DUAL] = zeros_like(self.model)  # h^0 = 0 (server state, not broadcast)

    def dual_coefficient(self) -> float:
        return self.params.alpha

    def dual_divisor(self, num_updates: int) -> int:
        """D: N, the number of clients in the federation."""
        return self.federation_size()

    def update(self, server_round, updates, weights):
        a, m = self.dual_coefficient(), len(updates)
        u = self.mean_delta(updates, weights)
        self.records[DUAL] = add_scaled(self.records[DUAL], -a * m / self.dual_divisor(m), u)
        step = add_scaled(u, -1.0 / a, self.records[DUAL])
        self.model = add_scaled(self.model, self.cfg.server_lr, step)
