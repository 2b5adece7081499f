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

``fedgloss.admm = false``: sigma stays 0 (w^{t+1} = w^t + eta_g u; the clients drop theirs too).
The plain sum over the M replies is M times the uniform mean (a robust estimate of it under a
robust ``aggregator``). rho_s = ``fedgloss.rho-server``; the clients' rho_l = ``sam.rho`` is sent
each round as a scalar (``local-radius``), so the server owns both radii's schedule.

Warm-up (``fedgloss.warmup-rounds`` T_s > 0; off by default, notes A4), round t = 0, 1, ...:
``linear`` ramps both radii rho(t) = rho0 + t (rho - rho0)/T_s up to t = T_s, then rho;
``code`` is the authors' (server L24-44): the client radius ramps so, the server radius is rho0
at t = 0, then rho_l + (rho_s - rho0)/T_s up to t = T_s (their bug), then rho_s.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flatflower.client.algorithms.fedgloss import GloSSDualParams
from flatflower.client.sam import SAMParams
from flatflower.common.params import NONNEGATIVE, Check, Range, key, one_of
from flatflower.common.protocol import DUAL, LOCAL_RADIUS, PSEUDO_GRADIENT
from flatflower.common.tensors import EPS, add_scaled, global_norm, scale, sub, zeros_like
from flatflower.strategies.fedavg import FedAvg


@dataclass(frozen=True)
class FedGloSSServerParams(SAMParams, GloSSDualParams):
    rho_server: float = key("fedgloss.rho-server", 0.15, "server SAM radius rho_s: the clients start "
                            "from w + rho_s pg/||pg|| (the authors' CIFAR-10 runs: 0.15)", NONNEGATIVE,
                            search=Range(0.01, 1.0, log=True))
    dual: str = key("fedgloss.dual", "NM", "divisor of the server dual step: beta N M (the code) or "
                    "beta N (Alg. 1)", one_of("NM", "N"))
    warmup_rounds: int = key("fedgloss.warmup-rounds", 0, "warm-up T_s: rounds over which the radii grow "
                             "from fedgloss.rho0 (0 = none, the default; the authors' CIFAR-10 runs: 2000 "
                             "of 10000)", Check(lambda x: isinstance(x, int) and x >= 0, "an integer >= 0"))
    rho0: float = key("fedgloss.rho0", 0.001, "the warm-up's start radius (the code's)", NONNEGATIVE)
    warmup: str = key("fedgloss.warmup", "linear", "the warm-up: linear = both radii rho0 -> final over "
                      "T_s rounds; code = the authors' (the server radius stays rho_l + (rho_s - rho0)/T_s "
                      "during it), for reproduction", one_of("linear", "code"))

    def radii(self, server_round: int) -> tuple[float, float]:
        """(client rho_l, server rho_s) of round ``server_round`` (1-based)."""
        t, steps, start = server_round - 1, self.warmup_rounds, self.rho0
        if steps == 0 or t > steps:
            return self.rho, self.rho_server
        client = start + t * (self.rho - start) / steps
        if self.warmup == "linear":
            return client, start + t * (self.rho_server - start) / steps
        return client, start if t == 0 else self.rho + (self.rho_server - start) / steps


class FedGloSS(FedAvg):
    Params = FedGloSSServerParams

    def init_records(self):
        self.records[DUAL] = zeros_like(self.model)  # sigma^0 = 0 (server state, not broadcast)
        self.records[PSEUDO_GRADIENT] = zeros_like(self.model)  # pg^0 = 0

    def start_point(self):
        pg, radius = self.records[PSEUDO_GRADIENT], self.params.radii(self.round)[1]
        return add_scaled(self.model, radius / (float(global_norm(pg, torch.float64)) + EPS), pg)

    def broadcast_values(self):
        return {LOCAL_RADIUS: self.params.radii(self.round)[0]}

    def update(self, server_round, updates, weights):
        p, m, start = self.params, len(updates), self.start_point()
        deltas = [sub(u.model, start) for u in updates]
        u = self.aggregate(deltas, weights)
        if p.admm:
            total = scale(self.aggregate(deltas, [1.0 / m] * m), float(m))  # sum_k Delta_k
            divisor = p.beta * self.federation_size() * (m if p.dual == "NM" else 1)
            self.records[DUAL] = add_scaled(self.records[DUAL], -1.0 / divisor, total)
        self.model = add_scaled(add_scaled(self.model, self.cfg.server_lr, u), -p.beta, self.records[DUAL])
        self.records[PSEUDO_GRADIENT] = scale(u, -1.0)
