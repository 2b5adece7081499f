"""The ten baselines (FedProx, SCAFFOLD, FedGAMMA, FedSMOO, FedLESAM, -D, -S, FedACG, FedAdam,
FedYogi) against hand-computed references and against each other.

Same set-up and machinery as ``test_seed_algorithms.py``: the real ServerApp + ClientApps
in-process on multinomial logistic regression over seeded ``synthetic`` data, and each
pseudocode re-implemented independently in float64 numpy on flat parameter vectors (every
norm global), which must give the pipeline's final model to 1e-6. Partial participation
(``PARTIAL``: 2 of 4 clients, 3 rounds) makes client state go stale between a client's rounds.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from common import protocol as P
from common.config import ConfigError, RunConfig
from test_algorithms import run
from test_seed_algorithms import (EPS, PARTIAL, Problem, assert_client_duals, assert_differ, assert_partial,
                                  client_state, count_gradient_passes, dual_server_step, finals_equal, matches,
                                  norm)
from strategies.base import FlatStrategy


@pytest.fixture
def strategy_spy(monkeypatch):
    """Records the strategy of the last run (to read its server state)."""
    seen = {}
    original = FlatStrategy.finish_round

    def spy(self, server_round, updates):
        seen["strategy"] = self
        return original(self, server_round, updates)

    monkeypatch.setattr(FlatStrategy, "finish_round", spy)
    return seen


def server_record(seen, name: str) -> np.ndarray:
    return Problem.flat(v.double().numpy() for v in seen["strategy"].records[name].values())


# ---------------------------------------------------------------- numpy references
def local_sgd(prob, i, w, eta, direction):
    """K steps theta <- theta - eta * direction(theta) from w."""
    th = w.copy()
    for _ in range(prob.K):
        th = th - eta * direction(th)
    return th


def fedprox_reference(prob, mu):
    """FedProx (Li et al. 2020): d = g(w_k) + mu (w_k - w^t); server w <- w + eta_g u."""
    w = prob.w0.copy()
    for r, sampled in enumerate(prob.rounds):
        eta, start = prob.round_lr(r), w.copy()
        models = [local_sgd(prob, i, w, eta, lambda th, i=i: prob.g(i, th) + mu * (th - start)) for i in sampled]
        w = w + prob.server_lr * prob.mean_update(sampled, models, w)
    return w


def scaffold_reference(prob, rho=0.0, lesam_rho=None, lesam_first="none"):
    """SCAFFOLD, option II (Karimireddy et al. 2020, Alg. 1; reference-codebases notes §2):
    client  d = g(y_k) - c_i + c;  c_i+ = c_i - c + (x - y_K)/(K eta);  upload c_i+ - c_i
    server  x <- x + eta_g u;  c <- c + (M/N) sum_i p_i (c_i+ - c_i)      (c = c_i = 0 at start)
    FedGAMMA (``sam.rho``): g -> the SAM gradient g(y + rho g/||g||).
    FedLESAM-S (``lesam_rho``): g -> g(y + delta_i), delta_i from the client's previous global model.
    Returns (x, c, client c_i)."""
    w, c = prob.w0.copy(), prob.zeros()
    ci = {i: prob.zeros() for i in range(prob.N)}
    old: dict[int, np.ndarray] = {}
    for r, sampled in enumerate(prob.rounds):
        eta = prob.round_lr(r)
        models, deltas = [], []
        for i in sampled:
            if lesam_rho is not None:
                offset = lesam_offset(prob, old.get(i), w, lesam_rho, lesam_first)
                gradient = (lambda th, i=i, o=offset: prob.g(i, th + o))
                old[i] = w.copy()
            elif rho:
                gradient = (lambda th, i=i: prob.sam(i, th, rho))
            else:
                gradient = (lambda th, i=i: prob.g(i, th))
            th = local_sgd(prob, i, w, eta, lambda th, gr=gradient, i=i: gr(th) - ci[i] + c)
            new = ci[i] - c + (w - th) / (prob.K * eta)
            deltas.append(new - ci[i])
            ci[i] = new
            models.append(th)
        M = len(sampled)
        c = c + (M / prob.N) * sum(p * d for p, d in zip(prob.weights(sampled), deltas))
        w = w + prob.server_lr * prob.mean_update(sampled, models, w)
    return w, c, ci


def scaled(prob, d, rho):
    """rho d/||d||, the global L2 norm."""
    return rho * d / (norm(d) + EPS)


def lesam_offset(prob, old, w, rho, first, perturb=scaled):
    """delta = perturb(theta_old - theta^t) = rho (theta_old - theta^t)/||.||; first round:
    none -> 0, initial -> theta_old = theta^0."""
    if old is None:
        if first == "none":
            return prob.zeros()
        old = prob.w0
    return perturb(prob, old - w, rho)


def fedlesam_reference(prob, rho, base="avg", a=None, first="none", perturb=scaled):
    """FedLESAM (Fan et al. 2024; fedtoga notes §2.2): per round the client's perturbation is
    delta_i = rho (theta_i^old - theta^t)/||.||, theta_i^old the global model of its previous
    round (kept after training), one gradient per step g(theta_k + delta_i);
    base "avg": FedAvg step and server; "dyn" (FedLESAM-D, Alg. 3): FedDyn's client and server.
    ``perturb`` builds delta_i from theta_i^old - theta^t (the public codes' variants:
    test_reference_bugs). Returns (theta, client duals)."""
    w, h = prob.w0.copy(), prob.zeros()
    hc = {i: prob.zeros() for i in range(prob.N)}
    old: dict[int, np.ndarray] = {}
    for r, sampled in enumerate(prob.rounds):
        eta = prob.round_lr(r)
        models = []
        for i in sampled:
            offset = lesam_offset(prob, old.get(i), w, rho, first, perturb)
            old[i] = w.copy()
            if base == "avg":
                th = local_sgd(prob, i, w, eta, lambda th, i=i, o=offset: prob.g(i, th + o))
            else:
                th = local_sgd(prob, i, w, eta,
                               lambda th, i=i, o=offset: prob.g(i, th + o) - hc[i] + a * (th - w))
                hc[i] = hc[i] - a * (th - w)
            models.append(th)
        u = prob.mean_update(sampled, models, w)
        if base == "avg":
            w = w + prob.server_lr * u
        else:
            w, h = dual_server_step(prob, w, h, u, a, len(sampled), prob.N)
    return w, hc


def fedsmoo_reference(prob, a, rho, received=lambda v: v, keep_grad=False):
    """FedSMOO (Sun et al. 2023; FedTOGA paper Alg. 2, fedtoga notes §2.1):
    client, per step: S = g(theta_k) - mu_i - s;  sh = rho S/||S||;  mu_i <- mu_i + (sh - s);
            d = g(theta_k + sh) - h_i + a (theta_k - theta^t);  after: h_i <- h_i - a (theta_K - theta^t),
            upload s~_i = mu_i - sh_K
    server  FedDyn (divisor N), then s = rho S/||S||, S = sum_i p_i s~_i  (s^0 = 0).
    The public codes' variants (test_reference_bugs): ``received`` maps mu_i and s as a client
    reads them; ``keep_grad`` adds the previous step's d to S (gradients never zeroed).
    Returns (theta, s, client duals, client mu_i)."""
    w, h, s = prob.w0.copy(), prob.zeros(), prob.zeros()
    hc = {i: prob.zeros() for i in range(prob.N)}
    mu = {i: prob.zeros() for i in range(prob.N)}
    for r, sampled in enumerate(prob.rounds):
        eta = prob.round_lr(r)
        models, uploads = [], []
        for i in sampled:
            th, last, left = w.copy(), prob.zeros(), prob.zeros()
            mu[i], s_i = received(mu[i]), received(s)
            for _ in range(prob.K):
                corrected = prob.g(i, th) + left - mu[i] - s_i
                last = rho * corrected / (norm(corrected) + EPS)
                mu[i] = mu[i] + (last - s_i)
                d = prob.g(i, th + last) - hc[i] + a * (th - w)
                left = d if keep_grad else left
                th = th - eta * d
            hc[i] = hc[i] - a * (th - w)
            uploads.append(mu[i] - last)
            models.append(th)
        u = prob.mean_update(sampled, models, w)
        w, h = dual_server_step(prob, w, h, u, a, len(sampled), prob.N)
        mean = sum(p * x for p, x in zip(prob.weights(sampled), uploads))
        s = rho * mean / (norm(mean) + EPS)
    return w, s, hc, mu


def fedacg_reference(prob, lam, beta, shadowed=False):
    """FedACG (Kim et al. 2024, Alg. 1; fednsam notes §5): broadcast x = theta + lam m;
    client d = g(theta_k) + beta (theta_k - x) from x; server Delta = sum p_i (theta_i - x),
    m <- lam m + Delta, theta <- theta + eta_g m (m^0 = 0). ``shadowed``: from round 2,
    m <- lam Delta + Delta (FedNSAM's public server, test_reference_bugs). Returns (theta, m)."""
    w, m = prob.w0.copy(), prob.zeros()
    for r, sampled in enumerate(prob.rounds):
        eta, x = prob.round_lr(r), w + lam * m
        models = [local_sgd(prob, i, x, eta, lambda th, i=i: prob.g(i, th) + beta * (th - x)) for i in sampled]
        delta = prob.mean_update(sampled, models, x)
        m = lam * (delta if shadowed and r > 0 else m) + delta
        w = w + prob.server_lr * m
    return w, m


def fedopt_reference(prob, eta_s, b1, b2, tau, yogi=False):
    """FedAdam / FedYogi (Reddi et al. 2021, Alg. 2, no bias correction, m^0 = v^0 = 0):
    Delta = u;  m = b1 m + (1-b1) Delta;  v = b2 v + (1-b2) Delta^2  (Yogi: v - (1-b2) Delta^2
    sign(v - Delta^2));  w = w + eta m/(sqrt(v) + tau). Returns (w, m, v)."""
    w, m, v = prob.w0.copy(), prob.zeros(), prob.zeros()
    for r, sampled in enumerate(prob.rounds):
        eta = prob.round_lr(r)
        models = [local_sgd(prob, i, w, eta, lambda th, i=i: prob.g(i, th)) for i in sampled]
        d = prob.mean_update(sampled, models, w)
        m = b1 * m + (1 - b1) * d
        v = v - (1 - b2) * d * d * np.sign(v - d * d) if yogi else b2 * v + (1 - b2) * d * d
        w = w + eta_s * m / (np.sqrt(v) + tau)
    return w, m, v


def assert_state(result, prob, record, expected):
    for i in range(prob.N):
        np.testing.assert_allclose(client_state(result, i, record, prob), expected.get(i, prob.zeros()),
                                   rtol=0, atol=1e-6)


# ================================================================ FedProx
@pytest.mark.parametrize("partial", [False, True], ids=["full", "partial"])
def test_fedprox_matches_pseudocode(tmp_path, partial):
    extra = PARTIAL if partial else {"num-server-rounds": 3, "server-lr": 0.8}
    result = run(tmp_path, "fedprox", algorithm="fedprox", **{"fedprox.mu": 0.7}, **extra)
    prob = Problem(result)
    matches(result, prob, fedprox_reference(prob, mu=0.7))


def test_fedprox_mu0_equals_fedavg(tmp_path):
    """mu = 0: 0 * (w - w^t) adds zeros to the gradient. Exact."""
    a = run(tmp_path, "a", algorithm="fedavg")
    b = run(tmp_path, "b", algorithm="fedprox", **{"fedprox.mu": 0.0})
    assert finals_equal(a, b)
    assert_differ(a, run(tmp_path, "c", algorithm="fedprox", **{"fedprox.mu": 0.7}))


# ================================================================ SCAFFOLD / FedGAMMA
@pytest.mark.parametrize("algorithm,rho", [("scaffold", 0.0), ("fedgamma", 0.3)])
@pytest.mark.parametrize("partial", [False, True], ids=["full", "partial"])
def test_scaffold_family_matches_pseudocode(tmp_path, strategy_spy, algorithm, rho, partial):
    """Option II control variates, c^0 = c_i^0 = 0, server c over all N; lr decay so that
    c_i's 1/(K eta) must use the round's eta. Server c and clients' c_i checked too."""
    extra = PARTIAL if partial else {"num-server-rounds": 3, "server-lr": 0.8}
    result = run(tmp_path, algorithm, algorithm=algorithm, **{"sam.rho": rho}, **{"lr-decay": 0.8}, **extra)
    prob = Problem(result)
    if partial:
        assert_partial(prob)
    w, c, ci = scaffold_reference(prob, rho=rho)
    matches(result, prob, w)
    np.testing.assert_allclose(server_record(strategy_spy, P.CONTROL), c, rtol=0, atol=1e-6)
    assert_state(result, prob, P.CLIENT_CONTROL, ci)
    assert np.abs(c).max() > 1e-3


def test_fedgamma_rho0_equals_scaffold(tmp_path):
    """rho = 0: the SAM offset is zero and the same gradient is recomputed. Exact."""
    a = run(tmp_path, "a", algorithm="scaffold", **PARTIAL)
    b = run(tmp_path, "b", algorithm="fedgamma", **{"sam.rho": 0.0}, **PARTIAL)
    assert finals_equal(a, b)
    assert_differ(a, run(tmp_path, "c", algorithm="fedgamma", **{"sam.rho": 0.3}, **PARTIAL))


def test_scaffold_first_round_is_fedavg_and_later_rounds_are_not(tmp_path):
    """c = c_i = 0 before any round, so round 1 is FedAvg's exactly (Karimireddy et al.:
    control variates start at zero, not at the model weights)."""
    a1 = run(tmp_path, "a1", algorithm="fedavg", **{"num-server-rounds": 1})
    s1 = run(tmp_path, "s1", algorithm="scaffold", **{"num-server-rounds": 1})
    assert finals_equal(a1, s1)
    assert_differ(run(tmp_path, "a3", algorithm="fedavg", **{"num-server-rounds": 3}),
                  run(tmp_path, "s3", algorithm="scaffold", **{"num-server-rounds": 3}))


# ================================================================ FedSMOO
@pytest.mark.parametrize("partial", [False, True], ids=["full", "partial"])
def test_fedsmoo_matches_pseudocode(tmp_path, strategy_spy, partial):
    """Alg. 2: corrected perturbation, mu_i across rounds, s~_i upload, normalised s, FedDyn
    duals. Server s, clients' mu_i and h_i checked too."""
    extra = PARTIAL if partial else {"num-server-rounds": 3, "server-lr": 0.9}
    result = run(tmp_path, "fedsmoo", algorithm="fedsmoo", **{"sam.rho": 0.3}, **{"feddyn.alpha": 0.4}, **extra)
    prob = Problem(result)
    w, s, hc, mu = fedsmoo_reference(prob, a=0.4, rho=0.3)
    matches(result, prob, w)
    np.testing.assert_allclose(server_record(strategy_spy, P.GLOBAL_PERTURBATION), s, rtol=0, atol=1e-6)
    assert norm(s) == pytest.approx(0.3)
    assert_client_duals(result, prob, hc)
    assert_state(result, prob, P.PERTURBATION_DUAL, mu)


def test_fedsmoo_rho0_equals_feddyn(tmp_path):
    """rho = 0: the perturbation, s and mu_i stay zero; FedDyn exactly."""
    a = run(tmp_path, "a", algorithm="feddyn", **{"feddyn.alpha": 0.4}, **PARTIAL)
    b = run(tmp_path, "b", algorithm="fedsmoo", **{"sam.rho": 0.0}, **{"feddyn.alpha": 0.4}, **PARTIAL)
    assert finals_equal(a, b)
    assert_differ(a, run(tmp_path, "c", algorithm="fedsmoo", **{"sam.rho": 0.3}, **{"feddyn.alpha": 0.4}, **PARTIAL))


# ================================================================ FedLESAM, -D, -S
@pytest.mark.parametrize("first", ["none", "initial"])
@pytest.mark.parametrize("algorithm", ["fedlesam", "fedlesam-d", "fedlesam-s"])
def test_fedlesam_family_matches_pseudocode(tmp_path, algorithm, first):
    """Under partial participation a client's theta_i^old is the global model of ITS last
    round, not the previous round's; both readings of a first round."""
    cfg = {"algorithm": algorithm, "sam.rho": 0.3, "feddyn.alpha": 0.4, "fedlesam.first": first, **PARTIAL,
           "num-server-rounds": 4}
    result = run(tmp_path, algorithm, **cfg)
    prob = Problem(result)
    assert_partial(prob)
    if algorithm == "fedlesam-s":
        w, _, ci = scaffold_reference(prob, lesam_rho=0.3, lesam_first=first)
        assert_state(result, prob, P.CLIENT_CONTROL, ci)
    else:
        w, hc = fedlesam_reference(prob, rho=0.3, base="avg" if algorithm == "fedlesam" else "dyn", a=0.4,
                                   first=first)
        if algorithm == "fedlesam-d":
            assert_client_duals(result, prob, hc)
    matches(result, prob, w)


@pytest.mark.parametrize("algorithm,base,extra", [
    ("fedlesam", "fedavg", {}), ("fedlesam-d", "feddyn", {"feddyn.alpha": 0.4}),
    ("fedlesam-s", "scaffold", {})])
def test_fedlesam_rho0_equals_its_base(tmp_path, algorithm, base, extra):
    """rho = 0: zero perturbation (first rounds: none), the base algorithm exactly."""
    a = run(tmp_path, "a", algorithm=base, **extra, **PARTIAL)
    b = run(tmp_path, "b", algorithm=algorithm, **{"sam.rho": 0.0}, **extra, **PARTIAL)
    assert finals_equal(a, b)
    assert_differ(a, run(tmp_path, "c", algorithm=algorithm, **{"sam.rho": 0.3}, **extra, **PARTIAL))


def test_fedlesam_first_round_choice_matters_only_after_round_one(tmp_path):
    """'none' vs 'initial' differ once a client is first sampled after round 1 (theta^0 !=
    theta^t); with one round both are 'no perturbation' (theta^0 = theta^1)."""
    one = {"num-server-rounds": 1, "sam.rho": 0.3}
    assert finals_equal(run(tmp_path, "n1", algorithm="fedlesam", **one, **{"fedlesam.first": "none"}),
                        run(tmp_path, "i1", algorithm="fedlesam", **one, **{"fedlesam.first": "initial"}))
    assert_differ(run(tmp_path, "n", algorithm="fedlesam", **{"sam.rho": 0.3}, **PARTIAL, **{"fedlesam.first": "none"}),
                  run(tmp_path, "i", algorithm="fedlesam", **{"sam.rho": 0.3}, **PARTIAL, **{"fedlesam.first": "initial"}))


# ================================================================ FedACG
@pytest.mark.parametrize("partial", [False, True], ids=["full", "partial"])
def test_fedacg_matches_pseudocode(tmp_path, strategy_spy, partial):
    extra = PARTIAL if partial else {"num-server-rounds": 3, "server-lr": 0.8}
    result = run(tmp_path, "fedacg", algorithm="fedacg", **{"fedacg.lambda": 0.6, "fedacg.beta": 0.5}, **extra)
    prob = Problem(result)
    w, m = fedacg_reference(prob, lam=0.6, beta=0.5)
    matches(result, prob, w)
    np.testing.assert_allclose(server_record(strategy_spy, P.MOMENTUM), m, rtol=0, atol=1e-6)


def test_fedacg_identities(tmp_path):
    """lambda = beta = 0 is FedAvg; lambda = 0 is FedProx with mu = beta. Exact: the
    look-ahead adds 0 * m, the momentum is 0 * m + Delta."""
    avg = run(tmp_path, "avg", algorithm="fedavg")
    assert finals_equal(avg, run(tmp_path, "a0", algorithm="fedacg", **{"fedacg.lambda": 0.0, "fedacg.beta": 0.0}))
    prox = run(tmp_path, "prox", algorithm="fedprox", **{"fedprox.mu": 0.5})
    assert finals_equal(prox, run(tmp_path, "a1", algorithm="fedacg", **{"fedacg.lambda": 0.0, "fedacg.beta": 0.5}))
    assert_differ(prox, run(tmp_path, "a2", algorithm="fedacg", **{"fedacg.lambda": 0.6, "fedacg.beta": 0.5}))


# ================================================================ FedAdam / FedYogi
@pytest.mark.parametrize("algorithm", ["fedadam", "fedyogi"])
def test_fedopt_matches_pseudocode(tmp_path, strategy_spy, algorithm):
    hp = {"fedopt.eta": 0.05, "fedopt.beta1": 0.8, "fedopt.beta2": 0.95, "fedopt.tau": 0.01}
    result = run(tmp_path, algorithm, algorithm=algorithm, **hp, **PARTIAL)
    prob = Problem(result)
    w, m, v = fedopt_reference(prob, 0.05, 0.8, 0.95, 0.01, yogi=algorithm == "fedyogi")
    matches(result, prob, w)
    np.testing.assert_allclose(server_record(strategy_spy, P.ADAPTIVE_M), m, rtol=0, atol=1e-7)
    np.testing.assert_allclose(server_record(strategy_spy, P.ADAPTIVE_V), v, rtol=0, atol=1e-9)


def test_fedadam_and_fedyogi_differ(tmp_path):
    hp = {"fedopt.eta": 0.05, **PARTIAL}
    assert_differ(run(tmp_path, "a", algorithm="fedadam", **hp), run(tmp_path, "y", algorithm="fedyogi", **hp),
                  min_diff=1e-6)


@pytest.mark.parametrize("algorithm", ["fedyogi", "fedadam"])
def test_fedopt_equals_flowers_own_strategy(algorithm):
    """Fed the same three rounds of aggregated models, our server step equals Flower's
    FedYogi; and FedAdam once Flower's bias correction sqrt(1-b2^(t+1))/(1-b1^(t+1)) is
    folded into eta (Reddi et al.'s Alg. 2 has none)."""
    from flwr.app import Array, ArrayRecord
    from flwr.serverapp.strategy import FedAdam as FlowerAdam
    from flwr.serverapp.strategy import FedYogi as FlowerYogi

    from strategies.fedopt import FedAdam, FedYogi
    from strategies.validation import ClientUpdate

    rng = np.random.default_rng(0)
    model = {"w": rng.normal(size=(3, 4)).astype(np.float32), "b": rng.normal(size=4).astype(np.float32)}
    eta, b1, b2, tau = 0.05, 0.9, 0.99, 1e-3
    flower = (FlowerYogi if algorithm == "fedyogi" else FlowerAdam)(eta=eta, beta_1=b1, beta_2=b2, tau=tau)
    flower.current_arrays = {k: v.copy() for k, v in model.items()}
    for t in range(1, 4 if algorithm == "fedyogi" else 2):
        scale = np.sqrt(1 - b2 ** (t + 1)) / (1 - b1 ** (t + 1)) if algorithm == "fedadam" else 1.0
        cfg = RunConfig.from_mapping({"algorithm": algorithm, "fedopt.eta": eta * scale, "fedopt.beta1": b1,
                                      "fedopt.beta2": b2, "fedopt.tau": tau})
        if t == 1:
            ours = (FedYogi if algorithm == "fedyogi" else FedAdam)(
                cfg, {k: torch.from_numpy(v.copy()) for k, v in model.items()})
        ours.cfg = cfg
        aggregated = {k: v + rng.normal(scale=0.1, size=v.shape).astype(np.float32)
                      for k, v in flower.current_arrays.items()}
        # Flower: aggregate_train's step on an already aggregated model
        delta, m_t, _ = flower._compute_deltat_and_mt(ArrayRecord({k: Array(v) for k, v in aggregated.items()}))
        update = ClientUpdate(1, 0, 1, 1, 0.0, {k: torch.from_numpy(v.copy()) for k, v in aggregated.items()})
        ours.update(t, [update], [1.0])
        theirs = _flower_step(flower, algorithm, t, delta, m_t)
        for k in model:
            np.testing.assert_allclose(ours.model[k].numpy(), theirs[k], rtol=0, atol=1e-6)
        flower.current_arrays = theirs


def _flower_step(flower, algorithm, t, delta, m_t):
    """The second half of Flower's FedAdam/FedYogi.aggregate_train (their moment update and
    step), applied to the delta and m_t Flower computed."""
    if not flower.v_t:
        flower.v_t = {k: np.zeros_like(v) for k, v in delta.items()}
    if algorithm == "fedyogi":
        flower.v_t = {k: v - (1.0 - flower.beta_2) * delta[k] ** 2 * np.sign(v - delta[k] ** 2)
                      for k, v in flower.v_t.items()}
        eta = flower.eta
    else:
        flower.v_t = {k: flower.beta_2 * v + (1 - flower.beta_2) * delta[k] ** 2 for k, v in flower.v_t.items()}
        eta = flower.eta * np.sqrt(1 - flower.beta_2 ** (t + 1)) / (1 - flower.beta_1 ** (t + 1))
    return {k: x + eta * m_t[k] / (np.sqrt(flower.v_t[k]) + flower.tau) for k, x in flower.current_arrays.items()}


def test_fedopt_refuses_a_server_lr(tmp_path):
    with pytest.raises(ConfigError, match="server-lr=0.5 has no effect on fedyogi"):
        RunConfig.from_mapping({"algorithm": "fedyogi", "server-lr": 0.5})


# ================================================================ gradient passes per step
@pytest.mark.parametrize("algorithm,per_step", [
    ("fedprox", 1), ("scaffold", 1), ("fedgamma", 2), ("fedsmoo", 2), ("fedlesam", 1),
    ("fedlesam-d", 1), ("fedlesam-s", 1), ("fedacg", 1)])
def test_gradient_passes_per_step(tmp_path, monkeypatch, algorithm, per_step):
    """fedtoga notes §2.3 / §5: FedLESAM needs one gradient per step (its perturbation needs
    no ascent gradient), FedGAMMA and FedSMOO two. Rounds 2-3, so FedLESAM's perturbation is
    active; counted at the batch (ModelBatch._grad)."""
    calls = count_gradient_passes(monkeypatch)
    k, rounds, clients = 4, 3, 3
    run(tmp_path, algorithm, algorithm=algorithm, **{"sam.rho": 0.2}, **{"local-steps": k, "num-server-rounds": rounds})
    assert calls["n"] == rounds * clients * k * per_step
