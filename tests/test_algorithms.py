"""Every algorithm against its paper's pseudocode: the real pipeline (ServerApp + ClientApp
through the in-process grid, real partitions and wire conversions) on the tiny deterministic
problem must give the float64 numpy reference of tests/reference.py to 1e-6, with full and
partial participation; client and server state (duals, EMA models, control variates) too.
Also the gradient passes each algorithm needs per step, and the SAM machinery."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flatflower.client.batch import ModelBatch, trainable
from flatflower.client.sam import sam_gradient
from flatflower.common import protocol as P
from flatflower.common.config import ConfigError, RunConfig
from tests.helpers import (
    PARTIAL,
    TOGA,
    K,
    assert_client_duals,
    assert_close_models,
    assert_differ,
    assert_matches,
    assert_partial,
    assert_state,
    client_state,
    count_gradient_passes,
    finals_equal,
    matches,
    metrics,
    run,
    server_dual,
    server_record,
)
from flatflower.tools.cli import main as cli
from tests.reference import (
    Problem,
    fedacg_reference,
    fedasam_reference,
    fedcm_reference,
    feddyn_reference,
    fedgloss_reference,
    fedgmt_reference,
    fedlesam_reference,
    fednsam_reference,
    fedopt_reference,
    fedprox_reference,
    fedsam_family_reference,
    fedsmoo_reference,
    fedsol_reference,
    fedswa_reference,
    fedmoswa_reference,
    fedgf_reference,
    fedtoga_reference,
    fedwmsam_reference,
    norm,
    scaffold_reference,
)


# ---------------------------------------------------------------- FedAvg, FedSAM, MoFedSAM
@pytest.mark.parametrize("server_lr", [1.0, 0.5])
def test_fedavg_matches_pseudocode(tmp_path, server_lr):
    result = run(tmp_path, "fedavg", algorithm="fedavg", **{"server-lr": server_lr})
    assert_matches(result, fedsam_family_reference(result, "fedavg", server_lr=server_lr))


def test_fedsam_matches_pseudocode(tmp_path):
    result = run(tmp_path, "fedsam", algorithm="fedsam", **{"sam.rho": 0.5}, aggregation="uniform")
    assert_matches(result, fedsam_family_reference(result, "fedsam", rho=0.5, weighting="uniform"))


@pytest.mark.parametrize("step", ["delta", "literal"])
def test_mofedsam_matches_pseudocode(tmp_path, step):
    result = run(tmp_path, "mofedsam", algorithm="mofedsam", **{"sam.rho": 0.2},
                 **{"mofedsam.beta": 0.3, "fedcm.server-step": step, "server-lr": 0.8})
    assert_matches(result, fedsam_family_reference(result, "mofedsam", rho=0.2, beta=0.3, server_lr=0.8, step=step))


# ---------------------------------------------------------------- FedCM
# ================================================================ 1. FedCM
@pytest.mark.parametrize("step", ["delta", "literal"])
def test_fedcm_matches_pseudocode(tmp_path, step):
    """FedCM client mixing and server Delta in gradient units (MoFedSAM notes §1.3, §6 A1-A2),
    with a decaying lr so Delta's 1/(eta_r K) must use the round's eta."""
    cfg = {"algorithm": "fedcm", "fedcm.alpha": 0.3, "fedcm.server-step": step,
           "server-lr": 0.8, "lr-decay": 0.7, "num-server-rounds": 3}
    result = run(tmp_path, "fedcm", **cfg)
    prob = Problem(result)
    matches(result, prob, fedcm_reference(prob, alpha=0.3, server_step=step))


def test_fedcm_partial_participation_matches_pseudocode(tmp_path):
    """FedCM with 2 of 4 clients per round: p_i over the M clients that trained."""
    result = run(tmp_path, "fedcm", **{**PARTIAL, "algorithm": "fedcm", "fedcm.alpha": 0.4})
    prob = Problem(result)
    assert_partial(prob)
    matches(result, prob, fedcm_reference(prob, alpha=0.4, server_step="delta"))


# ---------------------------------------------------------------- FedDyn
# ================================================================ 2. FedDyn
@pytest.mark.parametrize("aggregation", ["weighted", "uniform"])
def test_feddyn_matches_pseudocode(tmp_path, server_spy, aggregation):
    """FedDyn, full participation, non-default a and server lr: model, server dual h and the
    clients' duals h_i (read from the nodes' context.state) all match."""
    cfg = {"algorithm": "feddyn", "feddyn.alpha": 0.3, "server-lr": 0.7, "aggregation": aggregation,
           "num-server-rounds": 3}
    result = run(tmp_path, "feddyn", **cfg)
    prob = Problem(result)
    w, h, hc = feddyn_reference(prob, a=0.3)
    matches(result, prob, w)
    np.testing.assert_allclose(server_dual(server_spy), h, rtol=0, atol=1e-6)
    assert_client_duals(result, prob, hc)


def test_feddyn_partial_participation_matches_pseudocode(tmp_path, server_spy):
    """FedDyn with 2 of 4 clients: the server dual step is a (M/N) u (divisor N = 4, so the
    1/N of FedDyn's h^{t+1} = h^t - (a/N) sum_{i in S}(theta_i - theta^t) when uniform); clients
    that sit a round out keep h_i, and a client's h_i carries over to its next round."""
    result = run(tmp_path, "feddyn", **{**PARTIAL, "algorithm": "feddyn", "feddyn.alpha": 0.4})
    prob = Problem(result)
    assert_partial(prob)
    w, h, hc = feddyn_reference(prob, a=0.4)
    matches(result, prob, w)
    np.testing.assert_allclose(server_dual(server_spy), h, rtol=0, atol=1e-6)
    assert_client_duals(result, prob, hc)


def test_feddyn_server_dual_telescopes(tmp_path, server_spy):
    """FedDyn server rule, full participation, uniform weights (M = N): h^R = -a sum_r u_r, and
    theta^{t+1} = theta^t + u_t - h^{t+1}/a = theta^t + u_t + sum_{s<=t} u_s (fedtoga notes §1.5,
    'unrolled form'). u_r are recomputed here from the raw client models the server received.
    atol 1e-6: float32 accumulation vs a float64 sum."""
    a = 0.3
    result = run(tmp_path, "feddyn", algorithm="feddyn", aggregation="uniform",
                 **{"feddyn.alpha": a, "num-server-rounds": 3})
    us = server_spy["u_uniform"]
    assert len(us) == 3 and server_spy["M"] == [3, 3, 3]
    np.testing.assert_allclose(server_dual(server_spy), -a * sum(us), rtol=0, atol=1e-6)
    theta = Problem.flat(v.double().numpy() for v in result["init"].values())
    for t, u in enumerate(us):
        theta = theta + u + sum(us[: t + 1])
    got = Problem.flat(v.double().numpy() for v in result["final"].values())
    np.testing.assert_allclose(got, theta, rtol=0, atol=1e-6)
    # and the server dual is the mean of the clients' duals (h = (1/N) sum_i h_i)
    prob = Problem(result)
    mean_client = sum(client_state(result, i, P.DUAL, prob) for i in range(prob.N)) / prob.N
    np.testing.assert_allclose(server_dual(server_spy), mean_client, rtol=0, atol=1e-6)


def test_feddyn_server_dual_is_mean_of_all_client_duals_under_partial_participation(tmp_path, server_spy):
    """With divisor N and uniform p_i, h = -(a/N) sum_r sum_{i in S_r}(theta_i - theta^r)
    = (1/N) sum_{all i} h_i, never-sampled clients counting as 0 (fedtoga notes §1.5,
    fedgmt notes §1 'in the analysis u^t = (1/M) sum_m u_m^t')."""
    result = run(tmp_path, "feddyn", **{**PARTIAL, "algorithm": "feddyn", "feddyn.alpha": 0.4,
                                        "aggregation": "uniform"})
    prob = Problem(result)
    assert_partial(prob)
    mean_client = sum(client_state(result, i, P.DUAL, prob) for i in range(prob.N)) / prob.N
    assert np.abs(mean_client).max() > 1e-3
    np.testing.assert_allclose(server_dual(server_spy), mean_client, rtol=0, atol=1e-6)


# ---------------------------------------------------------------- FedSpeed
# ================================================================ 3. FedSpeed
def test_fedspeed_matches_pseudocode(tmp_path, server_spy):
    """FedSpeed = FedDyn around the local SAM gradient g~ (FedSpeed as in FL-Simulator)."""
    result = run(tmp_path, "fedspeed", algorithm="fedspeed", **{"sam.rho": 0.3},
                 **{"feddyn.alpha": 0.3, "server-lr": 0.9})
    prob = Problem(result)
    w, h, hc = feddyn_reference(prob, a=0.3, rho=0.3)
    matches(result, prob, w)
    np.testing.assert_allclose(server_dual(server_spy), h, rtol=0, atol=1e-6)
    assert_client_duals(result, prob, hc)


def test_fedspeed_partial_participation_matches_pseudocode(tmp_path, server_spy):
    result = run(tmp_path, "fedspeed", **{**PARTIAL, "algorithm": "fedspeed", "sam.rho": 0.3,
                                          "feddyn.alpha": 0.4})
    prob = Problem(result)
    assert_partial(prob)
    w, h, hc = feddyn_reference(prob, a=0.4, rho=0.3)
    matches(result, prob, w)
    np.testing.assert_allclose(server_dual(server_spy), h, rtol=0, atol=1e-6)
    assert_client_duals(result, prob, hc)


def test_fedspeed_alpha_is_the_papers_merged_gradient(tmp_path, server_spy):
    """fedspeed-alpha < 1: FedSpeed Alg. 1's quasi-gradient (1 - alpha) g + alpha g~ in the
    FedDyn step, against the hand computation."""
    result = run(tmp_path, "fedspeed", **{**PARTIAL, "algorithm": "fedspeed", "sam.rho": 0.3,
                                          "feddyn.alpha": 0.4, "fedspeed.alpha": 0.4})
    prob = Problem(result)
    w, h, hc = feddyn_reference(prob, a=0.4, rho=0.3, alpha=0.4)
    matches(result, prob, w)
    np.testing.assert_allclose(server_dual(server_spy), h, rtol=0, atol=1e-6)
    assert_client_duals(result, prob, hc)


# ---------------------------------------------------------------- FedGMT, FedGMT-v2
# ================================================================ 4. FedGMT
@pytest.mark.parametrize("partial", [False, True], ids=["full", "partial"])
def test_fedgmt_matches_pseudocode(tmp_path, server_spy, partial):
    """FedGMT Alg. 1 (fedgmt notes §2.1-2.2): CE + gamma tau^2 KL to the server's EMA, linear
    dual term, no prox; server FedDyn with a = 1/beta over all N clients; then the EMA."""
    hp = {"fedgmt.beta": 2.0, "fedgmt.gamma": 0.7, "fedgmt.tau": 2.0, "fedgmt.alpha": 0.6}
    extra = PARTIAL if partial else {"num-server-rounds": 3, "server-lr": 0.8}
    result = run(tmp_path, "fedgmt", algorithm="fedgmt", **hp, **extra)
    prob = Problem(result)
    if partial:
        assert_partial(prob)
    w, h, hc, _ = fedgmt_reference(prob, beta=2.0, gamma=0.7, tau=2.0, alpha=0.6)
    matches(result, prob, w)
    np.testing.assert_allclose(server_dual(server_spy), h, rtol=0, atol=1e-6)
    assert_client_duals(result, prob, hc)
    # the KL term is not vacuous: the same run with gamma = 0 in the reference is far off
    w0, *_ = fedgmt_reference(prob, beta=2.0, gamma=0.0, tau=2.0, alpha=0.6)
    assert np.abs(w0 - w).max() > 1e-4


def test_fedgmt_server_ema(tmp_path, server_spy):
    """e^{t+1} = alpha e^t + (1-alpha) theta^{t+1}, e^0 = theta^0 (fedgmt notes eq. 6, Alg. 1
    line 18): after R rounds e = alpha^R theta^0 + sum_t (1-alpha) alpha^(R-t) theta^t."""
    alpha = 0.6
    result = run(tmp_path, "fedgmt", algorithm="fedgmt",
                 **{"fedgmt.beta": 2.0, "fedgmt.gamma": 0.7, "fedgmt.tau": 2.0, "fedgmt.alpha": alpha})
    prob = Problem(result)
    ema = server_spy["rule"].records[P.EMA_MODEL]  # before the next run replaces the spy's strategy
    got = Problem.flat(v.double().numpy() for v in ema.values())
    # theta^1 is the one-round run's final model (same seed, same sampling)
    one = run(tmp_path, "one", algorithm="fedgmt",
              **{"fedgmt.beta": 2.0, "fedgmt.gamma": 0.7, "fedgmt.tau": 2.0, "fedgmt.alpha": alpha,
                 "num-server-rounds": 1})
    theta1 = Problem.flat(v.double().numpy() for v in one["final"].values())
    theta2 = Problem.flat(v.double().numpy() for v in result["final"].values())
    expected = alpha ** 2 * prob.w0 + (1 - alpha) * alpha * theta1 + (1 - alpha) * theta2
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6)

# ================================================================ 5. FedGMT-v2
@pytest.mark.parametrize("init", ["initial", "global"])
def test_fedgmt_v2_matches_pseudocode_partial(tmp_path, server_spy, init):
    """FedGMT-v2 (fedgmt notes §2.3): each client folds theta^t into its own EMA e_m on the
    rounds it takes part (e_m before its first round: theta^0 or theta^t), distils from it;
    no server EMA. Partial participation so that e_m goes stale between a client's rounds,
    and clients first sampled in a later round start from theta^0 ("initial") or from that
    round's theta^t ("global"). The clients' stored e_m are checked too."""
    hp = {"fedgmt.beta": 2.0, "fedgmt.gamma": 0.7, "fedgmt.tau": 2.0, "fedgmt-v2.alpha": 0.4,
          "fedgmt-v2.init": init}
    result = run(tmp_path, "v2", algorithm="fedgmt-v2", **hp, **PARTIAL)
    prob = Problem(result)
    assert_partial(prob)
    w, h, hc, emas = fedgmt_reference(prob, beta=2.0, gamma=0.7, tau=2.0, v2_alpha=0.4, v2_init=init)
    matches(result, prob, w)
    np.testing.assert_allclose(server_dual(server_spy), h, rtol=0, atol=1e-6)
    assert_client_duals(result, prob, hc)
    for i in range(prob.N):  # the stored client EMAs
        expected = emas.get(i, prob.zeros())
        np.testing.assert_allclose(client_state(result, i, P.CLIENT_EMA, prob), expected, rtol=0, atol=1e-6)


# ---------------------------------------------------------------- FedNSAM
# ================================================================ 6. FedNSAM
@pytest.mark.parametrize("partial", [False, True], ids=["full", "partial"])
def test_fednsam_matches_pseudocode(tmp_path, partial):
    """FedNSAM (fednsam notes §1.3): one gradient per step at theta_k + lam m - rho m/||m||,
    server momentum m <- lam m + u, theta <- theta + eta_g m; 3 rounds so the offset is
    non-zero in two of them."""
    hp = {"algorithm": "fednsam", "fednsam.lambda": 0.6, "sam.rho": 0.15}
    extra = PARTIAL if partial else {"num-server-rounds": 3, "server-lr": 0.8, "aggregation": "uniform"}
    result = run(tmp_path, "fednsam", **hp, **extra)
    prob = Problem(result)
    matches(result, prob, fednsam_reference(prob, lam=0.6, rho=0.15))


# ---------------------------------------------------------------- FedTOGA
# ================================================================ 7. FedTOGA


@pytest.mark.parametrize("perturbation,prox_scale,divisor,delta_scale,partial", [
    ("G", "multiplier", "M", "literal", False),
    ("G", "multiplier", "M", "literal", True),
    ("N", "literal", "N", "per-lr", True),
    ("fusion", "multiplier", "M", "per-lr", True),
    ("N", "multiplier", "N", "literal", False),
])


def test_fedtoga_matches_pseudocode(tmp_path, server_spy, perturbation, prox_scale, divisor,
                                    delta_scale, partial):
    """FedTOGA (fedtoga notes §1.3 per-step terms, §1.4 perturbation variants, §1.5 server,
    §1.10 pseudocode with its switches), with lr decay so that 'per-lr' divides by the
    round's eta."""
    cfg = {"algorithm": "fedtoga", **TOGA, "fedtoga.perturbation": perturbation,
           "fedtoga.prox-scale": prox_scale, "fedtoga.dual-divisor": divisor,
           "fedtoga.delta-scale": delta_scale, "lr-decay": 0.8,
           **(PARTIAL if partial else {"num-server-rounds": 3, "server-lr": 0.9})}
    result = run(tmp_path, "fedtoga", **cfg)
    prob = Problem(result)
    if partial:
        assert_partial(prob)
    w, h, hc = fedtoga_reference(prob, alpha=0.3, kappa=0.7, beta=0.4, rho=0.2, prox_scale=prox_scale,
                                 perturbation=perturbation, dual_divisor=divisor,
                                 delta_scale=delta_scale)
    matches(result, prob, w)
    np.testing.assert_allclose(server_dual(server_spy), h, rtol=0, atol=1e-6)
    assert_client_duals(result, prob, hc)


def test_fedtoga_global_update_broadcast(tmp_path, server_spy):
    """The Delta the server keeps (and broadcasts next round) is -sum_i p_i(theta_i - theta^t)/K
    of the last round ('literal' scale, fedtoga notes §1.5)."""
    run(tmp_path, "fedtoga", algorithm="fedtoga", aggregation="uniform", **TOGA)
    delta = Problem.flat(v.double().numpy() for v in server_spy["rule"].records[P.GLOBAL_UPDATE].values())
    np.testing.assert_allclose(delta, -server_spy["u_uniform"][-1] / K, rtol=0, atol=1e-6)
    assert np.abs(delta).max() > 1e-4


# ================================================================ FedSOL
@pytest.mark.parametrize("mode", ["adaptive", "fixed"])
@pytest.mark.parametrize("partial", [False, True], ids=["full", "partial"])
def test_fedsol_matches_pseudocode(tmp_path, mode, partial):
    extra = PARTIAL if partial else {"num-server-rounds": 3, "server-lr": 0.8}
    result = run(tmp_path, "fedsol", algorithm="fedsol",
                 **{"fedsol.rho": 0.5, "fedsol.tau": 2.0, "fedsol.mode": mode}, **extra)
    prob = Problem(result)
    matches(result, prob, fedsol_reference(prob, rho=0.5, tau=2.0, mode=mode))


def test_fedsol_identities(tmp_path):
    """fedsol notes §3: rho = 0 is FedAvg, and so is one local step (eps = 0 while the model is
    the received one, in both modes), bit for bit; with more steps the modes differ."""
    one = {**PARTIAL, "local-steps": 1}
    fedavg = run(tmp_path, "avg", algorithm="fedavg", **PARTIAL)
    assert finals_equal(run(tmp_path, "rho0", algorithm="fedsol", **{"fedsol.rho": 0.0}, **PARTIAL), fedavg)
    for mode in ("adaptive", "fixed"):
        assert finals_equal(run(tmp_path, f"k1-{mode}", algorithm="fedsol", **{"fedsol.mode": mode}, **one),
                            run(tmp_path, f"avg1-{mode}", algorithm="fedavg", **one))
    adaptive = run(tmp_path, "adaptive", algorithm="fedsol", **PARTIAL)
    assert_differ(adaptive, fedavg)
    assert_differ(run(tmp_path, "fixed", algorithm="fedsol", **{"fedsol.mode": "fixed"}, **PARTIAL), adaptive)


# ================================================================ FedGloSS
@pytest.mark.parametrize("dual", ["NM", "N"])
@pytest.mark.parametrize("partial", [False, True], ids=["full", "partial"])
def test_fedgloss_matches_pseudocode(tmp_path, strategy_spy, dual, partial):
    """Server SAM from the last pseudo-gradient, the clients' FedDyn steps anchored at the
    perturbed model, both dual divisors; the model, the server dual and every client dual."""
    extra = {**PARTIAL, "server-lr": 0.8} if partial else {"num-server-rounds": 3}
    keys = {"fedgloss.beta": 2.0, "sam.rho": 0.2, "fedgloss.rho-server": 0.3, "fedgloss.dual": dual}
    result = run(tmp_path, "fedgloss", algorithm="fedgloss", **keys, **extra)
    prob = Problem(result)
    if partial:
        assert_partial(prob)
    w, sigma, duals = fedgloss_reference(prob, beta=2.0, rho_l=0.2, rho_s=0.3, dual=dual)
    matches(result, prob, w)
    np.testing.assert_allclose(server_record(strategy_spy, P.DUAL), sigma, rtol=0, atol=1e-6)
    assert_client_duals(result, prob, duals)


# the warm-up's radii by hand (fedgloss notes §2.1 item 4, A4): T_s = 4, rho0 = 0.01, rho_l = 0.2,
# rho_s = 0.3, rounds 1..6; the code's server radius is rho_l + (rho_s - rho0)/T_s = 0.2725 in it
GLOSS_WARMUP = {"linear": ([0.01, 0.0575, 0.105, 0.1525, 0.2, 0.2], [0.01, 0.0825, 0.155, 0.2275, 0.3, 0.3]),
                "code": ([0.01, 0.0575, 0.105, 0.1525, 0.2, 0.2], [0.01, 0.2725, 0.2725, 0.2725, 0.2725, 0.3])}


@pytest.mark.parametrize("warmup", ["linear", "code"])
def test_fedgloss_warmup_matches_its_schedule(tmp_path, warmup):
    """Both radii follow the warm-up by hand, the server's start point and the clients' SAM
    radius (sent as ``local-radius``) included: the model after 6 rounds is the reference's."""
    keys = {"fedgloss.beta": 2.0, "sam.rho": 0.2, "fedgloss.rho-server": 0.3, "fedgloss.warmup-rounds": 4,
            "fedgloss.rho0": 0.01, "fedgloss.warmup": warmup}
    params = RunConfig.from_mapping({"algorithm": "fedgloss", **keys}).params
    local, server = zip(*(params.radii(r) for r in range(1, 7)))
    np.testing.assert_allclose(local, GLOSS_WARMUP[warmup][0], rtol=1e-12)
    np.testing.assert_allclose(server, GLOSS_WARMUP[warmup][1], rtol=1e-12)
    result = run(tmp_path, "warm", algorithm="fedgloss", **keys, **{**PARTIAL, "num-server-rounds": 6})
    prob = Problem(result)
    w, _, _ = fedgloss_reference(prob, beta=2.0, rho_l=0.2, rho_s=0.3,
                                 schedule=lambda r: (GLOSS_WARMUP[warmup][0][r], GLOSS_WARMUP[warmup][1][r]))
    matches(result, prob, w)


def test_fedgloss_identities(tmp_path):
    """fedgloss notes §4: rho_s = 0, rho_l = 0, the paper's divisor N, eta_g = 1 and uniform
    weights is FedDyn with a = 1/beta; the server perturbation changes the model."""
    keys = {**PARTIAL, "aggregation": "uniform"}
    plain = run(tmp_path, "gloss0", algorithm="fedgloss", **keys, **{
        "fedgloss.beta": 4.0, "sam.rho": 0.0, "fedgloss.rho-server": 0.0, "fedgloss.dual": "N"})
    assert_close_models(plain, run(tmp_path, "dyn", algorithm="feddyn", **keys, **{"feddyn.alpha": 0.25}))
    assert_differ(run(tmp_path, "gloss", algorithm="fedgloss", **keys, **{
        "fedgloss.beta": 4.0, "sam.rho": 0.0, "fedgloss.rho-server": 0.3, "fedgloss.dual": "N"}), plain)


def test_fedgloss_without_admm_or_server_radius_is_fedavg_or_fedsam_with_the_server_lr(tmp_path):
    """fedgloss notes §4 (issue 27): rho_s = 0 and no ADMM terms (``fedgloss.admm = false``, the
    limit beta -> inf) is FedAvg with server lr eta_g (rho_l = 0), or FedSAM with it (rho_l > 0);
    with the ADMM terms (any beta) it is not."""
    keys = {**PARTIAL, "server-lr": 0.7}
    gloss = {"fedgloss.rho-server": 0.0, "fedgloss.admm": False, "fedgloss.beta": 4.0}
    assert finals_equal(run(tmp_path, "gloss-avg", algorithm="fedgloss", **keys, **gloss, **{"sam.rho": 0.0}),
                        run(tmp_path, "avg", algorithm="fedavg", **keys))
    sam = run(tmp_path, "gloss-sam", algorithm="fedgloss", **keys, **gloss, **{"sam.rho": 0.05})
    assert finals_equal(sam, run(tmp_path, "sam", algorithm="fedsam", **keys, **{"sam.rho": 0.05}))
    assert_differ(run(tmp_path, "gloss-admm", algorithm="fedgloss", **keys, **{
        **gloss, "fedgloss.admm": True, "sam.rho": 0.05}), sam)


# ================================================================ FedSWA, FedMoSWA
@pytest.mark.parametrize("partial", [False, True], ids=["full", "partial"])
def test_fedswa_matches_pseudocode(tmp_path, partial):
    """The in-round lr eta_k = eta (1 - k/K + rho k/K) is SGD's lr: with momentum and weight
    decay the steps are torch.optim.SGD's at eta_k; the server step alpha = server-lr."""
    extra = PARTIAL if partial else {"num-server-rounds": 3}
    sgd = {"momentum": 0.5, "weight-decay": 0.01} if partial else {}
    result = run(tmp_path, "fedswa", algorithm="fedswa", **{"fedswa.lr-ratio": 0.2, "server-lr": 1.5,
                                                           "local-steps": 4}, **sgd, **extra)
    prob = Problem(result)
    matches(result, prob, fedswa_reference(prob, ratio=0.2, momentum=sgd.get("momentum", 0.0),
                                           wd=sgd.get("weight-decay", 0.0)))


def test_fedswa_ratio_1_is_fedavg_and_the_schedule_changes_the_model(tmp_path):
    keys = {**PARTIAL, "server-lr": 1.5}
    assert finals_equal(run(tmp_path, "swa1", algorithm="fedswa", **{"fedswa.lr-ratio": 1.0}, **keys),
                        run(tmp_path, "avg", algorithm="fedavg", **keys))
    assert_differ(run(tmp_path, "swa", algorithm="fedswa", **keys), run(tmp_path, "avg2", algorithm="fedavg", **keys))


@pytest.mark.parametrize("first,normaliser", [("full", "sum"), ("gamma", "mean")])
def test_fedmoswa_matches_pseudocode(tmp_path, strategy_spy, first, normaliser):
    """Partial participation, so c_i persists per client and m moves with gamma: the model,
    the server's m and every client's c_i."""
    keys = {"fedswa.lr-ratio": 0.3, "fedmoswa.gamma": 0.4, "fedmoswa.first": first,
            "fedmoswa.normaliser": normaliser, "server-lr": 1.2}
    result = run(tmp_path, "fedmoswa", algorithm="fedmoswa", **keys, **PARTIAL)
    prob = Problem(result)
    assert_partial(prob)
    w, m, ci = fedmoswa_reference(prob, ratio=0.3, gamma=0.4, first=first, normaliser=normaliser)
    matches(result, prob, w)
    np.testing.assert_allclose(server_record(strategy_spy, P.MOMENTUM_CONTROL), m, rtol=0, atol=1e-6)
    assert_state(result, prob, P.CLIENT_CONTROL, ci)


def test_fedmoswa_with_a_constant_lr_and_gamma_1_is_scaffold_at_full_participation(tmp_path):
    """fedswa notes §4: rho = 1, gamma = 1, every client every round: m stays the mean of the
    c_i, as SCAFFOLD's c (to rounding: the two servers compute it differently)."""
    keys = {"num-server-rounds": 3, "local-steps": 4}
    moswa = run(tmp_path, "moswa", algorithm="fedmoswa", **{"fedswa.lr-ratio": 1.0, "fedmoswa.gamma": 1.0}, **keys)
    assert_close_models(moswa, run(tmp_path, "scaffold", algorithm="scaffold", **keys))
    assert_differ(run(tmp_path, "moswa-g", algorithm="fedmoswa", **{"fedswa.lr-ratio": 1.0}, **keys), moswa)


# ================================================================ FedGF
GF = {"sam.rho": 0.2, "fedgf.window": 2, "lr": 0.3}
GF_ROUNDS = {**PARTIAL, "num-server-rounds": 5}


def gf_threshold(prob, rho_g) -> float:
    """A T_D between the reference's divergences, so c takes a fraction of 1 (window 2), and
    far (5%) from every D the reference meets with it: the decisions cannot flip on rounding."""
    _, ds, _ = fedgf_reference(prob, 0.2, rho_g, float("inf"), 2)
    for t in sorted(ds)[1:-1] + [float(np.mean(ds))]:
        t *= 1.001
        _, got, cs = fedgf_reference(prob, 0.2, rho_g, t, 2)
        if any(0 < c < 1 for c in cs) and all(abs(d - t) > 0.05 * t for d in got):
            return t
    raise AssertionError(f"no usable threshold among the divergences {ds}")


@pytest.mark.parametrize("rho_global", [-1.0, 0.5])
def test_fedgf_matches_pseudocode(tmp_path, rho_global):
    """The perturbed global model and c (window 2, a T_D that the divergences cross both
    ways) at partial participation: the final model, and each round's D and c in
    metrics.jsonl (fedgf_divergence, fedgf_mix); rho_g = -1 follows sam.rho."""
    rho_g = 0.2 if rho_global == -1 else rho_global
    keys = {**GF, **GF_ROUNDS, "fedgf.rho-global": rho_global}
    probe = Problem(run(tmp_path, "probe", algorithm="fedgf", **keys, **{"fedgf.threshold": float("inf")}))
    threshold = gf_threshold(probe, rho_g)
    result = run(tmp_path, "fedgf", algorithm="fedgf", **keys, **{"fedgf.threshold": threshold})
    prob = Problem(result)
    assert_partial(prob)
    w, ds, cs = fedgf_reference(prob, 0.2, rho_g, threshold, 2)
    matches(result, prob, w)
    np.testing.assert_allclose([r["fedgf_divergence"] for r in result["rows"]], ds, rtol=1e-6)
    assert [r["fedgf_mix"] for r in result["rows"]] == cs
    assert 0 < min(c for c in cs if c > 0) < 1  # the blend, not just FedSAM or w~ alone


def test_fedgf_thresholds_inf_and_negative(tmp_path):
    """fedgf notes §4: T_D = inf is FedSAM bit for bit (c = 0 every round); T_D < 0 makes
    c = 1 from round 2 (every step's gradient at w~), the reference's too."""
    keys = {**GF, **GF_ROUNDS}
    never = run(tmp_path, "inf", algorithm="fedgf", **keys, **{"fedgf.threshold": float("inf")})
    assert finals_equal(never, run(tmp_path, "fedsam", algorithm="fedsam", **keys))
    assert {r["fedgf_mix"] for r in never["rows"]} == {0.0}
    always = run(tmp_path, "neg", algorithm="fedgf", **keys, **{"fedgf.threshold": -1.0})
    prob = Problem(always)
    assert [r["fedgf_mix"] for r in always["rows"]] == [1.0] * 5
    matches(always, prob, fedgf_reference(prob, 0.2, 0.2, -1.0, 2)[0])
    assert_differ(always, never)


def test_fedgf_threshold_is_required():
    """No silent default for T_D (fedgf notes B1): a run without it is refused with what to
    do; other algorithms' configs stay valid with its placeholder."""
    with pytest.raises(ConfigError, match="fedgf.threshold is required and has no default.*fedgf_divergence"):
        RunConfig.from_mapping({"algorithm": "fedgf"})
    for unset in ("", "nan"):  # pyproject.toml's placeholder, and NaN
        with pytest.raises(ConfigError, match="fedgf.threshold is required"):
            RunConfig.from_mapping({"algorithm": "fedgf", "fedgf.threshold": unset})
    with pytest.raises(ConfigError, match="fedgf.threshold=.* is not a valid float"):
        RunConfig.from_mapping({"algorithm": "fedgf", "fedgf.threshold": "high"})
    assert RunConfig.from_mapping({"algorithm": "fedgf", "fedgf.threshold": "inf"}).params.threshold == float("inf")
    assert RunConfig.from_mapping({"algorithm": "fedsam", "fedgf.threshold": ""}).algorithm == "fedsam"


# ================================================================ FedWMSAM
WM = {"sam.rho": 0.3, "fedwmsam.alpha0": 0.4, "fedwmsam.lambda": 0.3, "lr-decay": 0.9, "server-lr": 1.1}


@pytest.mark.parametrize("perturbation,correction", [("paper", True), ("code-sign", True),
                                                     ("code-literal", True), ("paper", False)])
def test_fedwmsam_matches_pseudocode(tmp_path, strategy_spy, perturbation, correction):
    """Partial participation and a decaying lr: the model, the server's m and c, every
    client's c_k and each round's alpha (fedwmsam_alpha), for each perturbation reading and
    without the correction."""
    keys = {**WM, "fedwmsam.perturbation": perturbation, "fedwmsam.correction": correction}
    result = run(tmp_path, "fedwmsam", algorithm="fedwmsam", **keys, **{**PARTIAL, "num-server-rounds": 4})
    prob = Problem(result)
    assert_partial(prob)
    w, m, c, ck, alphas = fedwmsam_reference(prob, rho=0.3, alpha0=0.4, lam=0.3, perturbation=perturbation,
                                             correction=correction)
    matches(result, prob, w)
    np.testing.assert_allclose(server_record(strategy_spy, P.GLOBAL_UPDATE), m, rtol=0, atol=1e-6)
    np.testing.assert_allclose(server_record(strategy_spy, P.CONTROL), c, rtol=0, atol=1e-6)
    assert_state(result, prob, P.CLIENT_CONTROL, ck)
    np.testing.assert_allclose([r["fedwmsam_alpha"] for r in result["rows"]], alphas, rtol=1e-9)
    assert len(set(np.round(alphas, 9))) == len(alphas)  # alpha moves every round
    assert (np.abs(c).max() > 1e-3) == correction


def test_fedwmsam_identities(tmp_path):
    """fedwmsam notes §4: rho = 0, alpha0 = 1, lambda = 0 is SCAFFOLD (option II, c over all
    N); rho = 0, lambda = 0 without the correction is FedCM with alpha = alpha0 and the delta
    server step (to rounding: the servers compute c and m differently)."""
    keys = {**PARTIAL, "lr-decay": 1.0}
    scaffold = run(tmp_path, "scaffold", algorithm="scaffold", **keys)
    assert_close_models(run(tmp_path, "wm-scaffold", algorithm="fedwmsam", **keys, **{
        "sam.rho": 0.0, "fedwmsam.alpha0": 1.0, "fedwmsam.lambda": 0.0}), scaffold)
    fedcm = run(tmp_path, "fedcm", algorithm="fedcm", **keys, **{"fedcm.alpha": 0.4})
    assert_close_models(run(tmp_path, "wm-fedcm", algorithm="fedwmsam", **keys, **{
        "sam.rho": 0.0, "fedwmsam.alpha0": 0.4, "fedwmsam.lambda": 0.0, "fedwmsam.correction": False}), fedcm)
    assert_differ(fedcm, scaffold)
    with pytest.raises(ConfigError, match="fedwmsam.alpha0 = 1 needs sam.rho = 0"):
        RunConfig.from_mapping({"algorithm": "fedwmsam", "fedwmsam.alpha0": 1.0, "sam.rho": 0.01})


@pytest.mark.parametrize("algorithm,keys", [
    ("fedgf", {**GF, "fedgf.threshold": 0.0}), ("fedwmsam", WM),
    ("fedgloss", {"fedgloss.warmup-rounds": 3, "sam.rho": 0.2, "fedgloss.rho-server": 0.3})])
@pytest.mark.slow
def test_a_stopped_and_resumed_run_keeps_the_servers_scalars(tmp_path, algorithm, keys):
    """FedGF's window and w~, FedWMSAM's alpha (server records) and FedGloSS's warm-up (the
    round being played) survive a stop after round 2 (`flatflower simulate --resume`, which
    also restores the clients' state): the model and the rule columns of the uninterrupted run."""
    sets = [x for k, v in keys.items() for x in ("--set", f"{k}={v}")]
    common = ["simulate", "--engine", "inprocess", "-a", algorithm, "-n", "4", "--fraction", "0.5",
              "--dataset", "synthetic", "--seed", "3", *sets]
    assert cli([*common, "-r", "4", "--run-dir", str(tmp_path / "whole")]) == 0
    assert cli([*common, "-r", "2", "--run-dir", str(tmp_path / "cut")]) == 0
    assert cli(["simulate", "--engine", "inprocess", "--resume", str(tmp_path / "cut"), "--rounds", "4",
                "-n", "4"]) == 0
    whole, cut = (torch.load(tmp_path / d / "model_final.pt") for d in ("whole", "cut"))
    assert all(torch.equal(whole[k], cut[k]) for k in whole)
    rows = [metrics(tmp_path / d)[1:] for d in ("whole", "cut")]
    columns = [k for k in rows[0][-1] if k.startswith(algorithm + "_")]
    assert all(r["clients_failed"] == 0 for r in rows[1])
    assert [[r.get(k) for k in columns] for r in rows[1]] == [[r.get(k) for k in columns] for r in rows[0]]


# ---------------------------------------------------------------- FedProx, SCAFFOLD, FedGAMMA
# ================================================================ FedProx
@pytest.mark.parametrize("partial", [False, True], ids=["full", "partial"])
def test_fedprox_matches_pseudocode(tmp_path, partial):
    extra = PARTIAL if partial else {"num-server-rounds": 3, "server-lr": 0.8}
    result = run(tmp_path, "fedprox", algorithm="fedprox", **{"fedprox.mu": 0.7}, **extra)
    prob = Problem(result)
    matches(result, prob, fedprox_reference(prob, mu=0.7))

# ================================================================ FedASAM
@pytest.mark.parametrize("partial", [False, True], ids=["full", "partial"])
def test_fedasam_matches_pseudocode(tmp_path, partial):
    extra = PARTIAL if partial else {"num-server-rounds": 3}
    result = run(tmp_path, "fedasam", algorithm="fedasam", **{"sam.rho": 0.3, "fedasam.eta": 0.05}, **extra)
    prob = Problem(result)
    matches(result, prob, fedasam_reference(prob, rho=0.3, eta=0.05))


def test_fedasam_rho0_equals_fedavg_and_differs_from_fedsam(tmp_path):
    assert finals_equal(run(tmp_path, "a", algorithm="fedasam", **{"sam.rho": 0.0}, **PARTIAL),
                        run(tmp_path, "b", algorithm="fedavg", **PARTIAL))
    assert_differ(run(tmp_path, "c", algorithm="fedasam", **{"sam.rho": 0.3}, **PARTIAL),
                  run(tmp_path, "d", algorithm="fedsam", **{"sam.rho": 0.3}, **PARTIAL))


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


def test_scaffold_first_round_is_fedavg_and_later_rounds_are_not(tmp_path):
    """c = c_i = 0 before any round, so round 1 is FedAvg's exactly (Karimireddy et al.:
    control variates start at zero, not at the model weights)."""
    a1 = run(tmp_path, "a1", algorithm="fedavg", **{"num-server-rounds": 1})
    s1 = run(tmp_path, "s1", algorithm="scaffold", **{"num-server-rounds": 1})
    assert finals_equal(a1, s1)
    assert_differ(run(tmp_path, "a3", algorithm="fedavg", **{"num-server-rounds": 3}),
                  run(tmp_path, "s3", algorithm="scaffold", **{"num-server-rounds": 3}))


# ---------------------------------------------------------------- FedSMOO
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


# ---------------------------------------------------------------- FedLESAM, -D, -S
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


def test_fedlesam_first_round_choice_matters_only_after_round_one(tmp_path):
    """'none' vs 'initial' differ once a client is first sampled after round 1 (theta^0 !=
    theta^t); with one round both are 'no perturbation' (theta^0 = theta^1)."""
    one = {"num-server-rounds": 1, "sam.rho": 0.3}
    assert finals_equal(run(tmp_path, "n1", algorithm="fedlesam", **one, **{"fedlesam.first": "none"}),
                        run(tmp_path, "i1", algorithm="fedlesam", **one, **{"fedlesam.first": "initial"}))
    assert_differ(run(tmp_path, "n", algorithm="fedlesam", **{"sam.rho": 0.3}, **PARTIAL, **{"fedlesam.first": "none"}),
                  run(tmp_path, "i", algorithm="fedlesam", **{"sam.rho": 0.3}, **PARTIAL, **{"fedlesam.first": "initial"}))


# ---------------------------------------------------------------- FedACG
# ================================================================ FedACG
@pytest.mark.parametrize("partial", [False, True], ids=["full", "partial"])
def test_fedacg_matches_pseudocode(tmp_path, strategy_spy, partial):
    extra = PARTIAL if partial else {"num-server-rounds": 3, "server-lr": 0.8}
    result = run(tmp_path, "fedacg", algorithm="fedacg", **{"fedacg.lambda": 0.6, "fedacg.beta": 0.5}, **extra)
    prob = Problem(result)
    w, m = fedacg_reference(prob, lam=0.6, beta=0.5)
    matches(result, prob, w)
    np.testing.assert_allclose(server_record(strategy_spy, P.MOMENTUM), m, rtol=0, atol=1e-6)


# ---------------------------------------------------------------- FedAdam, FedYogi
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


@pytest.mark.parametrize("algorithm", ["fedyogi", "fedadam"])
def test_fedopt_equals_flowers_own_strategy(algorithm):
    """Fed the same three rounds of aggregated models, our server step equals Flower's
    FedYogi; and FedAdam once Flower's bias correction sqrt(1-b2^(t+1))/(1-b1^(t+1)) is
    folded into eta (Reddi et al.'s Alg. 2 has none)."""
    from flwr.app import Array, ArrayRecord
    from flwr.serverapp.strategy import FedAdam as FlowerAdam
    from flwr.serverapp.strategy import FedYogi as FlowerYogi

    from flatflower.strategies.registry import ALGORITHMS
    from flatflower.strategies.validation import ClientUpdate

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
            ours = ALGORITHMS[algorithm].new_rule(cfg, {k: torch.from_numpy(v.copy()) for k, v in model.items()})
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


# ---------------------------------------------------------------- gradient passes per local step
@pytest.mark.parametrize("perturbation,per_step", [("G", lambda k: 2 * k), ("N", lambda k: k + 1),
                                                   ("fusion", lambda k: 2 * k)])


def test_fedtoga_gradient_passes(tmp_path, monkeypatch, perturbation, per_step):
    """Cost per local round (fedtoga notes §1.4 table): G and fusion take 2 gradient passes per
    step (2K), N takes 1 per step after k = 0 (K + 1), counted at the batch."""
    calls = count_gradient_passes(monkeypatch)
    k, rounds, clients = 4, 2, 3
    run(tmp_path, perturbation, algorithm="fedtoga", **TOGA,
        **{"fedtoga.perturbation": perturbation, "local-steps": k})
    assert calls["n"] == rounds * clients * per_step(k)

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
