"""FedGMT and FedGMT-v2 servers (Li et al., ICML 2025, Alg. 1 lines 16-18).

ADMM server = the FedDyn server with a = 1/beta and the global dual over all M clients
(the paper's M is our N):

    u^{t+1} = u^t - (1/(beta N)) sum_{m in S} (w_m - w^t)
    w^{t+1} = mean_m w_m - beta u^{t+1}

FedGMT then moves the EMA ("trajectory") model and broadcasts it with w (2 models down):

    e^{t+1} = alpha e^t + (1 - alpha) w^{t+1}        (e^0 = w^0)

FedGMT-v2 keeps no EMA on the server (its clients keep their own): 1 model down.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from flatflower.client.algorithms.fedgmt import ADMMParams
from flatflower.common.params import FRACTION, Range, key
from flatflower.common.protocol import EMA_MODEL
from flatflower.strategies.feddyn import FedDyn


@dataclass(frozen=True)
class FedGMTServerParams(ADMMParams):
    alpha: float = key("fedgmt.alpha", 0.95, "decay alpha of the server's EMA model", FRACTION,
                       search=Range(0.5, 0.998))


class FedGMTv2(FedDyn):
    Params = ADMMParams  # fedgmt.beta, declared by the client half that reads it too

    def dual_coefficient(self) -> float:
        return 1.0 / self.params.beta


class FedGMT(FedGMTv2):
    Params = FedGMTServerParams

    def init_records(self):
        super().init_records()
        self.records[EMA_MODEL] = OrderedDict((k, v.clone()) for k, v in self.model.items())

    def update(self, server_round, updates, weights):
        super().update(server_round, updates, weights)
        alpha, ema = self.params.alpha, self.records[EMA_MODEL]
        self.records[EMA_MODEL] = OrderedDict(
            (k, alpha * ema[k] + (1.0 - alpha) * v) for k, v in self.model.items())
