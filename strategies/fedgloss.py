"""FedGloSS server (Caldarola et al., CVPR 2025, Alg. 1; pietrocagnasso/fedgloss @cbd6cf5,
servers/fedgloss_server.py): SAM on the server, with FedDyn-style duals (a = 1/beta).

The clients receive and start from the perturbed model (``start_point``, as FedACG's
look-ahead; nothing else goes down):

    w~^t      = w^t + rho_s pg/||pg||          (pg^0 = 0: no perturbation in round 1)

and after the round, with Delta_k = w_k - w~^t over the M accepted clients:

    u         = sum_k p_k Delta_k                                (the run's aggregation weights)
    sigma     = sigma - (sum_k Delta_k) / (beta N M)    ``fedgloss.dual = NM`` (the code)
                                         / (beta N)     ``fedgloss.dual = N``  (Alg. 1)
    w^{t+1}   = w^t + eta_g u - beta sigma               (eta_g = ``server-lr`` scales u only)
    pg        = -u                                       (the next round's ascent direction)

The plain sum over the M replies is M times the uniform mean (a robust estimate of it under a
robust ``aggregator``). rho_s = ``fedgloss.rho-server``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from client.algorithms.fedgloss import GloSSDualParams
from common.params import NONNEGATIVE, key, one_of
from common.protocol import DUAL, PSEUDO_GRADIENT
from common.tensors import EPS, add_scaled, global_norm, scale, sub, zeros_like
from strategies.fedavg import FedAvg


@dataclass(frozen=True)
class FedGloSSServerParams(GloSSDualParams):
    rho_server: float = key("fedgloss.rho-server", 0.15, "server SAM radius rho_s: the clients start "
                            "from w + rho_s pg/||pg|| (the authors' CIFAR-10 runs: 0.15)", NONNEGATIVE)
    dual: str = key("fedgloss.dual", "NM", "divisor of the server dual step: beta N M (the code) or "
                    "beta N (Alg. 1)", one_of("NM", "N"))


class FedGloSS(FedAvg):
    Params = FedGloSSServerParams

    def init_records(self):
        self.records[DUAL] = zeros_like(self.model)  # sigma^0 = 0 (server state, not broadcast)
        self.records[PSEUDO_GRADIENT] = zeros_like(self.model)  # pg^0 = 0

    def start_point(self):
        pg = self.records[PSEUDO_GRADIENT]
        return add_scaled(self.model, self.params.rho_server / (float(global_norm(pg, torch.float64)) + EPS), pg)

    def update(self, server_round, updates, weights):
        p, m, start = self.params, len(updates), self.start_point()
        deltas = [sub(u.model, start) for u in updates]
        u = self.aggregate(deltas, weights)
        total = scale(self.aggregate(deltas, [1.0 / m] * m), float(m))  # sum_k Delta_k
        divisor = p.beta * self.federation_size() * (m if p.dual == "NM" else 1)
        self.records[DUAL] = add_scaled(self.records[DUAL], -1.0 / divisor, total)
        self.model = add_scaled(add_scaled(self.model, self.cfg.server_lr, u), -p.beta, self.records[DUAL])
        self.records[PSEUDO_GRADIENT] = scale(u, -1.0)
