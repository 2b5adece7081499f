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
Before its first round e_m = w^0 (``fedgmt-v2.init = "initial"``, Alg. 1's "w = e = w^0")
or e_m = w^t (``"global"``, the alternative reading; notes §2.3).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn.functional as F

from flatflower.client.algorithms.feddyn import DualClient
from flatflower.client.batch import mean_cross_entropy, mean_kl
from flatflower.client.rule_state import MODEL, keeps
from flatflower.common.tensors import Tensors, add, scale
from flatflower.common.params import FRACTION, NONNEGATIVE, POSITIVE, Params, Range, key, one_of
from flatflower.common.protocol import CLIENT_EMA, EMA_MODEL


@dataclass(frozen=True)
class ADMMParams(Params):
    """beta, read by both halves: the client's and the server's dual step 1/beta."""

    beta: float = key("fedgmt.beta", 10.0, "ADMM penalty beta (dual step 1/beta)", POSITIVE,
                      search=Range(1.0, 1000.0, log=True))


@dataclass(frozen=True)
class DistillParams(ADMMParams):
    """What FedGMT's and FedGMT-v2's clients share: the ADMM penalty and the distillation."""

    gamma: float = key("fedgmt.gamma", 1.0, "weight gamma of the KL to the EMA model", NONNEGATIVE,
                       search=Range(0.5, 2.0, log=True))
    tau: float = key("fedgmt.tau", 3.0, "distillation temperature tau", POSITIVE)


@dataclass(frozen=True)
class FedGMTv2Params(DistillParams):
    client_alpha: float = key("fedgmt-v2.alpha", 0.5, "decay of each client's own EMA model", FRACTION,
                              search=Range(0.5, 0.998))
    init: str = key("fedgmt-v2.init", "initial", "a client's EMA before its first round: w^0 "
                    "(initial) or the received model (global)", one_of("initial", "global"))


class FedGMTClient(DualClient):
    Params = DistillParams
    Keeps = keeps(teacher=MODEL)  # the EMA model this round distils from

    def __init__(self, params, start, broadcast, state, lr, initial=None):
        super().__init__(params, start, broadcast, state, lr, initial)
        self.teacher = self.teacher_weights()

    def teacher_weights(self) -> Tensors:
        """The EMA model this round distils from: the server's e^t."""
        return self.broadcast[EMA_MODEL]

    def dual_coefficient(self) -> float:
        return 1.0 / self.params.beta

    def prox_coefficient(self) -> float:
        return 0.0

    def gradient(self, w, batch):
        gamma, tau = self.params.gamma, self.params.tau
        if gamma == 0:  # no KL, so no EMA forward pass either
            return batch.grad()
        teacher_logits = batch.outputs(self.teacher)

        def objective(logits, y, weight=None):
            ce = mean_cross_entropy(logits, y, weight)
            kl = mean_kl(F.log_softmax(logits / tau, dim=1), F.softmax(teacher_logits / tau, dim=1),
                         weight)
            return ce + gamma * tau * tau * kl, ce  # differentiate L_m, report CE

        return batch.grad(objective=objective)


class FedGMTv2Client(FedGMTClient):
    Params = FedGMTv2Params

    def teacher_weights(self) -> Tensors:
        """e_m <- alpha e_m + (1 - alpha) w^t, e_m before the first round per ``init``."""
        alpha = self.params.client_alpha
        previous = self.state.get(CLIENT_EMA)
        if previous is None:
            previous = self.initial() if self.params.init == "initial" else self.start
        return add(scale(previous, alpha), scale(self.start, 1.0 - alpha))

    def new_state(self, w):
        return {**super().new_state(w), CLIENT_EMA: self.teacher}
