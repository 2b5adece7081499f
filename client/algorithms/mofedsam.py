"""MoFedSAM client (Qu et al. 2022, eq. 6 / Alg. 2):

    g~ = SAM gradient at w_k (as FedSAM)
    v  = beta * g~ + (1 - beta) * Delta^r       (Delta^r: broadcast, fixed for the round)
    w_{k+1} = w_k - lr * v

beta weighs the fresh local SAM gradient; beta = 1 is FedSAM.
"""

from __future__ import annotations

from client.algorithms.base import ClientAlgorithm
from client.sam import sam_gradient
from common.protocol import GLOBAL_UPDATE


class MoFedSAMClient(ClientAlgorithm):
    def direction(self, model, x, y):
        beta = self.cfg.mofedsam_beta
        loss, g_sam = sam_gradient(model, x, y, self.cfg.rho)
        delta = self.broadcast_params[GLOBAL_UPDATE]
        return loss, [beta * g + (1.0 - beta) * d for g, d in zip(g_sam, delta)]
