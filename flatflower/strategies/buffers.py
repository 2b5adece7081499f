"""A model's buffers on the server: kept apart from what the algorithms' rules see.

A model's state dict holds its trainable parameters and, for a model with BatchNorm, buffers:
running means and variances (floats) and a step counter (``num_batches_tracked``, int64); a
frozen parameter is one too. The algorithms' server corrections (duals, momentum, EMA, control
variates, perturbations, extrapolation by ``server-lr``, robust aggregation, norms) are defined
on the weights the clients optimise: applied to a running variance they drive it negative
(FedDyn's and FedGMT's dual correction), applied to an integer counter they average it as a
float. So :class:`~flatflower.strategies.strategy.FlatStrategy` gives its rule the trainable parameters
only and keeps the buffers here:

* a reply is validated against the whole model (parameters and buffers), then split
  (:func:`split`); a buffer a client sends must be finite (every array is) and a running
  variance non-negative (:func:`check`);
* after a round the server applied, the buffers become the accepted clients' combination
  (:func:`combine`): floating-point buffers their mean with the round's aggregation weights
  p_i (the weights of the rule's mean: sizes, or uniform), integer buffers (counters) the
  largest of the clients' values, never a float mean; under a robust ``aggregator`` the
  coordinate-wise median of the clients' (one client cannot move them). A skipped round leaves
  them unchanged;
* the model sent down, checkpointed and evaluated is the parameters and buffers merged in the
  model's own key order (:func:`merge`).

A model without buffers takes none of these paths: its strategy is bit for bit what it was.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence

import torch

VARIANCE_SUFFIX = "running_var"  # BatchNorm's (and InstanceNorm's) running variance


def split(tensors: Mapping[str, torch.Tensor], buffers: Iterable[str]) -> tuple[OrderedDict, OrderedDict]:
    """(the entries that are not ``buffers``, the ``buffers``), each in ``tensors``' order."""
    names = set(buffers)
    params = OrderedDict((k, v) for k, v in tensors.items() if k not in names)
    return params, OrderedDict((k, v) for k, v in tensors.items() if k in names)


def merge(params: Mapping[str, torch.Tensor], buffers: Mapping[str, torch.Tensor],
          keys: Sequence[str]) -> OrderedDict:
    """The whole state dict, in the model's key order ``keys``."""
    return OrderedDict((k, params[k] if k in params else buffers[k]) for k in keys)


def check(buffers: Mapping[str, torch.Tensor], where: str = "record 'arrays'") -> None:
    """ValueError naming the key when a running variance has a negative entry (a BatchNorm
    layer would take its square root)."""
    for key, value in buffers.items():
        if key.endswith(VARIANCE_SUFFIX) and value.is_floating_point() and bool((value < 0).any()):
            raise ValueError(f"{where} key '{key}' is a variance with negative entries "
                             f"(min {float(value.min()):.4g})")


def combine(items: Sequence[Mapping[str, torch.Tensor]], weights: Sequence[float],
            robust: bool = False) -> OrderedDict:
    """The round's buffers from the accepted clients' (``items``, with aggregation weights
    ``weights`` summing to 1): a floating-point buffer is sum_i p_i b_i (in float64, cast back),
    an integer one (a counter such as ``num_batches_tracked``) the largest b_i, so it keeps its
    dtype and never passes through a float. ``robust`` (a robust ``aggregator`` protects the
    parameters): every buffer is the coordinate-wise median of the clients' instead (the lower
    median for an even count, so it is one of the values and an integer stays an integer), so
    one client's running statistics or counter cannot move the global ones arbitrarily."""
    out = OrderedDict()
    for key, first in items[0].items():
        values = [item[key] for item in items]
        if robust:
            out[key] = torch.stack(values).median(dim=0).values.to(first.dtype)
        elif first.is_floating_point():
            total = sum(float(w) * v.double() for w, v in zip(weights, values))
            out[key] = total.to(first.dtype)
        else:
            out[key] = torch.stack(values).amax(dim=0).to(first.dtype)
    return out
