"""FedSAM client (Qu et al. 2022, eq. 4 / Alg. 1):

    g  = grad F(w_k; xi_k)
    g~ = grad F(w_k + rho * g/||g||; xi_k)      (same mini-batch)
    w_{k+1} = w_k - lr * g~

DP-FedSAM (Shi et al., CVPR 2023) is FedSAM (or ASAM with eta = 0, its code's) under the run's
client-level DP (``dp.*``, common/privacy.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from client.algorithms.base import ClientRule
from client.sam import SAMParams, asam_gradient, sam_gradient
from common.params import key, one_of


class FedSAMClient(ClientRule):
    Params = SAMParams

    def gradient(self, w, batch):
        return sam_gradient(batch, self.params.rho)


@dataclass(frozen=True)
class DPFedSAMParams(SAMParams):
    local: str = key("dp-fedsam.local", "asam", "the local optimizer: asam = ASAM without eta, "
                     "rho |w|(|w| g)/|||w| g|| (the authors' code, whose switch cannot turn it off), "
                     "sam = rho g/||g|| (the paper)", one_of("asam", "sam"))


class DPFedSAMClient(FedSAMClient):
    """DP-FedSAM (Shi et al., CVPR 2023; YMJS-Irfan/DP-FedSAM @016bd7f): FedSAM's (or ASAM's,
    with eta = 0) local steps; the client-level DP of the run's ``dp.*`` keys clips and noises
    the round's update (common/privacy.py), as it does for any algorithm."""

    Params = DPFedSAMParams

    def gradient(self, w, batch):
        if self.params.local == "sam":
            return super().gradient(w, batch)
        return asam_gradient(batch, w, self.params.rho, 0.0)
