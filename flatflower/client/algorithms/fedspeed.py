"""FedSpeed client (Sun et al., ICLR 2023, Alg. 1): FedDyn's prox-correction around a merged
SAM gradient.

    g  = grad F(theta_k)                       g~ = grad F(theta_k + rho g/||g||)  (same batch)
    q  = (1 - alpha) g + alpha g~              (the paper's quasi-gradient; alpha = ``fedspeed.alpha``)
    theta_{k+1} = theta_k - lr * ( q - h_i + a (theta_k - theta^t) )
    h_i <- h_i - a (theta_K - theta^t)

alpha = 1 (default) is the authors' code (FL-Simulator's ESAM step: the perturbed gradient
alone, maintainer-confirmed in its issue #6), bit for bit; alpha = 0 is FedDyn; rho = 0 is FedDyn.
"""

from __future__ import annotations

from dataclasses import dataclass

from flatflower.client.algorithms.feddyn import DualParams, FedDynClient
from flatflower.client.sam import SAMParams, unit_scaled
from flatflower.common.tensors import add, scale
from flatflower.common.params import UNIT, key


@dataclass(frozen=True)
class FedSpeedParams(SAMParams, DualParams):
    merge: float = key("fedspeed.alpha", 1.0, "weight alpha of the perturbed gradient in "
                       "(1 - alpha) g + alpha g~: 1 = the authors' code (g~ alone), < 1 = the "
                       "paper's merged gradient", UNIT)


class FedSpeedClient(FedDynClient):
    Params = FedSpeedParams

    def gradient(self, w, batch):
        alpha = self.params.merge
        loss, g = batch.grad()
        g_sam = batch.grad(unit_scaled(g, self.params.rho))[1]
        # (1 - alpha) g + alpha g~; at alpha = 1 exactly g~ (0 * g adds a zero), at 0 exactly g
        return loss, add(scale(g, 1.0 - alpha), scale(g_sam, alpha))
