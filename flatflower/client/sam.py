"""SAM machinery (Foret et al. 2021; FedSAM eq. 3-4 of Qu et al. 2022), written over a
:class:`flatflower.client.batch.Batch`, so it does not care which engine computes the gradients.

Norms are global L2 over all trainable parameters. The ascent and the descent gradient use
the same mini-batch; the engine restores the weights bit-exactly after a gradient at an
offset (not by subtracting the perturbation, which would drift in floating point). No
``.item()``: the scale is a 0-dim tensor (float64, as the Python float it replaces), so a step
never waits for the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flatflower.client.batch import Batch
from flatflower.common.params import NONNEGATIVE, Params, Range, key
from flatflower.common.tensors import EPS, Tensors, global_norm, scale


@dataclass(frozen=True)
class SAMParams(Params):
    """The SAM family's radius (every algorithm with a perturbation)."""

    rho: float = key("sam.rho", 0.1, "SAM radius: the perturbation's global L2 norm", NONNEGATIVE,
                     search=Range(0.001, 0.5, log=True))


def unit_scaled(direction: Tensors, radius: float) -> Tensors:
    """radius * d/||d|| (global norm); all zeros when d = 0."""
    return scale(direction, radius / (global_norm(direction).double() + EPS))


def asam_gradient(batch: Batch, w: Tensors, rho: float, eta: float) -> tuple[torch.Tensor, Tensors]:
    """ASAM (Kwon et al. 2021, eq. 8; T_w = |w| + eta element-wise): g~ = grad F(w + rho T (T g)/||T g||).
    Returns (loss at w, g~)."""
    loss, g = batch.grad()
    t = [p.abs() + eta for p in w]
    shift = unit_scaled([ti * gi for ti, gi in zip(t, g)], rho)
    return loss, batch.grad([ti * si for ti, si in zip(t, shift)])[1]


def sam_gradient(batch: Batch, rho: float) -> tuple[torch.Tensor, Tensors]:
    """FedSAM eq. (4): g = grad F(w); g~ = grad F(w + rho g/||g||). Returns (loss at w, g~)."""
    loss, g = batch.grad()
    return loss, batch.grad(unit_scaled(g, rho))[1]
