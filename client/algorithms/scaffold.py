"""SCAFFOLD client (Karimireddy et al. 2020, Alg. 1, option II) and FedGAMMA's (Dai et al.
2023), which puts the same control variates around a local SAM gradient.

With the server control variate c (broadcast) and the client's own c_i (state, zeros before
its first round), K local steps of

    y_{k+1} = y_k - lr * ( g_k - c_i + c )          (FedGAMMA: g_k = g~_k, the SAM gradient)

then (option II)  c_i^+ = c_i - c + (x - y_K) / (K lr),  with x the received model;
c_i^+ - c_i is uploaded, c_i^+ kept. K is the number of steps this client took.
"""

from __future__ import annotations

import torch

from client.algorithms.base import ClientAlgorithm
from client.sam import loss_and_grad, sam_gradient, trainable
from common.protocol import CLIENT_CONTROL, CONTROL, CONTROL_DELTA


class ScaffoldClient(ClientAlgorithm):
    def __init__(self, cfg, model, broadcast, state, **kwargs):
        super().__init__(cfg, model, broadcast, state, **kwargs)
        self.start = [p.detach().clone() for p in trainable(model)]  # x
        self.c = self.broadcast_params[CONTROL]
        self.c_i = self.stored(CLIENT_CONTROL) or [torch.zeros_like(p) for p in self.start]
        self.correction = [c - ci for c, ci in zip(self.c, self.c_i)]  # c - c_i, fixed for the round
        self.steps = 0
        self._new_control = None

    def local_gradient(self, model, x, y):
        """(loss, g_k): the gradient the control variates correct."""
        return loss_and_grad(model, x, y)

    def direction(self, model, x, y):
        loss, g = self.local_gradient(model, x, y)
        self.steps += 1
        return loss, [gi + di for gi, di in zip(g, self.correction)]

    def new_control(self, model) -> list[torch.Tensor]:
        """Option II: c_i^+ = c_i - c + (x - y_K) / (K lr)."""
        if self._new_control is None:
            scale = 1.0 / (self.steps * self.lr)
            self._new_control = [ci - c + scale * (x0 - p.detach())
                                 for ci, c, x0, p in zip(self.c_i, self.c, self.start, trainable(model))]
        return self._new_control

    def uploads(self, model):
        return {CONTROL_DELTA: self.full_record(
            model, [new - old for new, old in zip(self.new_control(model), self.c_i)])}

    def new_state(self, model):
        return {CLIENT_CONTROL: self.named(self.new_control(model))}


class FedGAMMAClient(ScaffoldClient):
    """FedGAMMA: the perturbation comes from the raw local gradient (as in FL-Simulator's
    fedgamma), the corrected step uses the SAM gradient at it."""

    def local_gradient(self, model, x, y):
        return sam_gradient(model, x, y, self.cfg.rho)
