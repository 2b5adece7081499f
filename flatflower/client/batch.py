"""One mini-batch, as a client rule sees it: gradients at an offset of the current weights,
and outputs of other weights. The rule never touches a model, so the same rule runs with
any engine that provides these two calls; :class:`ModelBatch` is the one for a single
``nn.Module`` and autograd.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from flatflower.common.tensors import Tensors
# objective(logits, y, weight) -> (what is differentiated, the loss to report). weight: None for
# a plain batch (means over its rows); a padded batch's engine passes per-row weights (1/b on
# its b real rows, 0 on padding), and the means become weighted sums (batch_mean).
Objective = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def batch_mean(rows: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
    """The mean over a batch of per-row values, or their weighted sum (padded batches)."""
    return rows.mean() if weight is None else (rows * weight).sum()


def mean_cross_entropy(logits: torch.Tensor, y: torch.Tensor,
                       weight: torch.Tensor | None = None) -> torch.Tensor:
    if weight is None:
        return F.cross_entropy(logits, y)
    return batch_mean(F.cross_entropy(logits, y, reduction="none"), weight)


def mean_kl(log_p: torch.Tensor, q: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
    """KL(q || p) summed over classes, averaged over the batch (``reduction="batchmean"``)."""
    if weight is None:
        return F.kl_div(log_p, q, reduction="batchmean")
    return batch_mean(F.kl_div(log_p, q, reduction="none").sum(dim=1), weight)


def cross_entropy(logits: torch.Tensor, y: torch.Tensor,
                  weight: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    loss = mean_cross_entropy(logits, y, weight)
    return loss, loss


class Batch(Protocol):
    def grad(self, offset: Sequence[torch.Tensor] | None = None,
             objective: Objective = cross_entropy) -> tuple[torch.Tensor, Tensors]:
        """(reported loss, gradient of the objective w.r.t. the trainable parameters), both
        taken at w + offset (w: the current weights, unchanged afterwards)."""

    def outputs(self, weights: Sequence[torch.Tensor]) -> torch.Tensor:
        """The model's outputs on this batch with ``weights`` as its trainable parameters
        (no gradient): FedGMT's teacher."""


def trainable(model: nn.Module) -> list[nn.Parameter]:
    """The parameters a local step updates, in a fixed order."""
    return [p for p in model.parameters() if p.requires_grad]


_BUFFERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def buffers_of(model: nn.Module) -> list[torch.Tensor]:
    """The model's buffers (BatchNorm's running statistics and counter), found once per model."""
    found = _BUFFERS.get(model)
    if found is None:
        found = _BUFFERS[model] = list(model.buffers())
    return found


class ModelBatch:
    """:class:`Batch` for one model and autograd (one is made per local step).

    Running statistics (a model with buffers, such as BatchNorm's): the step's **first
    gradient pass** (:meth:`grad`; for SAM the pass at w, for FedLESAM its one pass) updates
    them, as one plain SGD step would; every later pass of the step (SAM's ascent pass at
    w + e, FedSOL's and FedGMT's other passes, any :meth:`outputs` such as FedGMT's teacher)
    leaves every buffer exactly as it was (saved and restored bit for bit). Without this, SAM
    counts each step twice in ``num_batches_tracked`` and mixes statistics of the perturbed
    weights into the running means. A model without buffers pays nothing for it."""

    def __init__(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor):
        self.model, self.x, self.y = model, x, y
        self.params = trainable(model)
        self.buffers = buffers_of(model)
        self.updated = False  # whether a pass of this step updated the running statistics

    def grad(self, offset=None, objective: Objective = cross_entropy):
        if offset is None:
            return self._grad(objective)
        saved = [p.detach().clone() for p in self.params]
        with torch.no_grad():
            torch._foreach_add_(self.params, list(offset))
        try:
            return self._grad(objective)
        finally:
            with torch.no_grad():
                torch._foreach_copy_(self.params, saved)

    def _grad(self, objective: Objective):
        if self.buffers and self.updated:
            return self._keeping_buffers(lambda: self._grad_pass(objective))
        self.updated = True
        return self._grad_pass(objective)

    def _grad_pass(self, objective: Objective):
        differentiate, report = objective(self.model(self.x), self.y)
        grads = torch.autograd.grad(differentiate, self.params)
        return report.detach(), list(grads)

    def _keeping_buffers(self, work):
        """``work()``, with every buffer restored to its value before it."""
        saved = [b.clone() for b in self.buffers]
        try:
            return work()
        finally:
            with torch.no_grad():
                for b, v in zip(self.buffers, saved):
                    b.copy_(v)

    def outputs(self, weights):
        names = [n for n, p in self.model.named_parameters() if p.requires_grad]

        def forward():
            with torch.no_grad():
                return torch.func.functional_call(self.model, dict(zip(names, weights)), (self.x,))

        return self._keeping_buffers(forward) if self.buffers else forward()
