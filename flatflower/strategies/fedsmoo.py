"""FedSMOO server (Sun et al. 2023; FedTOGA paper Alg. 2): FedDyn's ADMM server (a =
``feddyn.alpha``, dual over all N clients) plus the global perturbation s, broadcast next
round (s^0 = 0):

    S = sum_i p_i s~_i          (uniform p_i: the paper's (1/M) sum_{i in S} s~_i)
    s = rho S / ||S||           (global L2 norm over the whole model)
"""

from __future__ import annotations

import torch

from flatflower.client.algorithms.fedsmoo import FedSMOOParams
from flatflower.common.protocol import GLOBAL_PERTURBATION, PERTURBATION_CORRECTION
from flatflower.common.tensors import EPS, global_norm, scale, zeros_like
from flatflower.strategies.feddyn import FedDyn


class FedSMOO(FedDyn):
    Params = FedSMOOParams  # sam.rho and feddyn.alpha, declared by the client half that reads them too

    def init_records(self):
        super().init_records()
        self.records[GLOBAL_PERTURBATION] = zeros_like(self.model)

    def update(self, server_round, updates, weights):
        super().update(server_round, updates, weights)
        mean = self.aggregate([u.records[PERTURBATION_CORRECTION] for u in updates], weights)
        self.records[GLOBAL_PERTURBATION] = scale(mean, self.params.rho / (float(global_norm(mean, torch.float64)) + EPS))
