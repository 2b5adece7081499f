"""FedCM client (Xu et al. 2021): local steps mixed with the broadcast global update.

    v = alpha * g + (1 - alpha) * Delta^r      (Delta^r: broadcast, fixed for the round)
    w_{k+1} = w_k - lr * v

alpha (``fedcm.alpha``) weighs the fresh local gradient; alpha = 1 is FedAvg. MoFedSAM is
this rule with a SAM gradient g~ in place of g. ``fedcm.server-step`` is the server's (strategies/fedcm.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from flatflower.client.algorithms.base import ClientRule
from flatflower.common.tensors import add, scale
from flatflower.common.params import UNIT, Params, Range, key
from flatflower.common.protocol import GLOBAL_UPDATE


@dataclass(frozen=True)
class FedCMParams(Params):
    alpha: float = key("fedcm.alpha", 0.1, "weight of the fresh local gradient against the "
                       "global update Delta (1 = FedAvg)", UNIT, search=Range(0.01, 1.0, log=True))


class FedCMClient(ClientRule):
    Params = FedCMParams

    def mixing_weight(self) -> float:
        return self.params.alpha

    def direction(self, w, batch):
        a = self.mixing_weight()
        loss, g = self.gradient(w, batch)
        return loss, add(scale(g, a), scale(self.broadcast[GLOBAL_UPDATE], 1.0 - a))
