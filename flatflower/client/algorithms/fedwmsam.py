"""FedWMSAM client (Li et al., NeurIPS 2025, Alg. 1; Huang-Yongzhi/NeurlPS_FedWMSAM @a922a1d,
client/fedwmsam.py, optimizer/WMSAM.py): FedCM's momentum mixing with SCAFFOLD's correction on
the gradient part, and a one-pass SAM towards a momentum-extrapolated target.

With the server's momentum m (gradient units), control variate c and weight alpha (broadcast),
and the client's own c_k (state, 0 before its first round; the notes' client-held reading, A6):

    q        = (1 - alpha) m + alpha (c - c_k)              (= (1 - alpha) m_k, fixed for the round)
    m_k      = q / (1 - alpha)                              (the personalised momentum, Eq. 1)
    delta_b  = (x_r + b m_k) - x_b                          (Alg. 1 line 14; b = steps taken)
    g_b      = grad F(x_b + eps(delta_b))                   (line 15: one gradient pass)
    x_{b+1}  = x_b - lr (alpha g_b + q)                     (line 16-17: alpha g + (1 - alpha) m_k)
    c_k     <- c_k - c + (x_r - x_tau)/(tau lr)             (SCAFFOLD option II; nothing uploaded)

eps (``fedwmsam.perturbation``): ``paper`` rho delta/||delta|| (default); ``code-sign``
-rho delta/(||delta|| + 1e-7); ``code-literal`` the code's flat-index bug, tensor j shifted by the
scalar -delta_flat[j] rho/(sum_{j<P} |delta_flat[j]| + 1e-7), P = the number of tensors (A1, A3).
``fedwmsam.correction = false``: no c, no c_k (the paper's ablation).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flatflower.client.algorithms.scaffold import ScaffoldClient
from flatflower.client.rule_state import CONSTANT, MODEL, keeps, optional
from flatflower.client.sam import SAMParams, unit_scaled
from flatflower.common.params import key, one_of
from flatflower.common.protocol import CLIENT_CONTROL, GLOBAL_UPDATE, LOCAL_WEIGHT
from flatflower.common.tensors import add, global_norm, scale, sub, zeros_like

CODE_EPS = 1e-7  # the authors' guard in WMSAM.first_step


@dataclass(frozen=True)
class WMSAMSharedParams(SAMParams):
    """The keys both halves read: the radius (the server checks it against alpha0) and the switch."""

    correction: bool = key("fedwmsam.correction", True, "SCAFFOLD-style correction alpha (c - c_k) in the "
                           "personalised momentum (false: the paper's ablation without it)")


@dataclass(frozen=True)
class FedWMSAMParams(WMSAMSharedParams):
    perturbation: str = key("fedwmsam.perturbation", "paper", "perturbation towards the momentum target: "
                            "paper = +rho delta/||delta||; code-sign = the code's negated one; code-literal = "
                            "the code's flat-index bug (per-tensor scalars), for reproduction",
                            one_of("paper", "code-sign", "code-literal"))


def code_literal(delta, rho: float):
    """WMSAM.first_step as released: tensor j moves by the scalar -delta_flat[j] rho / (sum of
    |delta_flat[j]| over j < P + 1e-7), delta_flat = all tensors flattened in order, P = their count."""
    head = torch.cat([d.reshape(-1) for d in delta])[:len(delta)]
    shift = -head * (rho / (head.abs().sum() + CODE_EPS))
    return [torch.zeros_like(d) + shift[j] for j, d in enumerate(delta)]


class FedWMSAMClient(ScaffoldClient):
    Params = FedWMSAMParams
    # the server's alpha; q; m_k (none at sam.rho = 0)
    Keeps = keeps(alpha=CONSTANT, drift=MODEL, target_step=optional(MODEL))

    def __init__(self, params, start, broadcast, state, lr, initial=None):
        super().__init__(params, start, broadcast, state, lr, initial)
        a = broadcast[LOCAL_WEIGHT]
        if not 0 <= a <= 1 or (a == 1 and params.rho > 0):
            raise ValueError(f"the server's alpha = {a!r} is not in [0, 1) (1 only with sam.rho = 0)")
        if not params.correction:
            self.c_i = zeros_like(self.start)
            self.c_minus_ci = zeros_like(self.start)
        self.alpha = a
        self.drift = add(scale(broadcast[GLOBAL_UPDATE], 1.0 - a), scale(self.c_minus_ci, a))  # q
        self.target_step = scale(self.drift, 1.0 / (1.0 - a)) if params.rho > 0 else None  # m_k

    def perturbation(self, w):
        """eps(delta_b), delta_b = x_r + b m_k - x_b (b: the steps taken so far)."""
        delta = add(sub(self.start, w), [self.steps.to(t.dtype) * t for t in self.target_step])
        rho = self.params.rho
        if self.params.perturbation == "paper":
            return unit_scaled(delta, rho)
        if self.params.perturbation == "code-sign":
            return scale(delta, -rho / (global_norm(delta).double() + CODE_EPS))
        return code_literal(delta, rho)

    def direction(self, w, batch):
        if self.params.rho > 0:
            loss, g = batch.grad(self.perturbation(w))
        else:
            loss, g = batch.grad()
        self.steps = self.steps + 1
        return loss, add(scale(g, self.alpha), self.drift)

    def uploads(self, w):
        return {}  # the server derives sum (c_k^+ - c_k) from the models (notes A6)

    def new_state(self, w):
        return {CLIENT_CONTROL: self.new_control(w) if self.params.correction else self.c_i}

