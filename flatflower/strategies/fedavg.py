"""FedAvg server (FedSAM paper Alg. 1; McMahan et al. 2017):

    Delta^{r+1} = sum_i p_i (w_i - w^r)          (p_i: sample-weighted or uniform)
    w^{r+1}     = w^r + eta_g * Delta^{r+1}        (eta_g = server-lr; 1 = model averaging)
"""

from __future__ import annotations

from flatflower.common.tensors import add_scaled, sub
from flatflower.strategies.base import ServerRule


class FedAvg(ServerRule):
    def mean_delta(self, updates, weights):
        """sum_i p_i (w_i - w^r): the aggregated client update (from the start point; a robust
        estimate of it under a robust ``aggregator``)."""
        start = self.start_point()
        return self.aggregate([sub(u.model, start) for u in updates], weights)

    def update(self, server_round, updates, weights):
        self.model = add_scaled(self.model, self.cfg.server_lr, self.mean_delta(updates, weights))
