"""The one local training loop every algorithm uses (the engine for one model).

Per step: the rule gives a direction d (its gradient, SAM gradient, corrections...) from the
weights and a :class:`flatflower.client.batch.ModelBatch`; d becomes the parameters' .grad, is
optionally clipped (global norm), and one SGD step (client/sgd.py, torch.optim.SGD's, the one
the vectorised trainer takes too) applies lr (the round's, times the rule's ``lr_factor`` for
the step: 1 but for FedSWA's in-round schedule), weight decay and client momentum. With momentum and weight decay 0 and no clipping the step is
exactly w <- w - lr * d.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from flatflower.client.algorithms.base import ClientRule
from flatflower.client.batch import ModelBatch, trainable
from flatflower.client.layout import Layout
from flatflower.client.sgd import sgd_step
from flatflower.common.config import RunConfig, local_step_count
from flatflower.common.datasets import Split
from flatflower.common.tensors import Named


@dataclass(frozen=True)
class LocalResult:
    num_examples: int
    num_steps: int
    mean_loss: float


def build_rule(spec, cfg: RunConfig, model: nn.Module, broadcast: Mapping[str, Named],
               state: Mapping[str, Named], lr: float,
               initial: Callable[[], Named] | None = None) -> tuple[ClientRule, Layout]:
    """The client rule of ``spec`` (the run's algorithm, strategies/registry.py) for ``model``
    (its weights: w^t), with the broadcast records (named tensors) and scalars (the spec's
    ``values``) and this client's stored state (named tensors), and the layout that maps both
    ways. The rule sees its own keys only."""
    layout = Layout.of(model)
    rule = spec.client(
        cfg.params.view(spec.client.Params), [p.detach() for p in layout.params],
        {**{name: layout.aligned(broadcast[name]) for name in spec.down},
         **{name: float(broadcast[name]) for name in spec.values}},
        {name: layout.aligned(tensors) for name, tensors in state.items()}, lr,
        initial=(lambda: layout.aligned(initial())) if initial else None)
    return rule, layout


def rule_outputs(rule: ClientRule, layout: Layout, model: nn.Module) -> tuple[dict, dict]:
    """(uploads, new state) after training, as named records (uploads with every key of the
    model, as the server checks them)."""
    w = [p.detach() for p in layout.params]
    uploads = {name: layout.full_record(t) for name, t in rule.uploads(w).items()}
    return uploads, {name: layout.named(t) for name, t in rule.new_state(w).items()}


def round_generator(seed: int, server_round: int, partition_id: int) -> torch.Generator:
    """The client's shuffling RNG: a function of (seed, round, partition) only."""
    state = np.random.SeedSequence([seed, server_round, partition_id]).generate_state(1)[0]
    return torch.Generator().manual_seed(int(state))


def round_order(
    n: int, batch_size: int, local_epochs: int, local_steps: int, generator: torch.Generator
) -> tuple[torch.Tensor, list[int]]:
    """A round's mini-batches at once: the indices of all of them, in order, and each one's size.

    A reshuffled pass per epoch (one ``torch.randperm`` per pass begun); ``local_steps > 0``:
    exactly that many batches (epochs roll over as needed); otherwise ``local_epochs`` full
    passes (the last batch of a pass may be smaller).
    """
    if n <= 0:
        raise ValueError("no samples to draw mini-batches from")
    steps = local_step_count(n, batch_size, local_epochs, local_steps)
    per_pass = [min(batch_size, n - start) for start in range(0, n, batch_size)]
    passes = -(-steps // len(per_pass))  # each begun, so each drawn
    sizes = (per_pass * passes)[:steps]
    orders = [torch.randperm(n, generator=generator) for _ in range(passes)]
    order = torch.cat(orders) if orders else torch.zeros(0, dtype=torch.int64)
    return order[: sum(sizes)], sizes


def batch_indices(
    n: int, batch_size: int, local_epochs: int, local_steps: int, generator: torch.Generator
) -> Iterator[torch.Tensor]:
    """The round's mini-batches (:func:`round_order`), one at a time."""
    order, sizes = round_order(n, batch_size, local_epochs, local_steps, generator)
    yield from order.split(sizes)


def autocast(cfg: RunConfig, device: torch.device):
    """``amp = "bf16"``: forward passes (all of a step's, e.g. both SAM passes) in bfloat16
    autocast. Parameters, gradients, the perturbation and its restore, and the SGD step stay
    float32, so SAM still restores the weights bit for bit."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.amp == "bf16")


def local_train(
    model: nn.Module,
    data: Split,
    rule: ClientRule,
    cfg: RunConfig,
    lr: float,
    generator: torch.Generator,
    batch: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> LocalResult:
    """Train ``model`` in place on ``data`` with ``rule``'s directions. ``batch``: a
    mini-batch's rows -> (x, y) (the ClientApp's ``TrainCall.batch``, which applies the run's
    train-transform); default ``data.get``."""
    batch = batch or data.get
    if len(data) == 0:
        raise ValueError("this client's partition is empty: nothing to train on")
    device = next(model.parameters()).device
    params = trainable(model)
    buffers = None  # the momentum buffers (client/sgd.py)
    model.train()
    losses: list[torch.Tensor] = []  # each step's loss, left on the device (no host sync per step)
    steps = cfg.num_steps(len(data))
    for k, idx in enumerate(batch_indices(len(data), cfg.batch_size, cfg.local_epochs, cfg.local_steps, generator)):
        x, y = batch(idx)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with autocast(cfg, device):
            loss, direction = rule.direction([p.detach() for p in params], ModelBatch(model, x, y))
        buffers = sgd_step(params, [d.detach() for d in direction], buffers, lr=lr * rule.lr_factor(k, steps),
                           momentum=cfg.momentum, weight_decay=cfg.weight_decay, clip_norm=cfg.clip_norm)
        losses.append(loss.detach())
    return LocalResult(len(data), len(losses), round_loss(host_losses(losses)))


def host_losses(losses: list[torch.Tensor]) -> np.ndarray:
    """The round's step losses, copied to the host at once: the loop's one host synchronisation.
    float64, as ``float(loss)`` per step gave them (the float32 values, exactly)."""
    return torch.stack(losses).double().cpu().numpy() if losses else np.zeros(0)


def round_loss(losses: np.ndarray) -> float:
    """The mean step loss of a round (numpy's mean over float64, as when the losses were Python
    floats), or the in-loop error a non-finite loss always raised: the step it first appeared
    at. A step after it trained on, but the round fails all the same, so no model is reported."""
    bad = np.flatnonzero(~np.isfinite(losses))
    if len(bad):
        raise FloatingPointError(f"local loss became {float(losses[bad[0]])} at step {bad[0] + 1}")
    return float(np.mean(np.ascontiguousarray(losses)))
