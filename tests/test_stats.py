"""tools/stats.py: intervals, paired comparisons and Holm's correction, from the math."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats as scipy_stats

from flatflower.tools.stats import (
    DEFAULT_TEST,
    WELCH,
    compare_one,
    compare_to_best,
    holm,
    mean_interval,
    paired,
)

T_975_2 = 4.302652729749462  # t(0.975, 2 degrees of freedom): 4.303 in every printed t table


def test_t_interval_by_hand():
    """0.1, 0.2, 0.4: mean 0.7/3, s^2 = (0.0178 + 0.0011 + 0.0278) / 2 = 0.07/3, so the
    half-width is t(0.975, 2) * sqrt(0.07/3) / sqrt(3) = t * sqrt(0.07) / 3."""
    iv = mean_interval([0.1, 0.2, 0.4])
    assert iv.n == 3 and iv.note is None
    assert iv.mean == pytest.approx(0.7 / 3)
    assert iv.half_width == pytest.approx(T_975_2 * math.sqrt(0.07) / 3, rel=1e-12)
    assert iv.half_width == pytest.approx(4.303 * 0.2645751 / 3, rel=1e-4)  # the printed table's t
    # two values a, b: s = |a - b| / sqrt(2), t(0.975, 1) = 12.706
    assert mean_interval([0.5, 0.7]).half_width == pytest.approx(12.7062047 * 0.2 / math.sqrt(2) / math.sqrt(2),
                                                                 rel=1e-7)


def test_one_value_has_no_interval_and_says_so():
    iv = mean_interval([0.8])
    assert (iv.mean, iv.half_width, iv.n) == (0.8, None, 1)
    assert iv.note == "n=1: no interval"
    with pytest.raises(ValueError):
        mean_interval([])


def test_paired_t_statistic_by_hand():
    """Differences 0.1, 0.2, 0.4: t = mean / (s / sqrt(3)) = (0.7/3) / (sqrt(0.07)/3) =
    sqrt(7); with 2 degrees of freedom the t CDF is 1/2 + t / (2 sqrt(2 + t^2)), so the
    two-sided p is 1 - sqrt(7)/3."""
    row = paired([0.6, 0.7, 0.9], [0.5, 0.5, 0.5], "other")
    assert row.test == DEFAULT_TEST and row.n == 3
    assert row.difference == pytest.approx(0.7 / 3)
    assert row.statistic == pytest.approx(math.sqrt(7), rel=1e-9)
    assert row.p == pytest.approx(1 - math.sqrt(7) / 3, rel=1e-9)
    assert row.wilcoxon_p is None  # 3 pairs: Wilcoxon's smallest p is 2/8, it is not given


def test_holm_step_down_by_hand():
    """Sorted 0.005, 0.01, 0.03, 0.04 times 4, 3, 2, 1: 0.02, 0.03, 0.06, 0.04 -> the running
    maximum keeps 0.06 for the last; returned in the order given."""
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert holm([0.5, 0.6]) == pytest.approx([1.0, 1.0])  # capped at 1, never decreasing
    assert holm([0.02]) == pytest.approx([0.02])  # a family of one: no correction
    assert holm([]) == []


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_agrees_with_scipy(seed):
    rng = np.random.default_rng(seed)
    a, b = rng.normal(0.8, 0.02, 7), rng.normal(0.78, 0.02, 7)
    row = paired(a, b, "x")
    ref = scipy_stats.ttest_rel(a, b)
    assert (row.statistic, row.p) == pytest.approx((ref.statistic, ref.pvalue), rel=1e-12)
    assert row.wilcoxon_p == pytest.approx(scipy_stats.wilcoxon(a - b).pvalue)  # 7 pairs: given
    welch = compare_one(dict(enumerate(a)), {("other", i): v for i, v in enumerate(b[:4])}, "x")
    ref = scipy_stats.ttest_ind(a, b[:4], equal_var=False)
    assert welch.test == WELCH and (welch.statistic, welch.p) == pytest.approx((ref.statistic, ref.pvalue))


def test_differences_that_do_not_vary():
    """Equal numbers on every pair: indistinguishable (p = 1). The same non-zero gap on every
    pair (here with float rounding, 0.9 - 0.8 != 0.7 - 0.6 in binary): no t, never p ~ 0."""
    equal = paired([0.7, 0.8, 0.9], [0.7, 0.8, 0.9], "same")
    assert (equal.statistic, equal.p, equal.note) == (0.0, 1.0, "equal on every pair")
    gap = paired([0.7, 0.8, 0.9], [0.6, 0.7, 0.8], "gap")
    assert gap.test is None and gap.p is None and "undefined" in gap.note
    best, rows = compare_to_best({"a": {0: 0.7, 1: 0.8, 2: 0.9}, "b": {0: 0.6, 1: 0.7, 2: 0.8},
                                  "c": {0: 0.7, 1: 0.8, 2: 0.9}})
    assert best == "a"
    assert [(r.algorithm, r.verdict, r.p_holm) for r in rows] == [("b", "not testable", None), ("c", "≈ best", 1.0)]


def test_unpaired_and_too_few_runs():
    """No shared run: Welch over the runs, labelled; one run of either: no test, said why."""
    best = {("p", 0): 0.80, ("p", 1): 0.82, ("p", 2): 0.84}
    welch = compare_one(best, {("q", 0): 0.70, ("q", 1): 0.71}, "other")
    assert welch.test == WELCH and welch.p is not None
    assert "0 run(s) on the same partition and seed: compared unpaired" in welch.note
    one = compare_one(best, {("q", 0): 0.7}, "other")
    assert one.test is None and one.p is None and one.verdict == "not testable"
    assert "fewer than 2 runs of it: no test" in one.note
    shared_one = compare_one({0: 0.8}, {0: 0.7}, "other")
    assert shared_one.test is None and "1 shared run(s)" in shared_one.note


def test_compare_to_best_holm_and_verdicts():
    """Three methods against the best over four seeds: raw p-values from the paired t, Holm's
    adjustment over the two, and the verdicts from the adjusted p and the gap's sign."""
    best = {s: v for s, v in enumerate([0.90, 0.91, 0.92, 0.93])}
    far = {s: v for s, v in enumerate([0.80, 0.82, 0.81, 0.83])}  # clearly worse
    near = {s: v for s, v in enumerate([0.91, 0.90, 0.93, 0.91])}  # gaps -0.01, +0.01, -0.01, +0.02
    name, rows = compare_to_best({"near": near, "best": best, "far": far})
    assert name == "best" and [r.algorithm for r in rows] == ["near", "far"]
    raw = [scipy_stats.ttest_rel(list(best.values()), list(o.values())).pvalue for o in (near, far)]
    assert [r.p for r in rows] == pytest.approx(raw)
    assert [r.p_holm for r in rows] == pytest.approx(holm(raw))
    assert rows[0].p_holm > 0.5 and rows[0].verdict == "≈ best"
    assert rows[1].p_holm < 0.05 and rows[1].verdict == "worse"
    # a gap below min_gap (e.g. the machines' spread) is never called worse
    _, rows = compare_to_best({"best": best, "far": far}, min_gap=0.2)
    assert rows[0].verdict == "≈ best"


def test_better_on_the_shared_runs_is_not_called_worse():
    """The best has the highest mean over all its runs; on the runs it shares with another it
    can be behind: that is said, not "worse". Gaps -0.05, -0.06, -0.055: t = -0.055 / (0.005 /
    sqrt(3)), p = 1 - |t| / sqrt(2 + t^2) (2 degrees of freedom)."""
    best = {0: 0.80, 1: 0.81, 2: 0.805, "own": 0.99, "own2": 0.98}
    other = {0: 0.85, 1: 0.87, 2: 0.86}
    (_, (row,)) = compare_to_best({"best": best, "other": other})
    t = -0.055 / (0.005 / math.sqrt(3))
    assert row.n == 3 and row.statistic == pytest.approx(t, rel=1e-9)
    assert row.p_holm == pytest.approx(1 - abs(t) / math.sqrt(2 + t * t), rel=1e-6)
    assert row.verdict == "better on the runs compared"
