"""FedAdam and FedYogi servers (Reddi et al., ICLR 2021, Alg. 2): an adaptive optimizer on
the server, over the mean client update, with moments kept on the server (m^0 = v^0 = 0,
as Flower's FedAdam/FedYogi; the paper allows any v^{-1} >= tau^2):

    Delta = sum_i p_i (w_i - w)
    m     = beta1 m + (1 - beta1) Delta
    v     = beta2 v + (1 - beta2) Delta^2                          (Adam)
          = v - (1 - beta2) Delta^2 sign(v - Delta^2)               (Yogi)
    w     = w + eta m / (sqrt(v) + tau)

eta = ``fedopt.eta`` (server-lr is not used), beta1/beta2/tau = ``fedopt.beta1/.beta2/.tau``
(:class:`FedOptParams`; the clients run FedAvg's plain local SGD).
No bias correction, as in the paper's Alg. 2 (Flower's FedAdam scales eta by
sqrt(1 - beta2^(t+1)) / (1 - beta1^(t+1)); FedYogi has none in either).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from flatflower.common.params import FRACTION, POSITIVE, Params, Range, key
from flatflower.common.protocol import ADAPTIVE_M, ADAPTIVE_V
from flatflower.common.tensors import zeros_like
from flatflower.strategies.fedavg import FedAvg


@dataclass(frozen=True)
class FedOptParams(Params):
    eta: float = key("fedopt.eta", 0.01, "server step size eta (server-lr is not used)", POSITIVE,
                     search=Range(0.001, 1.0, log=True))
    beta1: float = key("fedopt.beta1", 0.9, "first-moment decay beta1", FRACTION)
    beta2: float = key("fedopt.beta2", 0.99, "second-moment decay beta2", FRACTION)
    tau: float = key("fedopt.tau", 0.001, "adaptivity tau", POSITIVE, search=Range(1e-05, 0.1, log=True))

    def problems(self, cfg) -> list[str]:
        out = super().problems(cfg)
        if cfg.server_lr != 1.0:
            out.append(f"server-lr={cfg.server_lr} has no effect on {cfg.algorithm}: its server "
                       "step size is fedopt.eta")
        return out


class FedAdam(FedAvg):
    Params = FedOptParams

    def init_records(self):
        self.records[ADAPTIVE_M] = zeros_like(self.model)
        self.records[ADAPTIVE_V] = zeros_like(self.model)

    def second_moment(self, v: torch.Tensor, d2: torch.Tensor) -> torch.Tensor:
        b2 = self.params.beta2
        return b2 * v + (1.0 - b2) * d2

    def update(self, server_round, updates, weights):
        p = self.params
        delta = self.mean_delta(updates, weights)
        m, v = self.records[ADAPTIVE_M], self.records[ADAPTIVE_V]
        m = OrderedDict((k, p.beta1 * m[k] + (1.0 - p.beta1) * d) for k, d in delta.items())
        v = OrderedDict((k, self.second_moment(v[k], d * d)) for k, d in delta.items())
        self.records[ADAPTIVE_M], self.records[ADAPTIVE_V] = m, v
        self.model = OrderedDict(
            (k, w + p.eta * m[k] / (torch.sqrt(v[k]) + p.tau))
            for k, w in self.model.items())


class FedYogi(FedAdam):
    def second_moment(self, v, d2):
        return v - (1.0 - self.params.beta2) * d2 * torch.sign(v - d2)
