"""FedMoSWA server (Liu et al., ICML 2025; fedswa notes §1, §3-4).

FedMoSWA keeps and broadcasts the momentum control variate m (m^0 = 0) and moves it with the
clients' uploads c_i^+ - m:

    s = sum_i p_i (c_i^+ - m)
    m <- m + s          (its first update, ``fedmoswa.first = full``: the code's, both versions)
    m <- m + gamma s    (afterwards, or always with ``gamma``; gamma = ``fedmoswa.gamma``)

and steps the model as FedSWA's server (strategies/fedswa.py). gamma = 1 under full
participation is SCAFFOLD's c.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from flatflower.common.params import UNIT, Params, Range, key, one_of
from flatflower.common.protocol import CONTROL_OFFSET, CONTROL_UPDATES, MOMENTUM_CONTROL
from flatflower.common.tensors import add_scaled, zeros_like
from flatflower.strategies.fedswa import FedSWA


@dataclass(frozen=True)
class FedMoSWAServerParams(Params):
    gamma: float = key("fedmoswa.gamma", 0.2, "momentum gamma of the server control variate m "
                       "(the paper's ablation optimum)", UNIT, search=Range(0.0, 0.9))
    first: str = key("fedmoswa.first", "full", "m's first update: full (m = s, the code) or gamma "
                     "(m = gamma s)", one_of("full", "gamma"))


class FedMoSWA(FedSWA):
    Params = FedMoSWAServerParams

    def init_records(self):
        self.records[MOMENTUM_CONTROL] = zeros_like(self.model)  # m^0 = 0
        self.records[CONTROL_UPDATES] = OrderedDict(count=torch.zeros((), dtype=torch.float64))

    def update(self, server_round, updates, weights):
        p, count = self.params, self.records[CONTROL_UPDATES]["count"]
        step = 1.0 if p.first == "full" and count == 0 else p.gamma
        s = self.aggregate([u.records[CONTROL_OFFSET] for u in updates], weights)
        self.records[MOMENTUM_CONTROL] = add_scaled(self.records[MOMENTUM_CONTROL], step, s)
        self.records[CONTROL_UPDATES] = OrderedDict(count=count + 1)
        super().update(server_round, updates, weights)
