"""FedDyn client (Acar et al. 2021): the dynamic regulariser that FedSpeed, FedSMOO, FedTOGA,
FedGMT and FedLESAM-D build on.

Local objective  F_i(theta) - <h_i, theta> + (a/2) ||theta - theta^t||^2, solved by K steps

    theta_{k+1} = theta_k - lr * ( g_k - h_i + a (theta_k - theta^t) )

then  h_i <- h_i - a (theta_K - theta^t), kept on the client (zeros before its first round).
g_k is the plain gradient here; subclasses change it (SAM: FedSpeed, KL to the EMA: FedGMT),
the prox weight (FedGMT: none) and add constant corrections (FedTOGA: + beta Delta).
``feddyn.alpha`` is a, for FedDyn and the family members that share it.
"""

from __future__ import annotations

from dataclasses import dataclass

from flatflower.client.algorithms.base import ClientRule
from flatflower.client.rule_state import MODEL, keeps
from flatflower.common.tensors import Tensors, add, scale, sub, zeros_like
from flatflower.common.params import POSITIVE, Params, Range, key
from flatflower.common.protocol import DUAL


@dataclass(frozen=True)
class DualParams(Params):
    """The FedDyn family's coefficient (FedDyn, FedSpeed, FedSMOO, FedLESAM-D)."""

    alpha: float = key("feddyn.alpha", 0.1, "FedDyn coefficient a: the prox weight and the dual "
                       "step", POSITIVE, search=Range(0.001, 1.0, log=True))


class DualClient(ClientRule):
    """Shared mechanics of the FedDyn family: dual h_i, prox term, dual update."""

    Params = DualParams
    Keeps = keeps(dual=MODEL)  # h_i

    def __init__(self, params, start, broadcast, state, lr, initial=None):
        super().__init__(params, start, broadcast, state, lr, initial)
        self.dual = state.get(DUAL) or zeros_like(self.start)

    # -- hooks
    def dual_coefficient(self) -> float:
        """a: the prox weight of the augmented Lagrangian and the dual step size."""
        return self.params.alpha

    def prox_coefficient(self) -> float:
        """Weight of a (theta - theta^t) in the local step (FedDyn: a)."""
        return self.dual_coefficient()

    def correction(self) -> Tensors | None:
        """A constant term added to every step (None: nothing)."""
        return None

    # -- the step and the dual update
    def direction(self, w, batch):
        loss, g = self.gradient(w, batch)
        prox = self.prox_coefficient()
        d = sub(g, self.dual)
        if prox:
            d = add(d, scale(sub(w, self.start), prox))
        extra = self.correction()
        if extra is not None:
            d = add(d, extra)
        return loss, d

    def new_state(self, w):
        return {DUAL: sub(self.dual, scale(sub(w, self.start), self.dual_coefficient()))}


class FedDynClient(DualClient):
    """FedDyn: plain gradients, a = ``feddyn.alpha``."""
