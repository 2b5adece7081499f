"""Aggregation arithmetic on named tensors (OrderedDict name -> tensor), written once."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch

Named = "OrderedDict[str, torch.Tensor]"


def client_weights(num_examples: Sequence[int], mode: str) -> list[float]:
    """Aggregation weights p_i summing to 1: by sample count (``weighted``) or ``uniform``."""
    if mode == "uniform":
        return [1.0 / len(num_examples)] * len(num_examples)
    total = float(sum(num_examples))
    return [n / total for n in num_examples]


def weighted_sum(items: Sequence[OrderedDict], weights: Sequence[float]) -> OrderedDict:
    """sum_i weights[i] * items[i], key by key (in the given order, for reproducibility)."""
    out = OrderedDict((k, torch.zeros_like(v)) for k, v in items[0].items())
    for item, w in zip(items, weights):
        for k, v in item.items():
            out[k].add_(v, alpha=float(w))
    return out


def sub(a: OrderedDict, b: OrderedDict) -> OrderedDict:
    """a - b."""
    return OrderedDict((k, a[k] - b[k]) for k in a)


def add_scaled(a: OrderedDict, scale: float, b: OrderedDict) -> OrderedDict:
    """a + scale * b."""
    return OrderedDict((k, a[k] + scale * b[k]) for k in a)


def scale(a: OrderedDict, s: float) -> OrderedDict:
    """s * a."""
    return OrderedDict((k, s * v) for k, v in a.items())


def zeros_like(a: OrderedDict) -> OrderedDict:
    return OrderedDict((k, torch.zeros_like(v)) for k, v in a.items())


def global_norm(a: OrderedDict) -> float:
    """L2 norm of all floating-point tensors of ``a`` taken as one flat vector."""
    return float(torch.sqrt(sum((v.double() ** 2).sum() for v in a.values() if v.is_floating_point())))
