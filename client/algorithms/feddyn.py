"""FedDyn client (Acar et al. 2021): the dynamic regulariser that FedSpeed, FedTOGA and
FedGMT build on.

Local objective  F_i(theta) - <h_i, theta> + (a/2) ||theta - theta^t||^2, solved by K steps

    theta_{k+1} = theta_k - lr * ( g_k - h_i + a (theta_k - theta^t) )

then  h_i <- h_i - a (theta_K - theta^t), kept on the client (zeros before its first round).
g_k is the plain gradient here; subclasses change it (SAM: FedSpeed, KL to the EMA: FedGMT),
the prox weight (FedGMT: none) and add constant corrections (FedTOGA: + beta Delta).
"""

from __future__ import annotations

import torch

from client.algorithms.base import ClientAlgorithm
from client.sam import loss_and_grad, trainable
from common.protocol import DUAL


class DualClient(ClientAlgorithm):
    """Shared mechanics of the FedDyn family: dual h_i, prox term, dual update."""

    def __init__(self, cfg, model, broadcast, state, **kwargs):
        super().__init__(cfg, model, broadcast, state, **kwargs)
        self.start = [p.detach().clone() for p in trainable(model)]  # theta^t
        self.dual = self.stored(DUAL) or [torch.zeros_like(p) for p in self.start]

    # -- hooks
    def dual_coefficient(self) -> float:
        """a: the prox weight of the augmented Lagrangian and the dual step size."""
        return self.cfg.feddyn_alpha

    def prox_coefficient(self) -> float:
        """Weight of a (theta - theta^t) in the local step (FedDyn: a)."""
        return self.dual_coefficient()

    def loss_gradient(self, model, x, y):
        """(loss, g_k): the gradient of the data term at this step."""
        return loss_and_grad(model, x, y)

    def correction(self) -> list[torch.Tensor] | None:
        """A constant term added to every step (None: nothing)."""
        return None

    # -- the step and the dual update
    def direction(self, model, x, y):
        loss, g = self.loss_gradient(model, x, y)
        prox = self.prox_coefficient()
        d = [gi - hi for gi, hi in zip(g, self.dual)]
        if prox:
            d = [di + prox * (p.detach() - p0) for di, p, p0 in zip(d, trainable(model), self.start)]
        extra = self.correction()
        if extra is not None:
            d = [di + ci for di, ci in zip(d, extra)]
        return loss, d

    def new_state(self, model):
        a = self.dual_coefficient()
        return {DUAL: self.named([hi - a * (p.detach() - p0)
                                  for hi, p, p0 in zip(self.dual, trainable(model), self.start)])}


class FedDynClient(DualClient):
    """FedDyn: plain gradients, a = ``feddyn-alpha``."""
