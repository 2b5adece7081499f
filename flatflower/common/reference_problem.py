"""The tiny problem a float64 numpy reference of one round receives, and its gradients.

``flatflower check-algorithm REF --reference module:callable`` (tools/conformance.py, docs/check-algorithm.md)
runs one round of an algorithm on multinomial logistic regression (``model = logreg``: logits
``x W^T + b``) over the offline ``synthetic`` data, full-batch local steps, and calls the user's
reference with a :class:`ReferenceProblem`: the initial model's trainable parameters, the
round's clients' data, their aggregation weights and the hyperparameters. The reference returns
the new global model's trainable parameters; they must match the algorithm's to 1e-6.

The gradients here are those of the mean softmax cross-entropy of that model, in float64
(:func:`grad`), and FedSAM's local SAM gradient (:func:`sam_grad`); tests/reference.py builds
every built-in algorithm's reference on them. Public as ``flatflower.conformance``. NumPy only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

Arrays = list  # list[np.ndarray]: a model's trainable parameters, in order (logreg: W, then b)


def grad(w: Sequence[np.ndarray], x: np.ndarray, y: np.ndarray) -> list[np.ndarray]:
    """The gradient, as ``[dW, db]``, of the mean softmax cross-entropy of the logits
    ``x W^T + b`` (``w = [W, b]``: W of shape (classes, features), b of shape (classes,)) with
    integer labels ``y``."""
    W, b = w
    z = x @ W.T + b
    z = z - z.max(axis=1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(axis=1, keepdims=True)
    p[np.arange(len(y)), y] -= 1.0
    p /= len(y)
    return [p.T @ x, p.sum(axis=0)]


def sam_grad(w: Sequence[np.ndarray], x: np.ndarray, y: np.ndarray, rho: float,
             gradient: Callable[..., list[np.ndarray]] = grad) -> list[np.ndarray]:
    """FedSAM's local SAM gradient (Qu et al. 2022, eq. 4): the gradient at
    ``w + rho g/||g||``, g the gradient at w and ||.|| the global L2 norm over ALL parameters
    (W and b), with flatflower's 1e-12 guard."""
    g = gradient(w, x, y)
    norm = np.sqrt(sum((gi ** 2).sum() for gi in g))
    return gradient([wi + rho * gi / (norm + 1e-12) for wi, gi in zip(w, g)], x, y)


@dataclass(frozen=True)
class ReferenceProblem:
    """One round of an algorithm, as a float64 numpy reference sees it (the argument of a
    ``--reference`` callable; docs/check-algorithm.md).

    ``w0``: the global model before the round, its trainable parameters in order (logreg:
    ``[W, b]``, float64). ``clients``: the round's clients, in the order the server sampled
    them (every client, in partition order: full participation), each ``(x, y)``: its
    training data (float64 features, int64 labels), all of it (local steps are full-batch).
    ``weights``: their aggregation weights p_i (summing to 1: n_i / n under the default
    ``aggregation = weighted``). ``params``: the algorithm's run-config keys -> values (its
    defaults; a required key at its example value). ``lr``: the clients' learning rate;
    ``local_steps``: K, plain SGD steps ``w <- w - lr d`` (no momentum, no weight decay, no
    clipping); ``server_lr``: the general ``server-lr`` key. ``grad(w, x, y)``: the mean
    cross-entropy gradient (:func:`grad`); ``num_clients``: N, the federation's size (equal to
    ``len(clients)`` here), for the rules that average over all N.
    """

    w0: Arrays
    clients: list[tuple[np.ndarray, np.ndarray]]
    weights: np.ndarray
    params: dict[str, Any]
    lr: float
    local_steps: int
    server_lr: float
    grad: Callable[..., list[np.ndarray]] = field(default=grad, repr=False)
    num_clients: int = 0

    def sam_grad(self, w: Sequence[np.ndarray], x: np.ndarray, y: np.ndarray, rho: float) -> list[np.ndarray]:
        """:func:`sam_grad` with this problem's gradient."""
        return sam_grad(w, x, y, rho, self.grad)
