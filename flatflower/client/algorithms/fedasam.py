"""FedASAM client (Caldarola et al., ECCV 2022, "Improving Generalization in Federated
Learning by Seeking Flat Minima"): local ASAM (Kwon et al., ICML 2021, eq. 8 with the
element-wise operator T_w = |w| + eta) in a FedAvg step; FedAvg's server.

    g   = grad F(w_k)
    T   = |w_k| + eta                       (element-wise)
    eps = rho T (T g) / ||T g||             (global L2 norm: rho T^2 g / ||T g||)
    w_{k+1} = w_k - lr grad F(w_k + eps)    (same mini-batch)

rho (``sam.rho``) = 0 is FedAvg. T applies to every parameter, as the ASAM paper defines the
operator; the ASAM authors' code leaves biases out (T = 1 there).
"""

from __future__ import annotations

from dataclasses import dataclass

from flatflower.client.algorithms.base import ClientRule
from flatflower.client.sam import SAMParams, asam_gradient
from flatflower.common.params import NONNEGATIVE, Range, key


@dataclass(frozen=True)
class FedASAMParams(SAMParams):
    eta: float = key("fedasam.eta", 0.01, "ASAM's eta in the element-wise T_w = |w| + eta", NONNEGATIVE,
                     search=Range(0.001, 0.1, log=True))


class FedASAMClient(ClientRule):
    Params = FedASAMParams

    def gradient(self, w, batch):
        return asam_gradient(batch, w, self.params.rho, self.params.eta)
