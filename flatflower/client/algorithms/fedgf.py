"""FedGF client (Lee & Yoon, ICML 2024; hwan-sig/Official-FedGF @36233b7,
fedlab/contrib/algorithm/fedgf.py L96-135): local SAM whose gradient point is pulled towards the
server's perturbed global model w~ (broadcast with the model) by the server's weight c (a scalar
sent in the config):

    g       = grad F(w_k)
    eps_k   = c (w~ - w_k) + (1 - c) rho g/||g||      (rho = ``sam.rho``)
    w_{k+1} = w_k - lr grad F(w_k + eps_k)              (same mini-batch)

so the gradient point is c w~ + (1 - c)(w_k + rho g/||g||): the code blends models, not
perturbations (notes B2). c = 0 (every round 1, and T_D never exceeded) is FedSAM exactly. The
ascent gradient is computed even at c = 1 (2 passes a step, as the code).
"""

from __future__ import annotations

from flatflower.client.algorithms.base import ClientRule
from flatflower.client.sam import SAMParams, sam_gradient, unit_scaled
from flatflower.common.protocol import MIX_WEIGHT, PERTURBED_GLOBAL
from flatflower.common.tensors import add, scale, sub


class FedGFClient(ClientRule):
    Params = SAMParams

    def gradient(self, w, batch):
        c, rho = self.broadcast[MIX_WEIGHT], self.params.rho
        if c == 0:  # a Python float, the same for every client of the round
            return sam_gradient(batch, rho)
        loss, g = batch.grad()
        offset = add(scale(sub(self.broadcast[PERTURBED_GLOBAL], w), c), scale(unit_scaled(g, rho), 1.0 - c))
        return loss, batch.grad(offset)[1]
