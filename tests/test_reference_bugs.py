"""One regression test per bug of the public reference code (reference-codebases notes,
/work/shared/reference): each test checks a property of ours, then re-runs with the bug
put back (monkeypatched into our code) and shows the same check fails. So every test is
known to catch the bug it is named after.

The property is, in most tests, "the pipeline's final model equals the independent numpy
reference of the paper's pseudocode" (tests/test_baseline_algorithms.py,
tests/test_seed_algorithms.py), on the tiny synthetic logistic regression with partial
participation; the reference's W (10 x 20) and b (10) have different sizes and shapes, which
the indexing and reshaping bugs need.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest
import torch

import client.algorithms.fedlesam as fedlesam_client
import client.algorithms.fedsmoo as fedsmoo_client
from client.algorithms.base import ClientAlgorithm
from client.algorithms.feddyn import DualClient
from client.algorithms.fedprox import FedACGClient, FedProxClient
from client.algorithms.scaffold import ScaffoldClient
from client.sam import loss_and_grad, trainable
from client.train import local_train
from common import protocol as P
from common.config import RunConfig
from common.datasets import Split
from strategies.fednsam import FedNSAM
from strategies.scaffold import Scaffold
from test_algorithms import run
from test_baseline_algorithms import (fedacg_reference, fedlesam_reference, fedprox_reference,
                                      fedsmoo_reference, scaffold_reference)
from test_seed_algorithms import PARTIAL, Problem, feddyn_reference

CASES = {  # algorithm -> (run config, reference giving the final model)
    "scaffold": ({}, lambda p: scaffold_reference(p)[0]),
    "fedprox": ({"fedprox-mu": 0.7}, lambda p: fedprox_reference(p, mu=0.7)),
    "feddyn": ({"feddyn-alpha": 0.4}, lambda p: feddyn_reference(p, a=0.4)[0]),
    "fedacg": ({"fedacg-lambda": 0.6, "fedacg-beta": 0.5}, lambda p: fedacg_reference(p, lam=0.6, beta=0.5)[0]),
    "fedlesam": ({"rho": 0.3}, lambda p: fedlesam_reference(p, rho=0.3)[0]),
    "fedsmoo": ({"rho": 0.3, "feddyn-alpha": 0.4}, lambda p: fedsmoo_reference(p, a=0.4, rho=0.3)[0]),
}


def follows_the_paper(tmp_path, algorithm: str, tag: str) -> bool:
    """True when the run's final model equals the paper's pseudocode to 1e-6."""
    overrides, reference = CASES[algorithm]
    result = run(tmp_path, f"{algorithm}-{tag}", algorithm=algorithm, **overrides,
                 **{**PARTIAL, "num-server-rounds": 4})
    prob = Problem(result)
    got = Problem.flat(v.double().numpy() for v in result["final"].values())
    return bool(np.abs(got - reference(prob)).max() < 1e-6)


def assert_catches(tmp_path, monkeypatch, algorithm: str, target, name: str, buggy) -> None:
    assert follows_the_paper(tmp_path, algorithm, "ours")
    monkeypatch.setattr(target, name, buggy)
    assert not follows_the_paper(tmp_path, algorithm, "buggy"), "the bug went unnoticed"


def flat_first_numel(tensors: list[torch.Tensor], radius: float) -> list[torch.Tensor]:
    """radius * d/||d||, but each layer takes the FIRST numel entries of the flat vector
    (get_params_list_with_shape without ``idx += length``; FedLESAM's g_update[idx])."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    flat = flat * (radius / (float(flat.norm()) + 1e-12))
    return [flat[: t.numel()].reshape(t.shape) for t in tensors]


# ---------------------------------------------------------------- control variates
def test_scaffold_control_variates_start_at_zero_not_the_weights(tmp_path, monkeypatch):
    """Flower baselines/niid_bench (server_scaffold.py, client_scaffold.py): c starts as the
    initial model weights and c_i as the current global weights, not zeros."""
    def buggy_init(self):
        self.records[P.CONTROL] = OrderedDict((k, v.clone()) for k, v in self.model.items())

    assert_catches(tmp_path, monkeypatch, "scaffold", Scaffold, "init_records", buggy_init)


def test_scaffold_correction_changes_the_step(tmp_path, monkeypatch):
    """junkangLiu0/FedNSAM update_scaf: the correction <p, c - c_i> is added to the loss via
    ``.item()``, so it carries no gradient and SCAFFOLD is FedAvg."""
    def detached(self, model, x, y):
        self.steps += 1
        return self.local_gradient(model, x, y)

    assert_catches(tmp_path, monkeypatch, "scaffold", ScaffoldClient, "direction", detached)


def test_scaffold_divides_by_all_local_steps_not_batches_per_epoch(monkeypatch):
    """PFLlib #152/#160: option II's K counted batches per epoch, not batches x epochs. With
    2 epochs of 2 batches, c_i+ = c_i - c + (x - y_K)/(4 lr)."""
    cfg = RunConfig.from_mapping({"algorithm": "scaffold", "local-epochs": 2, "batch-size": 5})
    torch.manual_seed(0)
    data = Split(torch.randn(10, 4), torch.randint(0, 3, (10,)))

    def new_control():
        model = torch.nn.Linear(4, 3)
        torch.nn.init.constant_(model.weight, 0.1)
        torch.nn.init.zeros_(model.bias)
        x0 = [p.detach().clone() for p in trainable(model)]
        c = OrderedDict((n, torch.full_like(p, 0.01)) for n, p in model.named_parameters())
        rule = ScaffoldClient(cfg, model, {P.CONTROL: c}, {}, lr=0.1)
        local_train(model, data, rule, cfg, 0.1, torch.Generator().manual_seed(0))
        expected = [-0.01 + (a - p.detach()) / (4 * 0.1) for a, p in zip(x0, trainable(model))]
        got = rule.new_state(model)[P.CLIENT_CONTROL]
        return all(torch.allclose(g, e, atol=1e-6) for g, e in zip(got.values(), expected))

    assert new_control()
    original = ScaffoldClient.new_control

    def per_epoch(self, model):
        self.steps //= cfg.local_epochs  # the miscount
        return original(self, model)

    monkeypatch.setattr(ScaffoldClient, "new_control", per_epoch)
    assert not new_control()


# ---------------------------------------------------------------- prox and dual terms
def test_fedacg_prox_term_has_a_gradient(tmp_path, monkeypatch):
    """junkangLiu0/FedNSAM update_FedACG: the prox term toward the look-ahead is built with
    ``.item()`` and contributes no gradient."""
    assert_catches(tmp_path, monkeypatch, "fedacg", FedACGClient, "prox_weight", lambda self: 0.0)


def unsquared(self, model, x, y):
    """Gradient of mu ||w - w^t||_2 (torch.norm, not squared): a unit vector times mu."""
    loss, g = loss_and_grad(model, x, y)
    diff = [p.detach() - p0 for p, p0 in zip(trainable(model), self.start)]
    scale = self.prox_weight() / (float(torch.sqrt(sum((d ** 2).sum() for d in diff))) + 1e-12)
    return loss, [gi + scale * d for gi, d in zip(g, diff)]


def test_fedprox_prox_term_is_the_squared_norm(tmp_path, monkeypatch):
    """Flower PR #2210 (FedProx baseline missing the square) — the same bug class as PFLlib's
    and FL-SAM's FedDyn: the gradient of mu ||w - w^t|| has constant magnitude mu."""
    assert_catches(tmp_path, monkeypatch, "fedprox", FedProxClient, "direction", unsquared)


def test_fedprox_prox_term_is_not_zero(tmp_path, monkeypatch):
    """Flower PR #1654: the FedProx term always evaluated to 0."""
    assert_catches(tmp_path, monkeypatch, "fedprox", FedProxClient, "prox_weight", lambda self: 0.0)


def test_feddyn_prox_is_the_squared_norm(tmp_path, monkeypatch):
    """PFLlib clientdyn.py / FL-SAM clientdyn.py: (a/2) torch.norm(v - v_global, 2), un-squared."""
    def buggy(self, model, x, y):
        loss, g = self.loss_gradient(model, x, y)
        diff = [p.detach() - p0 for p, p0 in zip(trainable(model), self.start)]
        size = float(torch.sqrt(sum((d ** 2).sum() for d in diff))) + 1e-12
        a = self.prox_coefficient()
        return loss, [gi - hi + (a / 2) * d / size for gi, hi, d in zip(g, self.dual, diff)]

    assert_catches(tmp_path, monkeypatch, "feddyn", DualClient, "direction", buggy)


def test_feddyn_step_pulls_towards_the_global_model(tmp_path, monkeypatch):
    """KarhouTam/FL-bench feddyn.py: the linear term a<w, h_i - w^t> without adding a to the
    weight decay leaves -a w^t in the gradient and drops the +a w pull."""
    def buggy(self, model, x, y):
        loss, g = self.loss_gradient(model, x, y)
        a = self.prox_coefficient()
        return loss, [gi - hi - a * p0 for gi, hi, p0 in zip(g, self.dual, self.start)]

    assert_catches(tmp_path, monkeypatch, "feddyn", DualClient, "direction", buggy)


# ---------------------------------------------------------------- flat vectors and state layout
def test_fedlesam_perturbation_is_sliced_per_layer_correctly(tmp_path, monkeypatch):
    """MediaBrain-SJTU/FedLESAM issue #1 (g_update[idx]) and FL-SAM serverlesamd.py
    get_params_list_with_shape: every layer's part of a flat vector starts at 0."""
    assert_catches(tmp_path, monkeypatch, "fedlesam", fedlesam_client, "unit_scaled", flat_first_numel)


def test_fedsmoo_perturbation_is_sliced_per_layer_correctly(tmp_path, monkeypatch):
    """woodenchild95/FL-Simulator issue #13 (fixed in 502bec6): mu_i and s mis-shaped per
    layer by get_params_list_with_shape."""
    assert_catches(tmp_path, monkeypatch, "fedsmoo", fedsmoo_client, "unit_scaled", flat_first_numel)


def test_client_state_comes_back_in_the_same_element_order(tmp_path, monkeypatch):
    """The same bug class (FL-Simulator #13): state stored flat and restored in the wrong
    order. Here the client's control variate c_i (W is 10 x 20) read back transposed."""
    original = ClientAlgorithm.aligned

    def transposed(self, tensors):
        return [t.t().reshape(t.shape) if t.dim() == 2 else t for t in original(self, tensors)]

    assert_catches(tmp_path, monkeypatch, "scaffold", ClientAlgorithm, "aligned", transposed)


def test_fedsmoo_mu_persists_between_a_clients_rounds(tmp_path, monkeypatch):
    """adap/flower PR #2433 draft (kumar-devesh/fedsmoo): mu_i kept in a client attribute that
    Flower recreates every round, so it restarts at 0."""
    def forgetful(self, model):
        return DualClient.new_state(self, model)  # h_i only; mu_i dropped

    assert_catches(tmp_path, monkeypatch, "fedsmoo", fedsmoo_client.FedSMOOClient, "new_state", forgetful)


# ---------------------------------------------------------------- which model, which momentum
def test_fedlesam_uses_each_clients_own_previous_model(tmp_path, monkeypatch):
    """Both public FedLESAMs (MediaBrain-SJTU/FedLESAM server/FedLESAM.py, FL-SAM
    serverlesamd.py) perturb every client along the last round's global update
    w^{t-1} - w^t, not the client's own w_i^old - w^t; they differ once clients skip rounds."""
    last_seen: dict[str, list] = {}
    original = fedlesam_client.LocalEstimate.__init__

    def global_update(self, cfg, model, broadcast, state, **kwargs):
        received = [p.detach().clone() for p in trainable(model)]
        current = last_seen.get("current")
        if current is None or not all(torch.equal(a, b) for a, b in zip(current, received)):
            last_seen["previous"], last_seen["current"] = current, received  # a new round began
        previous = last_seen.get("previous")
        state = dict(state)
        if previous is not None:
            state[P.PREVIOUS_GLOBAL] = OrderedDict(
                (n, t) for n, t in zip([n for n, p in model.named_parameters()], previous))
        else:
            state.pop(P.PREVIOUS_GLOBAL, None)
        original(self, cfg, model, broadcast, state, **kwargs)

    assert_catches(tmp_path, monkeypatch, "fedlesam", fedlesam_client.LocalEstimate, "__init__", global_update)


def test_server_momentum_keeps_its_history(tmp_path, monkeypatch):
    """junkangLiu0/FedNSAM apply_weights_avgACG: the loop variable shadows the momentum, so
    m <- (1 + lambda) Delta and the previous momentum is lost (FedNSAM's and FedACG's server)."""
    def shadowed(self, server_round, updates, weights):
        from strategies.aggregate import add_scaled, scale

        delta = self.mean_delta(updates, weights)
        self.records[P.MOMENTUM] = add_scaled(scale(delta, self.momentum_coefficient()), 1.0, delta)
        self.model = add_scaled(self.model, self.cfg.server_lr, self.records[P.MOMENTUM])

    assert_catches(tmp_path, monkeypatch, "fedacg", FedNSAM, "update", shadowed)


@pytest.mark.parametrize("algorithm", sorted(CASES))
def test_every_case_follows_the_paper(tmp_path, algorithm):
    """The property the tests above break holds for each algorithm they use."""
    assert follows_the_paper(tmp_path, algorithm, "check")
