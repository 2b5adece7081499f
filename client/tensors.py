"""Arithmetic on lists of parameter tensors (one tensor per trainable parameter, in a fixed
order): what client rules are written in. ``torch._foreach_*`` does each operation on the
whole list at once; each is the same element-wise float operation as its per-tensor form,
so results are bit-identical to it. Inside a ``torch.func`` transform (the vectorised engine's
vmap, which has no batching rule for the ``_foreach`` ops) the per-tensor forms run instead.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

Tensors = list[torch.Tensor]


def _transformed() -> bool:
    """Inside a torch.func transform (vmap, grad)?"""
    return torch._C._functorch.peek_interpreter_stack() is not None


def add(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> Tensors:
    """a + b."""
    if _transformed():
        return [x + y for x, y in zip(a, b)]
    return list(torch._foreach_add(list(a), list(b)))


def sub(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> Tensors:
    """a - b."""
    if _transformed():
        return [x - y for x, y in zip(a, b)]
    return list(torch._foreach_sub(list(a), list(b)))


def scale(a: Sequence[torch.Tensor], s: float | torch.Tensor) -> Tensors:
    """s * a (s a number, or a 0-dim tensor: no host synchronisation)."""
    if isinstance(s, torch.Tensor) or _transformed():
        return [t * s for t in a]
    return list(torch._foreach_mul(list(a), s))


def clone(a: Sequence[torch.Tensor]) -> Tensors:
    """Detached copies."""
    return [t.detach().clone() for t in a]


def zeros_like(a: Sequence[torch.Tensor]) -> Tensors:
    return [torch.zeros_like(t) for t in a]
