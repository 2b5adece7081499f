"""The Hessian's spectrum by Lanczos: top eigenvalues that converge, and its density.

``power iteration`` (common/flatness.py ``top_eigenvalue``) stops once its Rayleigh quotient
changes little, which is not the same as being right: when the top eigenvalues are close it
stops early and reports too little (on digits' logistic regression 1.364 for an exact 1.430).
Here the operator v -> Hv (Hessian-vector products on the model's device, GPU when it has one)
is handed to SciPy's ARPACK Lanczos solver (``scipy.sparse.linalg.eigsh``), in float64 on the
host, and each eigenpair comes back with its residual

    r = ||H v - lambda v|| / |lambda|      (v of unit norm),

measured with one more product after the solver stopped: a small r means lambda is within
about r |lambda| ||H|| / gap of an eigenvalue, whatever the solver's own bookkeeping said.

The density: stochastic Lanczos quadrature (Golub and Meurant; Ghorbani, Krishnan and Xiao,
ICML 2019; PyHessian). From ``starts`` random Rademacher vectors v (||v|| = 1), ``steps``
Lanczos steps with full reorthogonalisation give a tridiagonal T whose eigenvalues (nodes)
and the squared first components of its eigenvectors (weights, summing to 1) are the
Gauss quadrature of v's spectral measure; its expectation over v is the eigenvalue density
(1/d) sum_i delta(t - lambda_i). Averaged over the starts and smoothed by a Gaussian of width
``sigma`` it is the figure the Hessian-spectrum literature draws.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import torch

Vector = list[torch.Tensor]
SLQ_STEPS, SLQ_STARTS, DENSITY_POINTS = 80, 4, 400


class FlatOperator:
    """``hvp`` (a function of one tensor per parameter) as a function of one float64 array."""

    def __init__(self, hvp: Callable[[Vector], Vector], like: Sequence[torch.Tensor]):
        self.hvp, self.like = hvp, list(like)
        self.sizes = [p.numel() for p in self.like]
        self.dim = sum(self.sizes)
        self.products = 0

    def __call__(self, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, dtype=np.float64).reshape(-1)
        parts, start = [], 0
        for p, n in zip(self.like, self.sizes):
            parts.append(torch.from_numpy(x[start:start + n].copy()).view(p.shape).to(p.device, p.dtype))
            start += n
        self.products += 1
        return torch.cat([h.detach().reshape(-1).double().cpu() for h in self.hvp(parts)]).numpy()


def top_eigenvalues(hvp: Callable[[Vector], Vector], like: Sequence[torch.Tensor], k: int = 1,
                    tol: float = 1e-8, seed: int = 0, max_products: int | None = None) -> list[dict]:
    """The ``k`` largest (algebraic) eigenvalues of the symmetric operator ``hvp`` by ARPACK's
    Lanczos (``eigsh``, which='LA', stopping at relative accuracy ``tol``), largest first, each
    ``{"eigenvalue", "residual"}`` (the residual measured after the solve, as above)."""
    from scipy.sparse.linalg import LinearOperator, eigsh

    op = FlatOperator(hvp, like)
    if not 1 <= k < op.dim:
        raise ValueError(f"top-k must be in [1, {op.dim - 1}] for {op.dim} parameters, not {k}")
    start = np.random.default_rng(seed).standard_normal(op.dim)
    linear = LinearOperator((op.dim, op.dim), matvec=op, dtype=np.float64)
    from scipy.sparse.linalg import ArpackNoConvergence

    try:
        values, vectors = eigsh(linear, k=k, which="LA", tol=tol, v0=start,
                                maxiter=max_products or max(1000, 20 * op.dim))
    except ArpackNoConvergence as err:
        raise ValueError(f"Lanczos (eigsh) did not reach tol {tol:g} after {op.products} Hessian-vector "
                         f"products ({len(err.eigenvalues)} of {k} eigenvalues converged); a larger "
                         "--tol or a smaller --top-k") from None
    out = []
    for i in np.argsort(values)[::-1]:
        v = vectors[:, i] / np.linalg.norm(vectors[:, i])
        lam = float(values[i])
        residual = float(np.linalg.norm(op(v) - lam * v)) / (abs(lam) or 1.0)
        out.append({"eigenvalue": lam, "residual": residual})
    return out


def lanczos(matvec: Callable[[np.ndarray], np.ndarray], start: np.ndarray, steps: int) -> tuple[np.ndarray, np.ndarray]:
    """``steps`` Lanczos steps from ``start`` with full reorthogonalisation: the diagonal
    (alpha) and off-diagonal (beta) of the tridiagonal matrix; fewer when an invariant
    subspace is found (beta ~ 0)."""
    q = start / np.linalg.norm(start)
    basis = [q]
    alpha, beta = [], []
    for j in range(steps):
        w = matvec(basis[-1])
        alpha.append(float(basis[-1] @ w))
        Q = np.stack(basis)
        w = w - Q.T @ (Q @ w)
        w = w - Q.T @ (Q @ w)  # twice is enough (Kahan-Parlett)
        b = float(np.linalg.norm(w))
        if j == steps - 1 or b <= 1e-12 * max(1.0, abs(alpha[-1])):
            break
        beta.append(b)
        basis.append(w / b)
    return np.array(alpha), np.array(beta)


def quadrature(alpha: np.ndarray, beta: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Gauss quadrature nodes and weights of a Lanczos tridiagonal (weights sum to 1)."""
    from scipy.linalg import eigh_tridiagonal

    nodes, vectors = eigh_tridiagonal(alpha, beta)
    return nodes, vectors[0] ** 2


def density(hvp: Callable[[Vector], Vector], like: Sequence[torch.Tensor], steps: int = SLQ_STEPS,
            starts: int = SLQ_STARTS, seed: int = 0, points: int = DENSITY_POINTS,
            sigma: float | None = None) -> dict:
    """The eigenvalue density by stochastic Lanczos quadrature: ``{"grid", "density",
    "nodes", "weights", "sigma"}``; the density is the Gaussian-smoothed mean of the starts'
    quadratures on ``points`` grid points (``sigma``: default 1% of the spectrum's width), and
    integrates to 1 over the grid (up to the tails cut at 5 sigma)."""
    op = FlatOperator(hvp, like)
    rng = np.random.default_rng(seed)
    nodes, weights = [], []
    for _ in range(starts):
        start = rng.integers(0, 2, op.dim).astype(np.float64) * 2 - 1
        n, w = quadrature(*lanczos(op, start, min(steps, op.dim)))
        nodes.append(n)
        weights.append(w / starts)
    nodes, weights = np.concatenate(nodes), np.concatenate(weights)
    width = float(nodes.max() - nodes.min()) or max(1.0, abs(float(nodes.max())))
    sigma = sigma or 0.01 * width
    grid = np.linspace(nodes.min() - 5 * sigma, nodes.max() + 5 * sigma, points)
    values = (weights[None, :] * np.exp(-0.5 * ((grid[:, None] - nodes[None, :]) / sigma) ** 2)).sum(1)
    values /= sigma * math.sqrt(2 * math.pi)
    return {"grid": grid.tolist(), "density": values.tolist(), "nodes": nodes.tolist(),
            "weights": weights.tolist(), "sigma": sigma}
