"""MoFedSAM client (Qu et al. 2022, eq. 6 / Alg. 2): FedCM's mixing around a SAM gradient.

    g~ = SAM gradient at w_k (as FedSAM)
    v  = beta * g~ + (1 - beta) * Delta^r       (Delta^r: broadcast, fixed for the round)
    w_{k+1} = w_k - lr * v

beta (``mofedsam.beta``) weighs the fresh local SAM gradient; beta = 1 is FedSAM, rho = 0 is
FedCM.
"""

from __future__ import annotations

from dataclasses import dataclass

from flatflower.client.algorithms.fedcm import FedCMClient
from flatflower.client.sam import SAMParams, sam_gradient
from flatflower.common.params import UNIT, Range, key


@dataclass(frozen=True)
class MoFedSAMParams(SAMParams):
    beta: float = key("mofedsam.beta", 0.1, "weight of the local SAM gradient against the "
                      "global update Delta (1 = FedSAM)", UNIT, search=Range(0.01, 1.0, log=True))


class MoFedSAMClient(FedCMClient):
    Params = MoFedSAMParams

    def mixing_weight(self) -> float:
        return self.params.beta

    def gradient(self, w, batch):
        return sam_gradient(batch, self.params.rho)
