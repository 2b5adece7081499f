"""FedLESAM clients (Fan et al., ICML 2024; FedTOGA paper Alg. 3, fedtoga notes §2.2).

The perturbation is a locally estimated *global* one: the difference between the global
model the client received in its previous round and the one it received now,

    delta = rho (theta_i^old - theta^t) / ||theta_i^old - theta^t||     (fixed for the round)
    g~_k  = grad F(theta_k + delta)                                    (1 gradient pass per step)

and after the round the client keeps theta_i^old <- theta^t. On a client's first round there
is no theta_i^old (the paper leaves it open): ``fedlesam.first = "none"`` (default) takes no
perturbation (delta = 0, plain gradients, as the public code does in round 1); ``"initial"``
uses the run's initial model theta^0 as theta_i^old.

The estimate is one ``gradient``; FedLESAM uses it in a FedAvg step, FedLESAM-D in FedDyn's
(Alg. 3), FedLESAM-S in SCAFFOLD's. rho = 0 gives FedAvg, FedDyn and SCAFFOLD.
"""

from __future__ import annotations

from dataclasses import dataclass

from flatflower.client.algorithms.base import ClientRule
from flatflower.client.algorithms.feddyn import DualClient, DualParams
from flatflower.client.algorithms.scaffold import ScaffoldClient
from flatflower.client.rule_state import MODEL, keeps, optional
from flatflower.client.sam import SAMParams, unit_scaled
from flatflower.common.tensors import sub
from flatflower.common.params import key, one_of
from flatflower.common.protocol import PREVIOUS_GLOBAL


@dataclass(frozen=True)
class FedLESAMParams(SAMParams):
    first: str = key("fedlesam.first", "none", "a client's first round, with no previous global "
                     "model: none = no perturbation; initial = use w^0", one_of("none", "initial"))


@dataclass(frozen=True)
class FedLESAMDParams(FedLESAMParams, DualParams):
    """FedLESAM-D: FedLESAM's, and FedDyn's coefficient ``feddyn.alpha``."""


class LocalEstimate:
    """Mixin: the FedLESAM perturbation and the theta_i^old it needs (client state)."""

    Keeps = keeps(offset=optional(MODEL))  # delta; none on a first round without theta_i^old

    def __init__(self, params, start, broadcast, state, lr, initial=None):
        super().__init__(params, start, broadcast, state, lr, initial)
        old = state.get(PREVIOUS_GLOBAL)
        if old is None and params.first == "initial":
            old = initial()
        self.offset = None if old is None else unit_scaled(sub(old, self.start), params.rho)

    def gradient(self, w, batch):
        """(loss, g~_k): the gradient at theta_k + delta (theta_k itself on a first round)."""
        return batch.grad(self.offset)

    def new_state(self, w):
        return {**super().new_state(w), PREVIOUS_GLOBAL: self.start}


class FedLESAMClient(LocalEstimate, ClientRule):
    """FedLESAM: the estimate in a FedAvg step."""

    Params = FedLESAMParams


class FedLESAMDClient(LocalEstimate, DualClient):
    """FedLESAM-D: the estimate in FedDyn's step."""

    Params = FedLESAMDParams


class FedLESAMSClient(LocalEstimate, ScaffoldClient):
    """FedLESAM-S: the estimate in SCAFFOLD's step."""

    Params = FedLESAMParams
