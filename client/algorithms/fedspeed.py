"""FedSpeed client (Sun et al. 2023): FedDyn's prox-correction around a local SAM gradient.

    g~ = grad F(theta_k + rho g/||g||)       (same mini-batch)
    theta_{k+1} = theta_k - lr * ( g~ - h_i + a (theta_k - theta^t) )
    h_i <- h_i - a (theta_K - theta^t)

As in the authors' code (FL-Simulator, maintainer-confirmed in its issue #6) the perturbed
and unperturbed gradients are not mixed; rho = 0 is FedDyn.
"""

from __future__ import annotations

from client.algorithms.feddyn import FedDynClient
from client.sam import sam_gradient


class FedSpeedClient(FedDynClient):
    def loss_gradient(self, model, x, y):
        return sam_gradient(model, x, y, self.cfg.rho)
