"""FedTOGA client (Li et al., "From Local Tweaks To Global Awareness", final version, Alg. 1).

Each step, with the broadcast global update Delta^t and the client dual h_i fixed:

    v      = g_k + kappa Delta               "G" (default): g_k = grad F(theta_k), fresh
           = g~_{k-1} + kappa Delta          "N": last step's SAM gradient (1 gradient per step)
           = g_k + g~_{k-1} + kappa Delta    "fusion"
    delta  = rho v/||v||                     (at k = 0, "N" and "fusion" use g_0: no g~_{-1})
    g~_k   = grad F(theta_k + delta)         (same mini-batch)
    theta_{k+1} = theta_k - lr ( g~_k - h_i + a (theta_k - theta^t) + beta Delta )

then h_i <- h_i - a (theta_K - theta^t). ``fedtoga-prox-scale``: a = alpha ("multiplier",
the notes' reading, §6-A1) or a = 1/alpha ("literal", the (1/alpha) printed in Alg. 1).
With kappa = beta = 0, "G" and a = feddyn-alpha the client is FedSpeed's at fedspeed-alpha = 1
(the whole algorithm is FedSpeed when the server divides the dual by N too, or under full
participation).
"""

from __future__ import annotations

from client.algorithms.feddyn import DualClient
from client.sam import gradient_at, loss_and_grad, unit_scaled
from common.protocol import GLOBAL_UPDATE


class FedTOGAClient(DualClient):
    def __init__(self, cfg, model, broadcast, state, **kwargs):
        super().__init__(cfg, model, broadcast, state, **kwargs)
        delta = self.broadcast_params[GLOBAL_UPDATE]
        self.kappa_delta = [cfg.fedtoga_kappa * d for d in delta]
        self.beta_delta = [cfg.fedtoga_beta * d for d in delta]
        self.previous = None  # g~_{k-1}, the last SAM gradient (the "gradient register")

    def dual_coefficient(self) -> float:
        return self.cfg.fedtoga_coefficient()

    def correction(self):
        return self.beta_delta

    def loss_gradient(self, model, x, y):
        variant = self.cfg.fedtoga_perturbation
        loss = None
        if variant == "N" and self.previous is not None:
            v = [gp + kd for gp, kd in zip(self.previous, self.kappa_delta)]
        else:
            loss, g = loss_and_grad(model, x, y)
            if variant == "fusion" and self.previous is not None:
                g = [gi + gp for gi, gp in zip(g, self.previous)]
            v = [gi + kd for gi, kd in zip(g, self.kappa_delta)]
        perturbed_loss, g_sam = gradient_at(model, x, y, unit_scaled(v, self.cfg.rho))
        self.previous = g_sam
        return (perturbed_loss if loss is None else loss), g_sam
