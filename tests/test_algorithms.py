"""Algorithm tests derived from the math.

The full pipeline (real ServerApp + ClientApp through the in-process grid, real partitions,
real wire conversions) is run on a tiny deterministic problem: multinomial logistic
regression on the seeded ``synthetic`` data, full-batch gradients, K local steps. An
independent float64 numpy implementation of each algorithm's pseudocode (FedSAM paper,
Alg. 1-2, eq. 4 and 6) must give the same global model to 1e-6. The identities between the
algorithms are then checked bit for bit.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from client.batch import ModelBatch, trainable
from client.sam import sam_gradient
from common.datasets import load_dataset
from tools.inprocess import run_inprocess

K = 3  # local steps
LR = 0.1


def run(tmp_path, name, num_clients=3, **overrides) -> dict:
    """Run the real ServerApp + ClientApps in-process; ``overrides`` are run-config keys.

    Returns the initial and final global models, the partitions, the run config, the
    training rows of metrics.jsonl (round >= 1, each with ``sampled_partitions``), the run
    directory and the in-process grid (whose node contexts hold the clients' state).
    """
    cfg = {
        "dataset": "synthetic", "model": "logreg", "partition": "iid", "seed": 3,
        "local-steps": K, "batch-size": 100_000, "lr": LR, "num-server-rounds": 2,
        "run-dir": str(tmp_path / name), **overrides,
    }
    run_dir, grid = run_inprocess(cfg, num_clients=num_clients)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if line.strip()]
    return {
        "init": torch.load(run_dir / "model_init.pt"),
        "final": torch.load(run_dir / "model_final.pt"),
        "parts": json.loads((run_dir / "partition.json").read_text())["partitions"],
        "cfg": {**cfg},
        "rows": [row for row in rows if row["round"] >= 1],
        "run_dir": run_dir,
        "grid": grid,
        "num_clients": num_clients,
    }


# ---------------------------------------------------------------- numpy reference
def grad(w: list[np.ndarray], x: np.ndarray, y: np.ndarray) -> list[np.ndarray]:
    """Gradient of mean softmax cross-entropy of logits x W^T + b."""
    W, b = w
    z = x @ W.T + b
    z -= z.max(axis=1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(axis=1, keepdims=True)
    p[np.arange(len(y)), y] -= 1.0
    p /= len(y)
    return [p.T @ x, p.sum(axis=0)]


def sam_grad(w, x, y, rho):
    """FedSAM eq. (4): gradient at w + rho g/||g||, ||.|| over ALL parameters (W and b)."""
    g = grad(w, x, y)
    norm = np.sqrt(sum((gi ** 2).sum() for gi in g))
    return grad([wi + rho * gi / (norm + 1e-12) for wi, gi in zip(w, g)], x, y)


def reference(result, algorithm, rounds=2, rho=0.0, beta=1.0, server_lr=1.0,
              step="delta", weighting="weighted"):
    """The algorithms' pseudocode, independently, in float64."""
    data = load_dataset("synthetic").train
    x_all, y_all = data.x.double().numpy(), data.y.numpy()
    clients = [(x_all[idx], y_all[idx]) for idx in
               (np.array(result["parts"][str(i)]) for i in range(len(result["parts"])))]
    w = [v.double().numpy() for v in result["init"].values()]
    delta_global = [np.zeros_like(v) for v in w]  # MoFedSAM Delta^0 = 0
    sizes = np.array([len(c[1]) for c in clients], dtype=float)
    p = sizes / sizes.sum() if weighting == "weighted" else np.full(len(sizes), 1 / len(sizes))
    for _ in range(rounds):
        deltas = []
        for x, y in clients:
            wk = [v.copy() for v in w]
            for _ in range(K):
                d = sam_grad(wk, x, y, rho) if algorithm != "fedavg" else grad(wk, x, y)
                if algorithm == "mofedsam":
                    d = [beta * di + (1 - beta) * Di for di, Di in zip(d, delta_global)]
                wk = [wi - LR * di for wi, di in zip(wk, d)]
            deltas.append([a - b for a, b in zip(wk, w)])
        mean_delta = [sum(pi * dl[j] for pi, dl in zip(p, deltas)) for j in range(len(w))]
        if algorithm == "mofedsam":
            # Alg. 2: Delta^{r+1} = -(1/(eta_l K)) sum_i p_i Delta_i  (gradient units)
            delta_global = [-m / (LR * K) for m in mean_delta]
            if step == "literal":
                w = [wi - server_lr * Di for wi, Di in zip(w, delta_global)]
                continue
        w = [wi + server_lr * m for wi, m in zip(w, mean_delta)]
    return w


def assert_matches(result, expected):
    got = [v.double().numpy() for v in result["final"].values()]
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        np.testing.assert_allclose(g, e, rtol=0, atol=1e-6)
    # and training moved the model: the check is not vacuous
    init = [v.double().numpy() for v in result["init"].values()]
    assert max(np.abs(g - i).max() for g, i in zip(got, init)) > 1e-2


# ---------------------------------------------------------------- hand-computed rounds
@pytest.mark.parametrize("server_lr", [1.0, 0.5])
def test_fedavg_matches_pseudocode(tmp_path, server_lr):
    result = run(tmp_path, "fedavg", algorithm="fedavg", **{"server-lr": server_lr})
    assert_matches(result, reference(result, "fedavg", server_lr=server_lr))


def test_fedsam_matches_pseudocode(tmp_path):
    result = run(tmp_path, "fedsam", algorithm="fedsam", **{"sam.rho": 0.5}, aggregation="uniform")
    assert_matches(result, reference(result, "fedsam", rho=0.5, weighting="uniform"))


@pytest.mark.parametrize("step", ["delta", "literal"])
def test_mofedsam_matches_pseudocode(tmp_path, step):
    result = run(tmp_path, "mofedsam", algorithm="mofedsam", **{"sam.rho": 0.2},
                 **{"mofedsam.beta": 0.3, "fedcm.server-step": step, "server-lr": 0.8})
    assert_matches(result, reference(result, "mofedsam", rho=0.2, beta=0.3, server_lr=0.8, step=step))


def test_fedsam_differs_from_fedavg_when_rho_positive(tmp_path):
    """Guards the identities below against a SAM that silently does nothing."""
    a = run(tmp_path, "a", algorithm="fedavg")["final"]
    b = run(tmp_path, "b", algorithm="fedsam", **{"sam.rho": 0.5})["final"]
    assert any(not torch.equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------- identities (bit for bit)
def test_fedsam_rho0_equals_fedavg(tmp_path):
    a = run(tmp_path, "a", algorithm="fedavg")["final"]
    b = run(tmp_path, "b", algorithm="fedsam", **{"sam.rho": 0.0})["final"]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_mofedsam_beta1_equals_fedsam(tmp_path):
    a = run(tmp_path, "a", algorithm="fedsam", **{"sam.rho": 0.3})["final"]
    b = run(tmp_path, "b", algorithm="mofedsam", **{"sam.rho": 0.3}, **{"mofedsam.beta": 1.0})["final"]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_mofedsam_literal_step_equals_delta_step_when_lr_times_k_is_1(tmp_path):
    """Notes §6 A2: the literal Alg. 2 server step is model averaging iff eta_l * K = 1."""
    common = {"algorithm": "mofedsam", "sam.rho": 0.1, "lr": 0.25, "local-steps": 4}
    a = run(tmp_path, "a", **common)["final"]
    b = run(tmp_path, "b", **common, **{"fedcm.server-step": "literal"})["final"]
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6)


# ---------------------------------------------------------------- SAM machinery
def _tiny_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))


def test_sam_restores_weights_bit_exactly():
    model = _tiny_model()
    x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
    before = [p.detach().clone() for p in model.parameters()]
    sam_gradient(ModelBatch(model, x, y), rho=0.7)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_sam_uses_global_norm_and_same_batch():
    """g~ = grad at w + rho g/||g|| with ||g|| over all parameters (not per layer)."""
    model = _tiny_model()
    x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
    rho = 0.4
    _, g = ModelBatch(model, x, y).grad()
    norm = torch.sqrt(sum((gi ** 2).sum() for gi in g))
    shifted = _tiny_model()
    with torch.no_grad():
        for p, gi in zip(trainable(shifted), g):
            p.add_(rho * gi / norm)
    _, expected = ModelBatch(shifted, x, y).grad()
    _, got = sam_gradient(ModelBatch(model, x, y), rho)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    # a per-layer normalisation would give a different answer on this model
    per_layer = _tiny_model()
    with torch.no_grad():
        for p, gi in zip(trainable(per_layer), g):
            p.add_(rho * gi / gi.norm())
    _, wrong = ModelBatch(per_layer, x, y).grad()
    assert any(not torch.allclose(a, b, atol=1e-6) for a, b in zip(got, wrong))
