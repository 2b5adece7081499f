"""FedGAMMA client (Dai et al. 2023): SCAFFOLD's control variates (client/algorithms/scaffold.py)
around a local SAM gradient,

    y_{k+1} = y_k - lr * ( g~_k - c_i + c ),   g~_k = grad F(y_k + rho g_k/||g_k||)

the perturbation from the raw local gradient, as in FL-Simulator's fedgamma.
"""

from __future__ import annotations

from flatflower.client.algorithms.scaffold import ScaffoldClient
from flatflower.client.sam import SAMParams, sam_gradient


class FedGAMMAClient(ScaffoldClient):
    Params = SAMParams

    def gradient(self, w, batch):
        return sam_gradient(batch, self.params.rho)
