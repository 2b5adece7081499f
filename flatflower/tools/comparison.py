"""``flatflower report``'s comparison of the methods: each one against the best on its runs'
last-k accuracy (tools/stats.py: paired t on the runs they share, Holm-corrected), as a table,
report.json's ``comparison``, the per-algorithm CSV and a PNG of each method's mean with its
95% interval over seeds.

A run is paired by its pairing key (report.py: ``pairing_key``, the same partition and seed);
two runs of one method with the same key (the same seed run twice, e.g. on two machines) are
not paired with anything.
"""

from __future__ import annotations

import csv
from collections.abc import Hashable, Iterable, Sequence
from pathlib import Path
from typing import Any

from flatflower.tools import stats

METRIC = "last_k_mean"  # each run's mean accuracy over its last k rounds
CSV_COMPARISON = ("test", "n", "difference", "statistic", "p", "p_holm", "wilcoxon_p", "wilcoxon_p_holm",
                  "verdict", "note")


def samples(entries: Iterable[tuple[str, Hashable, str, float]]) -> dict[str, dict[Hashable, float]]:
    """(algorithm, pairing key, run name, value) -> algorithm -> {key: value}; a key that two
    runs of one algorithm share becomes each run's own (key, run name), which pairs with nothing."""
    seen: dict[str, dict[Hashable, list[tuple[str, float]]]] = {}
    for algorithm, key, name, value in entries:
        seen.setdefault(algorithm, {}).setdefault(key, []).append((name, value))
    return {algorithm: {(key if len(runs) == 1 else (key, name)): value
                        for key, runs in by_key.items() for name, value in runs}
            for algorithm, by_key in seen.items()}


def compare(entries: Iterable[tuple[str, Hashable, str, float]], min_gap: float = 0.0) -> dict[str, Any] | None:
    """report.json's ``comparison``: the metric, the default test, alpha, min_gap, the best
    algorithm and one row per other algorithm (None with fewer than two algorithms)."""
    by_algorithm = samples(entries)
    if len(by_algorithm) < 2:
        return None
    best, rows = stats.compare_to_best(by_algorithm, min_gap=min_gap)
    return {"metric": METRIC, "test": stats.DEFAULT_TEST, "alpha": stats.ALPHA, "min_gap": min_gap,
            "holm": "Holm's step-down over the comparisons with a test", "best": best,
            "rows": [row.as_dict() for row in rows]}


def _p(value: float | None) -> str:
    return "-" if value is None else ("<0.0001" if value < 1e-4 else f"{value:.4f}")


def table(comparison: dict[str, Any]) -> list[dict[str, str]]:
    """The comparison's rows as table cells (the gap in accuracy points)."""
    def gap(value: float | None) -> str:
        return "-" if value is None else f"{100 * value:+.2f}"

    return [{"algorithm": row["algorithm"], "test": row["test"] or "none", "n": str(row["n"]),
             "gap to best (points)": gap(row["difference"]),
             "statistic": "-" if row["statistic"] is None else f"{row['statistic']:.3f}",
             "p": _p(row["p"]), "p (Holm)": _p(row["p_holm"]), "Wilcoxon p (Holm)": _p(row["wilcoxon_p_holm"]),
             "verdict": row["verdict"], "note": row["note"] or ""}
            for row in comparison["rows"]]


def title(comparison: dict[str, Any], last_k: int) -> str:
    gap = f"; a gap below {100 * comparison['min_gap']:.2f} points is ≈ best" if comparison["min_gap"] else ""
    return (f"Each algorithm vs the best ({comparison['best']}) on the last-{last_k}-round accuracy: "
            f"{comparison['test']} test on the runs they share (same partition and seed), Welch where "
            f"none pair; p Holm-adjusted, ≈ best: p >= {comparison['alpha']}{gap}")


def write_algorithms_csv(grouped: Sequence[dict[str, Any]], comparison: dict[str, Any] | None,
                         path: Path) -> Path:
    """One row per algorithm: report.json's ``by_algorithm`` row and its comparison with the
    best (the best's verdict "best"; every comparison column empty with one algorithm)."""
    rows_by = {row["algorithm"]: row for row in (comparison or {}).get("rows", [])}
    fields: list[str] = []
    for row in grouped:
        fields += [k for k in row if k not in fields]
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[*fields, *CSV_COMPARISON])
        writer.writeheader()
        for row in grouped:
            versus = rows_by.get(row["algorithm"], {})
            if comparison is not None and row["algorithm"] == comparison["best"]:
                versus = {"verdict": "best"}
            cells = {**row, **{k: versus.get(k) for k in CSV_COMPARISON}}
            writer.writerow({k: "" if v is None else v for k, v in cells.items()})
    return path


def plot_intervals(grouped: Sequence[dict[str, Any]], values: dict[str, list[float]],
                   comparison: dict[str, Any] | None, out_png: Path, last_k: int, what: str) -> Path:
    """Each algorithm's mean last-k accuracy with its 95% interval as whiskers (none for one
    seed), each seed's value as a dot, coloured by the comparison's verdict."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    verdicts = {row["algorithm"]: row["verdict"] for row in (comparison or {}).get("rows", [])}
    if comparison is not None:
        verdicts[comparison["best"]] = "best"
    colors = {"best": "tab:green", "≈ best": "tab:blue", "worse": "tab:red"}
    rows = [row for row in grouped if row.get(METRIC) is not None]
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.6 * len(rows) + 2), 4.5))
    try:
        labelled: set[str] = set()
        for i, row in enumerate(rows):
            verdict = verdicts.get(row["algorithm"], "not testable")
            color = colors.get(verdict, "tab:gray")
            ci = row.get(f"{METRIC[:-len('_mean')]}_ci95")
            ax.errorbar([i], [100 * row[METRIC]], yerr=None if ci is None else [[100 * ci], [100 * ci]],
                        fmt="o", color=color, capsize=5, label=None if verdict in labelled else verdict)
            labelled.add(verdict)
            seeds = values.get(row["algorithm"], [])
            ax.plot([i + 0.15] * len(seeds), [100 * v for v in seeds], ".", color=color, alpha=0.5)
        ax.set_xticks(range(len(rows)), [row["algorithm"] for row in rows], rotation=45, ha="right")
        ax.set_ylabel(f"last-{last_k}-round {what} (%)")
        ax.set_title("Mean and 95% CI over seeds (dots: the seeds; no whisker: one seed)", fontsize=10)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out_png, format="png", dpi=110)
    finally:
        plt.close(fig)
    return out_png
