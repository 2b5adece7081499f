"""Independent float64 numpy references of every algorithm's pseudocode, on the tiny
deterministic problem of tests/helpers.py (multinomial logistic regression on the seeded
``synthetic`` data, full-batch gradients, K local steps). The algorithm tests check the real
pipeline (ServerApp + ClientApp over the in-process grid) against them to 1e-6."""

from __future__ import annotations

import numpy as np

from flatflower.common.datasets import load_dataset
from flatflower.common.reference_problem import grad, sam_grad

K = 3  # local steps


LR = 0.1


# ---------------------------------------------------------------- FedAvg, FedSAM, MoFedSAM (FedSAM paper Alg. 1-2)
# grad(w, x, y): the mean softmax cross-entropy gradient of logits x W^T + b; sam_grad(w, x, y,
# rho): FedSAM eq. (4)'s, the norm over ALL parameters. Public (flatflower.conformance), for the
# user's references of `flatflower check-algorithm --reference` too.


def fedsam_family_reference(result, algorithm, rounds=2, rho=0.0, beta=1.0, server_lr=1.0,
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


# ---------------------------------------------------------------- the problem of the other references
EPS = 1e-12


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


def local_sgd(prob, i, w, eta, direction):
    """K steps theta <- theta - eta * direction(theta) from w."""
    th = w.copy()
    for _ in range(prob.K):
        th = th - eta * direction(th)
    return th


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


# ---------------------------------------------------------------- the seed algorithms
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


# ---------------------------------------------------------------- the baselines
def fedasam_reference(prob, rho, eta):
    """FedASAM (Caldarola et al. 2022): local ASAM (Kwon et al. 2021) in a FedAvg step,
    T = |w_k| + eta element-wise, d = g(w_k + rho T^2 g / ||T g||)."""
    def asam(i):
        def d(th):
            g = prob.g(i, th)
            t = np.abs(th) + eta
            return prob.g(i, th + rho * t * t * g / (norm(t * g) + EPS))
        return d

    w = prob.w0.copy()
    for r, sampled in enumerate(prob.rounds):
        models = [local_sgd(prob, i, w, prob.round_lr(r), asam(i)) for i in sampled]
        w = w + prob.server_lr * prob.mean_update(sampled, models, w)
    return w


def fedsol_reference(prob, rho, tau, mode="adaptive"):
    """FedSOL (fedsol notes §1.1-1.4, §3; Lee-Gihun/FedSOL @ebc3f64): a SAM step whose ascent
    is the proximal KL's gradient, g_p = grad KL(softmax(z_t/tau) || softmax(z/tau)) (batch
    mean, no tau^2: kl_grad / tau^2), teacher = the received model w;
    adaptive eps = rho N(|theta - w|) g_p/||g_p||, N per tensor along dim 0 (each column of W
    over the classes, b as one vector); fixed eps = rho g_p/||g_p||, 0 while theta = w;
    d = g(theta + eps). FedAvg server."""
    def column_unit(a):
        a = np.abs(a)
        return a / np.maximum(np.sqrt((a ** 2).sum(axis=0, keepdims=True)), 1e-12)

    def sol(i, w):
        def d(th):
            g_p = prob.kl_grad(i, th, w, tau) / tau ** 2
            unit = rho * g_p / (norm(g_p) + EPS)
            if mode == "adaptive":
                eps = unit * prob.flat([column_unit(a) for a in prob.unflat(th - w)])
            else:
                eps = unit if norm(th - w) > 0 else prob.zeros()
            return prob.g(i, th + eps)
        return d

    w = prob.w0.copy()
    for r, sampled in enumerate(prob.rounds):
        models = [local_sgd(prob, i, w, prob.round_lr(r), sol(i, w)) for i in sampled]
        w = w + prob.server_lr * prob.mean_update(sampled, models, w)
    return w


def fedgloss_reference(prob, beta, rho_l, rho_s, dual="NM", schedule=None):
    """FedGloSS (fedgloss notes §1 Alg. 1, §2.3, §4): the clients start from
    w~ = w + rho_s pg/||pg|| (pg^0 = 0) and run FedDyn steps with a = 1/beta around the SAM
    gradient (plain when rho_l = 0), sigma_k <- sigma_k - (w_K - w~)/beta;
    server: u = sum p_k (w_k - w~), sigma <- sigma - sum_k (w_k - w~)/(beta N (M if NM)),
    w <- w + eta_g u - beta sigma, pg = -u. ``schedule(r)``: round r's (rho_l, rho_s) (0-based;
    the warm-up), constant by default. Returns (w, sigma, client duals)."""
    a = 1.0 / beta
    schedule = schedule or (lambda r: (rho_l, rho_s))
    w, sigma, pg = prob.w0.copy(), prob.zeros(), prob.zeros()
    hc = {i: prob.zeros() for i in range(prob.N)}
    for r, sampled in enumerate(prob.rounds):
        local, server = schedule(r)
        eta, start = prob.round_lr(r), w + server * pg / (norm(pg) + EPS)
        models = []
        for i in sampled:
            th = start.copy()
            for _ in range(prob.K):
                g = prob.sam(i, th, local) if local > 0 else prob.g(i, th)
                th = th - eta * (g - hc[i] + a * (th - start))
            hc[i] = hc[i] - a * (th - start)
            models.append(th)
        u = prob.mean_update(sampled, models, start)
        total = sum(m - start for m in models)
        sigma = sigma - total / (beta * prob.N * (len(sampled) if dual == "NM" else 1))
        w, pg = w + prob.server_lr * u - beta * sigma, -u
    return w, sigma, hc


def swa_lr(prob, eta, k, ratio):
    """FedSWA's in-round lr of step k (fedswa notes §1, §4): eta (1 - k/K + ratio k/K)."""
    return eta * (1.0 - (1.0 - ratio) * k / prob.K)


def fedswa_reference(prob, ratio, momentum=0.0, wd=0.0):
    """FedSWA (fedswa notes §4): K SGD steps (torch.optim.SGD's momentum and weight decay) at
    the in-round lr swa_lr; server w <- w + alpha u, alpha = server-lr."""
    w = prob.w0.copy()
    for r, sampled in enumerate(prob.rounds):
        eta, models = prob.round_lr(r), []
        for i in sampled:
            th, buf = w.copy(), None
            for k in range(prob.K):
                g = prob.g(i, th) + wd * th
                buf = g if buf is None else momentum * buf + g
                th = th - swa_lr(prob, eta, k, ratio) * (buf if momentum else g)
            models.append(th)
        w = w + prob.server_lr * prob.mean_update(sampled, models, w)
    return w


def fedmoswa_reference(prob, ratio, gamma, first="full", normaliser="sum"):
    """FedMoSWA (fedswa notes §1, §3-4): w_{k+1} = w_k - eta_k (g - c_i + m);
    c_i^+ = c_i - m + (w - w_K)/S, S = sum_k eta_k or K eta (1 + ratio)/2; upload c_i^+ - m;
    server s = sum p_i (c_i^+ - m), m <- m + s (first update, ``full``) or m + gamma s;
    w <- w + alpha u. Returns (w, m, client control variates)."""
    w, m, updates = prob.w0.copy(), prob.zeros(), 0
    ci = {i: prob.zeros() for i in range(prob.N)}
    for r, sampled in enumerate(prob.rounds):
        eta, models, offsets = prob.round_lr(r), [], []
        for i in sampled:
            th = w.copy()
            for k in range(prob.K):
                th = th - swa_lr(prob, eta, k, ratio) * (prob.g(i, th) - ci[i] + m)
            total = (eta * (prob.K - (1.0 - ratio) * (prob.K - 1) / 2.0) if normaliser == "sum"
                     else prob.K * eta * (1.0 + ratio) / 2.0)
            ci[i] = ci[i] - m + (w - th) / total
            offsets.append(ci[i] - m)
            models.append(th)
        s = sum(p * o for p, o in zip(prob.weights(sampled), offsets))
        m = m + (1.0 if first == "full" and updates == 0 else gamma) * s
        updates += 1
        w = w + prob.server_lr * prob.mean_update(sampled, models, w)
    return w, m, ci


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


# ---------------------------------------------------------------- what the papers say crosses the wire
# Model-sized records per sampled client per round (down, up), as the papers state them:
# FedGMT Table 1 (1.5x: w and e down), FedGMT-v2 (1x), FedTOGA §1.6 (theta and Delta down,
# theta_i up), FedNSAM (theta and m down; notes §6), FedCM/MoFedSAM (w and Delta down).
PAPER_PATTERN = {
    "fedavg": (1, 1), "fedsam": (1, 1), "mofedsam": (2, 1), "fedcm": (2, 1), "feddyn": (1, 1),
    "fedspeed": (1, 1), "fedgmt": (2, 1), "fedgmt-v2": (1, 1), "fednsam": (2, 1), "fedtoga": (2, 1),
    # the baselines (fedtoga notes §2.3 "extra communication": FedGAMMA 2x, FedSMOO 2x, FedLESAM
    # 1x; SCAFFOLD sends c down and Delta c up; FedLESAM-S is SCAFFOLD's; FedACG sends only its
    # look-ahead model; FedProx, FedAdam and FedYogi are FedAvg on the wire)
    "fedprox": (1, 1), "scaffold": (2, 2), "fedgamma": (2, 2), "fedsmoo": (2, 2), "fedlesam": (1, 1),
    "fedlesam-d": (1, 1), "fedlesam-s": (2, 2), "fedacg": (1, 1), "fedadam": (1, 1), "fedyogi": (1, 1),
    "fedasam": (1, 1),  # Caldarola et al. 2022: FedAvg's communication
    "fedsol": (1, 1),  # fedsol notes §3: the received model down, the local model up
    "fedgloss": (1, 1),  # fedgloss notes §4: the perturbed model down (in place of w), w_k up
    "fedswa": (1, 1), "fedmoswa": (2, 2),  # fedswa notes §4: FedMoSWA sends m down, c_i^+ - m up
    "dp-fedsam": (1, 1),  # dp-fedsam notes §4: the model down, the clipped and noised model up
    "fedgf": (2, 1),  # fedgf notes §4: w and w~ down (c is a config scalar), the model up
    "fedwmsam": (3, 1),  # fedwmsam notes §4: x, m and c down (alpha a config scalar), the model up
}


# ---------------------------------------------------------------- FedGF, FedWMSAM
def fedgf_reference(prob, rho, rho_g, threshold, window):
    """FedGF (fedgf notes §1.3, §4): each step's gradient at c w~ + (1 - c)(w_k + rho g/||g||)
    (FedSAM while c = 0, round 1 always); server D = mean ||w_i - w||, window of
    1(D > T_D), c = its mean, w <- w + eta_g u, w~ = w_new + rho_g unit(w - w_new).
    Returns (w, the D of each round, the c after each round)."""
    w, wt, bits, c, ds, cs = prob.w0.copy(), prob.w0.copy(), [], 0.0, [], []
    for r, sampled in enumerate(prob.rounds):
        eta, models = prob.round_lr(r), []
        for i in sampled:
            def d(th, i=i):
                g = prob.g(i, th)
                point = c * wt + (1 - c) * (th + rho * g / (norm(g) + EPS))
                return prob.g(i, point)
            models.append(local_sgd(prob, i, w, eta, d))
        ds.append(float(np.mean([norm(m - w) for m in models])))
        bits = (bits + [1.0 if ds[-1] > threshold else 0.0])[-window:]
        c = float(np.mean(bits))
        cs.append(c)
        new = w + prob.server_lr * prob.mean_update(sampled, models, w)
        wt = new + rho_g * (w - new) / (norm(w - new) + EPS)
        w = new
    return w, ds, cs


def wmsam_perturbation(prob, delta, rho, mode):
    """FedWMSAM's eps (fedwmsam notes A1, A3): the paper's, the code's negated one, or the
    code's flat-index bug (tensor j shifted by -delta[j] rho/(sum_{j<P}|delta[j]| + 1e-7))."""
    if mode == "paper":
        return rho * delta / (norm(delta) + EPS)
    if mode == "code-sign":
        return -rho * delta / (norm(delta) + 1e-7)
    head = delta[:len(prob.shapes)]
    shift = -head * rho / (np.abs(head).sum() + 1e-7)
    return prob.flat([np.full(shape, s) for shape, s in zip(prob.shapes, shift)])


def fedwmsam_reference(prob, rho, alpha0, lam, perturbation="paper", correction=True):
    """FedWMSAM (fedwmsam notes §4): m_k = m + alpha/(1 - alpha)(c - c_k); per step
    g = grad F(x_b + eps((x_r + b m_k) - x_b)), x <- x - eta (alpha g + (1 - alpha) m_k);
    c_k <- c_k - c - (x_K - x_r)/(K eta); server s = mean(1 + cos(Delta_k, m)) (0 for a zero
    norm), alpha <- (1 - lam) alpha + lam clip(s, 0.1, 0.9), c <- c + (M/N) sum p_k
    (-c - Delta_k/(K eta)), m <- -sum p_k Delta_k/(K eta) lr_decay, x <- x + eta_g u.
    Returns (x, m, c, {client: c_k}, [alpha after each round])."""
    w, m, c, alpha, alphas = prob.w0.copy(), prob.zeros(), prob.zeros(), alpha0, []
    ck = {i: prob.zeros() for i in range(prob.N)}
    for r, sampled in enumerate(prob.rounds):
        eta, models = prob.round_lr(r), []
        for i in sampled:
            mk = m + (alpha / (1 - alpha) * (c - ck[i]) if alpha < 1 else c - ck[i])
            th = w.copy()
            for b in range(prob.K):
                eps = wmsam_perturbation(prob, w + b * mk - th, rho, perturbation) if rho > 0 else 0.0
                g = prob.g(i, th + eps)
                v = alpha * g + (1 - alpha) * m + alpha * (c - ck[i])
                th = th - eta * v
            if correction:
                ck[i] = ck[i] - c - (th - w) / (prob.K * eta)
            models.append(th)
        p = prob.weights(sampled)
        deltas = [x - w for x in models]
        sims = [0.0 if norm(dl) == 0 or norm(m) == 0 else 1.0 + dl @ m / (norm(dl) * norm(m)) for dl in deltas]
        alpha = (1 - lam) * alpha + lam * min(max(float(np.mean(sims)), 0.1), 0.9)
        alphas.append(alpha)
        if correction:
            c = c + len(sampled) / prob.N * sum(pk * (-c - dl / (prob.K * eta)) for pk, dl in zip(p, deltas))
        m = -sum(pk * dl / (prob.K * eta) for pk, dl in zip(p, deltas)) * prob.lr_decay
        w = w + prob.server_lr * sum(pk * dl for pk, dl in zip(p, deltas))
    return w, m, c, ck, alphas
