"""How flat a model's minimum is: the measures the SAM-family papers report.

On a data split D (n examples) and the model in evaluation mode, with L(w) the mean
cross-entropy over **all** of D (summed exactly over chunks of ``batch_size``, no mini-batch
estimate) and w the model's trainable parameters:

* ``sharpness`` = L(w + rho g/||g||) - L(w), g = grad L(w): the loss increase at SAM's
  first-order worst-case perturbation of radius rho (FedNSAM Fig. 2, "global sharpness");
* ``hessian_max_eig``: the top eigenvalue of the Hessian of L, by power iteration on
  Hessian-vector products (Rayleigh quotient; when the dominant eigenvalue is negative, a
  second iteration on H - lambda I finds the top one);
* ``hessian_trace``: Hutchinson's estimate, the mean of v^T H v over Rademacher probes v;
* ``flatness_distance``: FedNSAM eq. (4), (1/M) sum_i ||theta_i - theta^{t+1}||^2 over the
  round's accepted client models theta_i and the new global model (trainable parameters).

Hessian-vector products are forward-over-reverse (``torch.func.jvp`` of ``torch.func.grad``)
or double backward (``torch.autograd.grad`` twice), chosen by ``hvp``; both run on the
model's device (CPU or CUDA). Random vectors come from a CPU generator seeded with ``seed``,
so the same seed gives the same numbers on any device.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from flatflower.common.datasets import Split
from flatflower.common.tensors import stacked_blocks
from flatflower.common.flatness_settings import (DEFAULT_ITERS, DEFAULT_PROBES, DEFAULT_RHO,  # noqa: F401 (re-exported)
                                     HVP_METHODS, TOLERANCE)

Vector = list[torch.Tensor]  # one tensor per trainable parameter, in model.parameters() order


def dot(a: Vector, b: Vector) -> float:
    return float(sum((x.double() * y.double()).sum() for x, y in zip(a, b)))


def norm(a: Vector) -> float:
    return math.sqrt(dot(a, a))


def seed_of(*numbers: int) -> int:
    """One 63-bit seed from several whole numbers (the run's seed and a round)."""
    return int(np.random.SeedSequence([int(n) for n in numbers]).generate_state(2, np.uint64)[0] >> 1)


class SplitLoss:
    """L(w), its gradient and Hessian-vector products for ``model`` on all of ``data``.

    The model is put in evaluation mode; inputs are cast to its parameters' dtype (so a
    float64 model gives float64 numbers). The parameters are read where they are, so a
    change to them (``perturbed``) changes L."""

    def __init__(self, model: nn.Module, data: Split, batch_size: int = 512, hvp: str = "double-backward"):
        if hvp not in HVP_METHODS:
            raise ValueError(f"hvp={hvp!r} is not one of {', '.join(HVP_METHODS)}")
        if len(data) == 0:
            raise ValueError("the split holds no examples")
        self.model = model.eval()
        self.data, self.batch_size, self.method = data, int(batch_size), hvp
        self.names = [n for n, p in model.named_parameters() if p.requires_grad]
        self.params = [p for p in model.parameters() if p.requires_grad]
        first = self.params[0]
        self.device, self.dtype = first.device, first.dtype

    def __len__(self) -> int:
        return len(self.data)

    def chunks(self):
        """(x, y) over the whole split, ``batch_size`` at a time, on the model's device."""
        for start in range(0, len(self.data), self.batch_size):
            x, y = self.data.get(slice(start, start + self.batch_size))
            yield x.to(self.device, self.dtype if x.is_floating_point() else x.dtype), y.to(self.device)

    def _sum_loss(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits, y, reduction="sum") / len(self.data)

    @torch.no_grad()
    def value(self) -> tuple[float, float]:
        """(L(w), accuracy) on the split."""
        loss, correct = 0.0, 0
        for x, y in self.chunks():
            logits = self.model(x)
            loss += float(self._sum_loss(logits, y))
            correct += int((logits.argmax(dim=1) == y).sum())
        return loss, correct / len(self.data)

    def gradient(self) -> tuple[float, Vector]:
        """(L(w), grad L(w))."""
        total = [torch.zeros_like(p) for p in self.params]
        loss = 0.0
        for x, y in self.chunks():
            part = self._sum_loss(self.model(x), y)
            for t, g in zip(total, torch.autograd.grad(part, self.params)):
                t += g
            loss += float(part.detach())
        return loss, total

    def hvp(self, v: Vector) -> Vector:
        """H v, H the Hessian of L at w (summed over the split's chunks)."""
        total = [torch.zeros_like(p) for p in self.params]
        one = self._hvp_func if self.method == "func" else self._hvp_double_backward
        for x, y in self.chunks():
            for t, h in zip(total, one(x, y, v)):
                t += h
        return total

    def _hvp_double_backward(self, x: torch.Tensor, y: torch.Tensor, v: Vector) -> Vector:
        grads = torch.autograd.grad(self._sum_loss(self.model(x), y), self.params, create_graph=True)
        inner = sum((g * u).sum() for g, u in zip(grads, v))
        return [h.detach() for h in torch.autograd.grad(inner, self.params)]

    def _hvp_func(self, x: torch.Tensor, y: torch.Tensor, v: Vector) -> Vector:
        from torch.func import functional_call, grad, jvp

        fixed = {n: b for n, b in self.model.named_buffers()}
        fixed.update({n: p.detach() for n, p in self.model.named_parameters() if not p.requires_grad})

        def loss(params: dict) -> torch.Tensor:
            return self._sum_loss(functional_call(self.model, {**fixed, **params}, (x,)), y)

        primal = {n: p.detach() for n, p in zip(self.names, self.params)}
        tangent = dict(zip(self.names, v))
        _, out = jvp(grad(loss), (primal,), (tangent,))
        return [out[n] for n in self.names]


def random_vector(like: Sequence[torch.Tensor], generator: torch.Generator, kind: str = "normal") -> Vector:
    """A Gaussian (``normal``) or Rademacher (``rademacher``) vector shaped as ``like``, drawn
    on the CPU (the same numbers on every device), then moved to each tensor's device."""
    out = []
    for p in like:
        if kind == "normal":
            r = torch.randn(p.shape, generator=generator, dtype=torch.float64)
        else:
            r = torch.randint(0, 2, p.shape, generator=generator, dtype=torch.int64) * 2.0 - 1.0
        out.append(r.to(p.device, p.dtype))
    return out


def top_eigenvalue(hvp: Callable[[Vector], Vector], like: Sequence[torch.Tensor], iters: int,
                   seed: int, tol: float = TOLERANCE) -> float:
    """The largest eigenvalue of the symmetric operator ``hvp`` by power iteration (at most
    ``iters`` products, stopping once the Rayleigh quotient changes by < ``tol`` relative).
    Power iteration finds the eigenvalue of largest magnitude; when it is negative, a second
    run on H - lambda I (whose spectrum is >= 0) gives the top one."""
    gen = torch.Generator().manual_seed(seed)
    start = random_vector(like, gen)
    value = _power(hvp, start, iters, tol)
    if value < 0:
        shifted = _power(lambda v: [h - value * u for h, u in zip(hvp(v), v)], start, iters, tol)
        value = shifted + value
    return value


def _power(hvp: Callable[[Vector], Vector], v: Vector, iters: int, tol: float) -> float:
    size = norm(v)
    v = [u / size for u in v]
    value = math.nan
    for _ in range(iters):
        hv = hvp(v)
        new = dot(v, hv)  # Rayleigh quotient of the unit vector v
        size = norm(hv)
        if size == 0.0 or not math.isfinite(size):
            return new if math.isfinite(size) else math.nan
        v = [h / size for h in hv]
        if abs(new - value) < tol * abs(new):
            return new
        value = new
    return value


def hessian_trace(hvp: Callable[[Vector], Vector], like: Sequence[torch.Tensor], probes: int,
                  seed: int) -> float:
    """Hutchinson's estimate of tr(H): the mean of v^T H v over ``probes`` Rademacher v."""
    gen = torch.Generator().manual_seed(seed)
    return sum(dot(v, hvp(v)) for v in (random_vector(like, gen, "rademacher")
                                         for _ in range(probes))) / probes


def sharpness(split_loss: SplitLoss, rho: float) -> tuple[float, float, float]:
    """(L(w), accuracy, L(w + rho g/||g||) - L(w)); the parameters are left as they were."""
    loss, accuracy = split_loss.value()
    _, g = split_loss.gradient()
    size = norm(g)
    if size == 0.0 or not math.isfinite(size):
        return loss, accuracy, 0.0 if size == 0.0 else math.nan
    with perturbed(split_loss.params, [rho * u / size for u in g]):
        ascended, _ = split_loss.value()
    return loss, accuracy, ascended - loss


class perturbed:
    """``with perturbed(params, d):`` the parameters are w + d inside, exactly w after."""

    def __init__(self, params: Sequence[torch.Tensor], delta: Sequence[torch.Tensor]):
        self.params, self.delta = list(params), list(delta)

    def __enter__(self):
        self.saved = [p.detach().clone() for p in self.params]
        with torch.no_grad():
            for p, d in zip(self.params, self.delta):
                p.add_(d)

    def __exit__(self, *exc) -> None:
        with torch.no_grad():
            for p, s in zip(self.params, self.saved):
                p.copy_(s)


def measure(model: nn.Module, data: Split, *, batch_size: int = 512, rho: float = DEFAULT_RHO,
            iters: int = DEFAULT_ITERS, probes: int = DEFAULT_PROBES, seed: int = 0,
            hvp: str = "double-backward", tol: float = TOLERANCE, method: str = "power",
            top_k: int = 1, density: dict | None = None) -> dict[str, float]:
    """Every flatness number of ``model`` on ``data``: ``loss``, ``accuracy``, ``sharpness``
    (with its ``rho``), ``hessian_max_eig`` (``iters`` power steps at most, fewer once the
    relative change is below ``tol``) and
    ``hessian_trace`` (``probes`` probes), ``examples``. Random vectors are seeded from
    ``seed`` (power iteration and Hutchinson each from their own stream)."""
    split_loss = SplitLoss(model, data, batch_size, hvp)
    loss, accuracy, sharp = sharpness(split_loss, rho)
    like = split_loss.params
    out = {"loss": loss, "accuracy": accuracy, "sharpness": sharp, "rho": rho}
    if method == "lanczos":  # common/spectrum.py: converged, with its residual
        from flatflower.common.spectrum import top_eigenvalues

        top = top_eigenvalues(split_loss.hvp, like, top_k, tol, seed_of(seed, 1))
        out.update({"hessian_max_eig": top[0]["eigenvalue"], "hessian_max_eig_residual": top[0]["residual"]})
        if top_k > 1:
            out["hessian_top_eigenvalues"] = top
    elif method == "power":
        out["hessian_max_eig"] = top_eigenvalue(split_loss.hvp, like, iters, seed_of(seed, 1), tol)
    else:
        raise ValueError(f"method must be power or lanczos, not {method!r}")
    out.update({"hessian_trace": hessian_trace(split_loss.hvp, like, probes, seed_of(seed, 2)),
                "examples": len(data)})
    if density is not None:  # {"steps", "starts"}: the eigenvalue density by SLQ
        from flatflower.common.spectrum import density as slq

        out["hessian_density"] = slq(split_loss.hvp, like, seed=seed_of(seed, 3), **density)
    return out


def flatness_distance(client_models: Sequence[Mapping[str, torch.Tensor]],
                      global_model: Mapping[str, torch.Tensor], names: Sequence[str]) -> float | None:
    """FedNSAM eq. (4): the uniform mean over the clients of ||theta_i - theta||^2 over the
    tensors ``names`` (the trainable parameters), in float64; None without clients."""
    if not client_models:
        return None
    # squares[n][i] = ||theta_i[n] - theta[n]||^2: each tensor's differences made for a block of
    # clients at once, then summed row by row (each row a whole reduction of its own, as that
    # tensor's sum on its own), and added in the order of the per-client formula: bit for bit it
    squares = {n: _squared_distances([m[n] for m in client_models], global_model[n]) for n in names}
    return sum(sum(squares[n][i] for n in names) for i in range(len(client_models))) / len(client_models)


def _squared_distances(tensors: Sequence[torch.Tensor], center: torch.Tensor) -> list[float]:
    """[float(((t.double() - center.double()) ** 2).sum()) for t in tensors], a block of
    tensors per operation (common/tensors.py ``stacked_blocks``)."""
    center = center.double().reshape(-1)
    out: list[float] = []
    for _, block in stacked_blocks(tensors):
        diff = block.double().sub_(center).square_()
        out += torch.stack([row.sum() for row in diff]).tolist()
    return out


# metrics.jsonl fields of a round (server/run.py); TensorBoard draws them as flatness/<field>
ROUND_FIELDS = ("flatness_distance", "sharpness", "sharpness_rho", "hessian_max_eig", "hessian_trace",
                "flatness_seconds")
