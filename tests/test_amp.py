"""``amp = "bf16"``: bfloat16 autocast forward passes around float32 weights, on CPU here."""

from __future__ import annotations

import json

import torch

from flatflower.client.batch import ModelBatch, trainable
from flatflower.client.sam import sam_gradient
from flatflower.client.train import autocast
from flatflower.common.config import RunConfig
from flatflower.runtime.engines.inprocess import run_inprocess
from tests.helpers import fast_config


def test_sam_under_bf16_autocast_restores_weights_and_keeps_float32_gradients():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    x, y = torch.randn(16, 6), torch.randint(0, 3, (16,))
    before = [p.detach().clone() for p in trainable(model)]
    cfg = RunConfig.from_mapping({"amp": "bf16"})
    with autocast(cfg, torch.device("cpu")):
        loss, grads = sam_gradient(ModelBatch(model, x, y), rho=0.05)
        assert model(x).dtype == torch.bfloat16  # the forward really runs in bf16
    assert all(torch.equal(a, b) for a, b in zip(before, trainable(model)))
    assert all(g.dtype == torch.float32 for g in grads)
    _, exact = sam_gradient(ModelBatch(model, x, y), rho=0.05)
    error = torch.sqrt(sum(((g - e) ** 2).sum() for g, e in zip(grads, exact)))
    norm = torch.sqrt(sum((e ** 2).sum() for e in exact))
    assert float(error / norm) < 0.15  # bf16 keeps ~3 significant digits (here 7%)


def test_bf16_run_learns_like_float32(tmp_path):
    rows = {}
    for amp in ("off", "bf16"):
        run_dir, _ = run_inprocess(fast_config(algorithm="fedsam", amp=amp, num_server_rounds=3,
                                               run_dir=str(tmp_path / amp)), 2)
        rows[amp] = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    final = {amp: r[-1]["test_accuracy"] for amp, r in rows.items()}
    assert final["bf16"] > rows["bf16"][0]["test_accuracy"]
    assert abs(final["bf16"] - final["off"]) < 0.05
