"""FedSMOO client (Sun et al. 2023; FedTOGA paper Alg. 2, fedtoga notes §2.1).

FedDyn's prox-correction (dual h_i, weight a = ``feddyn.alpha``) around a SAM step whose
perturbation is corrected towards the global one s (broadcast) by the client's perturbation
dual mu_i (state, zeros before its first round). Per step, on one mini-batch:

    S_k  = g(theta_k) - mu_i - s
    s^_k = rho S_k / ||S_k||
    mu_i <- mu_i + (s^_k - s)
    theta_{k+1} = theta_k - lr ( g(theta_k + s^_k) - h_i + a (theta_k - theta^t) )

then h_i <- h_i - a (theta_K - theta^t), and s~_i = mu_i - s^_K is uploaded (Alg. 2 as
printed; FL-Simulator's simplification uploads mu_i alone). rho = 0 is FedDyn.
"""

from __future__ import annotations

from dataclasses import dataclass

from flatflower.client.algorithms.feddyn import DualClient, DualParams
from flatflower.client.rule_state import MODEL, keeps
from flatflower.client.sam import SAMParams, unit_scaled
from flatflower.common.tensors import add, sub, zeros_like
from flatflower.common.protocol import GLOBAL_PERTURBATION, PERTURBATION_CORRECTION, PERTURBATION_DUAL


@dataclass(frozen=True)
class FedSMOOParams(SAMParams, DualParams):
    """FedSMOO: the SAM radius (also the server's for s) and FedDyn's coefficient."""


class FedSMOOClient(DualClient):
    Params = FedSMOOParams
    Keeps = keeps(s=MODEL, mu=MODEL, last=MODEL)  # s (broadcast), mu_i, s^_k

    def __init__(self, params, start, broadcast, state, lr, initial=None):
        super().__init__(params, start, broadcast, state, lr, initial)
        self.s = broadcast[GLOBAL_PERTURBATION]
        self.mu = state.get(PERTURBATION_DUAL) or zeros_like(self.start)
        self.last = zeros_like(self.start)  # s^_K

    def ascent_gradient(self, w, batch):
        """(loss, g(theta_k)): the gradient the perturbation S_k is built from."""
        return batch.grad()

    def gradient(self, w, batch):
        loss, g = self.ascent_gradient(w, batch)
        self.last = unit_scaled(sub(sub(g, self.mu), self.s), self.params.rho)
        self.mu = add(self.mu, sub(self.last, self.s))
        return loss, batch.grad(self.last)[1]

    def uploads(self, w):
        return {PERTURBATION_CORRECTION: sub(self.mu, self.last)}

    def new_state(self, w):
        return {**super().new_state(w), PERTURBATION_DUAL: self.mu}
