"""FedGF server (Lee & Yoon, ICML 2024; hwan-sig/Official-FedGF @36233b7,
fedlab/contrib/algorithm/fedgf.py L21-70): FedAvg that also broadcasts a perturbed global model
w~ and a mixing weight c, which the clients blend into their SAM point (client/algorithms/fedgf.py).

After round t, over the M accepted clients, in the code's order:

    D   = (1/M) sum_i ||w_i - w^t||                   (uniform mean of plain L2 distances, notes B5)
    window <- window + [1(D > T_D)], the last W kept;  c = mean(window)   (over < W entries early on)
    w^{t+1} = w^t + eta_g sum_i p_i (w_i - w^t)
    w~      = w^{t+1} + rho_g (w^t - w^{t+1})/||w^t - w^{t+1}||   (a zero step: w~ = w^{t+1}, B4)

c and w~ are sent in round t+1 (c = 0 and w~ = w^0 before round 1 ends: FedSAM). T_D =
``fedgf.threshold`` has no default (the authors' script omits it, notes B1): inf keeps c = 0
(FedSAM), a negative value makes c = 1 from round 2. D and c are written to metrics.jsonl
(``fedgf_divergence``, ``fedgf_mix``) every round, for calibrating T_D.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

import torch

from flatflower.client.sam import SAMParams
from flatflower.common.params import Check, Range, key, required_key
from flatflower.common.protocol import DIVERGENCE_WINDOW, MIX_WEIGHT, PERTURBED_GLOBAL
from flatflower.common.tensors import EPS, add_scaled, clone, global_norm, sub
from flatflower.strategies.fedavg import FedAvg

MAX_WINDOW = 100_000


@dataclass(frozen=True)
class FedGFServerParams(SAMParams):
    rho_global: float = key("fedgf.rho-global", -1.0, "global perturbation radius rho_g: w~ = w + rho_g "
                            "unit(w_prev - w); -1 = sam.rho (the authors' default)",
                            Check(lambda x: x == -1 or (math.isfinite(x) and x >= 0), "-1 or a finite number >= 0"))
    threshold: float = required_key("fedgf.threshold", "divergence threshold T_D (the authors' value is "
                                    "unknown): a round counts when the mean client distance D > T_D. Set it "
                                    "near the typical D of your setting (fedgf_divergence in metrics.jsonl of "
                                    "a run with fedgf.threshold = inf, which is FedSAM); round 1's D alone sets round "
                                    "2's c to 0 or 1, and c = 1 can diverge at many local steps (docs/algorithms.md)",
                                    Check(lambda x: isinstance(x, (int, float)) and not math.isnan(x),
                                          "a number (inf: never exceeded)"),
                                    example=0.0,  # always exceeded: c = 1 from round 2
                                    search=Range(0.0001, 10.0, log=True))
    window: int = key("fedgf.window", 30, "window W: c = the fraction of the last W rounds whose D > T_D "
                      "(the authors' script: 30)",
                      Check(lambda x: isinstance(x, int) and 1 <= x <= MAX_WINDOW, f"an integer in [1, {MAX_WINDOW}]"))

    def radius(self) -> float:
        """rho_g: ``fedgf.rho-global``, or ``sam.rho`` when it is -1."""
        return self.rho if self.rho_global == -1 else self.rho_global


class FedGF(FedAvg):
    Params = FedGFServerParams

    @classmethod
    def dp_refusal(cls, cfg):
        return ("its server measures each client's distance from the model it received (the "
                "divergence D that sets c), which the DP analysis of the uniform mean does not cover")

    def init_records(self):
        self.records[PERTURBED_GLOBAL] = clone(self.model)  # unused while c = 0
        # 1 / 0 per recent round (D > T_D or not), oldest first; -1 = no round yet
        self.records[DIVERGENCE_WINDOW] = OrderedDict(
            exceeded=torch.full((self.params.window,), -1.0, dtype=torch.float64))

    def mix_weight(self) -> float:
        """c: the fraction of the window's rounds whose divergence exceeded T_D (0 when empty)."""
        window = self.records[DIVERGENCE_WINDOW]["exceeded"]
        seen = window[window >= 0]
        return float(seen.mean()) if len(seen) else 0.0

    def broadcast_values(self):
        return {MIX_WEIGHT: self.mix_weight()}

    def check_records(self, records):
        window = records[DIVERGENCE_WINDOW]["exceeded"]
        if not bool(((window == -1) | (window == 0) | (window == 1)).all()):
            raise ValueError(f"records.{DIVERGENCE_WINDOW}: entries other than -1, 0 and 1")

    def update(self, server_round, updates, weights):
        w = self.model
        divergence = sum(float(global_norm(sub(u.model, w), torch.float64)) for u in updates) / len(updates)
        window = self.records[DIVERGENCE_WINDOW]["exceeded"]
        exceeded = torch.tensor([1.0 if divergence > self.params.threshold else 0.0], dtype=torch.float64)
        self.records[DIVERGENCE_WINDOW] = OrderedDict(exceeded=torch.cat([window[1:], exceeded]))
        super().update(server_round, updates, weights)
        step = sub(w, self.model)  # w^t - w^{t+1}
        norm = float(global_norm(step, torch.float64))
        self.records[PERTURBED_GLOBAL] = add_scaled(self.model, self.params.radius() / (norm + EPS), step)
        self.metrics = {"fedgf_divergence": divergence, "fedgf_mix": self.mix_weight()}
