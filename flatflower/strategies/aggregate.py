"""Aggregation of named tensors (OrderedDict name -> tensor): weights, the weighted mean and the
robust rules; the arithmetic itself is common/tensors.py."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import torch

from flatflower.common.tensors import global_norm, scale


def client_weights(num_examples: Sequence[int], mode: str) -> list[float]:
    """Aggregation weights p_i summing to 1: by sample count (``weighted``) or ``uniform``; none
    for a round with no accepted update (which is skipped, under every mode)."""
    if not num_examples:
        return []
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


# ---------------------------------------------------------------------------- robust aggregation
KRUM_FAMILY = ("krum", "multi-krum", "bulyan")  # rules that pick clients (the same for every quantity)


def _to_numpy(item: OrderedDict) -> list[np.ndarray]:
    return [v.detach().cpu().numpy() for v in item.values()]


def _from_numpy(arrays, like: OrderedDict) -> OrderedDict:
    return OrderedDict((k, torch.as_tensor(np.asarray(a), dtype=v.dtype).reshape(v.shape).clone())
                       for (k, v), a in zip(like.items(), arrays))


def _flat64(item: OrderedDict) -> torch.Tensor:
    """All floating-point tensors of ``item`` as one float64 vector (squares of float32 values
    near 1e30 overflow float32, never float64)."""
    return torch.cat([v.detach().reshape(-1).double() for v in item.values() if v.is_floating_point()])


def norm_clipped(items: Sequence[OrderedDict], bound: float) -> list[OrderedDict]:
    """Each item scaled down to global norm <= bound (items within it are kept as they are)."""
    out = []
    for item in items:
        norm = float(global_norm(item, torch.float64))
        out.append(item if norm <= bound else scale(item, bound / norm))
    return out


def joint_vectors(uploads: Sequence[Sequence[OrderedDict]]) -> torch.Tensor:
    """One float64 row per client: its quantities (model update, each uploaded record) each
    divided by that quantity's round median norm, concatenated; so every quantity counts
    alike, whatever its units (a zero median leaves the quantity as it is)."""
    rows = []
    for quantity in zip(*uploads):
        flat = torch.stack([_flat64(item) for item in quantity])
        median = float(np.median(flat.norm(dim=1).numpy()))
        rows.append(flat / median if median > 0 else flat)
    return torch.cat(rows, dim=1)


def krum_scores(vectors: torch.Tensor, f: int) -> torch.Tensor:
    """Krum's score of each row (Blanchard et al. 2017): the sum of its squared distances to
    its n - f - 2 nearest other rows (at least 1)."""
    n = len(vectors)
    distances = torch.cdist(vectors, vectors).pow(2) if n > 1 else torch.zeros(1, 1, dtype=vectors.dtype)
    closest = max(1, n - f - 2)
    others = distances + torch.diag(torch.full((n,), float("inf"), dtype=distances.dtype))
    return others.sort(dim=1).values[:, :closest].sum(dim=1)


def krum_choice(name: str, vectors: torch.Tensor, f: int) -> list[int]:
    """The clients (row indices, ascending) that ``krum`` (the best score), ``multi-krum``
    (the n - f best) or ``bulyan`` (θ = n - 2f picked one by one by Krum among those left,
    El Mhamdi et al. 2018) keep."""
    n = len(vectors)
    if name == "krum":
        return [int(krum_scores(vectors, f).argmin())]
    if name == "multi-krum":
        return sorted(int(i) for i in krum_scores(vectors, f).argsort(stable=True)[: n - f])
    left = list(range(n))
    for _ in range(n - 2 * f):
        best = int(krum_scores(vectors[left], f).argmin())
        left.pop(best)
    return sorted(set(range(n)) - set(left))


def closest_to_median(items: Sequence[OrderedDict], beta: int) -> OrderedDict:
    """Per coordinate, the mean of the ``beta`` values closest to the coordinate-wise median
    (Bulyan's second stage)."""
    out = OrderedDict()
    for k, v in items[0].items():
        stacked = torch.stack([item[k] for item in items]).double()
        median = torch.from_numpy(np.median(stacked.numpy(), axis=0))
        order = (stacked - median).abs().argsort(dim=0, stable=True)[:beta]
        out[k] = stacked.gather(0, order).mean(dim=0).to(v.dtype)
    return out


def centered_clip(items: Sequence[OrderedDict], weights: Sequence[float], bound: float,
                  iterations: int) -> OrderedDict:
    """Centred clipping (Karimireddy, He and Jaggi 2021), from the coordinate-wise median:
    v <- v + sum_i p_i clip_τ(x_i - v), ``iterations`` times; τ = ``bound``, or (0) the median
    of ||x_i - median||. Computed in float64."""
    flat = torch.stack([_flat64(item) for item in items])
    p = torch.tensor([float(w) for w in weights], dtype=torch.float64)[:, None]
    v = torch.from_numpy(np.median(flat.numpy(), axis=0))
    tau = bound or float(np.median((flat - v).norm(dim=1).numpy()))
    for _ in range(iterations):
        diff = flat - v
        norms = diff.norm(dim=1, keepdim=True)
        factor = torch.where(norms > tau, tau / norms.clamp_min(1e-300), torch.ones_like(norms))
        v = v + (p * factor * diff).sum(dim=0)
    out, at = OrderedDict(), 0
    for k, t in items[0].items():
        if t.is_floating_point():
            out[k] = v[at:at + t.numel()].reshape(t.shape).to(t.dtype)
            at += t.numel()
        else:
            out[k] = t.clone()
    return out


class Aggregator:
    """The server's estimate of the clients' mean, applied to every per-client quantity an
    algorithm aggregates (model updates and uploaded records alike; run-config ``aggregator``).

    * ``mean``: sum_i p_i x_i, the papers' rule (p_i by ``aggregation``: sample counts the
      server assigned, or uniform);
    * ``median``, ``trimmed-mean`` (``aggregator-trim`` of each tail cut per coordinate):
      Flower's own implementations (flwr.server.strategy.aggregate), weights ignored;
    * ``krum`` (Blanchard et al. 2017: the client of best score), ``multi-krum`` (the weighted
      mean of the n - f best), ``bulyan`` (El Mhamdi et al. 2018: n - 2f clients picked by
      Krum, then per coordinate the mean of the n - 4f values closest to their median);
      f = ``aggregator-f``, the number of clients assumed Byzantine. They pick clients: within
      a round the picks are made once, from all of each client's uploads together
      (:meth:`choose`), and every quantity is combined over the same clients;
    * ``norm-clip``: each x_i clipped to norm ``aggregator-clip`` (0: the round's median norm
      of that quantity), then the mean;
    * ``centered-clip``: centred clipping from the coordinate-wise median (:func:`centered_clip`),
      τ = ``aggregator-clip`` (0: the round's median distance from the median),
      ``aggregator-iterations`` steps.
    """

    def __init__(self, name: str = "mean", f: int = 1, trim: float = 0.2, clip: float = 0.0,
                 iterations: int = 3):
        self.name, self.f, self.trim, self.clip, self.iterations = name, f, trim, clip, iterations

    @classmethod
    def from_config(cls, cfg) -> Aggregator:
        return cls(cfg.aggregator, cfg.aggregator_f, cfg.aggregator_trim, cfg.aggregator_clip,
                   cfg.aggregator_iterations)

    def required(self) -> int:
        """The fewest updates the rule is defined for (Krum: n >= 2f + 3, Bulyan: n >= 4f + 3)."""
        return {"krum": 2 * self.f + 3, "multi-krum": 2 * self.f + 3,
                "bulyan": 4 * self.f + 3}.get(self.name, 1)

    def picks(self, n: int) -> bool:
        """Whether :meth:`choose` picks among ``n`` clients (a Krum-family rule with enough of
        them); the other rules combine every client, and need no uploads to choose from."""
        return self.name in KRUM_FAMILY and n >= self.required()

    def choose(self, uploads: Sequence[Sequence[OrderedDict]]) -> list[int] | None:
        """The clients a Krum-family rule keeps this round, given each client's uploads (its
        model update and each record) and scored on them together (:func:`joint_vectors`);
        None for the other rules, which combine every client."""
        if not self.picks(len(uploads)):
            return None
        return krum_choice(self.name, joint_vectors(uploads), self.f)

    def __call__(self, items: Sequence[OrderedDict], weights: Sequence[float],
                 chosen: Sequence[int] | None = None) -> OrderedDict:
        """The estimate from ``items`` (one per client); ``chosen``: the round's picks of a
        Krum-family rule (:meth:`choose`; None: picked from ``items`` alone)."""
        if len(items) < self.required():
            raise ValueError(f"aggregator {self.name} needs at least {self.required()} updates "
                             f"(aggregator-f={self.f}), got {len(items)}")
        if self.name == "mean":
            return weighted_sum(items, weights)
        if self.name == "norm-clip":
            bound = self.clip or float(np.median([float(global_norm(i, torch.float64)) for i in items]))
            return weighted_sum(norm_clipped(items, bound), weights)
        if self.name == "centered-clip":
            return centered_clip(items, weights, self.clip, self.iterations)
        if self.name in KRUM_FAMILY:
            chosen = self.choose([[item] for item in items]) if chosen is None else chosen
            kept = [items[i] for i in chosen]
            if self.name == "bulyan":
                return closest_to_median(kept, len(kept) - 2 * self.f)
            total = float(sum(weights[i] for i in chosen))
            return weighted_sum(kept, [weights[i] / total for i in chosen])
        from flwr.server.strategy import aggregate as flower

        results = [(_to_numpy(item), float(w)) for item, w in zip(items, weights)]
        if self.name == "median":
            arrays = flower.aggregate_median(results)
        elif self.name == "trimmed-mean":
            arrays = flower.aggregate_trimmed_avg(results, self.trim)
        else:
            raise ValueError(f"unknown aggregator {self.name!r}")
        return _from_numpy(arrays, items[0])
