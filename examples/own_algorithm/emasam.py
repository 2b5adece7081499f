"""EMA-SAM: an example of your own algorithm for flatflower (docs/own-algorithm.md); not a
published method.

FedSAM's ascent follows the client's last gradient; EMA-SAM's follows an exponential average
of the client's gradients, which the client keeps from one of its rounds to the next, and the
server adds heavy-ball momentum.

Client i (w_0 the received model; e the client's average from its last round, 0 before its first),
local step k:

    g_k     = grad F(w_k; xi_k)
    e      <- beta e + (1 - beta) g_k
    g~_k    = grad F(w_k + rho e/||e||; xi_k)          (the same mini-batch)
    w_{k+1} = w_k - lr g~_k

and keeps e. Server, over the round's clients with weights p_i:

    Delta = sum_i p_i (w_i - w);   m <- mu m + Delta;   w <- w + m        (m^0 = 0)

Run it: ``flatflower simulate --algorithm emasam:spec --set emasam.beta=0.5``, from this folder.
"""

from __future__ import annotations

from dataclasses import dataclass

from flatflower import AlgorithmSpec, ClientRule, Params, ServerRule, key
from flatflower.client.rule_state import MODEL, keeps
from flatflower.params import FRACTION, NONNEGATIVE, UNIT, Range
from flatflower.tensors import add, add_scaled, global_norm, scale, sub, zeros_like


@dataclass(frozen=True)
class ClientKeys(Params):
    rho: float = key("emasam.rho", 0.05, "the ascent radius", NONNEGATIVE, search=Range(0.001, 0.5, log=True))
    beta: float = key("emasam.beta", 0.9, "the gradient average's decay beta", UNIT)


@dataclass(frozen=True)
class ServerKeys(Params):
    mu: float = key("emasam.server-momentum", 0.5, "the server's heavy-ball momentum mu", FRACTION,
                    search=Range(0.0, 0.9))


class EMASAMClient(ClientRule):
    Params = ClientKeys
    Keeps = keeps(ema=MODEL)  # what it carries from step to step: the average, aligned with the model
    EMA = "ema"  # the record this client keeps between its rounds

    def __init__(self, params, start, broadcast, state, lr, initial=None):
        super().__init__(params, start, broadcast, state, lr, initial)
        self.ema = state.get(self.EMA) or zeros_like(self.start)

    def gradient(self, w, batch):
        loss, g = batch.grad()
        self.ema = add(scale(self.ema, self.params.beta), scale(g, 1.0 - self.params.beta))
        ascent = scale(self.ema, self.params.rho / (global_norm(self.ema).double() + 1e-12))
        return loss, batch.grad(ascent)[1]

    def new_state(self, w):
        return {self.EMA: self.ema}


class EMASAMServer(ServerRule):
    Params = ServerKeys
    MOMENTUM = "momentum"  # server state, not broadcast

    def init_records(self):
        self.records[self.MOMENTUM] = zeros_like(self.model)

    def update(self, server_round, updates, weights):
        start = self.start_point()
        delta = self.aggregate([sub(u.model, start) for u in updates], weights)
        self.records[self.MOMENTUM] = add_scaled(delta, self.params.mu, self.records[self.MOMENTUM])
        self.model = add(self.model, self.records[self.MOMENTUM])


def spec() -> AlgorithmSpec:
    """EMA-SAM's spec: its halves, the record its clients keep, two gradient passes per step."""
    return AlgorithmSpec("emasam", EMASAMServer, EMASAMClient, state=(EMASAMClient.EMA,), passes=2,
                         summary="EMA-SAM (an example): SAM along the client's gradient average, server momentum")
