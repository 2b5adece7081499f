"""Arithmetic on parameter tensors, written once for both halves.

Client rules work on lists of tensors (one per trainable parameter, in a fixed order); the
server on named tensors (OrderedDict name -> tensor). Each operation takes either and returns
the same kind (named: the keys of the first argument). ``torch._foreach_*`` does each
operation on the whole list at once; each is the same element-wise float operation as its
per-tensor form, so results are bit-identical to it. Inside a ``torch.func`` transform (the
vectorised engine's vmap, which has no batching rule for the ``_foreach`` ops) the per-tensor
forms run instead.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping, Sequence

import torch

Tensors = list[torch.Tensor]
Named = "OrderedDict[str, torch.Tensor]"
EPS = 1e-12  # guards a division by a norm that may be 0 (SAM's ||g||, FedSMOO's ||S||); the papers have none


def _transformed() -> bool:
    """Inside a torch.func transform (vmap, grad)?"""
    return torch._C._functorch.peek_interpreter_stack() is not None


def _named(a: Mapping, values: Sequence[torch.Tensor]) -> OrderedDict:
    return OrderedDict(zip(a.keys(), values))


def add(a, b):
    """a + b."""
    if isinstance(a, Mapping):
        return _named(a, add(list(a.values()), [b[k] for k in a]))
    if _transformed():
        return [x + y for x, y in zip(a, b)]
    return list(torch._foreach_add(list(a), list(b)))


def sub(a, b):
    """a - b."""
    if isinstance(a, Mapping):
        return _named(a, sub(list(a.values()), [b[k] for k in a]))
    if _transformed():
        return [x - y for x, y in zip(a, b)]
    return list(torch._foreach_sub(list(a), list(b)))


def scale(a, s: float | torch.Tensor):
    """s * a (s a number, or a 0-dim tensor: no host synchronisation)."""
    if isinstance(a, Mapping):
        return _named(a, scale(list(a.values()), s))
    a = list(a)
    if _transformed() or (isinstance(s, torch.Tensor) and (s.dim() or not a or s.device != a[0].device)):
        return [t * s for t in a]
    return list(torch._foreach_mul(list(a), s))  # a 0-dim tensor s too: the same products, one call


def add_scaled(a, s: float, b):
    """a + s * b."""
    return add(a, scale(b, s))


def clone(a):
    """Detached copies."""
    if isinstance(a, Mapping):
        return _named(a, clone(list(a.values())))
    return [t.detach().clone() for t in a]


def zeros_like(a):
    if isinstance(a, Mapping):
        return _named(a, zeros_like(list(a.values())))
    return [torch.zeros_like(t) for t in a]


def global_norm(a, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """L2 norm of all floating-point tensors of ``a`` taken as one flat vector, computed in
    ``dtype``: a 0-dim tensor (no host synchronisation). The clients' SAM radius uses float32
    (as the papers' code), the server's norms float64."""
    values: Iterable[torch.Tensor] = a.values() if isinstance(a, Mapping) else a
    return torch.sqrt(sum((t.detach().to(dtype) ** 2).sum() for t in values if t.is_floating_point()))


STACKED_ENTRIES = 1 << 22  # the most entries stacked_blocks stacks at once


def stacked_blocks(tensors: Sequence[torch.Tensor]) -> Iterator[tuple[int, torch.Tensor]]:
    """``tensors`` (one shape: the same tensor of many clients' models), a block at a time:
    (the block's first index, its tensors flattened and stacked, one row each), at most
    STACKED_ENTRIES entries a block (one client a block when a tensor holds more)."""
    rows = max(1, STACKED_ENTRIES // max(1, tensors[0].numel())) if tensors else 1
    for first in range(0, len(tensors), rows):
        yield first, torch.stack([t.detach().reshape(-1) for t in tensors[first:first + rows]])
