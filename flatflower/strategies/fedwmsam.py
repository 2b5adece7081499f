"""FedWMSAM server (Li et al., NeurIPS 2025; Huang-Yongzhi/NeurlPS_FedWMSAM @a922a1d,
server/FedWMSAM.py L47-84): it keeps and broadcasts the momentum m (gradient units, FedCM's
global update) and the control variate c, and sends alpha as a scalar. After a round, with
Delta_k = x_k - x_r over the M accepted clients, tau_k their steps and eta the round's lr:

    s      = (1/M) sum_k [1 + cos(Delta_k, m)]   (a term is 0 when a norm is 0: round 1, m = 0)
    alpha <- (1 - lambda) alpha + lambda clip(s, 0.1, 0.9)                  (notes A5, the code)
    c     <- c + (M/N) sum_k p_k (-c - Delta_k/(tau_k eta))     (SCAFFOLD option II from the models, A6)
    m     <- -sum_k p_k Delta_k/(tau_k eta) * lr-decay           (A2: the code's reading)
    x     <- x + eta_g sum_k p_k Delta_k

with m the momentum the clients used (before this update). ``fedwmsam.correction = false``
keeps c = 0. alpha and s are written to metrics.jsonl (``fedwmsam_alpha``, ``fedwmsam_similarity``).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from flatflower.client.algorithms.fedwmsam import WMSAMSharedParams
from flatflower.common.params import UNIT, Range, key
from flatflower.common.protocol import CONTROL, GLOBAL_UPDATE, GRADIENT_WEIGHT, LOCAL_WEIGHT
from flatflower.common.tensors import add_scaled, global_norm, scale, sub, zeros_like
from flatflower.strategies.fedavg import FedAvg
from flatflower.strategies.fedcm import global_update


@dataclass(frozen=True)
class FedWMSAMServerParams(WMSAMSharedParams):
    alpha0: float = key("fedwmsam.alpha0", 0.1, "initial alpha, the weight of the local gradient against "
                        "the momentum (paper and code: 0.1)", UNIT, search=Range(0.01, 0.5, log=True))
    lam: float = key("fedwmsam.lambda", 0.01, "adaptation rate lambda of alpha (paper and code: 0.01)", UNIT,
                     search=Range(0.001, 0.1, log=True))

    def problems(self, cfg):
        out = super().problems(cfg)
        if self.alpha0 == 1 and self.rho > 0:
            out.append("fedwmsam.alpha0 = 1 needs sam.rho = 0: the perturbation's target uses m_k = m + "
                       "alpha/(1 - alpha)(c - c_k)")
        return out


def cosine(a, b) -> float | None:
    """cos(a, b) in float64; None when either norm is 0."""
    na, nb = float(global_norm(a, torch.float64)), float(global_norm(b, torch.float64))
    if na == 0 or nb == 0:
        return None
    dot = sum(float((x.double() * y.double()).sum()) for x, y in zip(a.values(), b.values()) if x.is_floating_point())
    return dot / (na * nb)


class FedWMSAM(FedAvg):
    Params = FedWMSAMServerParams

    @classmethod
    def dp_refusal(cls, cfg):
        return ("its server reads each client's update on its own (the similarity 1 + cos(Delta_k, m) "
                "that sets alpha, each update scaled by its own 1/tau_k), which the DP analysis of "
                "the uniform mean does not cover")

    def init_records(self):
        self.records[GLOBAL_UPDATE] = zeros_like(self.model)  # m^0 = 0
        self.records[CONTROL] = zeros_like(self.model)  # c^0 = 0
        self.records[GRADIENT_WEIGHT] = OrderedDict(alpha=torch.tensor(self.params.alpha0, dtype=torch.float64))

    def alpha(self) -> float:
        return float(self.records[GRADIENT_WEIGHT]["alpha"])

    def broadcast_values(self):
        return {LOCAL_WEIGHT: self.alpha()}

    def check_records(self, records):
        alpha = float(records[GRADIENT_WEIGHT]["alpha"])
        if not 0 <= alpha <= 1 or (alpha == 1 and self.params.rho > 0):
            raise ValueError(f"records.{GRADIENT_WEIGHT}: alpha = {alpha!r} is not in [0, 1) "
                             "(1 only with sam.rho = 0)")

    def update(self, server_round, updates, weights):
        p, w, m, c = self.params, self.model, self.records[GLOBAL_UPDATE], self.records[CONTROL]
        lr = self.cfg.round_lr(server_round)
        deltas = [sub(u.model, w) for u in updates]
        # 1 + cos per client, 0 (not 1) when a norm is 0, as the code (round 1: m = 0)
        similarity = sum(0.0 if (cos := cosine(d, m)) is None else 1.0 + cos for d in deltas) / len(deltas)
        alpha = (1 - p.lam) * self.alpha() + p.lam * min(max(similarity, 0.1), 0.9)
        self.records[GRADIENT_WEIGHT] = OrderedDict(alpha=torch.tensor(alpha, dtype=torch.float64))
        if p.correction:
            steps = [add_scaled(scale(c, -1.0), -1.0 / (u.num_steps * lr), d) for u, d in zip(updates, deltas)]
            self.records[CONTROL] = add_scaled(c, len(updates) / self.federation_size(), self.aggregate(steps, weights))
        self.records[GLOBAL_UPDATE] = scale(global_update(w, updates, weights, lr, self.aggregate), self.cfg.lr_decay)
        super().update(server_round, updates, weights)
        self.metrics = {"fedwmsam_alpha": alpha, "fedwmsam_similarity": similarity}
