"""FedSpeed client (Sun et al., ICLR 2023, Alg. 1): FedDyn's prox-correction around a merged
SAM gradient.

    g  = grad F(theta_k)                       g~ = grad F(theta_k + rho g/||g||)  (same batch)
    q  = (1 - alpha) g + alpha g~              (the paper's quasi-gradient; alpha = ``fedspeed-alpha``)
    theta_{k+1} = theta_k - lr * ( q - h_i + a (theta_k - theta^t) )
    h_i <- h_i - a (theta_K - theta^t)

alpha = 1 (default) is the authors' code (FL-Simulator's ESAM step: the perturbed gradient
alone, maintainer-confirmed in its issue #6), bit for bit; alpha = 0 is FedDyn; rho = 0 is FedDyn.
"""

from __future__ import annotations

from client.algorithms.feddyn import FedDynClient
from client.sam import loss_and_grad, perturbed_gradient


class FedSpeedClient(FedDynClient):
    def loss_gradient(self, model, x, y):
        alpha = self.cfg.fedspeed_alpha
        loss, g = loss_and_grad(model, x, y)
        g_sam = perturbed_gradient(model, x, y, g, self.cfg.rho)
        # (1 - alpha) g + alpha g~; at alpha = 1 exactly g~ (0 * g adds a zero), at 0 exactly g
        return loss, [(1.0 - alpha) * gi + alpha * si for gi, si in zip(g, g_sam)]
