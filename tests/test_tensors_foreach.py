"""common/tensors.py's ``scale`` by a 0-dim tensor (SAM's rho / ||g||, kept on the device) is one
``torch._foreach_mul`` call now, bit for bit the per-tensor products it replaces (issue 45, item 3),
and still the per-tensor form under vmap (no foreach batching rule)."""

from __future__ import annotations

import torch
from torch.func import vmap

from flatflower.common.tensors import scale

SHAPES = [(6, 1, 5, 5), (6,), (16, 6, 5, 5), (120, 400), (10,)]


def test_scale_by_a_0_dim_tensor_is_bitwise_the_per_tensor_products():
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(s, generator=g) for s in SHAPES]
    for s in (torch.tensor(0.05 / 3.3, dtype=torch.float64), torch.tensor(1.7), torch.tensor(-2e-7)):
        got = scale(tensors, s)
        assert all(x.dtype == torch.float32 and torch.equal(x, t * s) for x, t in zip(got, tensors))


def test_scale_under_vmap_is_the_per_client_product():
    g = torch.Generator().manual_seed(1)
    stacked = [torch.randn(3, *s, generator=g) for s in SHAPES]
    factors = torch.rand(3, dtype=torch.float64, generator=g)
    got = vmap(lambda ts, f: scale(ts, f))(stacked, factors)
    for x, t in zip(got, stacked):
        assert torch.equal(x, torch.stack([t[i] * factors[i] for i in range(3)]))
