"""One test per bug of the public reference code (each cited by repository, commit, file and line).

Each bug is a *variant*: a function below that puts the bug back into our code (monkeypatch).
Its test first checks that our pipeline follows the paper (the final model equals the float64
numpy reference of tests/reference.py to 1e-6),
then re-runs with the variant and pins the claim numerically:

* the variant's result differs from the paper's rule by more than 10x the float32 floor
  (FLOAT32_FLOOR, the agreement of the float32 pipeline with the float64 references); and,
* where the authors' rule can be written in float64, it equals that reference to 1e-6, so the
  variant is the authors' computation, not merely *a* bug.

Every variant names the authors' file and line it reproduces (repository @ commit, path; "not
stored" where our code index lacks that file: the cite then follows the reference-codebases
notes). Variants compose: each replaces one function. The sizes measured here are the table
in docs/algorithms.md ("Public-code bugs").

The problem is the tiny synthetic logistic regression with partial participation (2 of 4
clients, 3 full-batch steps, 4 rounds); its W (10 x 20) and b (10) have different sizes and
shapes, which the slicing bugs need.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest
import torch

import flatflower.client.algorithms.fedlesam as fedlesam_client
import flatflower.client.sam as sam
from flatflower.client.algorithms.feddyn import DualClient
from flatflower.client.algorithms.fedacg import FedACGClient
from flatflower.client.algorithms.fedprox import FedProxClient
from flatflower.client.algorithms.fedsmoo import FedSMOOClient
from flatflower.client.algorithms.fedspeed import FedSpeedClient
from flatflower.client.algorithms.scaffold import ScaffoldClient
from flatflower.client.batch import ModelBatch, cross_entropy, trainable
from flatflower.client.layout import Layout
from flatflower.client.train import build_rule, local_train, rule_outputs
from flatflower.common import protocol as P
from flatflower.common.config import RunConfig
from flatflower.common.datasets import Split, load_dataset
from flatflower.common.models import build_model
from flatflower.common.tensors import add_scaled, scale
from flatflower.strategies.fednsam import FedNSAM
from flatflower.strategies.registry import ALGORITHMS
from flatflower.strategies.scaffold import Scaffold
from tests.helpers import PARTIAL, run
from tests.reference import EPS, Problem, fedacg_reference, feddyn_reference, fedlesam_reference, fedprox_reference, fedsmoo_reference, norm, scaffold_reference, scaled

FLOAT32_FLOOR = 1e-6  # max |float32 pipeline - float64 reference| the equality tests allow
A, RHO = 0.4, 0.3  # feddyn-alpha and rho of the cases below

CASES = {  # algorithm -> (run config, the paper's reference giving the final model)
    "scaffold": ({}, lambda p: scaffold_reference(p)[0]),
    "fedprox": ({"fedprox.mu": 0.7}, lambda p: fedprox_reference(p, mu=0.7)),
    "feddyn": ({"feddyn.alpha": A}, lambda p: feddyn_reference(p, a=A)[0]),
    "fedspeed": ({"sam.rho": RHO, "feddyn.alpha": A}, lambda p: feddyn_reference(p, a=A, rho=RHO)[0]),
    "fedacg": ({"fedacg.lambda": 0.6, "fedacg.beta": 0.5}, lambda p: fedacg_reference(p, lam=0.6, beta=0.5)[0]),
    "fedlesam": ({"sam.rho": RHO}, lambda p: fedlesam_reference(p, rho=RHO)[0]),
    "fedlesam-d": ({"sam.rho": RHO, "feddyn.alpha": A},
                   lambda p: fedlesam_reference(p, rho=RHO, base="dyn", a=A)[0]),
    "fedsmoo": ({"sam.rho": RHO, "feddyn.alpha": A}, lambda p: fedsmoo_reference(p, a=A, rho=RHO)[0]),
}


# ---------------------------------------------------------------- the mechanics
def final(tmp_path, algorithm: str, tag: str, **extra) -> tuple[Problem, np.ndarray]:
    """The run's problem and final global model (flat, float64)."""
    overrides, _ = CASES[algorithm]
    result = run(tmp_path, f"{algorithm}-{tag}", algorithm=algorithm,
                 **{**overrides, **PARTIAL, "num-server-rounds": 4, **extra})
    return Problem(result), Problem.flat(v.double().numpy() for v in result["final"].values())


def bug_size(tmp_path, monkeypatch, algorithm: str, *variants, authors=None) -> float:
    """Checks ours == the paper (1e-6), puts ``variants`` in, checks the run then differs from
    the paper by > 10 x FLOAT32_FLOOR and, given ``authors`` (prob -> the authors' rule in
    float64), equals it to 1e-6. Returns the bug's size ||w_bug - w|| / ||w - w^0||."""
    prob, ours = final(tmp_path, algorithm, "ours")
    paper = CASES[algorithm][1](prob)
    assert np.abs(ours - paper).max() < FLOAT32_FLOOR
    for put_in in variants:
        put_in(monkeypatch)
    prob, buggy = final(tmp_path, algorithm, "buggy")
    assert np.abs(buggy - paper).max() > 10 * FLOAT32_FLOOR, "the variant is invisible here"
    if authors is not None:
        np.testing.assert_allclose(buggy, authors(prob), rtol=0, atol=FLOAT32_FLOOR)
    return norm(buggy - paper) / norm(paper - prob.w0)


def replaces(target, name: str, value):
    """A variant that sets ``target.name = value``."""
    return lambda monkeypatch: monkeypatch.setattr(target, name, value)


# ---------------------------------------------------------------- slicing a flat vector per layer
def first_numel(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each layer gets the FIRST numel entries of the flat vector: get_params_list_with_shape
    without ``idx += length`` (woodenchild95/FL-Simulator @e677e78 utils.py L32-38, fixed in
    502bec6; harrylee999/FL-SAM @2c16149 system/flcore/servers/serverlesamd.py, not stored)."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    return [flat[: t.numel()].reshape(t.shape) for t in tensors]


def first_entries(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Layer l gets the scalar flat[l], broadcast over the layer: ``g_update[idx]`` on a flat
    vector (MediaBrain-SJTU/FedLESAM @d6663cc optimizer/LESAM.py L48, and LESAM_D.py L48;
    files as stored at 8a9fe90; its issue #1)."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    return [flat[layer] for layer in range(len(tensors))]


def np_first_numel(prob: Problem, v: np.ndarray) -> np.ndarray:
    return prob.flat(v[: int(np.prod(shape))] for shape in prob.shapes)


flsam_slicing = replaces(fedlesam_client, "unit_scaled", lambda d, r: sam.unit_scaled(first_numel(d), r))
mediabrain_index = replaces(fedlesam_client, "unit_scaled", lambda d, r: sam.unit_scaled(first_entries(d), r))
# MediaBrain LESAM.py L32: grad_norm += g_update[idx].norm(p=2), the SUM of per-layer norms
per_layer_norm = replaces(sam, "global_norm", lambda tensors: sum(t.detach().float().norm() for t in tensors))


def mediabrain_perturbation(index_bug: bool):
    """float64: MediaBrain's delta from d = theta^old - theta^t; per layer rho p_l / sum_j ||p_j||,
    p_l = d[l] (index bug, a scalar) or layer l of d."""
    def perturb(prob, d, rho):
        pieces = [d[layer] for layer in range(len(prob.shapes))] if index_bug else prob.unflat(d)
        size = sum(norm(np.asarray(p)) for p in pieces)
        return prob.flat(np.broadcast_to(rho * p / (size + EPS), shape) for p, shape in zip(pieces, prob.shapes))
    return perturb


def fedsmoo_reads_mis_sliced(monkeypatch):
    """FL-Simulator before 502bec6: the server sends mu_i and s per layer through the unfixed
    get_params_list_with_shape (server/FedSMOO.py process_for_communication, L49-50 as stored at
    653ebb5), so the client starts each round from mis-sliced mu_i and s; they are flattened back
    correctly (postprocess). h_i stays flat and correct."""
    original = FedSMOOClient.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.s, self.mu = first_numel(self.s), first_numel(self.mu)

    monkeypatch.setattr(FedSMOOClient, "__init__", init)


def test_fl_simulator_fedsmoo_mis_slices_mu_and_s(tmp_path, monkeypatch):
    """woodenchild95/FL-Simulator issue #13: mu_i and s are mis-shaped per layer (from the
    client's second round and from round 2: in round 1 both are zero). The perturbation s^
    itself is built per tensor and is not mis-sliced."""
    bug_size(tmp_path, monkeypatch, "fedsmoo", fedsmoo_reads_mis_sliced,
             authors=lambda p: fedsmoo_reference(p, a=A, rho=RHO, received=lambda v: np_first_numel(p, v))[0])


def test_fl_sam_fedlesam_d_slices_the_update_then_normalises(tmp_path, monkeypatch):
    """FL-SAM's FedLESAM-D: the global update is mis-sliced per layer by the server
    (serverlesamd.py get_params_list_with_shape), the client then normalises the mis-sliced
    pieces by their global norm (system/utils/lesam_utils.py first_step; not stored)."""
    bug_size(tmp_path, monkeypatch, "fedlesam-d", flsam_slicing,
             authors=lambda p: fedlesam_reference(p, rho=RHO, base="dyn", a=A,
                                                  perturb=lambda q, d, r: scaled(q, np_first_numel(q, d), r))[0])


@pytest.mark.parametrize("algorithm", ["fedlesam", "fedlesam-d"])
def test_mediabrain_fedlesam_shifts_each_layer_by_one_scalar(tmp_path, monkeypatch, algorithm):
    """MediaBrain's published FedLESAM (and -D): layer l is shifted by rho g[l] / sum_j |g[j]|,
    g[l] the l-th ENTRY of the flat update (index bug, LESAM.py L48) over the sum of the
    per-layer "norms" (L32). Both variants together are the published code."""
    base = "avg" if algorithm == "fedlesam" else "dyn"
    bug_size(tmp_path, monkeypatch, algorithm, mediabrain_index, per_layer_norm,
             authors=lambda p: fedlesam_reference(p, rho=RHO, base=base, a=A,
                                                  perturb=mediabrain_perturbation(index_bug=True))[0])


def test_mediabrain_fedlesam_normalises_by_the_sum_of_layer_norms(tmp_path, monkeypatch):
    """MediaBrain-SJTU/FedLESAM optimizer/LESAM.py L32 (grad_norm += ...norm(p=2)) with the
    index fixed: delta = rho d / sum_l ||d_l||, not rho d / ||d||."""
    bug_size(tmp_path, monkeypatch, "fedlesam", per_layer_norm,
             authors=lambda p: fedlesam_reference(p, rho=RHO, perturb=mediabrain_perturbation(index_bug=False))[0])


# ---------------------------------------------------------------- FL-SAM's FedDyn family
def unsquared_dual(monkeypatch):
    """FL-SAM @2c16149 system/flcore/clients/clientdyn.py (and clientspeed.py, clientsmoo.py,
    clientlesamd.py; not stored), after PFLlib's clientdyn.py: the prox term is
    (a/2) torch.norm(w - w^t, 2), un-squared; its gradient (a/2)(w - w^t)/||w - w^t|| is 0 at
    w = w^t (torch's subgradient) and a unit vector times a/2 elsewhere."""
    def direction(self, w, batch):
        loss, g = self.gradient(w, batch)
        diff = [p - p0 for p, p0 in zip(w, self.start)]
        size = float(torch.sqrt(sum((d ** 2).sum() for d in diff))) + 1e-12
        a = self.prox_coefficient()
        return loss, [gi - hi + (a / 2) * d / size for gi, hi, d in zip(g, self.dual, diff)]

    monkeypatch.setattr(DualClient, "direction", direction)


def restored_by_subtraction(monkeypatch):
    """The SAM step restores w with ``p.sub_(e_w)`` after ``p.add_(e_w)`` (FL-SAM's ESAM in
    system/utils/fedspeed_utils.py, LESAM in lesam_utils.py, not stored; the same code as
    woodenchild95/FL-Simulator @502bec6 optimizer/ESAM.py second_step). (w + e) - e != w in
    float32: ~1e-8 stays in the weights."""
    def grad(self, offset=None, objective=cross_entropy):
        if offset is None:
            return self._grad(objective)
        with torch.no_grad():
            for p, o in zip(self.params, offset):
                p.add_(o)
        result = self._grad(objective)
        with torch.no_grad():
            for p, o in zip(self.params, offset):
                p.sub_(o)
        return result

    monkeypatch.setattr(ModelBatch, "grad", grad)


def test_feddyn_prox_is_the_squared_norm(tmp_path, monkeypatch):
    """PFLlib (TsingZ0/PFLlib system/flcore/clients/clientdyn.py) and FL-SAM's clientdyn.py:
    (a/2) torch.norm(w - w^t, 2), un-squared. For FL-SAM's FedDyn (no SAM step) this variant
    is the whole bug."""
    bug_size(tmp_path, monkeypatch, "feddyn", unsquared_dual)


@pytest.mark.parametrize("algorithm", ["fedspeed", "fedsmoo", "fedlesam-d"])
def test_fl_sam_restore_rounding_kicks_the_unsquared_prox(tmp_path, monkeypatch, algorithm):
    """FL-SAM's FedSpeed, FedSMOO and FedLESAM-D are NOT the un-squared prox alone: after the
    SAM step w = w^t + r (restore rounding, r ~ 1e-8), and the un-squared term's gradient turns r
    into (a/2) r/||r||, a full-size kick, at step 1 of every round (test below)."""
    unsquared_dual(monkeypatch)
    _, plain = final(tmp_path, algorithm, "unsquared")
    restored_by_subtraction(monkeypatch)
    _, kicked = final(tmp_path, algorithm, "kicked")
    assert np.abs(kicked - plain).max() > 10 * FLOAT32_FLOOR


def test_restore_rounding_is_a_kick_of_a_half_at_step_one(monkeypatch):
    """Step 1 of a FedSpeed round under FL-SAM's two mechanisms: the weights come back off by a
    residual r with 0 < ||r|| < 1e-6, and the direction differs from the SAM gradient (the dual
    is 0 in round 1) by exactly (a/2) r/||r||, of norm a/2."""
    cfg = RunConfig.from_mapping({"algorithm": "fedspeed", "sam.rho": RHO, "feddyn.alpha": A})
    data = load_dataset("synthetic").train
    x, y = data.x[:64], data.y[:64]
    model = build_model("logreg", tuple(x.shape[1:]), 10, seed=3)
    start = [p.detach().clone() for p in trainable(model)]
    _, g_sam = sam.sam_gradient(ModelBatch(model, x, y), RHO)
    unsquared_dual(monkeypatch)
    restored_by_subtraction(monkeypatch)
    rule = FedSpeedClient(cfg.params, start, {}, {}, cfg.lr)
    _, kicked = rule.direction([p.detach() for p in trainable(model)], ModelBatch(model, x, y))
    residual = [p.detach() - s for p, s in zip(trainable(model), start)]
    assert 0 < float(sam.global_norm(residual)) < 1e-6
    kick = [k - g for k, g in zip(kicked, g_sam)]
    assert float(sam.global_norm(kick)) == pytest.approx(A / 2, rel=1e-3)
    r = float(sam.global_norm(residual))
    for k, res in zip(kick, residual):
        torch.testing.assert_close(k, (A / 2) * res / r, rtol=1e-3, atol=1e-6)


def no_zero_grad(monkeypatch):
    """FL-SAM @2c16149 FedSMOO (system/utils/fedsmoo_utils.py step; not stored): no zero_grad
    before a step's first backward, so the ascent gradient is g(w_k) plus what .grad still
    holds, the previous step's descent direction d_{k-1} (the model is fresh each round:
    serverbase.py send_models deep-copies it, so step 1 is clean)."""
    def direction(self, w, batch):
        loss, d = DualClient.direction(self, w, batch)  # looked up now: composes with unsquared_dual
        self.left_in_grad = d
        return loss, d

    def ascent_gradient(self, w, batch):
        loss, g = batch.grad()
        left = getattr(self, "left_in_grad", None)
        return loss, g if left is None else [gi + li for gi, li in zip(g, left)]

    monkeypatch.setattr(FedSMOOClient, "direction", direction)
    monkeypatch.setattr(FedSMOOClient, "ascent_gradient", ascent_gradient)


def test_fl_sam_fedsmoo_never_zeroes_the_ascent_gradient(tmp_path, monkeypatch):
    bug_size(tmp_path, monkeypatch, "fedsmoo", no_zero_grad,
             authors=lambda p: fedsmoo_reference(p, a=A, rho=RHO, keep_grad=True)[0])


def test_fl_simulator_clips_before_adding_the_weight_decay_part(tmp_path, monkeypatch):
    """A difference, not a bug: FL-Simulator clips g + a(h_i - w^t), then SGD's
    weight_decay = wd + a adds a w AFTER clipping (woodenchild95/FL-Simulator @e677e78
    client/feddyn.py L10 and L34; fedspeed.py, fedsmoo.py and MediaBrain's fedlesam_d.py
    likewise). Ours clips the whole d = g - h_i + a(w - w^t). Emulated here: d - a w as the
    direction and weight-decay = a. Equal while clipping is inactive, different when it acts."""
    def fl_simulator(monkeypatch):
        original = DualClient.direction

        def direction(self, w, batch):
            loss, d = original(self, w, batch)
            a = self.prox_coefficient()
            return loss, [di - a * p for di, p in zip(d, w)]

        monkeypatch.setattr(DualClient, "direction", direction)

    _, ours = final(tmp_path, "feddyn", "ours-clip", **{"clip-norm": 0.5})
    _, unclipped = final(tmp_path, "feddyn", "ours")
    with monkeypatch.context() as m:
        fl_simulator(m)
        _, theirs = final(tmp_path, "feddyn", "theirs-clip", **{"clip-norm": 0.5, "weight-decay": A})
        _, theirs_unclipped = final(tmp_path, "feddyn", "theirs", **{"weight-decay": A})
    assert np.abs(theirs_unclipped - unclipped).max() < FLOAT32_FLOOR
    assert np.abs(theirs - ours).max() > 10 * FLOAT32_FLOOR
    assert np.abs(ours - unclipped).max() > 10 * FLOAT32_FLOOR  # clipping acts at 0.5


# ---------------------------------------------------------------- control variates
def test_scaffold_control_variates_start_at_zero_not_the_weights(tmp_path, monkeypatch):
    """adap/flower baselines/niid_bench: c starts as the initial model weights
    (niid_bench/server_scaffold.py L50 @91ba57f) and c_i as the received weights
    (niid_bench/client_scaffold.py L66-68 @09d72eb), not zeros."""
    def buggy_init(self):
        self.records[P.CONTROL] = OrderedDict((k, v.clone()) for k, v in self.model.items())

    bug_size(tmp_path, monkeypatch, "scaffold", replaces(Scaffold, "init_records", buggy_init))


def test_scaffold_correction_changes_the_step(tmp_path, monkeypatch):
    """junkangLiu0/FedNSAM @3c0681c main_FedNSAM.py update_scaf: the correction <p, c - c_i> is
    added to the loss via ``lossh.item()``, so it carries no gradient and SCAFFOLD is FedAvg."""
    def detached(self, w, batch):
        self.steps += 1
        return self.gradient(w, batch)

    bug_size(tmp_path, monkeypatch, "scaffold", replaces(ScaffoldClient, "direction", detached))


def test_scaffold_divides_by_all_local_steps_not_batches_per_epoch(monkeypatch):
    """TsingZ0/PFLlib issues #152/#160 (system/flcore/clients/clientscaffold.py before their fix):
    option II's K counted batches per epoch, not batches x epochs. With 2 epochs of 2 batches,
    c_i+ = c_i - c + (x - y_K)/(4 lr)."""
    cfg = RunConfig.from_mapping({"algorithm": "scaffold", "local-epochs": 2, "batch-size": 5})
    torch.manual_seed(0)
    data = Split(torch.randn(10, 4), torch.randint(0, 3, (10,)))

    def control_error():
        """max |c_i+ - (c_i - c + (x - y_K)/(4 lr))|."""
        model = torch.nn.Linear(4, 3)
        torch.nn.init.constant_(model.weight, 0.1)
        torch.nn.init.zeros_(model.bias)
        x0 = [p.detach().clone() for p in trainable(model)]
        c = OrderedDict((n, torch.full_like(p, 0.01)) for n, p in model.named_parameters())
        rule, layout = build_rule(ALGORITHMS[cfg.algorithm], cfg, model, {P.CONTROL: c}, {}, 0.1)
        assert isinstance(rule, ScaffoldClient)
        local_train(model, data, rule, cfg, 0.1, torch.Generator().manual_seed(0))
        expected = [-0.01 + (a - p.detach()) / (4 * 0.1) for a, p in zip(x0, trainable(model))]
        got = rule_outputs(rule, layout, model)[1][P.CLIENT_CONTROL]
        return max(float((g - e).abs().max()) for g, e in zip(got.values(), expected))

    assert control_error() < FLOAT32_FLOOR
    original = ScaffoldClient.new_control

    def per_epoch(self, w):
        self.steps //= cfg.local_epochs  # the miscount
        return original(self, w)

    monkeypatch.setattr(ScaffoldClient, "new_control", per_epoch)
    assert control_error() > 10 * FLOAT32_FLOOR


# ---------------------------------------------------------------- prox and dual terms
def test_fedacg_prox_term_has_a_gradient(tmp_path, monkeypatch):
    """junkangLiu0/FedNSAM @3c0681c main_FedNSAM.py update_FedACG: the prox term toward the
    look-ahead is built with ``.item()`` and contributes no gradient."""
    bug_size(tmp_path, monkeypatch, "fedacg", replaces(FedACGClient, "prox_weight", lambda self: 0.0))


def unsquared_prox(self, w, batch):
    """Gradient of mu ||w - w^t||_2 (torch.norm, not squared): a unit vector times mu."""
    loss, g = batch.grad()
    diff = [p - p0 for p, p0 in zip(w, self.start)]
    size = self.prox_weight() / (float(torch.sqrt(sum((d ** 2).sum() for d in diff))) + 1e-12)
    return loss, [gi + size * d for gi, d in zip(g, diff)]


def test_fedprox_prox_term_is_the_squared_norm(tmp_path, monkeypatch):
    """adap/flower PR #2210 (baselines/fedprox: the proximal term missed its square) — the
    same bug class as PFLlib's and FL-SAM's FedDyn."""
    bug_size(tmp_path, monkeypatch, "fedprox", replaces(FedProxClient, "direction", unsquared_prox))


def test_fedprox_prox_term_is_not_zero(tmp_path, monkeypatch):
    """adap/flower PR #1654 (baselines/fedprox: the proximal term always evaluated to 0)."""
    bug_size(tmp_path, monkeypatch, "fedprox", replaces(FedProxClient, "prox_weight", lambda self: 0.0))


def test_feddyn_step_pulls_towards_the_global_model(tmp_path, monkeypatch):
    """KarhouTam/FL-bench @06e658b src/client/feddyn.py: the linear term a<w, h_i - w^t> without
    adding a to the weight decay leaves -a w^t in the gradient and drops the +a w pull."""
    def buggy(self, w, batch):
        loss, g = self.gradient(w, batch)
        a = self.prox_coefficient()
        return loss, [gi - hi - a * p0 for gi, hi, p0 in zip(g, self.dual, self.start)]

    bug_size(tmp_path, monkeypatch, "feddyn", replaces(DualClient, "direction", buggy))


# ---------------------------------------------------------------- state layout
def test_client_state_comes_back_in_the_same_element_order(tmp_path, monkeypatch):
    """The bug class of FL-Simulator #13 (state stored flat and restored in the wrong order),
    not one repository's line: here the client's c_i (W is 10 x 20) read back transposed."""
    original = Layout.aligned

    def transposed(self, tensors):
        return [t.t().reshape(t.shape) if t.dim() == 2 else t for t in original(self, tensors)]

    bug_size(tmp_path, monkeypatch, "scaffold", replaces(Layout, "aligned", transposed))


def test_fedsmoo_mu_persists_between_a_clients_rounds(tmp_path, monkeypatch):
    """kumar-devesh/fedsmoo @d196fb9 (adap/flower PR #2433 draft): mu_i kept in a client
    attribute that Flower recreates every round, so it restarts at 0."""
    def forgetful(self, w):
        return DualClient.new_state(self, w)  # h_i only; mu_i dropped

    bug_size(tmp_path, monkeypatch, "fedsmoo", replaces(FedSMOOClient, "new_state", forgetful))


# ---------------------------------------------------------------- which model, which momentum
def test_fedlesam_uses_each_clients_own_previous_model(tmp_path, monkeypatch):
    """Both public FedLESAMs perturb every client along the last round's global update
    w^{t-1} - w^t, not the client's own w_i^old - w^t (MediaBrain-SJTU/FedLESAM
    server/FedLESAM.py L29, global_update, as stored at 8a9fe90; FL-SAM serverlesamd.py, not
    stored); they differ once clients skip rounds."""
    last_seen: dict[str, list] = {}
    original = fedlesam_client.LocalEstimate.__init__

    def global_update(self, params, start, broadcast, state, lr, initial=None):
        received = [t.clone() for t in start]
        current = last_seen.get("current")
        if current is None or not all(torch.equal(a, b) for a, b in zip(current, received)):
            last_seen["previous"], last_seen["current"] = current, received  # a new round began
        previous = last_seen.get("previous")
        state = dict(state)
        if previous is not None:
            state[P.PREVIOUS_GLOBAL] = previous
        else:
            state.pop(P.PREVIOUS_GLOBAL, None)
        original(self, params, start, broadcast, state, lr, initial)

    bug_size(tmp_path, monkeypatch, "fedlesam", replaces(fedlesam_client.LocalEstimate, "__init__", global_update))


def shadowed(self, server_round, updates, weights):
    """junkangLiu0/FedNSAM @c3c9e90 main_FedNSAM.py apply_weights_avgACG (not stored at that
    commit): m = Delta while the momentum dict is empty (round 1), then the loop runs over the
    new Delta, not m, so m <- lambda Delta + Delta. (The stored 3c0681c version loops over m.)"""
    delta = self.mean_delta(updates, weights)
    lam = 0.0 if server_round == 1 else self.momentum_coefficient()
    self.records[P.MOMENTUM] = add_scaled(scale(delta, lam), 1.0, delta)
    self.model = add_scaled(self.model, self.cfg.server_lr, self.records[P.MOMENTUM])


def test_server_momentum_keeps_its_history(tmp_path, monkeypatch):
    """FedNSAM's and FedACG's server in the FedNSAM repository (``shadowed`` above)."""
    bug_size(tmp_path, monkeypatch, "fedacg", replaces(FedNSAM, "update", shadowed),
             authors=lambda p: fedacg_reference(p, lam=0.6, beta=0.5, shadowed=True)[0])


@pytest.mark.parametrize("algorithm", sorted(CASES))
def test_every_case_follows_the_paper(tmp_path, algorithm):
    """The property the tests above break holds for each algorithm they use."""
    prob, ours = final(tmp_path, algorithm, "check")
    assert np.abs(ours - CASES[algorithm][1](prob)).max() < FLOAT32_FLOOR
