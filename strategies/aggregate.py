"""Aggregation arithmetic on named tensors (OrderedDict name -> tensor), written once."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
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


# ---------------------------------------------------------------------------- robust aggregation
def _to_numpy(item: OrderedDict) -> list[np.ndarray]:
    return [v.detach().cpu().numpy() for v in item.values()]


def _from_numpy(arrays, like: OrderedDict) -> OrderedDict:
    return OrderedDict((k, torch.as_tensor(np.asarray(a), dtype=v.dtype).reshape(v.shape).clone())
                       for (k, v), a in zip(like.items(), arrays))


def norm_clipped(items: Sequence[OrderedDict], bound: float) -> list[OrderedDict]:
    """Each item scaled down to global norm <= bound (items within it are kept as they are)."""
    out = []
    for item in items:
        norm = global_norm(item)
        out.append(item if norm <= bound else scale(item, bound / norm))
    return out


class Aggregator:
    """The server's estimate of the clients' mean, applied to every per-client quantity an
    algorithm aggregates (model updates and uploaded records alike; run-config ``aggregator``).

    * ``mean``: sum_i p_i x_i, the papers' rule (p_i by ``aggregation``: sample counts the
      server assigned, or uniform);
    * ``median``, ``trimmed-mean`` (``aggregator-trim`` of each tail cut per coordinate),
      ``krum`` (Blanchard et al. 2017), ``multi-krum`` (the mean of the n - f best by Krum's
      score), ``bulyan`` (El Mhamdi et al. 2018, over Krum): Flower's own implementations
      (flwr.server.strategy.aggregate), weights ignored except in multi-krum's mean;
      f = ``aggregator-f``, the number of clients assumed Byzantine;
    * ``norm-clip``: each x_i clipped to norm ``aggregator-clip`` (0: the round's median norm
      of that quantity), then the mean.
    """

    def __init__(self, name: str = "mean", f: int = 1, trim: float = 0.2, clip: float = 0.0):
        self.name, self.f, self.trim, self.clip = name, f, trim, clip

    @classmethod
    def from_config(cls, cfg) -> Aggregator:
        return cls(cfg.aggregator, cfg.aggregator_f, cfg.aggregator_trim, cfg.aggregator_clip)

    def required(self) -> int:
        """The fewest updates the rule is defined for (Krum: n >= 2f + 3, Bulyan: n >= 4f + 3)."""
        return {"krum": 2 * self.f + 3, "multi-krum": 2 * self.f + 3,
                "bulyan": 4 * self.f + 3}.get(self.name, 1)

    def __call__(self, items: Sequence[OrderedDict], weights: Sequence[float]) -> OrderedDict:
        if len(items) < self.required():
            raise ValueError(f"aggregator {self.name} needs at least {self.required()} updates "
                             f"(aggregator-f={self.f}), got {len(items)}")
        if self.name == "mean":
            return weighted_sum(items, weights)
        if self.name == "norm-clip":
            bound = self.clip or float(np.median([global_norm(i) for i in items]))
            return weighted_sum(norm_clipped(items, bound), weights)
        from flwr.server.strategy import aggregate as flower

        results = [(_to_numpy(item), float(w)) for item, w in zip(items, weights)]
        if self.name == "median":
            arrays = flower.aggregate_median(results)
        elif self.name == "trimmed-mean":
            arrays = flower.aggregate_trimmed_avg(results, self.trim)
        elif self.name == "krum":
            arrays = flower.aggregate_krum(results, self.f, to_keep=0)
        elif self.name == "multi-krum":
            arrays = flower.aggregate_krum(results, self.f, to_keep=len(items) - self.f)
        elif self.name == "bulyan":
            arrays = flower.aggregate_bulyan(list(results), self.f, flower.aggregate_krum, to_keep=0)
        else:
            raise ValueError(f"unknown aggregator {self.name!r}")
        return _from_numpy(arrays, items[0])
