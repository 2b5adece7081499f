"""FedSAM client (Qu et al. 2022, eq. 4 / Alg. 1):

    g  = grad F(w_k; xi_k)
    g~ = grad F(w_k + rho * g/||g||; xi_k)      (same mini-batch)
    w_{k+1} = w_k - lr * g~
"""

from __future__ import annotations

from client.algorithms.base import ClientAlgorithm
from client.sam import sam_gradient


class FedSAMClient(ClientAlgorithm):
    def direction(self, model, x, y):
        return sam_gradient(model, x, y, self.cfg.rho)
