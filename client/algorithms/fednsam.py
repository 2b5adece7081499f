"""FedNSAM client (Liu et al., ACM MM 2025, Alg. 1 lines 7-10 with the notes' corrected
indexing, §1.3): one gradient per step, taken at a look-ahead + perturbed point built from
the server momentum m^{t-1} (broadcast, fixed for the round):

    e = lambda * m - rho * m/||m||                 (e = 0 while m = 0, i.e. in round 1)
    theta_{k+1} = theta_k - lr * grad F(theta_k + e; xi_k)

The iterate itself is not shifted (notes §8.7). Stateless: nothing is kept between rounds.
"""

from __future__ import annotations

from client.algorithms.base import ClientAlgorithm
from client.sam import gradient_at, unit_scaled
from common.protocol import MOMENTUM


class FedNSAMClient(ClientAlgorithm):
    def __init__(self, cfg, model, broadcast, state, **kwargs):
        super().__init__(cfg, model, broadcast, state, **kwargs)
        m = self.broadcast_params[MOMENTUM]
        lam = cfg.fednsam_lambda
        self.offset = [lam * mi - pi for mi, pi in zip(m, unit_scaled(m, cfg.rho))]

    def direction(self, model, x, y):
        return gradient_at(model, x, y, self.offset)
