"""Statistics over seeds for ``flatflower report``: a t-based 95% interval of a mean, and each
method compared with the best one, Holm-corrected.

* :func:`mean_interval`: mean ± t(0.975, n-1) · s / √n, s the sample standard deviation
  (ddof = 1). One value has no interval: none is made up (``half_width`` None, a note says so).
* :func:`compare_to_best`: the best method is the one with the highest mean; every other one is
  compared with it on the runs they share (same pairing key: the same partition and seed), by
  the **paired t-test** (the default: with 3 seeds a Wilcoxon signed-rank test can never reach
  p < 0.05, its smallest two-sided p being 2 / 2^n). Where the two share fewer than 2 runs but
  each has at least 2, Welch's unpaired t-test, labelled so; otherwise no test ("not
  testable", never a claim). The Wilcoxon signed-rank p is given beside the paired t where there
  are at least :data:`WILCOXON_MIN_PAIRS` pairs.
* :func:`holm`: Holm's step-down adjustment over the family of comparisons made.

A method is "≈ best" (indistinguishable from it) when its Holm-adjusted p is at least
:data:`ALPHA`, or when the gap is smaller than ``min_gap`` (a spread that is not the methods',
e.g. the same run on two machines); "worse" when the adjusted p is below ALPHA and the best is
ahead on the runs compared; "better on the runs compared" when the other way round (the best
has the highest mean over all its runs, not necessarily over the shared ones).
Differences that do not vary (every pair the same gap) leave the t statistic undefined: equal
numbers are "≈ best" (p = 1), a constant non-zero gap is "not testable".
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

ALPHA = 0.05
LEVEL = 0.95
DEFAULT_TEST = "paired t"
WELCH = "Welch t (unpaired)"
WILCOXON_MIN_PAIRS = 6  # the fewest pairs whose exact two-sided p can fall below 0.05 (2 / 2^6)
FLAT = 1e-12  # a spread of differences at or below this is float rounding, not variation


@dataclass(frozen=True)
class Interval:
    """A mean over ``n`` values with the half-width of its t-based interval (None for n < 2)."""

    mean: float
    half_width: float | None
    n: int
    note: str | None = None


def mean_interval(values: Sequence[float], level: float = LEVEL) -> Interval:
    """mean ± t((1 + level) / 2, n - 1) · s / √n over ``values`` (s: ddof = 1)."""
    from scipy import stats

    x = np.asarray(values, dtype=float)
    if x.size == 0:
        raise ValueError("no values")
    if x.size == 1:
        return Interval(float(x[0]), None, 1, "n=1: no interval")
    s = float(x.std(ddof=1))
    half = float(stats.t.ppf((1 + level) / 2, x.size - 1)) * s / math.sqrt(x.size)
    return Interval(float(x.mean()), half, int(x.size))


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in the order given: sorted ascending, the i-th
    (from 0) becomes max over j <= i of min(1, (m - j) · p_(j))."""
    order = sorted(range(len(p_values)), key=lambda i: p_values[i])
    adjusted = [0.0] * len(p_values)
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(p_values) - rank) * p_values[i]))
        adjusted[i] = running
    return adjusted


@dataclass
class Comparison:
    """One method against the best: the test made (None: none), over ``n`` pairs (paired) or
    runs of each (Welch: ``n`` the smaller), the mean gap (best minus it, on the runs
    compared), the statistic, raw and Holm-adjusted p, and the verdict."""

    algorithm: str
    test: str | None
    n: int
    difference: float | None = None
    statistic: float | None = None
    p: float | None = None
    p_holm: float | None = None
    wilcoxon_p: float | None = None
    wilcoxon_p_holm: float | None = None
    verdict: str = "not testable"
    note: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _flat(x: np.ndarray) -> bool:
    return x.size < 2 or float(np.ptp(x)) <= FLAT


def paired(best: Sequence[float], other: Sequence[float], algorithm: str) -> Comparison:
    """The paired t-test of ``best - other`` (n >= 2 pairs), with Wilcoxon's p where n allows."""
    from scipy import stats

    d = np.asarray(best, dtype=float) - np.asarray(other, dtype=float)
    out = Comparison(algorithm, DEFAULT_TEST, int(d.size), difference=float(d.mean()))
    if _flat(d):
        if abs(float(d.mean())) <= FLAT:
            out.statistic, out.p, out.note = 0.0, 1.0, "equal on every pair"
        else:
            out.test, out.note = None, "the same gap on every pair: the t statistic is undefined"
        return out
    result = stats.ttest_rel(best, other)
    out.statistic, out.p = float(result.statistic), float(result.pvalue)
    if d.size >= WILCOXON_MIN_PAIRS:
        out.wilcoxon_p = float(stats.wilcoxon(d).pvalue)
    return out


def welch(best: Sequence[float], other: Sequence[float], algorithm: str) -> Comparison:
    """Welch's unpaired t-test of the two means (each at least 2 runs)."""
    from scipy import stats

    a, b = np.asarray(best, dtype=float), np.asarray(other, dtype=float)
    out = Comparison(algorithm, WELCH, int(min(a.size, b.size)), difference=float(a.mean() - b.mean()))
    if _flat(a) and _flat(b):
        if abs(out.difference) <= FLAT:
            out.statistic, out.p, out.note = 0.0, 1.0, "equal in every run"
        else:
            out.test, out.note = None, "no spread in either method's runs: the t statistic is undefined"
        return out
    result = stats.ttest_ind(a, b, equal_var=False)
    out.statistic, out.p = float(result.statistic), float(result.pvalue)
    return out


def compare_one(best: Mapping[Hashable, float], other: Mapping[Hashable, float], algorithm: str) -> Comparison:
    """``other`` (pairing key -> value) against ``best``: paired on their shared keys (at least
    2), else Welch over all their runs (at least 2 each), else no test, saying why."""
    shared = [key for key in best if key in other]
    if len(shared) >= 2:
        return paired([best[k] for k in shared], [other[k] for k in shared], algorithm)
    if len(best) >= 2 and len(other) >= 2:
        out = welch(list(best.values()), list(other.values()), algorithm)
        out.note = out.note or f"{len(shared)} run(s) on the same partition and seed: compared unpaired"
        return out
    return Comparison(algorithm, None, len(shared),
                      note=f"{len(shared)} shared run(s), and fewer than 2 runs of "
                           f"{'it' if len(other) < 2 else 'the best'}: no test")


def compare_to_best(samples: Mapping[str, Mapping[Hashable, float]], min_gap: float = 0.0,
                    alpha: float = ALPHA) -> tuple[str, list[Comparison]]:
    """(the best method, each other method's :class:`Comparison`), in ``samples``' order.
    ``samples``: method -> {pairing key: value}, higher is better; the best has the highest
    mean (the first of equals). p-values are Holm-adjusted over the comparisons with a test,
    Wilcoxon's over those with a Wilcoxon p."""
    best = max(samples, key=lambda name: float(np.mean(list(samples[name].values()))))
    rows = [compare_one(samples[best], values, name) for name, values in samples.items() if name != best]
    for p_key in ("p", "wilcoxon_p"):
        tested = [row for row in rows if getattr(row, p_key) is not None]
        for row, adjusted in zip(tested, holm([getattr(row, p_key) for row in tested])):
            setattr(row, f"{p_key}_holm", adjusted)
    for row in rows:
        row.verdict = verdict(row, min_gap, alpha)
    return best, rows


def verdict(row: Comparison, min_gap: float = 0.0, alpha: float = ALPHA) -> str:
    """"≈ best", "worse", "better on the runs compared" or "not testable" (see the module)."""
    if row.p_holm is None:
        return "not testable"
    if row.p_holm >= alpha or abs(row.difference or 0.0) < min_gap:
        return "≈ best"
    return "worse" if (row.difference or 0.0) > 0 else "better on the runs compared"
