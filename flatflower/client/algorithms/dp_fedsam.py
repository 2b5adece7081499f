"""DP-FedSAM client (Shi et al., CVPR 2023; YMJS-Irfan/DP-FedSAM @016bd7f): FedSAM's local steps
(client/algorithms/fedsam.py), or ASAM's with eta = 0 (its code's), under the run's client-level
DP (``dp.*``, common/privacy.py), which clips and noises the round's update as it does for any
algorithm.
"""

from __future__ import annotations

from dataclasses import dataclass

from flatflower.client.algorithms.fedsam import FedSAMClient
from flatflower.client.sam import SAMParams, asam_gradient
from flatflower.common.params import key, one_of


@dataclass(frozen=True)
class DPFedSAMParams(SAMParams):
    local: str = key("dp-fedsam.local", "asam", "the local optimizer: asam = ASAM without eta, "
                     "rho |w|(|w| g)/|||w| g|| (the authors' code, whose switch cannot turn it off), "
                     "sam = rho g/||g|| (the paper)", one_of("asam", "sam"))


class DPFedSAMClient(FedSAMClient):
    """DP-FedSAM: FedSAM's (or ASAM's, with eta = 0) local steps; the client-level DP of the
    run's ``dp.*`` keys clips and noises the round's update (common/privacy.py), as it does for
    any algorithm."""

    Params = DPFedSAMParams

    def gradient(self, w, batch):
        if self.params.local == "sam":
            return super().gradient(w, batch)
        return asam_gradient(batch, w, self.params.rho, 0.0)
