"""The tuned Fashion-MNIST study's tables (docs/benchmarks.md, "Fashion-MNIST, tuned"), from the
records beside this file: each algorithm's tune.json, best.json, trials.csv and final runs
(<algorithm>/<algorithm>-s<seed>/metrics.jsonl), and the untuned study's ../fashion-mnist.csv.

    python docs/results/fashion-mnist-tuned/table.py       # prints the markdown tables

tests/test_tuned_study.py checks that docs/benchmarks.md holds exactly what this prints, and that
every record is what the tune's command makes.
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
UNTUNED = HERE.parent / "fashion-mnist.csv"
LAST_K = 10  # the study's last-k (docs/benchmarks.md reads the last 10 rounds' mean)
SEEDS = (0, 1, 2)


def tuned_algorithms() -> list[str]:
    """The algorithms whose piece has landed: a best.json and a final run for every seed."""
    return sorted(p.name for p in HERE.iterdir() if (p / "best.json").is_file()
                  and all((p / f"{p.name}-s{s}" / "metrics.jsonl").is_file() for s in SEEDS))


def last_k_mean(metrics: Path, k: int = LAST_K) -> float:
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    accs = [r["test_accuracy"] for r in rows if r.get("round", 0) > 0]
    return float(np.mean(accs[-k:]))


def tuned(algorithm: str) -> dict[int, float]:
    return {s: last_k_mean(HERE / algorithm / f"{algorithm}-s{s}" / "metrics.jsonl") for s in SEEDS}


def untuned(algorithm: str) -> dict[int, float]:
    with open(UNTUNED) as f:
        return {int(r["seed"]): float(r["last_k_mean"]) for r in csv.DictReader(f) if r["algorithm"] == algorithm}


# the papers' claims that two methods of the study order (winner, loser, whose claim)
CLAIMS = (("fedsam", "fedavg", "FedSAM (Qu et al. 2022)"), ("mofedsam", "fedsam", "MoFedSAM (Qu et al. 2022)"),
          ("fedgmt", "fedsam", "FedGMT (Li et al. 2025)"), ("fedgmt-v2", "fedgmt", "FedGMT-v2 (Li et al. 2025)"),
          ("fednsam", "fedsam", "FedNSAM (Liu et al. 2025)"), ("fedtoga", "fedsam", "FedTOGA (Li et al.)"),
          ("fedsmoo", "fedsam", "FedSMOO (Sun et al. 2023)"), ("fedwmsam", "fedsam", "FedWMSAM (Li et al. 2025)"),
          ("fedgf", "fedsam", "FedGF (Lee & Yoon 2024)"))


def claims(after: dict[str, dict[int, float]], before: dict[str, dict[int, float]]) -> str:
    """Each claim whose two methods have landed: the winner's lead in each column, its paired-t
    p (Holm-adjusted over the claims of that column) and what the column says."""
    from flatflower.tools.stats import holm, paired

    rows = [(w, l, who) for w, l, who in CLAIMS if w in after and l in after]
    if not rows:
        return ""
    out = ("\nThe papers' claims among the landed methods (the winner's lead in points; paired t over "
           "seeds 0-2, Holm-adjusted over the claims of each column; holds / reversed: p < 0.05)\n\n"
           "| claim | tuned: lead, p | tuned says | untuned: lead, p | untuned says |\n|---|---|---|---|---|\n")
    cells = {}
    for label, data in (("tuned", after), ("untuned", before)):
        tests = [paired([data[w][s] for s in SEEDS], [data[l][s] for s in SEEDS], w) for w, l, _ in rows]
        adjusted = holm([t.p if t.p is not None else 1.0 for t in tests])
        cells[label] = [(t.difference, p, "holds" if p < 0.05 and t.difference > 0 else
                         "reversed" if p < 0.05 else "not significant") for t, p in zip(tests, adjusted)]
    for i, (w, l, who) in enumerate(rows):
        (ta, tp, ts), (ua, up, us) = cells["tuned"][i], cells["untuned"][i]
        out += (f"| {who}: {w} > {l} | {100 * ta:+.2f}, {tp:.3f} | {ts} | {100 * ua:+.2f}, {up:.3f} | {us} |\n")
    return out


def _fmt_params(params: dict) -> str:
    return ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in params.items())


def tables() -> str:
    """The markdown: the side-by-side table, then each tuned algorithm against the best tuned one."""
    sys.path.insert(0, str(HERE.parents[2]))
    from flatflower.tools.stats import compare_to_best, mean_interval

    algorithms = tuned_algorithms()
    if not algorithms:
        return "(no piece has landed yet)\n"
    after = {a: tuned(a) for a in algorithms}
    before = {a: untuned(a) for a in algorithms}
    rank_after = {a: i + 1 for i, a in enumerate(sorted(algorithms, key=lambda a: -np.mean(list(after[a].values()))))}
    rank_before = {a: i + 1 for i, a in enumerate(sorted(algorithms, key=lambda a: -np.mean(list(before[a].values()))))}
    lines = ["| algorithm | tuned setting (best trial) | trials: complete / pruned / failed | tuned: last-10 mean % "
             "± 95% CI | rank | untuned (the study): last-10 mean % ± 95% CI | rank |",
             "|---|---|---|---|---|---|---|"]
    for a in sorted(algorithms, key=lambda a: rank_after[a]):
        best = json.loads((HERE / a / "best.json").read_text())
        states = best["budget"]["trials_by_state"]
        t, u = mean_interval(list(after[a].values())), mean_interval(list(before[a].values()))
        lines.append(f"| {a} | {_fmt_params(best['best']['params'])} | {states['complete']} / {states['pruned']} / "
                     f"{states['fail']} | {100 * t.mean:.2f} ± {100 * t.half_width:.2f} | {rank_after[a]} | "
                     f"{100 * u.mean:.2f} ± {100 * u.half_width:.2f} | {rank_before[a]} |")
    out = "\n".join(lines) + "\n"
    for label, samples in (("tuned", after), ("untuned", before)):
        best, rows = compare_to_best(samples)
        out += (f"\n{label}: each against the best ({best}), paired t over seeds 0-2 (the same partition and seeds), "
                "Holm-adjusted\n\n| algorithm | behind the best (points) | p (Holm) | verdict |\n|---|---|---|---|\n")
        for row in rows:
            p = "-" if row.p_holm is None else f"{row.p_holm:.3f}"
            out += f"| {row.algorithm} | {100 * row.difference:.2f} | {p} | {row.verdict} |\n"
    return out + claims(after, before)


if __name__ == "__main__":
    print(tables(), end="")
