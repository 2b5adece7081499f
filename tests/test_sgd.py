"""The one local SGD step (client/sgd.py) that client/train.py and the vectorised trainer take:
torch.optim.SGD's step with clip_grad_norm_ first, bit for bit for one model, and client by
client on stacked tensors (each client its own norm, lr and mask)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from flatflower.client.sgd import sgd_step

OPTIONS = [
    {"momentum": 0.0, "weight_decay": 0.0, "clip_norm": 0.0},
    {"momentum": 0.9, "weight_decay": 1e-2, "clip_norm": 0.0},
    {"momentum": 0.9, "weight_decay": 1e-3, "clip_norm": 0.5},
    {"momentum": 0.0, "weight_decay": 0.0, "clip_norm": 0.5},
]
SHAPES = [(5, 3), (5,), (2, 2, 3)]


def torch_sgd(start, grads, lrs, options):
    """What torch.optim.SGD and clip_grad_norm_ make of ``start`` along ``grads`` (step k with
    lr ``lrs[k]``), the way client/train.py ran them before the shared step."""
    params = [nn.Parameter(p.clone()) for p in start]
    opt = torch.optim.SGD(params, lr=lrs[0], momentum=options["momentum"], weight_decay=options["weight_decay"])
    for g, lr in zip(grads, lrs):
        for p, t in zip(params, g):
            p.grad = t.clone()
        if options["clip_norm"] > 0:
            torch.nn.utils.clip_grad_norm_(params, options["clip_norm"])
        opt.param_groups[0]["lr"] = lr
        opt.step()
    return [p.detach() for p in params]


@pytest.mark.parametrize("options", OPTIONS)
def test_one_model_step_is_torch_sgd_bit_for_bit(options):
    """The stored results and digests were made by torch.optim.SGD: the shared step keeps them."""
    torch.manual_seed(1)
    start = [torch.randn(s) for s in SHAPES]
    grads = [[torch.randn(s) * (1 + 3 * i) for s in SHAPES] for i in range(5)]
    lrs = [0.1, 0.05, 0.1, 0.2, 0.01]  # a per-step lr (FedSWA's schedule)
    params = [nn.Parameter(p.clone()) for p in start]  # client/train.py steps the model's parameters
    buffers = None
    for g, lr in zip(grads, lrs):
        buffers = sgd_step(params, [t.clone() for t in g], buffers, lr=lr, **options)
    assert (buffers is not None) == bool(options["momentum"])
    for mine, theirs in zip(params, torch_sgd(start, grads, lrs, options)):
        assert torch.equal(mine.detach(), theirs)
    if options["clip_norm"]:  # the clip really acted (gradients have norms far above 0.5)
        assert all(torch.linalg.vector_norm(torch.cat([t.flatten() for t in g])) > 1 for g in grads)


@pytest.mark.parametrize("options", OPTIONS)
def test_stacked_step_is_torch_sgd_client_by_client(options):
    """The vectorised trainer's step: each client (row) of the stacked tensors takes its own
    torch.optim.SGD step, with its own lr; a client past its last step keeps its weights and
    its momentum buffer."""
    torch.manual_seed(2)
    clients, steps = 4, 4
    last = [4, 4, 2, 3]  # each client's number of steps
    start = [torch.randn(clients, *s) for s in SHAPES]
    grads = [[torch.randn(clients, *s) * (1 + 3 * i) for s in SHAPES] for i in range(steps)]
    lrs = [[0.1, 0.1, 0.2, 0.05], [0.1] * 4, [0.3, 0.2, 0.1, 0.1], [0.1] * 4]
    stacked, buffers = [p.clone() for p in start], None
    for k, g in enumerate(grads):
        live = [k < n for n in last]
        active = None if all(live) else torch.tensor(live)
        lr = 0.1 if len(set(lrs[k])) == 1 else torch.tensor(lrs[k])
        buffers = sgd_step(stacked, [t.clone() for t in g], buffers, lr=lr, clients=True, active=active, **options)
    for c in range(clients):
        theirs = torch_sgd([p[c] for p in start], [[t[c] for t in g] for g in grads[:last[c]]],
                           [lrs[k][c] for k in range(last[c])], options)
        for s, p in zip(stacked, theirs):
            torch.testing.assert_close(s[c], p, rtol=1e-6, atol=1e-6)
    assert not torch.equal(stacked[0][2], start[0][2])  # client 2 moved before its steps ended
