"""FedLESAM clients (Fan et al., ICML 2024; FedTOGA paper Alg. 3, fedtoga notes §2.2).

The perturbation is a locally estimated *global* one: the difference between the global
model the client received in its previous round and the one it received now,

    delta = rho (theta_i^old - theta^t) / ||theta_i^old - theta^t||     (fixed for the round)
    g~_k  = grad F(theta_k + delta)                                    (1 gradient pass per step)

and after the round the client keeps theta_i^old <- theta^t. On a client's first round there
is no theta_i^old (the paper leaves it open): ``fedlesam-first = "none"`` (default) takes no
perturbation (delta = 0, plain gradients, as the public code does in round 1); ``"initial"``
uses the run's initial model theta^0 as theta_i^old.

FedLESAM uses g~ in a FedAvg step; FedLESAM-D in FedDyn's (Alg. 3), FedLESAM-S in
SCAFFOLD's. rho = 0 gives FedAvg, FedDyn and SCAFFOLD.
"""

from __future__ import annotations

from client.algorithms.base import ClientAlgorithm
from client.algorithms.feddyn import DualClient
from client.algorithms.scaffold import ScaffoldClient
from client.sam import gradient_at, loss_and_grad, trainable, unit_scaled
from common.protocol import PREVIOUS_GLOBAL


class LocalEstimate:
    """Mixin: the FedLESAM perturbation and the theta_i^old it needs (client state)."""

    def __init__(self, cfg, model, broadcast, state, **kwargs):
        super().__init__(cfg, model, broadcast, state, **kwargs)
        self.received = [p.detach().clone() for p in trainable(model)]  # theta^t
        old = self.stored(PREVIOUS_GLOBAL)
        if old is None and cfg.fedlesam_first == "initial":
            old = self.aligned(self.initial_weights())
        self.offset = (None if old is None else
                       unit_scaled([o - t for o, t in zip(old, self.received)], cfg.rho))

    def estimate_gradient(self, model, x, y):
        """(loss, g~_k): the gradient at theta_k + delta (theta_k itself on a first round)."""
        if self.offset is None:
            return loss_and_grad(model, x, y)
        return gradient_at(model, x, y, self.offset)

    def new_state(self, model):
        return {**super().new_state(model), PREVIOUS_GLOBAL: self.named(self.received)}


class FedLESAMClient(LocalEstimate, ClientAlgorithm):
    def direction(self, model, x, y):
        return self.estimate_gradient(model, x, y)


class FedLESAMDClient(LocalEstimate, DualClient):
    def loss_gradient(self, model, x, y):
        return self.estimate_gradient(model, x, y)


class FedLESAMSClient(LocalEstimate, ScaffoldClient):
    def local_gradient(self, model, x, y):
        return self.estimate_gradient(model, x, y)
