"""FedGMT and FedGMT-v2 clients (Li et al., ICML 2025, Alg. 1 and eq. 9, 12).

Local loss (eq. 9, with the official code's tau^2 and KL direction, notes §1):

    L_m(w) = CE(f(w; x), y) + gamma * tau^2 * KL( softmax(f(e; x)/tau) || softmax(f(w; x)/tau) )

(batch mean; no gradient through the EMA model e), and the ADMM step of Alg. 1 line 11

    w_{k+1} = w_k - lr * ( grad L_m(w_k) - u_m )

with no prox term (eq. 12); then u_m <- u_m - (1/beta)(w_K - w^t), kept on the client.
That is the FedDyn client with a = 1/beta and the prox weight 0.

FedGMT: e = the server's EMA model, broadcast each round (2 models down).
FedGMT-v2: no EMA broadcast. The client keeps its own e_m and, on each round it takes part,
first folds in the global model (Alg. 1 line 7):  e_m <- alpha e_m + (1 - alpha) w^t.
Before its first round e_m = w^0 (``fedgmt-v2-init = "initial"``, Alg. 1's "w = e = w^0")
or e_m = w^t (``"global"``, the alternative reading; notes §2.3).
"""

from __future__ import annotations

import copy
from collections import OrderedDict

import torch
import torch.nn.functional as F

from client.algorithms.feddyn import DualClient
from client.sam import loss_and_grad
from common.protocol import CLIENT_EMA, EMA_MODEL


class FedGMTClient(DualClient):
    def __init__(self, cfg, model, broadcast, state, **kwargs):
        super().__init__(cfg, model, broadcast, state, **kwargs)
        ema = self.ema_weights(model)
        self.teacher = None
        if cfg.fedgmt_gamma > 0:  # gamma = 0: no KL, so no EMA forward pass either
            self.teacher = copy.deepcopy(model)
            self.teacher.load_state_dict(ema)
            self.teacher.requires_grad_(False)

    def ema_weights(self, model) -> OrderedDict:
        """The EMA model this round distils from: the server's e^t."""
        return self.broadcast[EMA_MODEL]

    def dual_coefficient(self) -> float:
        return 1.0 / self.cfg.fedgmt_beta

    def prox_coefficient(self) -> float:
        return 0.0

    def loss_gradient(self, model, x, y):
        if self.teacher is None:
            return loss_and_grad(model, x, y)
        with torch.no_grad():
            teacher_logits = self.teacher(x)
        gamma, tau = self.cfg.fedgmt_gamma, self.cfg.fedgmt_tau

        def loss_fn(logits, x, y):
            ce = F.cross_entropy(logits, y)
            kl = F.kl_div(F.log_softmax(logits / tau, dim=1), F.softmax(teacher_logits / tau, dim=1),
                          reduction="batchmean")
            return ce + gamma * tau * tau * kl, ce  # differentiate L_m, report CE

        return loss_and_grad(model, x, y, loss_fn)


class FedGMTv2Client(FedGMTClient):
    def ema_weights(self, model) -> OrderedDict:
        alpha = self.cfg.fedgmt_v2_alpha
        received = OrderedDict((k, v.detach().cpu().clone()) for k, v in model.state_dict().items())
        previous = self.state.get(CLIENT_EMA)
        if previous is None:
            previous = self.initial_weights() if self.cfg.fedgmt_v2_init == "initial" else received
        self.ema = OrderedDict(
            (k, alpha * previous[k] + (1.0 - alpha) * v if v.is_floating_point() else v)
            for k, v in received.items())
        return self.ema

    def new_state(self, model):
        return {**super().new_state(model), CLIENT_EMA: self.ema}
