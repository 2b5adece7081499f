"""FedNSAM client (Liu et al., ACM MM 2025, Alg. 1 lines 7-10 with the notes' corrected
indexing, §1.3): one gradient per step, taken at a look-ahead + perturbed point built from
the server momentum m^{t-1} (broadcast, fixed for the round):

    e = lambda * m - rho * m/||m||                 (e = 0 while m = 0, i.e. in round 1)
    theta_{k+1} = theta_k - lr * grad F(theta_k + e; xi_k)

The iterate itself is not shifted (notes §8.7). Stateless: nothing is kept between rounds.
``fednsam.lambda`` is also the server's momentum coefficient (strategies/fednsam.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from flatflower.client.algorithms.base import ClientRule
from flatflower.client.rule_state import MODEL, keeps
from flatflower.client.sam import SAMParams, unit_scaled
from flatflower.common.tensors import scale, sub
from flatflower.common.params import FRACTION, Params, Range, key
from flatflower.common.protocol import MOMENTUM


@dataclass(frozen=True)
class MomentumParams(Params):
    """lambda, read by both halves: the server's momentum coefficient and the look-ahead."""

    lam: float = key("fednsam.lambda", 0.85, "server momentum and look-ahead lambda", FRACTION, search=Range(0.5, 0.95))


@dataclass(frozen=True)
class FedNSAMParams(SAMParams, MomentumParams):
    pass


class FedNSAMClient(ClientRule):
    Params = FedNSAMParams
    Keeps = keeps(offset=MODEL)  # e, fixed for the round

    def __init__(self, params, start, broadcast, state, lr, initial=None):
        super().__init__(params, start, broadcast, state, lr, initial)
        m = broadcast[MOMENTUM]
        self.offset = sub(scale(m, params.lam), unit_scaled(m, params.rho))

    def gradient(self, w, batch):
        return batch.grad(self.offset)
