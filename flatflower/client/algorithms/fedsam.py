"""FedSAM client (Qu et al. 2022, eq. 4 / Alg. 1):

    g  = grad F(w_k; xi_k)
    g~ = grad F(w_k + rho * g/||g||; xi_k)      (same mini-batch)
    w_{k+1} = w_k - lr * g~

DP-FedSAM's client (client/algorithms/dp_fedsam.py) extends this one.
"""

from __future__ import annotations

from flatflower.client.algorithms.base import ClientRule
from flatflower.client.sam import SAMParams, sam_gradient


class FedSAMClient(ClientRule):
    Params = SAMParams

    def gradient(self, w, batch):
        return sam_gradient(batch, self.params.rho)
