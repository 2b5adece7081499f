"""Identities between the algorithms, derived from their math (MoFedSAM with beta = 1 is
FedSAM, FedTOGA with kappa = beta = 0 is FedSpeed, any SAM method with rho = 0 is its base,
...): exact (``torch.equal``) unless stated, each with a guard that the pair differs when the
parameter is non-zero."""

from __future__ import annotations


import pytest
import torch

from flatflower.client.algorithms.fedspeed import FedSpeedClient
from flatflower.client.sam import sam_gradient
from tests.helpers import PARTIAL, TOGA, assert_client_duals, assert_close_models, assert_differ, finals_equal, matches, run
from tests.reference import Problem, fedgmt_reference


# ---------------------------------------------------------------- FedAvg, FedSAM, MoFedSAM, FedCM
def test_fedsam_differs_from_fedavg_when_rho_positive(tmp_path):
    """Guards the identities below against a SAM that silently does nothing."""
    a = run(tmp_path, "a", algorithm="fedavg")["final"]
    b = run(tmp_path, "b", algorithm="fedsam", **{"sam.rho": 0.5})["final"]
    assert any(not torch.equal(a[k], b[k]) for k in a)


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


def test_fedcm_equals_mofedsam_with_rho0(tmp_path):
    """MoFedSAM eq. 6 with rho = 0 is FedCM (mixing weight mofedsam-beta = fedcm-alpha).
    Exact: SAM with rho = 0 adds a zero offset and recomputes the same gradient."""
    a = run(tmp_path, "a", algorithm="fedcm", **{"fedcm.alpha": 0.3})
    b = run(tmp_path, "b", algorithm="mofedsam", **{"sam.rho": 0.0}, **{"mofedsam.beta": 0.3})
    assert finals_equal(a, b)
    c = run(tmp_path, "c", algorithm="mofedsam", **{"sam.rho": 0.3}, **{"mofedsam.beta": 0.3})
    assert_differ(a, c)  # guard: rho > 0 matters


def test_fedcm_alpha1_equals_fedavg(tmp_path):
    """FedCM with alpha = 1 is FedAvg (the broadcast Delta gets weight 0). Exact: 1.0 * g = g
    and 0 * Delta adds zeros; the 'delta' server step is FedAvg's."""
    a = run(tmp_path, "a", algorithm="fedavg")
    b = run(tmp_path, "b", algorithm="fedcm", **{"fedcm.alpha": 1.0})
    assert finals_equal(a, b)
    c = run(tmp_path, "c", algorithm="fedcm", **{"fedcm.alpha": 0.5})
    assert_differ(a, c)  # guard: alpha < 1 matters (from round 2, Delta != 0)


# ---------------------------------------------------------------- the FedDyn family
def test_fedspeed_rho0_equals_feddyn(tmp_path):
    """rho = 0 turns FedSpeed into FedDyn. Exact: the zero SAM offset leaves the weights
    untouched and the same gradient is recomputed; the servers are the same code."""
    common = {"feddyn.alpha": 0.3}
    a = run(tmp_path, "a", algorithm="feddyn", **common)
    b = run(tmp_path, "b", algorithm="fedspeed", **{"sam.rho": 0.0}, **common)
    assert finals_equal(a, b)
    c = run(tmp_path, "c", algorithm="fedspeed", **{"sam.rho": 0.3}, **common)
    assert_differ(a, c)  # guard


def test_fedspeed_alpha1_is_the_authors_rule_bit_for_bit(tmp_path, monkeypatch):
    """The default fedspeed-alpha = 1 is FL-Simulator's rule, the perturbed gradient alone, as
    FedSpeed ran before the switch existed (0 * g adds zeros)."""
    common = {"sam.rho": 0.3, "feddyn.alpha": 0.4}
    a = run(tmp_path, "a", algorithm="fedspeed", **common, **{"fedspeed.alpha": 1.0})
    monkeypatch.setattr(FedSpeedClient, "gradient",
                        lambda self, w, batch: sam_gradient(batch, self.params.rho))
    b = run(tmp_path, "b", algorithm="fedspeed", **common)
    assert finals_equal(a, b)


def test_fedspeed_alpha0_equals_feddyn(tmp_path):
    """alpha = 0 keeps only the plain gradient: FedDyn, exactly (0 * g~ adds zeros)."""
    common = {"feddyn.alpha": 0.4}
    a = run(tmp_path, "a", algorithm="feddyn", **common)
    b = run(tmp_path, "b", algorithm="fedspeed", **{"sam.rho": 0.3}, **common, **{"fedspeed.alpha": 0.0})
    assert finals_equal(a, b)
    c = run(tmp_path, "c", algorithm="fedspeed", **{"sam.rho": 0.3}, **common, **{"fedspeed.alpha": 0.4})
    assert_differ(a, c)  # guard: the mix matters
    assert_differ(c, run(tmp_path, "d", algorithm="fedspeed", **{"sam.rho": 0.3}, **common))


def test_fedgmt_gamma0_is_ce_plus_linear_dual_without_prox(tmp_path, server_spy):
    """gamma = 0: the local objective is CE - <u_m, w> alone, no prox term (fedgmt notes §1
    eq. 12, §2.2 'no proximal term in FedGMT'). Matches the gamma = 0 reference, and differs
    from FedDyn with feddyn-alpha = 1/beta, which is the same but for the prox term."""
    beta = 2.0
    result = run(tmp_path, "fedgmt", algorithm="fedgmt", **{"fedgmt.beta": beta, "fedgmt.gamma": 0.0,
                                                              "num-server-rounds": 3})
    prob = Problem(result)
    w, h, hc, _ = fedgmt_reference(prob, beta=beta, gamma=0.0, tau=3.0, alpha=0.95)
    matches(result, prob, w)
    assert_client_duals(result, prob, hc)
    dyn = run(tmp_path, "feddyn", algorithm="feddyn", **{"feddyn.alpha": 1 / beta, "num-server-rounds": 3})
    assert_differ(result, dyn)


def test_fedgmt_v2_init_matters(tmp_path):
    """Guard for the test above: "initial" and "global" differ (a client first sampled after
    round 1 starts from theta^0 vs theta^t)."""
    hp = {"algorithm": "fedgmt-v2", "fedgmt.beta": 2.0, "fedgmt.gamma": 0.7, "fedgmt.tau": 2.0,
          "fedgmt-v2.alpha": 0.4, **PARTIAL}
    a = run(tmp_path, "a", **hp, **{"fedgmt-v2.init": "initial"})
    b = run(tmp_path, "b", **hp, **{"fedgmt-v2.init": "global"})
    assert_differ(a, b)


def test_fedgmt_v2_equals_fedgmt_under_full_participation(tmp_path):
    """Full participation, v2-alpha = alpha, init "initial": every client's e_m follows the
    server's recursion e^t = alpha e^{t-1} + (1-alpha) theta^t from e = theta^0 (fedgmt notes
    eq. 6 vs the §2.3 reconstruction of Alg. 1 line 7), so v2 = v1; v2 is only an
    approximation of v1 when clients skip rounds.
    atol 1e-6, not exact: in round 1 v2 uses alpha theta^0 + (1-alpha) theta^0, which float32
    rounds differently from theta^0 itself."""
    hp = {"fedgmt.beta": 2.0, "fedgmt.gamma": 0.7, "fedgmt.tau": 2.0, "num-server-rounds": 3}
    a = run(tmp_path, "a", algorithm="fedgmt", **hp, **{"fedgmt.alpha": 0.6})
    b = run(tmp_path, "b", algorithm="fedgmt-v2", **hp,
            **{"fedgmt-v2.alpha": 0.6, "fedgmt-v2.init": "initial"})
    assert_close_models(a, b)
    c = run(tmp_path, "c", algorithm="fedgmt-v2", **hp,
            **{"fedgmt-v2.alpha": 0.2, "fedgmt-v2.init": "initial"})
    assert_differ(a, c)  # guard: the EMA coefficient matters


@pytest.mark.parametrize("participation", ["full", "partial-divisor-N"])
def test_fedtoga_kappa0_beta0_equals_fedspeed(tmp_path, participation):
    """kappa = beta = 0 removes both global corrections: FedTOGA is FedSpeed (fedtoga notes §1.8,
    ablation '+Dynamic Regularization' = FedSpeed-like) with a = fedtoga-alpha = feddyn-alpha, as
    long as the dual divisors agree: full participation (M = N) or divisor N.
    Exact: 0 * Delta adds zeros, v = g gives the same SAM offset, and the server is FedDyn's."""
    extra = {} if participation == "full" else {**PARTIAL, "fedtoga.dual-divisor": "N"}
    a = run(tmp_path, "a", algorithm="fedspeed", **{"sam.rho": 0.2}, **{"feddyn.alpha": 0.3},
            **{k: v for k, v in extra.items() if not k.startswith("fedtoga")})
    b = run(tmp_path, "b", algorithm="fedtoga", **{"sam.rho": 0.2},
            **{"fedtoga.alpha": 0.3, "fedtoga.kappa": 0.0, "fedtoga.beta": 0.0}, **extra)
    assert finals_equal(a, b)
    # guards: kappa alone and beta alone each matter (from round 2, once Delta != 0)
    common = {"algorithm": "fedtoga", "sam.rho": 0.2, "fedtoga.alpha": 0.3, **extra}
    c = run(tmp_path, "c", **common, **{"fedtoga.kappa": 0.7, "fedtoga.beta": 0.0})
    d = run(tmp_path, "d", **common, **{"fedtoga.kappa": 0.0, "fedtoga.beta": 0.4})
    assert_differ(a, c)
    assert_differ(a, d)


def test_fedtoga_divisor_M_differs_from_fedspeed_under_partial_participation(tmp_path):
    """With the printed divisor M (fedtoga notes §1.5, §6-A2) the accumulated dual is N/M times
    FedDyn's under partial participation, so kappa = beta = 0 is no longer FedSpeed."""
    a = run(tmp_path, "a", algorithm="fedspeed", **{"sam.rho": 0.2}, **{"feddyn.alpha": 0.3}, **PARTIAL)
    b = run(tmp_path, "b", algorithm="fedtoga", **{"sam.rho": 0.2}, **PARTIAL,
            **{"fedtoga.alpha": 0.3, "fedtoga.kappa": 0.0, "fedtoga.beta": 0.0, "fedtoga.dual-divisor": "M"})
    assert_differ(a, b)


def test_fedtoga_N_equals_G_with_one_local_step(tmp_path):
    """With K = 1 there is no previous SAM gradient, so N-perturbation uses g(theta_0) + kappa
    Delta, exactly as G (fedtoga notes §1.4, §6-A5). Exact: the same code branch runs. With
    K > 1, N's ascent direction is last step's g~ and the runs differ."""
    common = {"algorithm": "fedtoga", **TOGA, "num-server-rounds": 3}
    g1 = run(tmp_path, "g1", **common, **{"local-steps": 1, "fedtoga.perturbation": "G"})
    n1 = run(tmp_path, "n1", **common, **{"local-steps": 1, "fedtoga.perturbation": "N"})
    assert finals_equal(g1, n1)
    g3 = run(tmp_path, "g3", **common, **{"fedtoga.perturbation": "G"})
    n3 = run(tmp_path, "n3", **common, **{"fedtoga.perturbation": "N"})
    assert_differ(g3, n3)


def test_fedsmoo_rho0_equals_feddyn(tmp_path):
    """rho = 0: the perturbation, s and mu_i stay zero; FedDyn exactly."""
    a = run(tmp_path, "a", algorithm="feddyn", **{"feddyn.alpha": 0.4}, **PARTIAL)
    b = run(tmp_path, "b", algorithm="fedsmoo", **{"sam.rho": 0.0}, **{"feddyn.alpha": 0.4}, **PARTIAL)
    assert finals_equal(a, b)
    assert_differ(a, run(tmp_path, "c", algorithm="fedsmoo", **{"sam.rho": 0.3}, **{"feddyn.alpha": 0.4}, **PARTIAL))


# ---------------------------------------------------------------- server momentum
def test_fednsam_lambda0_rho0_equals_fedavg(tmp_path):
    """lam = rho = 0: zero offset and m = u, i.e. FedAvg. Exact: the offset is 0 * m - 0 * m/..,
    added to the weights as zeros; m = 0 * m + 1.0 * u."""
    a = run(tmp_path, "a", algorithm="fedavg", **{"server-lr": 0.8})
    b = run(tmp_path, "b", algorithm="fednsam", **{"sam.rho": 0.0}, **{"fednsam.lambda": 0.0, "server-lr": 0.8})
    assert finals_equal(a, b)
    # guards: each parameter on its own matters (from round 2, once m != 0)
    c = run(tmp_path, "c", algorithm="fednsam", **{"sam.rho": 0.0}, **{"fednsam.lambda": 0.5, "server-lr": 0.8})
    d = run(tmp_path, "d", algorithm="fednsam", **{"sam.rho": 0.3}, **{"fednsam.lambda": 0.0, "server-lr": 0.8})
    assert_differ(a, c)
    assert_differ(a, d)


def test_fedacg_identities(tmp_path):
    """lambda = beta = 0 is FedAvg; lambda = 0 is FedProx with mu = beta. Exact: the
    look-ahead adds 0 * m, the momentum is 0 * m + Delta."""
    avg = run(tmp_path, "avg", algorithm="fedavg")
    assert finals_equal(avg, run(tmp_path, "a0", algorithm="fedacg", **{"fedacg.lambda": 0.0, "fedacg.beta": 0.0}))
    prox = run(tmp_path, "prox", algorithm="fedprox", **{"fedprox.mu": 0.5})
    assert finals_equal(prox, run(tmp_path, "a1", algorithm="fedacg", **{"fedacg.lambda": 0.0, "fedacg.beta": 0.5}))
    assert_differ(prox, run(tmp_path, "a2", algorithm="fedacg", **{"fedacg.lambda": 0.6, "fedacg.beta": 0.5}))


# ---------------------------------------------------------------- the baselines
def test_fedprox_mu0_equals_fedavg(tmp_path):
    """mu = 0: 0 * (w - w^t) adds zeros to the gradient. Exact."""
    a = run(tmp_path, "a", algorithm="fedavg")
    b = run(tmp_path, "b", algorithm="fedprox", **{"fedprox.mu": 0.0})
    assert finals_equal(a, b)
    assert_differ(a, run(tmp_path, "c", algorithm="fedprox", **{"fedprox.mu": 0.7}))


def test_fedgamma_rho0_equals_scaffold(tmp_path):
    """rho = 0: the SAM offset is zero and the same gradient is recomputed. Exact."""
    a = run(tmp_path, "a", algorithm="scaffold", **PARTIAL)
    b = run(tmp_path, "b", algorithm="fedgamma", **{"sam.rho": 0.0}, **PARTIAL)
    assert finals_equal(a, b)
    assert_differ(a, run(tmp_path, "c", algorithm="fedgamma", **{"sam.rho": 0.3}, **PARTIAL))


@pytest.mark.parametrize("algorithm,base,extra", [
    ("fedlesam", "fedavg", {}), ("fedlesam-d", "feddyn", {"feddyn.alpha": 0.4}),
    ("fedlesam-s", "scaffold", {})])


def test_fedlesam_rho0_equals_its_base(tmp_path, algorithm, base, extra):
    """rho = 0: zero perturbation (first rounds: none), the base algorithm exactly."""
    a = run(tmp_path, "a", algorithm=base, **extra, **PARTIAL)
    b = run(tmp_path, "b", algorithm=algorithm, **{"sam.rho": 0.0}, **extra, **PARTIAL)
    assert finals_equal(a, b)
    assert_differ(a, run(tmp_path, "c", algorithm=algorithm, **{"sam.rho": 0.3}, **extra, **PARTIAL))


def test_fedadam_and_fedyogi_differ(tmp_path):
    hp = {"fedopt.eta": 0.05, **PARTIAL}
    assert_differ(run(tmp_path, "a", algorithm="fedadam", **hp), run(tmp_path, "y", algorithm="fedyogi", **hp),
                  min_diff=1e-6)
