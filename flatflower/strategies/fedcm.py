"""FedCM server (Xu et al. 2021), also MoFedSAM's (Qu et al. 2022, Alg. 2): it keeps and
broadcasts the global update

    Delta^{r+1} = - sum_i p_i (w_i - w^r) / (eta_l^r * tau_i)    (gradient units)

sent to the clients next round (Delta^0 = 0). The papers' normalisation is
-(1/(eta_l K S)) sum_i Delta_i; with tau_i = each client's actual number of local steps the
two agree when all clients take K steps (MoFedSAM notes §6 A1-A2).

Model step, ``fedcm.server-step`` (:class:`GlobalUpdateParams`):
  * ``delta`` (default, the notes' recommended reading and the FL-Simulator code):
    w^{r+1} = w^r + eta_g sum_i p_i (w_i - w^r), i.e. model averaging at eta_g = 1;
  * ``literal`` (Alg. 2 as printed): w^{r+1} = w^r - eta_g Delta^{r+1}; equals ``delta`` only
    when eta_l * K = 1 (the paper's defaults eta_l = 0.1, K = 10).
"""

from __future__ import annotations

from dataclasses import dataclass

from flatflower.common.params import Params, key, one_of
from flatflower.common.protocol import GLOBAL_UPDATE
from flatflower.common.tensors import add_scaled, scale, sub, zeros_like
from flatflower.strategies.fedavg import FedAvg


def dp_refusal_of_global_update(cfg) -> str | None:
    """The global update scales each client's update by its own 1/tau_i: a function of the mean
    of the updates under DP only when every client takes the same number of steps."""
    if cfg.local_steps == 0:
        return ("its server scales each client's update by 1/(lr tau_i), tau_i the client's own step "
                "count, which the DP analysis of the uniform mean does not cover; set local-steps > 0 "
                "(every client the same number of steps)")
    return None


def global_update(model, updates, weights, lr: float, aggregate):
    """-sum_i p_i (w_i - w) / (lr * tau_i): the round's mean pseudo-gradient (tau_i: the steps
    the server asked of client i), combined by ``aggregate``."""
    per_client = [scale(sub(u.model, model), -1.0 / (lr * u.num_steps)) for u in updates]
    return aggregate(per_client, weights)


@dataclass(frozen=True)
class GlobalUpdateParams(Params):
    """The FedCM family's server model step (FedCM, MoFedSAM)."""

    server_step: str = key("fedcm.server-step", "delta",
                           "server model step: delta = w + server-lr * mean(w_i - w) (the notes' "
                           "reading); literal = w - server-lr * Delta as printed in Alg. 2",
                           one_of("delta", "literal"))


class FedCM(FedAvg):
    Params = GlobalUpdateParams

    @classmethod
    def dp_refusal(cls, cfg):
        return dp_refusal_of_global_update(cfg)

    def init_records(self):
        self.records[GLOBAL_UPDATE] = zeros_like(self.model)  # Delta^0 = 0

    def update(self, server_round, updates, weights):
        lr = self.cfg.round_lr(server_round)
        self.records[GLOBAL_UPDATE] = global_update(self.model, updates, weights, lr, self.aggregate)
        if self.params.server_step == "literal":
            self.model = add_scaled(self.model, -self.cfg.server_lr, self.records[GLOBAL_UPDATE])
        else:
            self.model = add_scaled(self.model, self.cfg.server_lr, self.mean_delta(updates, weights))
