"""Client-level differential privacy (DP-FedAvg's mechanism; DP-FedSAM, Shi et al., CVPR 2023).

Each sampled client clips its round update Delta = w_K - w^t to L2 norm C (``dp.clip``) and adds
Gaussian noise of standard deviation sigma C / sqrt(M) per coordinate (sigma =
``dp.noise-multiplier``, M = the clients the server sampled this round, sent in the train
config). The uniform mean of the M noised updates then carries noise of standard deviation
sigma C / M per coordinate: the sampled Gaussian mechanism with sensitivity C on the mean's sum.

Where the noise is added: on the client, so the server never holds an un-noised update. Each
single update carries only noise multiplier sigma / sqrt(M), so the guarantee is for what the
aggregate releases (the global models), against anyone who sees only it: the usual trusted-
aggregator / secure-aggregation reading. A server that inspects single updates learns more.

The noise comes from the operating system's entropy, never from the run's seed: a seed the
server knows would let it subtract the noise. DP runs with sigma > 0 are therefore not
reproducible bit for bit (their clipping is).

``dp.clip-mode = per-tensor`` clips each trainable tensor to C on its own, as DP-FedSAM's code
does (for reproducing it): the update's norm is then bounded by C sqrt(L) for L tensors, not C,
and the reported epsilon understates the loss of privacy by that factor.

The privacy spent is accounted by Renyi DP of the sampled Gaussian mechanism (Mironov et al.
2019; Opacus's implementation), composed over the rounds and converted to (epsilon, delta),
each round with its own sampling rate q (a client's chance to be sampled: M of the connected
partitions, strategies/participation.py) and noise multiplier: sigma, or sigma sqrt(M'/M) when
only M' of the M sampled updates were accepted (their mean then carries sigma C / sqrt(M M')
over sensitivity C / M'; :func:`round_noise_multiplier`). The analysis assumes Poisson
sampling; the server samples a fixed number of clients, as the papers' code does. It is of the
uniform mean only: a server rule that reads single updates otherwise is refused under DP
(``ServerRule.dp_refusal``).
"""

from __future__ import annotations

import math
import secrets
from collections import OrderedDict
from collections.abc import Iterable, Mapping

import torch

from flatflower.common.tensors import global_norm

# Renyi orders: DP-FedSAM's accountant's grid (its eps_computer.py), whose published values
# Opacus's functions reproduce on it.
ORDERS = tuple(1.01 + 0.05 * i for i in range(1980))


def privatize(trained: Mapping[str, torch.Tensor], received: Mapping[str, torch.Tensor],
              trainable: Iterable[str], clip: float, noise_multiplier: float, sampled: int,
              mode: str = "global", generator: torch.Generator | None = None) -> OrderedDict:
    """The model a client uploads under DP: received + clip(trained - received) + noise, over
    the trainable tensors; every other tensor (buffers: BatchNorm's running statistics and
    counter) as received, never clipped nor noised, so nothing else leaks. The consequence: under
    DP the global buffers never move (the server refuses a reply whose buffers differ from what
    it sent, and keeps its own fixed: strategies/buffers.py ``check_reply``), the running
    statistics stay those of the initial model; with ``buffers = local`` each client still
    normalises with its own (kept on the client, never released)."""
    names = set(trainable)
    delta = {k: (trained[k].detach().cpu().double() - received[k].double()) for k in trained if k in names}
    if mode == "global":
        norm = float(global_norm(delta, torch.float64))
        factors = dict.fromkeys(delta, min(1.0, clip / norm) if norm > 0 else 1.0)
    else:  # per-tensor: DP-FedSAM's code
        factors = {k: min(1.0, clip / n) if (n := float(d.norm())) > 0 else 1.0 for k, d in delta.items()}
    std = noise_multiplier * clip / math.sqrt(sampled)
    if generator is None and std > 0:
        generator = torch.Generator().manual_seed(secrets.randbits(63))
    out = OrderedDict()
    for k, w in received.items():
        if k not in delta:
            out[k] = w.clone()
            continue
        d = delta[k] * factors[k]
        if std > 0:
            d = d + std * torch.randn(d.shape, generator=generator, dtype=torch.float64)
        out[k] = (received[k].double() + d).to(w.dtype)
    return out


# Each bound of honest_norm_range fails an honest update with probability at most p = e^-TAIL_X
# (8.8e-27). A refusal depends on the update, so the mechanism differs from the one accounted
# on an event of probability at most 2p per update, under either of two neighbouring datasets:
# the run is (epsilon, delta + n 2p (1 + e^epsilon))-DP over n checked updates (3e-18 for 800
# rounds of 10 clients at epsilon = 10, against dp.delta = 1e-5). A p near 1e-9 would not be
# negligible there: the factor 1 + e^epsilon is 22,027 at epsilon = 10.
TAIL_X = 60.0


def honest_norm_range(clip: float, noise_multiplier: float, sampled: int, dim: int, tensors: int = 1,
                      mode: str = "global", x: float = TAIL_X) -> tuple[float, float]:
    """The norms an honest upload can have under DP: (lo, hi), each violated with probability
    at most e^-x.

    An honest client sends u = c + n: its clipped update c, ||c|| <= C' (C' = C, or C sqrt(L)
    for ``per-tensor`` clipping of L tensors), plus noise n ~ N(0, s^2 I_d), s = sigma C / sqrt(M)
    over the d trainable coordinates. ||n||^2 / s^2 is chi-square with d degrees of freedom, and
    Laurent and Massart (2000, Lemma 1) bound both of its tails:
        P(chi2_d >= d + 2 sqrt(d x) + 2x) <= e^-x,    P(chi2_d <= d - 2 sqrt(d x)) <= e^-x.
    By the triangle inequality ||n|| - C' <= ||u|| <= ||n|| + C', so
        hi = C' + s sqrt(d + 2 sqrt(d x) + 2x),    lo = max(0, s sqrt(max(0, d - 2 sqrt(d x))) - C').
    Above hi: a client that did not clip (or scaled its update). Below lo (only when the noise
    dominates C'): a client that left out its noise, which would lower the noise of the round's
    mean and so every other client's privacy."""
    bound = clip * (math.sqrt(tensors) if mode == "per-tensor" else 1.0)
    s = noise_multiplier * clip / math.sqrt(max(1, sampled))
    hi = bound + s * math.sqrt(dim + 2 * math.sqrt(dim * x) + 2 * x)
    lo = max(0.0, s * math.sqrt(max(0.0, dim - 2 * math.sqrt(dim * x))) - bound)
    return lo, hi


def round_noise_multiplier(noise_multiplier: float, sampled: int, accepted: int) -> float | None:
    """The noise multiplier of a round's mean over its ``accepted`` updates, each noised for
    ``sampled`` clients: noise std sigma C / sqrt(sampled M') over sensitivity C / M', i.e.
    sigma sqrt(M'/M) (sigma itself when every sampled client was accepted; None: no update
    was accepted, nothing of any client's data reaches the model)."""
    if accepted <= 0 or sampled <= 0:
        return None
    return noise_multiplier * math.sqrt(min(accepted, sampled) / sampled)


class LedgerError(ValueError):
    """A line of a privacy ledger (privacy.jsonl) that no run of this config writes."""


def ledger_entries(lines: Iterable[str], noise_multiplier: float, where: str,
                   max_round: int = 2**31) -> list[tuple[int, float, float | None]]:
    """The entries (round, sampling rate q, the round mean's noise multiplier or None) of a
    privacy ledger's ``lines`` (privacy.jsonl: one JSON object per line, as server/run.py
    appends them), each checked against what a run with this ``noise_multiplier`` can have
    written: a noise multiplier above it (an edit to 1000 would lower epsilon) or a released
    round with q = 0 (it would be free) is refused; LedgerError naming ``where`` and the line."""
    import json

    out = []
    for number, line in enumerate(lines, 1):
        try:
            entry = json.loads(line)
            rnd, rate, sigma = int(entry["round"]), entry["dp_sampling_rate"], entry["dp_noise_multiplier"]
            if not (0.0 <= float(rate) <= 1.0 and (sigma is None or 0.0 <= float(sigma) < math.inf)):
                raise ValueError(f"sampling rate {rate!r}, noise multiplier {sigma!r}")
            if not 1 <= rnd < max_round:
                raise ValueError(f"round {rnd}")
            # what this run's config can have written: a round's mean carries sigma sqrt(M'/M) <= sigma
            # (a larger one, e.g. an edit to 1000, would lower epsilon), and a released round was
            # sampled with a chance q > 0 (q = 0 would make it free)
            if sigma is not None and (float(sigma) > noise_multiplier * (1 + 1e-12) or float(rate) == 0.0):
                raise ValueError(f"noise multiplier {sigma!r} at sampling rate {rate!r}, which no round of "
                                 f"this run (dp.noise-multiplier = {noise_multiplier:g}) releases; "
                                 "epsilon would be lower than spent")
            out.append((rnd, float(rate), None if sigma is None else float(sigma)))
        except (ValueError, KeyError, TypeError, RecursionError) as err:
            raise LedgerError(f"{where}, line {number}: not a privacy ledger entry ({err})") from None
    return out


_STEPS: dict[tuple[float, float], list[float]] = {}  # (q, sigma) -> one round's RDP, per process


def _step(key: tuple[float, float]) -> list[float]:
    """One round's RDP at (q, sigma) on ORDERS (Opacus's analysis; seconds to compute, so kept)."""
    from opacus.accountants.analysis.rdp import compute_rdp

    step = _STEPS.get(key)
    if step is None:
        step = ([math.inf] * len(ORDERS) if key[1] == 0 else
                [float(x) for x in compute_rdp(q=key[0], noise_multiplier=key[1], steps=1, orders=list(ORDERS))])
        _STEPS[key] = step
    return step


class PrivacyLedger:
    """The privacy spent so far: Renyi DP of the sampled Gaussian mechanism, one composition
    per round with that round's sampling rate q and noise multiplier."""

    def __init__(self):
        self.rdp = [0.0] * len(ORDERS)
        self.rounds = 0
        self._per_round: dict[tuple[float, float], list[float]] = {}  # (q, sigma) -> one round's RDP

    def add_round(self, rate: float, noise_multiplier: float | None) -> None:
        """One round that released the mean of its accepted clients' noised updates (rate: the
        chance q that a client was sampled; noise_multiplier: that of the mean, None when no
        update was accepted: nothing released, nothing spent)."""
        if noise_multiplier is None:
            return
        key = (min(1.0, max(0.0, rate)), noise_multiplier)
        step = self._per_round.get(key)
        if step is None:
            step = self._per_round[key] = _step(key)
        self.rdp = [a + b for a, b in zip(self.rdp, step)]
        self.rounds += 1

    def epsilon(self, delta: float) -> float:
        """epsilon of (epsilon, delta)-DP after the rounds added (inf without noise; 0 before any)."""
        from opacus.accountants.analysis.rdp import get_privacy_spent

        if self.rounds == 0:
            return 0.0
        if any(math.isinf(r) for r in self.rdp):
            return math.inf
        eps, _ = get_privacy_spent(orders=list(ORDERS), rdp=self.rdp, delta=delta)
        return float(eps)
