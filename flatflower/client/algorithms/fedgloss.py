"""FedGloSS client (Caldarola et al., CVPR 2025, Alg. 1; pietrocagnasso/fedgloss @cbd6cf5,
clients/fedgloss_client.py): FedDyn's local step with a = 1/beta around a local SAM gradient,
anchored at the model received, which is the server's perturbed model w~^t:

    g~ = grad F(w_k + rho_l g/||g||)    (rho_l: this round's radius, sent by the server: ``sam.rho``
                                         after the warm-up; 0: the plain gradient, 1 pass)
    w_{k+1} = w_k - lr ( g~ - sigma_k + (w_k - w~^t)/beta )
    sigma_k <- sigma_k - (w_K - w~^t)/beta      (kept on the client)

The anchor and the dual update are once per round (Alg. 1; the code re-anchors every local
epoch, the same for its published E = 1: notes A3). ``fedgloss.admm = false`` drops the ADMM
terms (no prox, sigma_k stays 0): with rho_s = 0 the method is then FedAvg (rho_l = 0) or FedSAM
with the server lr.
"""

from __future__ import annotations

from dataclasses import dataclass

from flatflower.client.algorithms.feddyn import DualClient
from flatflower.client.sam import sam_gradient
from flatflower.common.params import POSITIVE, Params, Range, key
from flatflower.common.protocol import LOCAL_RADIUS


@dataclass(frozen=True)
class GloSSDualParams(Params):
    """beta, read by both halves: the prox weight and both dual steps are 1/beta."""

    beta: float = key("fedgloss.beta", 10.0, "ADMM penalty beta: prox weight and dual step 1/beta "
                      "(the authors' CIFAR-10 runs: 10)", POSITIVE, search=Range(1.0, 1000.0, log=True))
    admm: bool = key("fedgloss.admm", True, "the ADMM terms (FedDyn-style duals and prox); false: none, "
                     "the limit beta -> inf (with rho_s = 0: FedAvg / FedSAM with the server lr)")


class FedGloSSClient(DualClient):
    Params = GloSSDualParams

    def dual_coefficient(self) -> float:
        return 1.0 / self.params.beta if self.params.admm else 0.0

    def gradient(self, w, batch):
        rho = self.broadcast[LOCAL_RADIUS]  # a Python float, the same for every client of the round
        return sam_gradient(batch, rho) if rho > 0 else batch.grad()
