"""FedCM client (Xu et al. 2021): local steps mixed with the broadcast global update.

    v = alpha * g + (1 - alpha) * Delta^r      (Delta^r: broadcast, fixed for the round)
    w_{k+1} = w_k - lr * v

alpha (``fedcm-alpha``) weighs the fresh local gradient; alpha = 1 is FedAvg.
MoFedSAM is this rule with a SAM gradient g~ in place of g.
"""

from __future__ import annotations

from client.algorithms.base import ClientAlgorithm
from client.sam import loss_and_grad
from common.protocol import GLOBAL_UPDATE


class FedCMClient(ClientAlgorithm):
    def mixing_weight(self) -> float:
        return self.cfg.fedcm_alpha

    def local_gradient(self, model, x, y):
        return loss_and_grad(model, x, y)

    def direction(self, model, x, y):
        a = self.mixing_weight()
        loss, g = self.local_gradient(model, x, y)
        delta = self.broadcast_params[GLOBAL_UPDATE]
        return loss, [a * gi + (1.0 - a) * d for gi, d in zip(g, delta)]
