"""A model's buffers on the server: kept apart from what the algorithms' rules see, and
checked like the parameters.

A model's state dict holds its trainable parameters and, for a model with BatchNorm, buffers:
running means and variances (floats) and a step counter (``num_batches_tracked``, int64); a
frozen parameter is one too. The algorithms' server corrections (duals, momentum, EMA, control
variates, perturbations, extrapolation by ``server-lr``, robust aggregation, norms) are defined
on the weights the clients optimise: applied to a running variance they drive it negative
(FedDyn's and FedGMT's dual correction), applied to an integer counter they average it as a
float. So :class:`~flatflower.strategies.strategy.FlatStrategy` gives its rule the trainable parameters
only and keeps the buffers here:

* a reply is validated against the whole model (parameters and buffers: decoded dtype and
  shape, finite values), then split (:func:`split`), and its buffers pass the rules of
  :func:`check_reply`: statistics that data cannot give are refused (a running variance below 0
  or above :data:`VARIANCE_LIMIT`, any other float buffer beyond :data:`STAT_LIMIT` in
  magnitude), an integer buffer (a counter) grows by no more than the client's local steps,
  and under DP every buffer is the one the server sent. ``outlier-norm-factor`` measures the
  buffers' update as a quantity of its own (:func:`update_norm`; strategies/strategy.py);
* after a round the server applied, the buffers become the accepted clients' combination
  (:func:`combine`): floating-point buffers their mean with the round's aggregation weights
  p_i (the weights of the rule's mean: sizes, or uniform), integer buffers (counters) the
  largest of the clients' values, never a float mean; under a robust ``aggregator`` the
  coordinate-wise median of the clients' (one client cannot move them). A skipped round leaves
  them unchanged, and so does every round under DP (the server keeps the initial model's);
* the model sent down, checkpointed and evaluated is the parameters and buffers merged in the
  model's own key order (:func:`merge`).

A model without buffers takes none of these paths: its strategy is bit for bit what it was.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence

import torch

VARIANCE_SUFFIX = "running_var"  # BatchNorm's (and InstanceNorm's) running variance

# The largest statistic data can give, in the units of a layer's inputs: a running mean (any
# float buffer but a variance) of magnitude above STAT_LIMIT = 1e18, or a running variance above
# VARIANCE_LIMIT = STAT_LIMIT^2 = 1e36 (a standard deviation of 1e18), is refused. A BatchNorm
# running statistic is an exponential (or cumulative) average of the value the client received
# and of batch means and unbiased variances of the layer's float32 inputs: a mean is no larger
# than the largest input, a variance no larger than about its square. Honest inputs stay many
# orders of magnitude below 1e18 (images in [0, 1] or 0-255, standardised features; a raw 32-bit
# count, 4.3e9, times weights of 1e8 is 4e17), and 1e18 is within a factor 20 of the square root
# of float32's largest number (1.8e19), where an activation's square is inf in float32 (the
# batch variance's (x - mean)^2, a norm): no float32 model trains near it. So the bound is far
# from every honest statistic and refuses the values of issue 58 (running_mean 1e30,
# running_var 3e38). It is a sanity bound, not a defence: statistics within it still reach the
# weighted mean; the defences are ``outlier-norm-factor`` (which measures the buffers' update)
# and a robust ``aggregator`` (docs/reliability.md, "Buffers"). An entry equal to the one the
# server sent always passes (it is the server's value, not the client's: a frozen parameter).
STAT_LIMIT = 1e18
VARIANCE_LIMIT = STAT_LIMIT ** 2


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


def _is_counter(value: torch.Tensor) -> bool:
    """An integer buffer (BatchNorm's ``num_batches_tracked``); a bool mask is none."""
    return not value.is_floating_point() and not value.is_complex() and value.dtype != torch.bool


def check_reply(buffers: Mapping[str, torch.Tensor], sent: Mapping[str, torch.Tensor],
                counted_from: Mapping[str, torch.Tensor], steps: int, frozen: bool = False,
                where: str = "record 'arrays'") -> None:
    """ValueError naming the key and the rule when a reply's ``buffers`` hold what no honest
    client of this round could send (its arrays were decoded and found finite before):

    * ``frozen`` (DP, ``dp.clip`` > 0): every buffer equals ``sent`` (the global buffers the
      server sent) bit for bit. An honest client sends them back as received, never clipped nor
      noised (common/privacy.py ``privatize``): any other value is a statistic of its data that
      the DP analysis does not cover, and the server keeps its buffers fixed (docs/privacy.md);
    * a running variance is >= 0 and at most :data:`VARIANCE_LIMIT`; every other float buffer
      at most :data:`STAT_LIMIT` in magnitude (an entry equal to ``sent``'s always passes);
    * an integer buffer (a counter: ``num_batches_tracked`` counts training forwards, one per
      local step, SAM's later passes restore it: client/batch.py) lies in [``counted_from``,
      ``counted_from`` + ``steps``]: with ``buffers = global`` what the server sent and the
      client's local steps this round; with ``buffers = local`` (each client goes on from its
      own counter) the initial model's counter and the most steps any client can have taken
      since (the caller's bound: rounds so far times the largest partition's steps).
    """
    for key, value in buffers.items():
        name = f"{where} key '{key}'"
        if frozen:
            if not torch.equal(value, sent[key]):
                raise ValueError(f"{name} differs from the buffer the server sent: under DP (dp.clip > 0) "
                                 "buffers go back as received and the global ones stay fixed (docs/privacy.md)")
        elif value.is_floating_point():
            own = value.ne(sent[key])  # the server's own value always passes
            if key.endswith(VARIANCE_SUFFIX):
                if bool((value < 0).any()):
                    raise ValueError(f"{name} is a variance with negative entries (min {float(value.min()):.4g})")
                beyond, limit = own & (value > VARIANCE_LIMIT), f"a variance above {VARIANCE_LIMIT:g}"
            else:
                beyond, limit = own & (value.abs() > STAT_LIMIT), f"a magnitude above {STAT_LIMIT:g}"
            if bool(beyond.any()):
                raise ValueError(f"{name} holds {float(value[beyond].double().abs().max()):.4g}, {limit}: "
                                 "a statistic no data gives (strategies/buffers.py, STAT_LIMIT)")
        elif _is_counter(value):
            low = counted_from[key]
            outside = (value < low) | (value > low + steps)
            if bool(outside.any()):
                raise ValueError(f"{name} is a counter of {int(value[outside].max())}, outside "
                                 f"[{int(low.max())}, {int(low.max()) + steps}]: it grows by at most "
                                 "the client's local steps")


def update_norm(buffers: Mapping[str, torch.Tensor], sent: Mapping[str, torch.Tensor]) -> float:
    """||b_i - b|| over the float buffers (the client's minus the ones the server sent), in
    float64: the quantity ``outlier-norm-factor`` compares with the round's median, apart from
    the parameters' update, so that BatchNorm statistics (in the units of the layers' inputs)
    neither dominate the parameters' norm nor hide in it."""
    squares = [(value.double() - sent[key].double()).square().sum() for key, value in buffers.items()
               if value.is_floating_point()]
    return float(torch.stack(squares).sum().sqrt()) if squares else 0.0


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
