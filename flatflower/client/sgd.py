"""The local SGD step, written once for every engine: the one-model loop (client/train.py) and
the vectorised trainer (runtime/engines/vectorized.py, whose tensors are stacked along a leading client
dimension) both call :func:`sgd_step`.

The step is ``torch.optim.SGD``'s (dampening 0, no Nesterov) with ``clip_grad_norm_`` first:
clip the direction d to global norm ``clip-norm``, add ``weight-decay`` * w, mix it into the
momentum buffer b <- momentum * b + d (b = d at the first step), then w <- w - lr * b. It is
written with the same torch operations torch.optim.SGD and clip_grad_norm_ run (their
``foreach`` kernels, which on the CPU are the per-tensor operations), so a model trains bit for
bit as it did under torch.optim.SGD: the stored results and final-model digests stay.
"""

from __future__ import annotations

import torch

from flatflower.common.tensors import Tensors


def per_client(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """One value per client (dim 0), shaped to broadcast over ``like``'s other dimensions."""
    return values.view(-1, *[1] * (like.dim() - 1))


def masked(active: torch.Tensor | None, new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """``new`` for the active clients (dim 0), ``old`` for the others; ``new`` if all are."""
    if active is None:
        return new
    return torch.where(per_client(active, new), new, old)


def clipped(grads: Tensors, max_norm: float, clients: bool) -> Tensors:
    """``grads`` scaled by min(1, max_norm / (||grads|| + 1e-6)), ||.|| the global L2 norm over
    all tensors (clip_grad_norm_'s rule). One model: scaled in place, as clip_grad_norm_ scales
    each ``p.grad``. ``clients``: each client's own norm (over its row of every tensor)."""
    if clients:
        norms = torch.stack([torch.linalg.vector_norm(g.flatten(1), dim=1) for g in grads], dim=1)
        total = torch.linalg.vector_norm(norms, dim=1)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        return [g * per_client(coef, g) for g in grads]
    total = torch.nn.utils.get_total_norm(grads)
    torch._foreach_mul_(list(grads), torch.clamp(max_norm / (total + 1e-6), max=1.0))
    return grads


@torch.no_grad()
def sgd_step(params: Tensors, grads: Tensors, buffers: list | None, *, lr: float | torch.Tensor,
             momentum: float = 0.0, weight_decay: float = 0.0, clip_norm: float = 0.0,
             clients: bool = False, active: torch.Tensor | None = None) -> list | None:
    """One SGD step of ``params`` (in place) along the directions ``grads``; returns the
    momentum buffers to pass to the next step (``buffers``: None at the first step; None
    without momentum).

    ``clients``: every tensor holds one row per client (dim 0), which steps on its own: its own
    clipping norm; ``lr`` a number or a tensor of each client's; ``active`` (a bool per client,
    None = all) leaves the weights and buffers of the inactive ones as they are."""
    if clip_norm > 0:
        grads = clipped(grads, clip_norm, clients)
    if weight_decay:
        grads = torch._foreach_add(list(grads), list(params), alpha=weight_decay)
    if momentum:
        if buffers is None:  # the first step, which every client takes
            buffers = [g.detach().clone() for g in grads]
        elif active is None:
            torch._foreach_mul_(buffers, momentum)
            torch._foreach_add_(buffers, list(grads))
        else:
            mixed = torch._foreach_mul(buffers, momentum)
            torch._foreach_add_(mixed, list(grads))
            buffers = [masked(active, new, old) for new, old in zip(mixed, buffers)]
        grads = buffers
    if isinstance(lr, torch.Tensor):  # each client's own (FedSWA's in-round schedule)
        steps = [p - per_client(lr, g) * g for p, g in zip(params, grads)]
    elif active is None:
        torch._foreach_add_(list(params), list(grads), alpha=-lr)
        return buffers
    else:
        steps = torch._foreach_add(list(params), list(grads), alpha=-lr)
    for p, step in zip(params, steps):
        p.copy_(masked(active, step, p))
    return buffers
