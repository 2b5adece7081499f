"""FedMoSWA client (Liu et al., ICML 2025; junkangLiu0/FedSWA, v1 main.py @6f3e52c
update_FedSWAS L2171-2235; fedswa notes §1, §3-4).

SCAFFOLD's control variates around FedSWA's steps (client/algorithms/fedswa.py), with the
server's momentum control variate m in place of c (broadcast), the client's own c_i (state, 0
before its first round):

    w_{k+1} = w_k - eta_k (g_k - c_i + m)
    c_i^+   = c_i - m + (w^t - w_tau) / S,   S = sum_k eta_k (``fedmoswa.normaliser = sum``)
                                             or tau (eta_l + rho eta_l)/2 (``mean``, the v1 code)

c_i^+ is kept; c_i^+ - m is uploaded. c_i is per client (the authors' code keeps it per Ray
actor, a bug: notes §2.5).
"""

from __future__ import annotations

from dataclasses import dataclass

from flatflower.client.algorithms.fedswa import FedSWAClient, FedSWAParams
from flatflower.client.algorithms.scaffold import ScaffoldClient
from flatflower.common.params import key, one_of
from flatflower.common.protocol import CONTROL_OFFSET, MOMENTUM_CONTROL
from flatflower.common.tensors import sub


@dataclass(frozen=True)
class FedMoSWAParams(FedSWAParams):
    normaliser: str = key("fedmoswa.normaliser", "sum", "S in c_i^+ = c_i - m + (w^t - w)/S: the sum "
                          "of the round's step sizes (sum) or tau (lr + rho lr)/2 (mean, the v1 code)",
                          one_of("sum", "mean"))


class FedMoSWAClient(ScaffoldClient):
    Params = FedMoSWAParams
    SERVER_CONTROL = MOMENTUM_CONTROL
    lr_factor = FedSWAClient.lr_factor

    def step_sum(self):
        """S: sum_k eta_k = eta_l (tau - (1 - rho)(tau - 1)/2), or tau eta_l (1 + rho)/2."""
        rho, tau = self.params.ratio, self.steps
        if self.params.normaliser == "mean":
            return tau * self.lr * (1.0 + rho) / 2.0
        return self.lr * (tau - (1.0 - rho) * (tau - 1.0) / 2.0)

    def uploads(self, w):
        return {CONTROL_OFFSET: sub(self.new_control(w), self.c)}
