"""FedSMOO client (Sun et al. 2023; FedTOGA paper Alg. 2, fedtoga notes §2.1).

FedDyn's prox-correction (dual h_i, weight a = ``feddyn-alpha``) around a SAM step whose
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

import torch

from client.algorithms.feddyn import DualClient
from client.sam import gradient_at, loss_and_grad, unit_scaled
from common.protocol import GLOBAL_PERTURBATION, PERTURBATION_CORRECTION, PERTURBATION_DUAL


class FedSMOOClient(DualClient):
    def __init__(self, cfg, model, broadcast, state, **kwargs):
        super().__init__(cfg, model, broadcast, state, **kwargs)
        self.s = self.broadcast_params[GLOBAL_PERTURBATION]
        self.mu = self.stored(PERTURBATION_DUAL) or [torch.zeros_like(p) for p in self.start]
        self.last = [torch.zeros_like(p) for p in self.start]  # s^_K

    def ascent_gradient(self, model, x, y):
        """(loss, g(theta_k)): the gradient the perturbation S_k is built from."""
        return loss_and_grad(model, x, y)

    def loss_gradient(self, model, x, y):
        loss, g = self.ascent_gradient(model, x, y)
        corrected = [gi - mi - si for gi, mi, si in zip(g, self.mu, self.s)]
        self.last = unit_scaled(corrected, self.cfg.rho)
        self.mu = [mi + (pi - si) for mi, pi, si in zip(self.mu, self.last, self.s)]
        return loss, gradient_at(model, x, y, self.last)[1]

    def uploads(self, model):
        return {PERTURBATION_CORRECTION: self.full_record(
            model, [mi - pi for mi, pi in zip(self.mu, self.last)])}

    def new_state(self, model):
        return {**super().new_state(model), PERTURBATION_DUAL: self.named(self.mu)}
