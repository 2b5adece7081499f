"""The seven seed algorithms (FedCM, FedDyn, FedSpeed, FedGMT, FedGMT-v2, FedNSAM, FedTOGA),
checked against hand-computed references and against each other.

Set-up as in ``test_algorithms.py``: the real ServerApp + ClientApps run in-process on
multinomial logistic regression over the seeded ``synthetic`` data (iid partition, full-batch
gradients, K local steps). Each algorithm's pseudocode is re-implemented below, independently,
in float64 numpy on *flat* parameter vectors (W and b concatenated, so every norm is the
global norm over all parameters), and must give the pipeline's final global model to 1e-6.
Partial participation is reproduced from the ``sampled_partitions`` of metrics.jsonl.

Notation: theta^t global model, K local steps, eta round lr (lr * lr-decay^(r-1)),
p_i aggregation weights over the M clients trained this round (n_i / sum n, or 1/M),
N clients in all, u = sum_i p_i (theta_i - theta^t), eta_g = server-lr,
g(theta) the full-batch mean cross-entropy gradient.

Identities are asserted with ``torch.equal`` where both sides run the same float32
arithmetic (a zero coefficient multiplies a finite tensor, adding exact zeros), and with
atol 1e-6 otherwise; each identity has a guard showing the pair differs when the parameter
that should vanish does not.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from client.batch import ModelBatch
from client.sam import sam_gradient
from client.algorithms.fedspeed import FedSpeedClient
from common import protocol as P
from common.datasets import load_dataset
from strategies.feddyn import FedDyn
from test_algorithms import K, assert_matches, grad, run, sam_grad

EPS = 1e-12
FIRST_NODE = 1000  # InProcessGrid's node id of partition 0
PARTIAL = {"num_clients": 4, "fraction-train": 0.5, "num-server-rounds": 3}


# ---------------------------------------------------------------- numpy reference machinery
class Problem:
    """The data, initial model, sampling and hyperparameters of one run, as float64 numpy.

    Parameters are one flat vector: W (row-major) then b.
    """

    def __init__(self, result):
        cfg = result["cfg"]
        data = load_dataset("synthetic").train
        x_all, y_all = data.x.double().numpy(), data.y.numpy()
        self.N = len(result["parts"])
        self.clients = [(x_all[idx], y_all[idx]) for idx in
                        (np.array(result["parts"][str(i)]) for i in range(self.N))]
        init = [v.double().numpy() for v in result["init"].values()]
        self.shapes = [v.shape for v in init]
        self.w0 = self.flat(init)
        self.rounds = [row["sampled_partitions"] for row in result["rows"]]
        for row in result["rows"]:  # the reference assumes every sampled client trained
            assert row["clients_replied"] == len(row["sampled_partitions"]) > 0
            assert row["clients_rejected"] == row["clients_failed"] == 0
        assert len(self.rounds) == cfg["num-server-rounds"]
        self.K = cfg["local-steps"]
        self.lr = cfg["lr"]
        self.lr_decay = cfg.get("lr-decay", 1.0)
        self.server_lr = cfg.get("server-lr", 1.0)
        self.weighting = cfg.get("aggregation", "weighted")

    # -- vectors
    @staticmethod
    def flat(arrays) -> np.ndarray:
        return np.concatenate([np.asarray(a, dtype=np.float64).ravel() for a in arrays])

    def unflat(self, v: np.ndarray) -> list[np.ndarray]:
        out, start = [], 0
        for shape in self.shapes:
            size = int(np.prod(shape))
            out.append(v[start:start + size].reshape(shape))
            start += size
        return out

    def zeros(self) -> np.ndarray:
        return np.zeros_like(self.w0)

    # -- gradients (the helpers of test_algorithms, on flat vectors)
    def g(self, i: int, theta: np.ndarray) -> np.ndarray:
        x, y = self.clients[i]
        return self.flat(grad(self.unflat(theta), x, y))

    def sam(self, i: int, theta: np.ndarray, rho: float) -> np.ndarray:
        x, y = self.clients[i]
        return self.flat(sam_grad(self.unflat(theta), x, y, rho))

    def kl_grad(self, i: int, theta: np.ndarray, teacher: np.ndarray, tau: float) -> np.ndarray:
        """Gradient of tau^2 KL(softmax(z_e/tau) || softmax(z/tau)), batchmean, w.r.t. theta:
        by the logits it is tau (softmax(z/tau) - softmax(z_e/tau)) / B (FedGMT notes §1, eq. 9)."""
        x, _ = self.clients[i]

        def softmax(z):
            z = z - z.max(axis=1, keepdims=True)
            e = np.exp(z)
            return e / e.sum(axis=1, keepdims=True)

        W, b = self.unflat(theta)
        We, be = self.unflat(teacher)
        dz = tau * (softmax((x @ W.T + b) / tau) - softmax((x @ We.T + be) / tau)) / len(x)
        return self.flat([dz.T @ x, dz.sum(axis=0)])

    # -- rounds
    def round_lr(self, r: int) -> float:
        """eta of round r (0-based here, 1-based in the config)."""
        return self.lr * self.lr_decay ** r

    def weights(self, sampled) -> np.ndarray:
        if self.weighting == "uniform":
            return np.full(len(sampled), 1.0 / len(sampled))
        sizes = np.array([len(self.clients[i][1]) for i in sampled], dtype=float)
        return sizes / sizes.sum()

    def mean_update(self, sampled, models, w) -> np.ndarray:
        """u = sum_i p_i (theta_i - theta^t)."""
        return sum(p * (m - w) for p, m in zip(self.weights(sampled), models))


def norm(v: np.ndarray) -> float:
    return float(np.sqrt((v ** 2).sum()))


def dual_server_step(prob, w, h, u, a, M, D):
    """FedDyn server (notes: fedgmt §1 eq. 13, fedtoga §1.5):
    h <- h - a (M/D) u ;  theta <- theta + eta_g (u - h/a)."""
    h = h - a * (M / D) * u
    return w + prob.server_lr * (u - h / a), h


def fedcm_reference(prob, alpha, server_step):
    """FedCM (Xu et al. 2021; MoFedSAM notes §1.3 with rho = 0):
    client  d = alpha g(theta_k) + (1 - alpha) Delta          (Delta^0 = 0)
    server  Delta <- -sum_i p_i (theta_i - theta^t)/(eta tau_i)
            theta <- theta + eta_g u  (delta)  |  theta - eta_g Delta  (literal)."""
    w, delta = prob.w0.copy(), prob.zeros()
    for r, sampled in enumerate(prob.rounds):
        eta = prob.round_lr(r)
        models = []
        for i in sampled:
            th = w.copy()
            for _ in range(prob.K):
                th = th - eta * (alpha * prob.g(i, th) + (1 - alpha) * delta)
            models.append(th)
        u = prob.mean_update(sampled, models, w)
        delta = -sum(p * (m - w) / (eta * prob.K) for p, m in zip(prob.weights(sampled), models))
        w = w + prob.server_lr * u if server_step == "delta" else w - prob.server_lr * delta
    return w


def feddyn_reference(prob, a, rho=0.0, alpha=1.0):
    """FedDyn (Acar et al. 2021); FedSpeed (Sun et al. 2023, Alg. 1) when rho > 0:
    client  d = g(theta_k) - h_i + a (theta_k - theta^t)
            [FedSpeed: g -> (1 - alpha) g(theta_k) + alpha g~(theta_k), the quasi-gradient]
            h_i <- h_i - a (theta_K - theta^t)    (only when trained; zeros before)
    server  h <- h - a (M/N) u ;  theta <- theta + eta_g (u - h/a).
    Returns (theta, server h, client duals)."""
    w, h = prob.w0.copy(), prob.zeros()
    hc = {i: prob.zeros() for i in range(prob.N)}
    for r, sampled in enumerate(prob.rounds):
        eta = prob.round_lr(r)
        models = []
        for i in sampled:
            th = w.copy()
            for _ in range(prob.K):
                g = (1 - alpha) * prob.g(i, th) + alpha * prob.sam(i, th, rho) if rho else prob.g(i, th)
                th = th - eta * (g - hc[i] + a * (th - w))
            hc[i] = hc[i] - a * (th - w)
            models.append(th)
        u = prob.mean_update(sampled, models, w)
        w, h = dual_server_step(prob, w, h, u, a, len(sampled), prob.N)
    return w, h, hc


def fedgmt_reference(prob, beta, gamma, tau, alpha=None, v2_alpha=None, v2_init="initial"):
    """FedGMT (fedgmt notes §1 eq. 9, 12, 13; §2.1-2.2) or, with ``v2_alpha``, FedGMT-v2 (§2.3):
    client  d = grad[CE + gamma tau^2 KL(softmax(z_e/tau) || softmax(z/tau))](theta_k) - u_m
            (no prox term);  u_m <- u_m - (1/beta)(theta_K - theta^t)
    server  FedDyn with a = 1/beta and divisor N; FedGMT: e <- alpha e + (1-alpha) theta^{t+1}
            (e^0 = theta^0, the teacher broadcast each round).
    v2:     no server EMA; client e_m (theta^0 "initial" or theta^t "global" before its first
            round) <- v2_alpha e_m + (1 - v2_alpha) theta^t, then teacher = e_m.
    Returns (theta, server dual, client duals, client EMAs)."""
    a = 1.0 / beta
    w, h, ema = prob.w0.copy(), prob.zeros(), prob.w0.copy()
    hc = {i: prob.zeros() for i in range(prob.N)}
    client_ema: dict[int, np.ndarray] = {}
    for r, sampled in enumerate(prob.rounds):
        eta = prob.round_lr(r)
        models = []
        for i in sampled:
            if v2_alpha is None:
                teacher = ema
            else:
                previous = client_ema.get(i, prob.w0 if v2_init == "initial" else w)
                teacher = client_ema[i] = v2_alpha * previous + (1 - v2_alpha) * w
            th = w.copy()
            for _ in range(prob.K):
                d = prob.g(i, th) - hc[i]
                if gamma:
                    d = d + gamma * prob.kl_grad(i, th, teacher, tau)
                th = th - eta * d
            hc[i] = hc[i] - a * (th - w)
            models.append(th)
        u = prob.mean_update(sampled, models, w)
        w, h = dual_server_step(prob, w, h, u, a, len(sampled), prob.N)
        if v2_alpha is None:
            ema = alpha * ema + (1 - alpha) * w
    return w, h, hc, client_ema


def fednsam_reference(prob, lam, rho):
    """FedNSAM (fednsam notes §1.3):
    client  o = lam m - rho m/(||m|| + eps)  (0 while m = 0);  d = g(theta_k + o)
    server  m <- lam m + u ;  theta <- theta + eta_g m      (m^0 = 0, broadcast)."""
    w, m = prob.w0.copy(), prob.zeros()
    for r, sampled in enumerate(prob.rounds):
        eta = prob.round_lr(r)
        offset = lam * m - rho * m / (norm(m) + EPS)
        models = []
        for i in sampled:
            th = w.copy()
            for _ in range(prob.K):
                th = th - eta * prob.g(i, th + offset)
            models.append(th)
        m = lam * m + prob.mean_update(sampled, models, w)
        w = w + prob.server_lr * m
    return w


def fedtoga_reference(prob, alpha, kappa, beta, rho, prox_scale="multiplier", perturbation="G",
                      dual_divisor="M", delta_scale="literal"):
    """FedTOGA (fedtoga notes §1.3-1.5, pseudocode §1.10):
    a = alpha ("multiplier") or 1/alpha ("literal"); per step, g~_{k-1} the last SAM gradient:
      G: v = g(theta_k) + kappa Delta;  N: v = g~_{k-1} + kappa Delta (k >= 1);
      fusion: v = g(theta_k) + g~_{k-1} + kappa Delta (k >= 1); at k = 0 N/fusion use G's v.
      g~_k = g(theta_k + rho v/(||v|| + eps))
      d = g~_k - h_i + a (theta_k - theta^t) + beta Delta;  h_i <- h_i - a (theta_K - theta^t)
    server  Delta <- -sum_i p_i (theta_i - theta^t)/(tau_i s), s = 1 or eta ("per-lr")
            h <- h - a (M/D) u (D = M or N);  theta <- theta + eta_g (u - h/a).
    Returns (theta, server dual, client duals)."""
    a = alpha if prox_scale == "multiplier" else 1.0 / alpha
    w, h, delta = prob.w0.copy(), prob.zeros(), prob.zeros()
    hc = {i: prob.zeros() for i in range(prob.N)}
    for r, sampled in enumerate(prob.rounds):
        eta = prob.round_lr(r)
        models = []
        for i in sampled:
            th, previous = w.copy(), None
            for _ in range(prob.K):
                if perturbation == "N" and previous is not None:
                    v = previous + kappa * delta
                elif perturbation == "fusion" and previous is not None:
                    v = prob.g(i, th) + previous + kappa * delta
                else:
                    v = prob.g(i, th) + kappa * delta
                g_sam = prob.g(i, th + rho * v / (norm(v) + EPS))
                th = th - eta * (g_sam - hc[i] + a * (th - w) + beta * delta)
                previous = g_sam
            hc[i] = hc[i] - a * (th - w)
            models.append(th)
        u = prob.mean_update(sampled, models, w)
        s = eta if delta_scale == "per-lr" else 1.0
        delta = -sum(p * (m - w) / (prob.K * s) for p, m in zip(prob.weights(sampled), models))
        M = len(sampled)
        w, h = dual_server_step(prob, w, h, u, a, M, M if dual_divisor == "M" else prob.N)
    return w, h, hc


# ---------------------------------------------------------------- helpers on the pipeline side
def matches(result, prob, expected: np.ndarray) -> None:
    """Final global model == reference to 1e-6, and training moved the model."""
    assert_matches(result, prob.unflat(expected))


def client_state(result, partition: int, record: str, prob: Problem) -> np.ndarray:
    """A client's persistent record (flat float64); zeros if it never wrote one."""
    state = result["grid"].contexts[FIRST_NODE + partition].state
    if record not in state.array_records:
        return prob.zeros()
    return prob.flat(v.double().numpy() for v in P.from_record(state.array_records[record]).values())


def assert_client_duals(result, prob, expected: dict[int, np.ndarray]) -> None:
    for i in range(prob.N):
        np.testing.assert_allclose(client_state(result, i, P.DUAL, prob), expected[i], rtol=0, atol=1e-6)


def assert_partial(prob) -> None:
    """The sampling really is partial and some client trains twice (so h_i persists)."""
    assert all(len(s) < prob.N for s in prob.rounds)
    trained = [i for s in prob.rounds for i in s]
    assert len(set(trained)) < len(trained)


def finals_equal(a: dict, b: dict) -> bool:
    return all(torch.equal(a["final"][k], b["final"][k]) for k in a["final"])


def assert_close_models(a: dict, b: dict, atol=1e-6) -> None:
    for k in a["final"]:
        torch.testing.assert_close(a["final"][k], b["final"][k], rtol=0, atol=atol)


def assert_differ(a: dict, b: dict, min_diff=1e-4) -> None:
    """Guard: the two runs differ by far more than the tolerance of the identities."""
    diff = max(float((a["final"][k] - b["final"][k]).abs().max()) for k in a["final"])
    assert diff > min_diff, diff


@pytest.fixture
def server_spy(monkeypatch):
    """Wraps the FedDyn-family server update (FedSpeed, FedGMT, FedTOGA call it through
    super()) to record the strategy and, per round, u computed independently in float64 with
    uniform weights, and the number of clients M."""
    seen = {"strategy": None, "u_uniform": [], "M": []}
    original = FedDyn.update

    def spy(self, server_round, updates, weights):
        start = Problem.flat(v.double().numpy() for v in self.model.values())
        models = [Problem.flat(v.double().numpy() for v in up.model.values()) for up in updates]
        seen["strategy"] = self
        seen["u_uniform"].append(sum(m - start for m in models) / len(models))
        seen["M"].append(len(updates))
        return original(self, server_round, updates, weights)

    monkeypatch.setattr(FedDyn, "update", spy)
    return seen


def server_dual(seen) -> np.ndarray:
    return Problem.flat(v.double().numpy() for v in seen["strategy"].records[P.DUAL].values())


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


def test_fedspeed_rho0_equals_feddyn(tmp_path):
    """rho = 0 turns FedSpeed into FedDyn. Exact: the zero SAM offset leaves the weights
    untouched and the same gradient is recomputed; the servers are the same code."""
    common = {"feddyn.alpha": 0.3}
    a = run(tmp_path, "a", algorithm="feddyn", **common)
    b = run(tmp_path, "b", algorithm="fedspeed", **{"sam.rho": 0.0}, **common)
    assert finals_equal(a, b)
    c = run(tmp_path, "c", algorithm="fedspeed", **{"sam.rho": 0.3}, **common)
    assert_differ(a, c)  # guard


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
    ema = server_spy["strategy"].records[P.EMA_MODEL]  # before the next run replaces the spy's strategy
    got = Problem.flat(v.double().numpy() for v in ema.values())
    # theta^1 is the one-round run's final model (same seed, same sampling)
    one = run(tmp_path, "one", algorithm="fedgmt",
              **{"fedgmt.beta": 2.0, "fedgmt.gamma": 0.7, "fedgmt.tau": 2.0, "fedgmt.alpha": alpha,
                 "num-server-rounds": 1})
    theta1 = Problem.flat(v.double().numpy() for v in one["final"].values())
    theta2 = Problem.flat(v.double().numpy() for v in result["final"].values())
    expected = alpha ** 2 * prob.w0 + (1 - alpha) * alpha * theta1 + (1 - alpha) * theta2
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6)


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


# ================================================================ 7. FedTOGA
TOGA = {"fedtoga.alpha": 0.3, "fedtoga.kappa": 0.7, "fedtoga.beta": 0.4, "sam.rho": 0.2}


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
    delta = Problem.flat(v.double().numpy() for v in server_spy["strategy"].records[P.GLOBAL_UPDATE].values())
    np.testing.assert_allclose(delta, -server_spy["u_uniform"][-1] / K, rtol=0, atol=1e-6)
    assert np.abs(delta).max() > 1e-4


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


def count_gradient_passes(monkeypatch) -> dict:
    """Counts gradient (forward + backward) passes: every one a rule asks of its batch goes
    through ModelBatch._grad. The count is in the returned dict's "n"."""
    calls = {"n": 0}
    original = ModelBatch._grad

    def counting(*args, **kwargs):
        calls["n"] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(ModelBatch, "_grad", counting)
    return calls
