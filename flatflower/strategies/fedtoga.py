"""FedTOGA server (Li et al., final version, Alg. 1 "Server execute"), on the FedDyn server:

    h^{t+1}     = h^t - (a/D) sum_{i in S} (theta_i - theta^t)   D = M (printed) or N: ``fedtoga.dual-divisor``
    Delta^{t+1} = -(1/(M K)) sum_{i in S} (theta_i - theta^t)     (÷ eta_l too: ``fedtoga.delta-scale = per-lr``)
    theta^{t+1} = mean_i theta_i - h^{t+1}/a

with a = alpha or 1/alpha (``fedtoga.prox-scale``, read by both halves and so declared by the
client's flatflower.client.algorithms.fedtoga.DualStepParams). Delta is
broadcast with theta (2 models down, 1 up); Delta^0 = 0. K is each client's own number of
steps tau_i, and 1/M is the aggregation weight p_i.
"""

from __future__ import annotations

from dataclasses import dataclass

from flatflower.client.algorithms.fedtoga import DualStepParams
from flatflower.common.params import key, one_of
from flatflower.common.protocol import GLOBAL_UPDATE
from flatflower.common.tensors import zeros_like
from flatflower.strategies.fedcm import dp_refusal_of_global_update, global_update
from flatflower.strategies.feddyn import FedDyn


@dataclass(frozen=True)
class FedTOGAServerParams(DualStepParams):
    dual_divisor: str = key("fedtoga.dual-divisor", "M", "the server dual's divisor: M sampled "
                            "(as printed) or N clients", one_of("M", "N"))
    delta_scale: str = key("fedtoga.delta-scale", "literal", "Delta per local step (literal) or "
                           "per step and lr (per-lr)", one_of("literal", "per-lr"))


class FedTOGA(FedDyn):
    Params = FedTOGAServerParams

    @classmethod
    def dp_refusal(cls, cfg):
        return dp_refusal_of_global_update(cfg)

    def init_records(self):
        super().init_records()
        self.records[GLOBAL_UPDATE] = zeros_like(self.model)  # Delta^0 = 0

    def dual_coefficient(self) -> float:
        return self.params.coefficient()

    def dual_divisor(self, num_updates: int) -> int:
        return num_updates if self.params.dual_divisor == "M" else super().dual_divisor(num_updates)

    def update(self, server_round, updates, weights):
        lr = self.cfg.round_lr(server_round) if self.params.delta_scale == "per-lr" else 1.0
        self.records[GLOBAL_UPDATE] = global_update(self.model, updates, weights, lr, self.aggregate)
        super().update(server_round, updates, weights)
