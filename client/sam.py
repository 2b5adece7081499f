"""SAM machinery (Foret et al. 2021; FedSAM eq. 3-4 of Qu et al. 2022).

Norms are global L2 over all trainable parameters. The ascent and the descent gradient use
the same mini-batch, and the weights are restored bit-exactly from a saved copy (not by
subtracting the perturbation, which would drift in floating point).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

LossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]

EPS = 1e-12  # guards ||g|| = 0; the paper has no epsilon (notes §1.2)


def trainable(model: nn.Module) -> list[nn.Parameter]:
    """The parameters a local step updates, in a fixed order."""
    return [p for p in model.parameters() if p.requires_grad]


def loss_and_grad(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: LossFn | None = None
) -> tuple[float, list[torch.Tensor]]:
    """Loss on (x, y) (cross-entropy unless ``loss_fn``) and its gradient w.r.t. the trainable
    parameters. ``loss_fn(logits, x, y)`` returns (objective to differentiate, loss to report)."""
    logits = model(x)
    if loss_fn is None:
        objective = reported = F.cross_entropy(logits, y)
    else:
        objective, reported = loss_fn(logits, x, y)
    grads = torch.autograd.grad(objective, trainable(model))
    return float(reported.detach()), list(grads)


def global_norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    """L2 norm of all tensors taken as one flat vector."""
    return torch.sqrt(sum((t.detach().float() ** 2).sum() for t in tensors))


def unit_scaled(direction: list[torch.Tensor], radius: float) -> list[torch.Tensor]:
    """radius * d/||d|| (global norm); all zeros when d = 0."""
    scale = radius / (float(global_norm(direction)) + EPS)
    return [d * scale for d in direction]


def gradient_at(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, offset: list[torch.Tensor]
) -> tuple[float, list[torch.Tensor]]:
    """(loss, gradient) at w + offset on (x, y); the weights come back bit-exactly."""
    params = trainable(model)
    saved = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p, o in zip(params, offset):
            p.add_(o)
    try:
        return loss_and_grad(model, x, y)
    finally:
        with torch.no_grad():
            for p, s in zip(params, saved):
                p.copy_(s)


def perturbed_gradient(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, direction: list[torch.Tensor], rho: float
) -> list[torch.Tensor]:
    """Gradient at w + rho * d/||d|| on the same batch; the weights come back unchanged."""
    return gradient_at(model, x, y, unit_scaled(direction, rho))[1]


def sam_gradient(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, rho: float
) -> tuple[float, list[torch.Tensor]]:
    """FedSAM eq. (4): g = grad F(w); g~ = grad F(w + rho g/||g||). Returns (loss at w, g~)."""
    loss, g = loss_and_grad(model, x, y)
    return loss, perturbed_gradient(model, x, y, g, rho)
