"""SCAFFOLD client (Karimireddy et al. 2020, Alg. 1, option II); FedGAMMA and FedLESAM-S put
the same control variates around their own gradient.

With the server control variate c (broadcast) and the client's own c_i (state, zeros before
its first round), K local steps of

    y_{k+1} = y_k - lr * ( g_k - c_i + c )

then (option II)  c_i^+ = c_i - c + (x - y_K) / (K lr),  with x the received model;
c_i^+ - c_i is uploaded, c_i^+ kept. K is the number of steps this client took.
"""

from __future__ import annotations

import torch

from flatflower.client.algorithms.base import ClientRule
from flatflower.client.rule_state import MODEL, SCALAR, keeps, optional
from flatflower.common.tensors import Tensors, add, scale, sub, zeros_like
from flatflower.common.protocol import CLIENT_CONTROL, CONTROL, CONTROL_DELTA


class ScaffoldClient(ClientRule):
    SERVER_CONTROL = CONTROL  # the broadcast record that holds c
    # c, c_i, c - c_i; K; c_i^+ once uploads or new_state computed it
    Keeps = keeps(c=MODEL, c_i=MODEL, c_minus_ci=MODEL, steps=SCALAR, _new_control=optional(MODEL))

    def __init__(self, params, start, broadcast, state, lr, initial=None):
        super().__init__(params, start, broadcast, state, lr, initial)
        self.c = broadcast[self.SERVER_CONTROL]
        self.c_i = state.get(CLIENT_CONTROL) or zeros_like(self.start)
        self.c_minus_ci = sub(self.c, self.c_i)  # fixed for the round
        # K, the steps taken: a tensor, so an engine that batches clients counts per client
        self.steps = torch.zeros((), dtype=torch.float64, device=self.start[0].device)
        self._new_control: Tensors | None = None

    def correction(self) -> Tensors:
        """c - c_i, added to every step."""
        return self.c_minus_ci

    def direction(self, w, batch):
        loss, g = self.gradient(w, batch)
        self.steps = self.steps + 1
        return loss, add(g, self.correction())

    def step_sum(self) -> torch.Tensor:
        """The sum of the round's step sizes: K lr (a constant lr)."""
        return self.steps * self.lr

    def new_control(self, w) -> Tensors:
        """Option II: c_i^+ = c_i - c + (x - y_K) / (K lr)."""
        if self._new_control is None:
            self._new_control = add(sub(self.c_i, self.c), scale(sub(self.start, w), 1.0 / self.step_sum()))
        return self._new_control

    def uploads(self, w):
        return {CONTROL_DELTA: sub(self.new_control(w), self.c_i)}

    def new_state(self, w):
        return {CLIENT_CONTROL: self.new_control(w)}

