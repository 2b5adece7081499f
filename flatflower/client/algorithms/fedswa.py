"""FedSWA client (Liu et al., ICML 2025; junkangLiu0/FedSWA, v1 main.py @6f3e52c
update_FedSWA L2143-2169; notes §1, §3-4): plain local SGD with a cyclical in-round learning
rate, restarted every round,

    eta_k = eta_l (1 - k/tau + rho k/tau)      k = 0..tau-1, tau = this client's steps this round

(rho = ``fedswa.lr-ratio``), a per-step lr of the training loop (``lr_factor``), so weight decay
and momentum take it as SGD's lr does. rho = 1 is FedAvg. FedMoSWA's client
(client/algorithms/fedmoswa.py) takes the same steps.
"""

from __future__ import annotations

from dataclasses import dataclass

from flatflower.client.algorithms.base import ClientRule
from flatflower.common.params import NONNEGATIVE, Params, Range, key


@dataclass(frozen=True)
class FedSWAParams(Params):
    ratio: float = key("fedswa.lr-ratio", 0.1, "rho: the in-round lr decays linearly from lr to "
                       "rho * lr over the client's steps (1 = a constant lr, FedAvg)", NONNEGATIVE,
                       search=Range(0.01, 1.0, log=True))


class FedSWAClient(ClientRule):
    Params = FedSWAParams

    def lr_factor(self, step, steps):
        return 1.0 - (1.0 - self.params.ratio) * step / steps
