"""SAM machinery (Foret et al. 2021; FedSAM eq. 3-4 of Qu et al. 2022).

Norms are global L2 over all trainable parameters. The ascent and the descent gradient use
the same mini-batch, and the weights are restored bit-exactly from a saved copy (not by
subtracting the perturbation, which would drift in floating point).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

EPS = 1e-12  # guards ||g|| = 0; the paper has no epsilon (notes §1.2)


def trainable(model: nn.Module) -> list[nn.Parameter]:
    """The parameters a local step updates, in a fixed order."""
    return [p for p in model.parameters() if p.requires_grad]


def loss_and_grad(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, list[torch.Tensor]]:
    """Cross-entropy on (x, y) and its gradient w.r.t. the trainable parameters."""
    loss = F.cross_entropy(model(x), y)
    grads = torch.autograd.grad(loss, trainable(model))
    return float(loss.detach()), list(grads)


def global_norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    """L2 norm of all tensors taken as one flat vector."""
    return torch.sqrt(sum((t.detach().float() ** 2).sum() for t in tensors))


def perturbed_gradient(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, direction: list[torch.Tensor], rho: float
) -> list[torch.Tensor]:
    """Gradient at w + rho * d/||d|| on the same batch; the weights come back unchanged."""
    params = trainable(model)
    scale = rho / (global_norm(direction) + EPS)
    saved = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p, d in zip(params, direction):
            p.add_(d, alpha=float(scale))
    try:
        _, grads = loss_and_grad(model, x, y)
    finally:
        with torch.no_grad():
            for p, s in zip(params, saved):
                p.copy_(s)
    return grads


def sam_gradient(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, rho: float
) -> tuple[float, list[torch.Tensor]]:
    """FedSAM eq. (4): g = grad F(w); g~ = grad F(w + rho g/||g||). Returns (loss at w, g~)."""
    loss, g = loss_and_grad(model, x, y)
    return loss, perturbed_gradient(model, x, y, g, rho)
