"""FedSOL client (Lee et al., CVPR 2024, "FedSOL: Stabilized Orthogonal Learning with
Proximal Restrictions in Federated Learning"; Lee-Gihun/FedSOL @ebc3f64,
algorithms/fedsol_adaptive/ClientTrainer.py L35-75 and fedsol_fixed/).

Local SAM whose ascent follows the proximal objective, a tempered KL to the received model
w^t (no tau^2 factor, as the code), while the descent is the plain task loss:

    g_p = grad_w (1/B) sum_b KL( softmax(f(w^t; x_b)/tau) || softmax(f(w_k; x_b)/tau) )
    eps = rho N(|w_k - w^t|) * g_p / ||g_p||       (``adaptive``, the main method)
        = rho g_p / ||g_p||                        (``fixed``)
    w_{k+1} = w_k - lr grad CE(w_k + eps)          (same mini-batch)

N(A) normalises each tensor along dim 0 (``F.normalize(A, dim=0)``: a Linear weight's column
of |Delta| over the outputs to unit norm, a bias as one vector); ||g_p|| is the global norm.
eps = 0 while w_k equals w^t (the first step of a round), in both modes: there g_p is
rounding noise (exactly 0 in exact arithmetic), which the authors' fixed variant normalises to
a full-radius step in a random direction (notes S1). The adaptive mode is 0 there anyway.
rho = 0 is FedAvg; so is one local step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from flatflower.client.algorithms.base import ClientRule
from flatflower.client.batch import mean_cross_entropy, mean_kl
from flatflower.client.sam import unit_scaled
from flatflower.common.params import NONNEGATIVE, POSITIVE, Params, Range, key, one_of
from flatflower.common.tensors import global_norm, sub


@dataclass(frozen=True)
class FedSOLParams(Params):
    rho: float = key("fedsol.rho", 1.0, "perturbation radius rho (the code's configs: 1.0; the "
                     "adaptive scale is at most 1 per entry)", NONNEGATIVE, search=Range(0.01, 2.0, log=True))
    tau: float = key("fedsol.tau", 3.0, "temperature tau of the proximal KL (no tau^2 factor)", POSITIVE)
    mode: str = key("fedsol.mode", "adaptive", "perturbation: adaptive = rho N(|w - w^t|) * g_p/||g_p|| "
                    "(the main method), fixed = rho g_p/||g_p||", one_of("adaptive", "fixed"))


def column_normalized(t: torch.Tensor) -> torch.Tensor:
    """``F.normalize(t, p=2, dim=0)`` (a 0-d tensor as a 1-vector): each slice along dim 0 to
    unit L2 norm, a zero slice stays zero."""
    return F.normalize(t.reshape(1) if t.dim() == 0 else t, p=2.0, dim=0, eps=1e-12).reshape(t.shape)


class FedSOLClient(ClientRule):
    Params = FedSOLParams

    def gradient(self, w, batch):
        p, tau = self.params, self.params.tau
        teacher = batch.outputs(self.start)

        def proximal(logits, y, weight=None):  # differentiate the KL, report the task loss at w
            kl = mean_kl(F.log_softmax(logits / tau, dim=1), F.softmax(teacher / tau, dim=1), weight)
            return kl, mean_cross_entropy(logits, y, weight)

        loss, g_p = batch.grad(objective=proximal)
        drift, unit = sub(w, self.start), unit_scaled(g_p, p.rho)
        if p.mode == "adaptive":  # 0 where w has not moved from w^t
            eps = [column_normalized(d.abs()) * u for d, u in zip(drift, unit)]
        else:  # 0 while w = w^t (its first step): a 0/1 tensor, no branch on a value
            moved = (global_norm(drift) > 0).to(unit[0].dtype)
            eps = [moved * u for u in unit]
        return loss, batch.grad(eps)[1]
