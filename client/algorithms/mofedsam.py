"""MoFedSAM client (Qu et al. 2022, eq. 6 / Alg. 2): FedCM's mixing around a SAM gradient.

    g~ = SAM gradient at w_k (as FedSAM)
    v  = beta * g~ + (1 - beta) * Delta^r       (Delta^r: broadcast, fixed for the round)
    w_{k+1} = w_k - lr * v

beta weighs the fresh local SAM gradient; beta = 1 is FedSAM, rho = 0 is FedCM.
"""

from __future__ import annotations

from client.algorithms.fedcm import FedCMClient
from client.sam import sam_gradient


class MoFedSAMClient(FedCMClient):
    def mixing_weight(self) -> float:
        return self.cfg.mofedsam_beta

    def local_gradient(self, model, x, y):
        return sam_gradient(model, x, y, self.cfg.rho)
