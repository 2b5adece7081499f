"""EMA-SAM's first round, independently, in float64 numpy: what ``flatflower check-algorithm
emasam:spec --reference reference:first_round`` compares the algorithm with (docs/check-algorithm.md
describes ``problem``: the initial model, the round's clients, their weights, the keys, the lr)."""

import numpy as np


def first_round(problem):
    rho, beta = problem.params["emasam.rho"], problem.params["emasam.beta"]
    mu = problem.params["emasam.server-momentum"]
    delta = [np.zeros_like(w) for w in problem.w0]
    for (x, y), p in zip(problem.clients, problem.weights):
        w = [v.copy() for v in problem.w0]
        ema = [np.zeros_like(v) for v in w]  # before a client's first round
        for _ in range(problem.local_steps):
            g = problem.grad(w, x, y)
            ema = [beta * e + (1 - beta) * gi for e, gi in zip(ema, g)]
            norm = np.sqrt(sum((e ** 2).sum() for e in ema))
            g_tilde = problem.grad([wi + rho * e / (norm + 1e-12) for wi, e in zip(w, ema)], x, y)
            w = [wi - problem.lr * gi for wi, gi in zip(w, g_tilde)]
        delta = [d + p * (wi - w0) for d, wi, w0 in zip(delta, w, problem.w0)]
    momentum = [mu * 0.0 + d for d in delta]  # m^0 = 0
    return [w0 + m for w0, m in zip(problem.w0, momentum)]
