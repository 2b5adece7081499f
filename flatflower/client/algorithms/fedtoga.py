"""FedTOGA client (Li et al., "From Local Tweaks To Global Awareness", final version, Alg. 1).

Each step, with the broadcast global update Delta^t and the client dual h_i fixed:

    v      = g_k + kappa Delta               "G" (default): g_k = grad F(theta_k), fresh
           = g~_{k-1} + kappa Delta          "N": last step's SAM gradient (1 gradient per step)
           = g_k + g~_{k-1} + kappa Delta    "fusion"
    delta  = rho v/||v||                     (at k = 0, "N" and "fusion" use g_0: no g~_{-1})
    g~_k   = grad F(theta_k + delta)         (same mini-batch)
    theta_{k+1} = theta_k - lr ( g~_k - h_i + a (theta_k - theta^t) + beta Delta )

then h_i <- h_i - a (theta_K - theta^t). ``fedtoga.prox-scale``: a = alpha ("multiplier",
the notes' reading, §6-A1) or a = 1/alpha ("literal", the (1/alpha) printed in Alg. 1).
With kappa = beta = 0, "G" and a = feddyn.alpha the client is FedSpeed's (the whole algorithm
is FedSpeed when the server divides the dual by N too, or under full participation).
``fedtoga.alpha`` and ``fedtoga.prox-scale`` are read by both halves (:class:`DualStepParams`);
the server's own switches (``dual-divisor``, ``delta-scale``) are in strategies/fedtoga.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from flatflower.client.algorithms.feddyn import DualClient
from flatflower.client.rule_state import MODEL, keeps, optional
from flatflower.client.sam import SAMParams, unit_scaled
from flatflower.common.tensors import add, scale
from flatflower.common.params import NONNEGATIVE, POSITIVE, Params, Range, key, one_of
from flatflower.common.protocol import GLOBAL_UPDATE


@dataclass(frozen=True)
class DualStepParams(Params):
    """a, read by both halves: the client's prox weight and dual step, the server's dual step."""

    alpha: float = key("fedtoga.alpha", 0.1, "prox and dual coefficient (see prox-scale)",
                       POSITIVE, search=Range(0.001, 1.0, log=True))
    prox_scale: str = key("fedtoga.prox-scale", "multiplier", "a = alpha (multiplier, notes "
                          "§6-A1) or 1/alpha (literal, as printed in Alg. 1)",
                          one_of("multiplier", "literal"))

    def coefficient(self) -> float:
        """a, the prox weight and dual step: alpha (multiplier) or 1/alpha (literal)."""
        return self.alpha if self.prox_scale == "multiplier" else 1.0 / self.alpha


@dataclass(frozen=True)
class FedTOGAParams(SAMParams, DualStepParams):
    kappa: float = key("fedtoga.kappa", 1.0, "correction kappa of the perturbation by Delta", NONNEGATIVE,
                       search=Range(0.0, 2.0))
    beta: float = key("fedtoga.beta", 0.9, "correction beta of the step by Delta", NONNEGATIVE, search=Range(0.0, 1.0))
    perturbation: str = key("fedtoga.perturbation", "G", "G: fresh gradient + kappa Delta; N: "
                            "last SAM gradient (1 pass per step); fusion: both",
                            one_of("G", "N", "fusion"))


class FedTOGAClient(DualClient):
    Params = FedTOGAParams
    # kappa Delta, beta Delta; g~_{k-1}: none before the first step
    Keeps = keeps(kappa_delta=MODEL, beta_delta=MODEL, previous=optional(MODEL))

    def __init__(self, params, start, broadcast, state, lr, initial=None):
        super().__init__(params, start, broadcast, state, lr, initial)
        delta = broadcast[GLOBAL_UPDATE]
        self.kappa_delta = scale(delta, params.kappa)
        self.beta_delta = scale(delta, params.beta)
        self.previous = None  # g~_{k-1}, the last SAM gradient (the "gradient register")

    def dual_coefficient(self) -> float:
        return self.params.coefficient()

    def correction(self):
        return self.beta_delta

    def gradient(self, w, batch):
        variant = self.params.perturbation
        loss = None
        if variant == "N" and self.previous is not None:
            v = add(self.previous, self.kappa_delta)
        else:
            loss, g = batch.grad()
            if variant == "fusion" and self.previous is not None:
                g = add(g, self.previous)
            v = add(g, self.kappa_delta)
        perturbed_loss, g_sam = batch.grad(unit_scaled(v, self.params.rho))
        self.previous = g_sam
        return (perturbed_loss if loss is None else loss), g_sam
