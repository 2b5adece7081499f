"""Summarize finished (or running) runs: tables, plots, JSON and CSV.

Reads what a run directory holds (``config.json``, ``metrics.jsonl``: one JSON object per
round, ``clients.jsonl``: one per client per round) and backs ``flatflower report RUN_DIR
[RUN_DIR ...]``: accuracy per run and per algorithm (mean ± std over seeds, with std bands in
the plots), client drift per algorithm (cosine of the clients' updates to their mean, spread of
their norms), flatness (FedNSAM's flatness distance, sharpness and the Hessian's top eigenvalue,
where the runs measured them), and a warning (``--strict``: a refusal) when the runs compared differ in their
setting (clients, rounds, dataset, partition). Per algorithm, the final and last-k accuracy's mean
with its t-based 95% interval over seeds, and each algorithm against the best on the runs they
share (tools/comparison.py, tools/stats.py: paired t, Holm-corrected); a warning when the runs ran
on different machines (config.json's ``machines``, server/machine.py).

The privacy a run spent (``dp_epsilon``) is recomputed from its privacy ledger
(``privacy.jsonl``, each round's sampling rate and noise multiplier) through the accountant
(common/privacy.py), never taken from metrics.jsonl's copy; the files the report reads are
checked against the run's manifest.json, sealed under the user's record key
(server/manifest.py): a seal that does not match, or a ledger that is not as the run wrote it,
is refused in one line; a manifest that is not sealed by this user (an older flatflower's,
another machine's or user's, none in a DP run) and any other file that differs from its record
are one warning line each (:func:`check_records`).

A run's accuracy is the server's test split's (``test_accuracy``); a run with no evaluation set
on the server (``partition = local`` without ``data-dir``) is measured by its federated
evaluation instead (``federated_accuracy``: the clients' own held-out data, example-weighted),
which the report says (``RunSummary.measure``, the plot's axis, a note under the table).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table
from rich.text import Text

from flatflower.common.schema import printable
from flatflower.tools.parsers import FLATNESS_FILE
from flatflower.tools.parsers import report as build_parser  # noqa: F401 (flatflower.tools.cli, tests)
from flatflower.tools.runfiles import RunFileError, number, read_json, read_jsonl, table, whole
from flatflower.tools.comparison import compare, plot_intervals, write_algorithms_csv
from flatflower.tools.comparison import table as comparison_table
from flatflower.tools.comparison import title as comparison_title
from flatflower.tools.stats import mean_interval

CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"
CLIENTS_FILE = "clients.jsonl"
LEDGER_FILE = "privacy.jsonl"
RECORDED = (CONFIG_FILE, METRICS_FILE, CLIENTS_FILE, LEDGER_FILE)  # what the report reads of what manifest.json records
SETTING = ("clients", "rounds", "dataset", "partition")  # what makes two runs comparable


class ReportError(RunFileError):
    """A run directory is missing, unreadable or holds no rounds (tools/runfiles.py: a damaged
    file is one of these too, one line naming it)."""


@dataclass
class RunSummary:
    """The curves of one run, as read from its directory."""

    run_dir: Path
    label: str
    algorithm: str
    seed: int | None
    rounds: list[int] = field(default_factory=list)
    accuracy: list[float] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    bytes_total: int = 0
    cumulative_bytes: list[int] = field(default_factory=list)  # bytes down + up up to each round
    config: dict[str, Any] = field(default_factory=dict)
    # config.json's record of the run beside its config: the engine, the versions (and code)
    record: dict[str, Any] = field(default_factory=dict)
    rows: list[dict[str, Any]] = field(default_factory=list)  # metrics.jsonl
    drift: dict[int, dict[str, float]] = field(default_factory=dict)  # round -> clients.jsonl summary
    # what ``accuracy`` and ``loss`` measure: "test" (the server's test split) or "federated"
    # (federated evaluation, for a run with no evaluation set on the server)
    measure: str = "test"
    # the privacy spent, from the ledger (check_records): after its last entry, and by round
    # (the epsilon metrics.jsonl's row of that round should hold); None: no ledger, or no noise
    epsilon: float | None = None
    epsilon_by_round: dict[int, float | None] = field(default_factory=dict)


# ---------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------


def _read_config(run_dir: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the ``config`` section of ``config.json``, the whole file); empty when the file or
    key is missing."""
    path = run_dir / CONFIG_FILE
    if not path.is_file():
        return {}, {}
    data = table(read_json(path, infinity=True), str(path))
    section = data.get("config", {})
    return (section if isinstance(section, dict) else {}), data


# metrics.jsonl fields the report reads, and their range (accuracies are fractions)
FRACTIONS = ("test_accuracy", "federated_accuracy")
NUMBERS = ("test_loss", "federated_loss", "seconds", "flatness_seconds", "flatness_distance", "sharpness",
           "hessian_max_eig", "hessian_trace", "dp_epsilon", "train_loss")
COUNTS = ("bytes_down", "bytes_up")


def _checked_row(row: Any, where: str) -> dict[str, Any]:
    """A metrics.jsonl row whose fields the report reads are what flatflower writes
    (RunFileError naming the line and the field otherwise)."""
    row = table(row, where)
    if "round" not in row:
        raise RunFileError(f"{where}: no round")
    whole(row, "round", where)
    for key in FRACTIONS:
        number(row, key, where, 0.0, 1.0)
    for key in NUMBERS:
        number(row, key, where)
    for key in COUNTS:
        whole(row, key, where)
    return row


def _read_metrics(path: Path) -> tuple[list[dict[str, Any]], str]:
    """(one dict per round line that holds the run's accuracy, sorted by round; the measure:
    "test", or "federated" for a run whose lines hold no test_accuracy at all). A truncated or
    blank line is skipped."""
    rows = [_checked_row(row, f"{path}, line {n}") for n, row in read_jsonl(path)]
    measure = "test" if any("test_accuracy" in row for row in rows) or not rows else "federated"
    rows = [row for row in rows if isinstance(row.get(f"{measure}_accuracy"), (int, float))]
    return sorted(rows, key=lambda row: int(row["round"])), measure


def _read_drift(path: Path) -> dict[int, dict[str, float]]:
    """Round -> client drift of that round (server/tensorboard.py: drift) from clients.jsonl."""
    from flatflower.server.tensorboard import drift

    if not path.is_file():
        return {}
    by_round: dict[int, list[dict[str, Any]]] = {}
    for n, row in read_jsonl(path):
        where = f"{path}, line {n}"
        rnd = whole(table(row, where), "round", where)
        if rnd is None:
            raise RunFileError(f"{where}: no round")
        by_round.setdefault(rnd, []).append(row)
    return {r: d for r, rows in sorted(by_round.items()) if (d := drift(rows))}


def setting(config: dict[str, Any]) -> dict[str, str]:
    """The parts of a run's config that make runs comparable, as text ('?' when unknown)."""
    scheme = config.get("partition", "?")
    if scheme == "?":
        return {"clients": str(config.get("num-partitions", "?")),
                "rounds": str(config.get("num-server-rounds", "?")),
                "dataset": str(config.get("dataset", "?")), "partition": "?"}
    if scheme in ("dirichlet", "dirichlet-balanced"):
        scheme = f"{scheme}({config.get('dirichlet-alpha', '?')})"
    elif scheme == "pathological":
        scheme = f"{scheme}({config.get('classes-per-client', '?')} classes)"
    seed = config.get("partition-seed", -1)
    seed = config.get("seed", "?") if seed == -1 else seed
    if scheme not in ("natural", "local"):  # synthetic-fedprox's seed is its generator's, named with the dataset
        scheme = f"{scheme}, partition seed {seed}"
    dataset = str(config.get("dataset", "?"))
    if dataset == "synthetic-fedprox":
        dataset += (f"({config.get('synthetic-alpha', '?')}, {config.get('synthetic-beta', '?')}; "
                    f"seed {seed})")
    return {"clients": str(config.get("num-partitions", "?")),
            "rounds": str(config.get("num-server-rounds", "?")), "dataset": dataset,
            "partition": scheme}


def setting_differences(runs: Sequence[RunSummary]) -> list[str]:
    """What differs between the runs' settings, e.g. ``clients: 3 (run-a); 20 (run-b)``."""
    out = []
    settings = [setting(run.config) for run in runs]
    for key in SETTING:
        values: dict[str, list[str]] = {}
        for run, s in zip(runs, settings):
            values.setdefault(s[key], []).append(run.run_dir.name)
        if len(values) > 1:
            out.append(f"{key}: " + "; ".join(f"{printable(v, 200)} ({', '.join(names[:3])}"
                                               f"{', ...' if len(names) > 3 else ''})"
                                               for v, names in values.items()))
    return out


def code_differences(runs: Sequence[RunSummary]) -> str | None:
    """``"<commit> (run-a, run-b); <commit>+modified (run-c)"`` when the runs that recorded
    their code (config.json's versions, from a git checkout) ran different code, else None."""
    codes: dict[str, list[str]] = {}
    for run in runs:
        versions = run.record.get("versions")
        code = versions.get("flatflower-code") if isinstance(versions, dict) else None
        if code is not None:
            codes.setdefault(printable(code, 60), []).append(run.run_dir.name)
    if len(codes) < 2 and not any(code.endswith("+modified") for code in codes):
        return None
    return "; ".join(f"{code} ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})"
                     for code, names in codes.items())


def machines(run: RunSummary) -> list[dict[str, Any]]:
    """The machines config.json records for a run (server/machine.py), in the order they ran
    it; [] for a run of a flatflower that recorded none."""
    recorded = run.record.get("machines")
    return [m for m in recorded if isinstance(m, dict) and isinstance(m.get("id"), str)] \
        if isinstance(recorded, list) else []


def machine_groups(runs: Sequence[RunSummary]) -> list[dict[str, Any]]:
    """One entry per machine the runs ran on: its id, a line describing it and its runs' names
    (a run resumed on another machine is under both)."""
    from flatflower.server.machine import describe

    groups: dict[str, dict[str, Any]] = {}
    for run in runs:
        for m in machines(run):
            group = groups.setdefault(m["id"], {"id": m["id"], "description": printable(describe(m), 300),
                                                "runs": []})
            if run.run_dir.name not in group["runs"]:
                group["runs"].append(run.run_dir.name)
    return list(groups.values())


def machine_differences(groups: Sequence[dict[str, Any]]) -> str | None:
    """``"<machine> (run-a, run-b); <machine> (run-c)"`` when the runs ran on more than one
    machine, else None."""
    if len(groups) < 2:
        return None
    return "; ".join(f"{g['description']} ({', '.join(g['runs'][:3])}{', ...' if len(g['runs']) > 3 else ''})"
                     for g in groups)


def pairing_key(run: RunSummary) -> tuple:
    """What makes two runs of different methods a pair: the same setting (clients, rounds,
    dataset, partition with its seed), the same seed and, where the run kept one, the same
    partition.json (its sha256: the partition itself)."""
    path = run.run_dir / "partition.json"
    partition = None
    if path.is_file():
        from flatflower.server.manifest import file_digest

        try:
            partition = file_digest(path)["sha256"]
        except OSError:
            partition = None
    return (*setting(run.config).values(), run.seed, partition)


def _make_label(config: dict[str, Any], run_dir: Path) -> str:
    """``"<algorithm> seed<seed>"`` from the config, else the directory name."""
    algorithm, seed = config.get("algorithm"), config.get("seed")
    if algorithm is None:
        return printable(run_dir.name, 200)
    return printable(f"{algorithm} seed{seed}" if seed is not None else str(algorithm), 200)


def load_run(run_dir: str | Path) -> RunSummary:
    """Read one run directory into a :class:`RunSummary`."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ReportError(f"run directory not found: {run_dir}")
    metrics_path = run_dir / METRICS_FILE
    if not metrics_path.is_file():
        raise ReportError(f"metrics file not found: {metrics_path}")
    rows, measure = _read_metrics(metrics_path)
    if not rows:
        raise ReportError(f"no rounds recorded in {metrics_path}")
    config, record = _read_config(run_dir)
    return RunSummary(
        config=config, record=record, rows=rows, drift=_read_drift(run_dir / CLIENTS_FILE),
        run_dir=run_dir,
        label=_make_label(config, run_dir),
        algorithm=printable(config.get("algorithm", run_dir.name), 200),
        seed=config.get("seed") if type(config.get("seed")) is int else None,
        rounds=[int(row["round"]) for row in rows],
        accuracy=[float(row[f"{measure}_accuracy"]) for row in rows],
        loss=[float(row.get(f"{measure}_loss") if row.get(f"{measure}_loss") is not None else float("nan"))
              for row in rows],
        measure=measure,
        bytes_total=sum(int(row.get("bytes_down", 0)) + int(row.get("bytes_up", 0)) for row in rows),
        cumulative_bytes=list(np.cumsum([int(row.get("bytes_down", 0)) + int(row.get("bytes_up", 0))
                                         for row in rows]).tolist()),
    )


# ---------------------------------------------------------------------------
# Summaries
# ---------------------------------------------------------------------------


def rounds_to_target(run: RunSummary, target: float | None) -> int | None:
    """The first round whose accuracy reaches ``target``; None if none does (or no target)."""
    if target is None:
        return None
    return next((r for r, acc in zip(run.rounds, run.accuracy) if acc >= target), None)


FLATNESS_SUMMARY = ("flatness_distance", "sharpness", "hessian_max_eig")


def curve(run: RunSummary, key: str) -> tuple[list[int], list[float]]:
    """(rounds, values) of a metrics.jsonl field over the rounds that hold a number for it."""
    pairs = [(int(row["round"]), float(row[key])) for row in run.rows
             if isinstance(row.get(key), (int, float)) and not isinstance(row.get(key), bool)]
    return [r for r, _ in pairs], [v for _, v in pairs]


def has_flatness(run: RunSummary) -> bool:
    return any(curve(run, key)[0] for key in FLATNESS_SUMMARY)


def flatness_summary(run: RunSummary, last_k: int) -> dict[str, float | None]:
    """The mean flatness distance over the last ``last_k`` rounds, and the last measured
    sharpness and top Hessian eigenvalue (the final model's, with flatness-every)."""
    _, distance = curve(run, "flatness_distance")
    tail = distance[-last_k:] if last_k > 0 else []
    out: dict[str, float | None] = {"flatness_distance": float(np.mean(tail)) if tail else None}
    for key in ("sharpness", "hessian_max_eig"):
        _, values = curve(run, key)
        out[key] = values[-1] if values else None
    return out


def has_privacy(run: RunSummary) -> bool:
    """Whether the run ran under client-level DP (dp.clip > 0), kept a privacy ledger, or says
    it spent privacy (metrics.jsonl's dp_epsilon)."""
    clip = run.config.get("dp.clip")
    return ((isinstance(clip, (int, float)) and not isinstance(clip, bool) and clip > 0)
            or (run.run_dir / LEDGER_FILE).is_file() or bool(curve(run, "dp_epsilon")[0]))


def _record_key() -> tuple[Any, str | None]:
    """(this user's record key or None, a warning when it cannot be read)."""
    from flatflower.server import recordkey

    try:
        return recordkey.load(create=False), None
    except recordkey.RecordKeyError as err:
        return None, f"{err}: no run's records can be checked"


def check_records(run: RunSummary, key: Any) -> list[str]:
    """The files the report reads checked against the run's manifest.json (its seal under the
    user's record ``key``, then each file's digest), and the run's privacy recomputed from its
    ledger (``run.epsilon``, ``run.epsilon_by_round``). RunFileError (one line) for a seal of
    this user's key that does not match, or a ledger that is not as the run wrote it (or no
    run writes); the warnings to print otherwise: records this user did not seal, another file
    not as written, ledger rows past the sealed checkpoint, metrics.jsonl's dp_epsilon not the
    ledger's, a DP run without a ledger."""
    from flatflower.server import manifest, recordkey

    warnings: list[str] = []
    private = has_privacy(run)
    try:
        data = manifest.read(run.run_dir)
    except manifest.ManifestError:
        data = None
        warnings.append(f"{run.run_dir / manifest.MANIFEST} is damaged: the run's records cannot be checked; "
                        "the report shows them as they are")
    else:
        status = manifest.seal_status(run.run_dir, data, key)
        problem = manifest.seal_problem(run.run_dir, data, status, key, what="the report")
        if status == recordkey.BROKEN:
            raise ReportError(problem)
        # no manifest at all: worth a line for a DP run's ledger (a DP run without one gets its own line)
        if problem is not None and (data is not None or (private and (run.run_dir / LEDGER_FILE).is_file())):
            warnings.append(f"{problem}; the report shows them as they are")
        if data is not None:
            for name, differs in manifest.check_files(run.run_dir, data, RECORDED).items():
                if differs and name == LEDGER_FILE:
                    raise ReportError(f"{differs}; the report refuses its privacy numbers (restore the file)")
                if differs:
                    warnings.append(f"{differs}; the report shows it as it is now")
            recorded = data["prefixes"].get(LEDGER_FILE)
            path = run.run_dir / LEDGER_FILE
            if recorded and path.is_file() and path.stat().st_size > recorded[0]["size"]:
                warnings.append(f"{path} has rows past the checkpoint {manifest.MANIFEST} seals (a run that is "
                                "running or was interrupted): they are counted, not verified")
    if private:
        warnings += _ledger_privacy(run)
    return warnings


def _ledger_privacy(run: RunSummary) -> list[str]:
    """Set ``run.epsilon`` and ``run.epsilon_by_round`` from the run's privacy.jsonl through the
    accountant, as the server composed it (each entry in file order: a round redone after a
    resume counts twice); the warnings: no ledger, metrics.jsonl's dp_epsilon not the ledger's."""
    import math

    from flatflower.common.privacy import LedgerError, PrivacyLedger, ledger_entries
    from flatflower.tools.runfiles import read_text

    path = run.run_dir / LEDGER_FILE
    if not path.is_file():
        return [(f"{run.run_dir} ran under DP but keeps no {LEDGER_FILE}: its privacy is not shown "
                 "(metrics.jsonl's dp_epsilon is a copy, not the ledger)")]
    sigma, delta = run.config.get("dp.noise-multiplier"), run.config.get("dp.delta", 1e-5)
    if not (isinstance(sigma, (int, float)) and isinstance(delta, (int, float)) and 0 < delta < 1):
        raise ReportError(f"{run.run_dir / CONFIG_FILE} holds no dp.noise-multiplier and dp.delta in (0, 1) "
                          f"for its {LEDGER_FILE}: the privacy it spent cannot be accounted")
    try:
        entries = ledger_entries(read_text(path).splitlines(), float(sigma), str(path))
    except LedgerError as err:
        raise ReportError(str(err)) from None
    ledger, by_round = PrivacyLedger(), {}
    for rnd, rate, noise in entries:
        ledger.add_round(rate, noise)
        eps = ledger.epsilon(float(delta))
        by_round[rnd] = eps if math.isfinite(eps) else None
    run.epsilon_by_round = by_round
    last = ledger.epsilon(float(delta))  # 0 before any round; inf without noise: no privacy (None)
    run.epsilon = last if math.isfinite(last) else None
    differ = [int(r["round"]) for r in run.rows if "dp_epsilon" in r and int(r["round"]) >= 1
              and not _same_number(r["dp_epsilon"], by_round.get(int(r["round"])))]
    if differ:
        first = next(r for r in run.rows if int(r["round"]) == differ[0])
        return [(f"{run.run_dir / METRICS_FILE}'s dp_epsilon is not its ledger's at rounds {differ[:5]}"
                 f"{' ...' if len(differ) > 5 else ''} (round {differ[0]}: {first['dp_epsilon']!r:.12}, the "
                 f"ledger's {by_round.get(differ[0])!r:.12}): the report shows the ledger's ({LEDGER_FILE})")]
    return []


def _same_number(a: Any, b: float | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return abs(float(a) - b) <= 1e-9 * max(1.0, abs(b))


def summarize(run: RunSummary, last_k: int = 5, target: float | None = None,
              flatness: bool = False, privacy: bool = False) -> dict[str, Any]:
    """Headline numbers of one run; last-k statistics ignore round 0. ``flatness``: with
    :func:`flatness_summary`'s columns; ``privacy``: with ``dp_epsilon``, the privacy the run
    spent by its last round (client-level DP: its ledger, :func:`check_records`; None for a run
    without DP or without a ledger)."""
    trained = [acc for r, acc in zip(run.rounds, run.accuracy) if r >= 1]
    tail = np.asarray(trained[-last_k:] if last_k > 0 else [], dtype=float)
    return {
        "label": run.label,
        "algorithm": run.algorithm,
        "seed": run.seed,
        "rounds": run.rounds[-1],
        "final_accuracy": run.accuracy[-1],
        "last_k_mean": float(tail.mean()) if tail.size else None,
        "last_k_std": float(tail.std()) if tail.size else None,
        "best_accuracy": max(run.accuracy),
        "rounds_to_target": rounds_to_target(run, target),
        "bytes_total": run.bytes_total,
        **(flatness_summary(run, last_k) if flatness else {}),
        **({"dp_epsilon": run.epsilon} if privacy else {}),
    }


def drift_summary(run: RunSummary) -> dict[str, float] | None:
    """A run's client drift over its rounds: mean of each round's mean and min cosine of the
    clients' updates to their mean, and of the spread (std / mean) of their norms."""
    if not run.drift:
        return None
    rows = list(run.drift.values())
    return {key: float(np.mean([r[key] for r in rows if key in r]))
            for key in ("cosine_mean", "cosine_min", "norm_spread") if any(key in r for r in rows)}


def drift_by_algorithm(runs: Sequence[RunSummary]) -> list[dict[str, Any]]:
    """One row per algorithm with clients.jsonl: its runs' drift, mean ± std over seeds."""
    groups: dict[str, list[dict[str, float]]] = {}
    for run in runs:
        if (summary := drift_summary(run)) is not None:
            groups.setdefault(run.algorithm, []).append(summary)
    rows = []
    for algorithm, summaries in groups.items():
        row: dict[str, Any] = {"algorithm": algorithm, "num_seeds": len(summaries)}
        for key in ("cosine_mean", "cosine_min", "norm_spread"):
            values = [s[key] for s in summaries if key in s]
            row[key] = float(np.mean(values)) if values else None
            row[f"{key}_std"] = float(np.std(values)) if values else None
        rows.append(row)
    return rows


def drift_table(rows: Sequence[dict[str, Any]]) -> list[dict[str, str]]:
    """drift_by_algorithm's rows as table cells."""
    def cell(row, key):
        return "-" if row[key] is None else f"{row[key]:.3f} ± {row[key + '_std']:.3f}"

    return [{"algorithm": r["algorithm"], "seeds": str(r["num_seeds"]),
             "mean cosine to the mean update": cell(r, "cosine_mean"),
             "min cosine": cell(r, "cosine_min"), "norm spread (std / mean)": cell(r, "norm_spread")}
            for r in rows]


def _mean_or_none(values: Iterable[float | None]) -> float | None:
    """Mean of the non-None values; None when there are none."""
    present = [v for v in values if v is not None]
    return float(np.mean(present)) if present else None


def group_by_algorithm(summaries: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per algorithm, aggregating its runs (seeds); order of first appearance."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for summary in summaries:
        groups.setdefault(summary["algorithm"], []).append(summary)
    rows = []
    for algorithm, runs in groups.items():
        finals = np.asarray([run["final_accuracy"] for run in runs], dtype=float)
        tails = [run["last_k_mean"] for run in runs if run["last_k_mean"] is not None]
        reached = [run["rounds_to_target"] for run in runs if run["rounds_to_target"] is not None]
        rows.append(
            {
                "algorithm": algorithm,
                "num_seeds": len(runs),
                "final_accuracy_mean": float(finals.mean()),
                "final_accuracy_std": float(finals.std()),
                # each seed's mean of its last k rounds, then mean and std over the seeds
                "last_k_mean": float(np.mean(tails)) if tails else None,
                "last_k_std": float(np.std(tails)) if tails else None,
                # half-widths of the t-based 95% intervals of those means (None: one seed)
                "final_accuracy_ci95": mean_interval(finals).half_width,
                "last_k_ci95": mean_interval(tails).half_width if tails else None,
                "rounds_to_target_mean": _mean_or_none(reached),
                "seeds_reaching_target": f"{len(reached)}/{len(runs)}",
                "bytes_total_mean": float(np.mean([run["bytes_total"] for run in runs])),
            }
        )
        for key in (*FLATNESS_SUMMARY, "dp_epsilon"):
            if key in runs[0]:
                values = [run[key] for run in runs if run.get(key) is not None]
                rows[-1][f"{key}_mean"] = float(np.mean(values)) if values else None
                rows[-1][f"{key}_std"] = float(np.std(values)) if values else None
    return rows


# ---------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------


def _curves(runs: Sequence[RunSummary], x_of, y_of=lambda run: run.accuracy
            ) -> list[tuple[str, list[float], list[float], list[float] | None]]:
    """(label, x, y, std of y or None) per run; with several seeds of one algorithm, one mean
    curve per algorithm with its std over seeds (over the points all its runs have)."""
    by_alg: dict[str, list[RunSummary]] = {}
    for run in runs:
        by_alg.setdefault(run.algorithm, []).append(run)
    if all(len(group) == 1 for group in by_alg.values()):
        return [(run.label, list(x_of(run)), list(y_of(run)), None) for run in runs]
    curves = []
    for alg, group in by_alg.items():
        n = min(len(y_of(run)) for run in group)
        x = np.mean([x_of(run)[:n] for run in group], axis=0)
        ys = np.asarray([y_of(run)[:n] for run in group], dtype=float)
        curves.append((f"{alg} (mean ± std of {len(group)})", x.tolist(), ys.mean(axis=0).tolist(),
                       ys.std(axis=0).tolist()))
    return curves


MANY = 10  # matplotlib's default colour cycle: more curves than this need care


def _plot(ax, curves) -> None:
    """One line per curve; more curves than matplotlib's 10 default colours get 20 colours
    and alternate line styles, so that no two share a look (12 methods in a study)."""
    import matplotlib

    many = len(curves) > MANY
    tab20 = matplotlib.colormaps["tab20"].colors  # pairs of a dark and a light shade
    colors = tab20[0::2] + tab20[1::2]  # the 10 dark ones first: neighbours differ in hue
    for i, (label, xs, ys, std) in enumerate(curves):
        style = {"color": colors[i % 20], "linestyle": ("-", "--")[i % 2]} if many else {}
        line, = ax.plot(xs, ys, marker="o", markersize=2, label=label, **style)
        if std is not None:
            lo, hi = np.asarray(ys) - np.asarray(std), np.asarray(ys) + np.asarray(std)
            ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.2, linewidth=0)


def _log_if_wide(ax, curves) -> None:
    """A per-round panel whose values are all positive and span more than two decades gets a
    logarithmic y axis, so that one diverging method (FedGF's flatness distance in the
    thousands, every other method's below 3) does not flatten the others to a line. A panel
    with a value at or below zero (a cosine) stays linear: a log axis would hide that value."""
    values = [y for _, _, ys, _ in curves for y in ys if y is not None and np.isfinite(y)]
    if values and min(values) > 0 and max(values) > 100 * min(values):
        ax.set_yscale("log")


def _legend(ax, n_curves: int, fontsize: float | None = None) -> None:
    """The legend inside the axes for a few curves; for more than ``MANY``, beside them on the
    right, where it hides no curve (a study of 19 methods)."""
    if n_curves > MANY:
        ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0, fontsize=fontsize or 8)
    else:
        ax.legend(fontsize=fontsize)


def accuracy_name(runs: Sequence[RunSummary]) -> str:
    """What the runs' accuracy is: "test accuracy", "federated accuracy", or both named."""
    measures = {run.measure for run in runs}
    if measures == {"federated"}:
        return "federated accuracy"
    validated = {validation_run(run) for run in runs}  # a tune's trials: the server's split is a validation split
    if measures == {"test"}:
        return {frozenset({True}): "validation accuracy", frozenset({False}): "test accuracy"}.get(
            frozenset(validated), "accuracy (validation in runs with validation-fraction > 0, test in the others)")
    return "accuracy (test; federated where no test set)"


def validation_run(run: RunSummary) -> bool:
    """Whether the run's server evaluated a validation split carved from the training split
    (``validation-fraction`` > 0, as ``flatflower tune``'s trials do) instead of the test split."""
    value = run.config.get("validation-fraction", 0)
    return isinstance(value, (int, float)) and value > 0


def plot_accuracy(runs: Sequence[RunSummary], out_png: str | Path, x: str = "round") -> Path:
    """Test accuracy vs round (``x="round"``) or vs cumulative bytes down + up (``"bytes"``),
    one line per run (per algorithm, averaged, when it has several seeds), saved as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    x_of = (lambda run: run.rounds) if x == "round" else (lambda run: [b / 1e6 for b in run.cumulative_bytes])
    curves = _curves(runs, x_of)
    fig, ax = plt.subplots(figsize=(9 if len(curves) > MANY else 7, 4.5))
    try:
        _plot(ax, curves)
        ax.set_xlabel("round" if x == "round" else "cumulative bytes down + up (MB)")
        what = accuracy_name(runs)
        ax.set_ylabel(what)
        ax.set_title(f"{what[0].upper()}{what[1:]} per round" if x == "round" else
                     f"{what[0].upper()}{what[1:]} vs communication")
        ax.grid(True, alpha=0.3)
        _legend(ax, len(curves))
        fig.tight_layout()
        fig.savefig(out_png, format="png", dpi=120)
    finally:
        plt.close(fig)
    return out_png


def plot_panels(runs: Sequence[RunSummary], out_png: str | Path, title: str,
                panels: Sequence[tuple[str, Any, Any]]) -> Path:
    """One row of per-round panels: each (title, x_of(run), y_of(run)), one curve per run or
    per algorithm (mean ± std over seeds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    panel_curves = [_curves(runs, x_of, y_of) for _, x_of, y_of in panels]
    n_curves = len(panel_curves[0])
    width = 5 * len(panels) + (3 if n_curves > MANY else 1)
    fig, axes = plt.subplots(1, len(panels), figsize=(width, 4.2), squeeze=False)
    axes = axes[0]
    try:
        for ax, (name, _, _), curves in zip(axes, panels, panel_curves):
            _plot(ax, curves)
            _log_if_wide(ax, curves)
            ax.set_title(name, fontsize=10)
            ax.set_xlabel("round")
            ax.grid(True, alpha=0.3)
        _legend(axes[-1] if n_curves > MANY else axes[0], n_curves, fontsize=8)
        fig.suptitle(title)
        fig.tight_layout()
        fig.savefig(out_png, format="png", dpi=110)
    finally:
        plt.close(fig)
    return out_png


def plot_drift(runs: Sequence[RunSummary], out_png: str | Path) -> Path | None:
    """Client drift per round (clients.jsonl): mean and min cosine of the clients' updates to
    their mean, and the spread of the update norms. None when no run has clients.jsonl."""
    runs = [run for run in runs if run.drift]
    if not runs:
        return None

    def panel(key: str, name: str):
        return (name, lambda run: [r for r, d in run.drift.items() if key in d],
                lambda run: [d[key] for d in run.drift.values() if key in d])

    return plot_panels(runs, out_png, "Client drift: how far the clients' updates disagree",
                       [panel("cosine_mean", "mean cosine to the mean update"),
                        panel("cosine_min", "min cosine to the mean update"),
                        panel("norm_spread", "update norm spread (std / mean)")])


def plot_flatness(runs: Sequence[RunSummary], out_png: str | Path) -> Path | None:
    """Flatness per round, as FedNSAM's Fig. 2: the flatness distance (every round), the
    sharpness and the top Hessian eigenvalue (the rounds that measured them). None when no
    run has them."""
    runs = [run for run in runs if has_flatness(run)]
    if not runs:
        return None

    def panel(key: str, name: str):
        return name, lambda run: curve(run, key)[0], lambda run: curve(run, key)[1]

    panels = [panel(key, name) for key, name in (
        ("flatness_distance", "flatness distance (1/M) sum ||theta_i - theta||^2"),
        ("sharpness", "sharpness L(w + rho g/||g||) - L(w)"),
        ("hessian_max_eig", "top Hessian eigenvalue"))
        if any(curve(run, key)[0] for run in runs)]  # a measure no run took gets no empty panel
    return plot_panels(runs, out_png, "Flatness of the global model per round", panels)


def human_bytes(n: float) -> str:
    """``3898000`` -> ``3.90 MB`` (decimal units, as network traffic is counted)."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} TB"


def _format_cell(key: str, value: Any) -> str:
    """Accuracies as percentages, bytes in kB/MB/GB, ``None`` as ``-``, the rest as is."""
    if value is None:
        return "-"
    if "accuracy" in key or key.startswith("last_k"):
        return f"{100 * value:.2f}%"
    if "bytes" in key and isinstance(value, (int, float)):
        return human_bytes(value)
    if key.startswith(FLATNESS_SUMMARY) and isinstance(value, float):
        return f"{value:.4g}"  # sharpness is often ~1e-3
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)


def _merge_mean_std(row: dict[str, Any]) -> dict[str, str]:
    """Format one row, fusing ``X_mean``/``X_std`` and ``last_k_mean``/``last_k_std`` pairs;
    where the row has ``X_ci95`` (a per-algorithm row), ``X_mean`` ± its 95% CI instead of
    the std (``n=1``: no interval)."""
    cells: dict[str, str] = {}
    for key, value in row.items():
        if key.endswith(("_std", "_ci95")) and key.rsplit("_", 1)[0] + "_mean" in row:
            continue
        if key.endswith("_mean") and key[: -len("_mean")] + "_ci95" in row:
            ci = row[key[: -len("_mean")] + "_ci95"]
            text = _format_cell(key, value)
            cells[f"{key} ± 95% CI"] = (text if value is None else f"{text} (n=1)" if ci is None
                                        else f"{text} ± {_format_cell(key, ci)}")
            continue
        if key.endswith("_mean") and key[: -len("_mean")] + "_std" in row:
            std = row[key[: -len("_mean")] + "_std"]
            text = _format_cell(key, value)
            cells[f"{key} ± std"] = text if std is None else f"{text} ± {_format_cell(key, std)}"
        else:
            cells[key] = _format_cell(key, value)
    return cells


def render_table(rows: Sequence[dict[str, Any]], title: str, width: int = 160) -> str:
    """Render rows (summaries or per-algorithm rows) as a plain-text table."""
    formatted = [_merge_mean_std(row) for row in rows]
    columns = list(formatted[0]) if formatted else []
    table = Table(title=title)
    for column in columns:
        table.add_column(column.replace("_", " "), justify="left" if column in ("label", "algorithm") else "right")
    for cells in formatted:
        # Text: a cell is never rich markup ("[/]" in a run's algorithm name would raise)
        table.add_row(*(Text(cells.get(column, "-")) for column in columns))
    buffer = io.StringIO()
    Console(file=buffer, width=width, color_system=None, force_terminal=False).print(table)
    return buffer.getvalue()


# ---------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------


def _csv_cell(value: Any) -> Any:
    """Numbers as they are; a list of numbers space-separated; anything else as JSON."""
    if isinstance(value, list) and all(isinstance(v, (int, float)) for v in value):
        return " ".join(map(str, value))
    return json.dumps(value) if isinstance(value, (list, dict)) else value


RUN_COLUMNS = ("algorithm", "seed", "engine", "rounds", "final_accuracy", "last_k_mean", "best_accuracy",
               "best_round", "rounds_to_target", "seconds", "bytes_up", "bytes_down", "flatness_distance",
               "sharpness", "hessian_max_eig", "flatness_split", "run")


def run_row(run: RunSummary, last_k: int, target: float | None) -> dict[str, Any]:
    """One run as a row of RUN_COLUMNS: accuracy (fractions), the best round, rounds to
    ``target``, the rounds' seconds (training, plus any flatness measurement), bytes each way,
    the mean flatness distance over the last ``last_k`` rounds, and the final model's sharpness
    and top Hessian eigenvalue from the run's flatness.json when it has one."""
    summary = summarize(run, last_k, target, flatness=True)
    rows = [r for r in run.rows if int(r["round"]) >= 1]
    best = max(range(len(run.accuracy)), key=lambda i: run.accuracy[i])
    saved: dict[str, Any] = {}
    try:
        saved = read_json(run.run_dir / FLATNESS_FILE)
        saved = saved if isinstance(saved, dict) else {}
    except RunFileError:  # none, or not one (a column left empty, as without it)
        pass
    engine = run.record.get("engine")
    return {
        "algorithm": run.algorithm, "seed": run.seed, "engine": engine, "rounds": run.rounds[-1],
        "final_accuracy": summary["final_accuracy"], "last_k_mean": summary["last_k_mean"],
        "best_accuracy": summary["best_accuracy"], "best_round": run.rounds[best],
        "rounds_to_target": summary["rounds_to_target"],
        "seconds": round(sum(float(r.get("seconds") or 0) + float(r.get("flatness_seconds") or 0)
                             for r in rows), 2),
        "bytes_up": sum(int(r.get("bytes_up", 0)) for r in rows),
        "bytes_down": sum(int(r.get("bytes_down", 0)) for r in rows),
        "flatness_distance": summary["flatness_distance"],
        "sharpness": saved.get("sharpness"), "hessian_max_eig": saved.get("hessian_max_eig"),
        "flatness_split": saved.get("split"), "run": run.run_dir.name,
    }


def write_runs_csv(runs: Sequence[RunSummary], path: Path, last_k: int, target: float | None) -> Path:
    """One row per run (RUN_COLUMNS), e.g. a study's results table."""
    import csv

    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=RUN_COLUMNS)
        writer.writeheader()
        for run in runs:
            writer.writerow({k: ("" if v is None else v) for k, v in run_row(run, last_k, target).items()})
    return path


def write_csv(runs: Sequence[RunSummary], path: Path) -> Path:
    """Every metrics.jsonl row of every run, with the run's directory, algorithm and seed;
    columns are the union of the rows' scalar fields (lists such as sampled_partitions are
    written as space-separated values)."""
    import csv

    fields: list[str] = []
    for run in runs:
        for row in run.rows:
            fields += [k for k in row if k not in fields]
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["run", "algorithm", "seed", *fields])
        writer.writeheader()
        for run in runs:
            for row in run.rows:
                cells = {k: _csv_cell(v) for k, v in row.items()}
                if "dp_epsilon" in row:  # the ledger's (check_records), never metrics.jsonl's copy
                    cells["dp_epsilon"] = run.epsilon_by_round.get(int(row["round"]))
                writer.writerow({"run": str(run.run_dir), "algorithm": run.algorithm,
                                 "seed": run.seed, **cells})
    return path


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``flatflower report``; 0 on success, 2 on a bad run directory (or, with
    ``--strict``, runs of different settings)."""
    args = build_parser().parse_args(argv)
    try:
        runs = [load_run(run_dir) for run_dir in args.run_dirs]
    except RunFileError as exc:  # ReportError, or a damaged file (tools/runfiles.py)
        print(f"error: {exc}", file=sys.stderr)
        return 2
    key, problem = _record_key()
    try:  # the records checked against their sealed manifests; the privacy from the ledgers
        notes = [problem] if problem else []
        notes += [note for run in runs for note in check_records(run, key)]
    except RunFileError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for note in notes:
        print(f"warning: {printable(note, 600)}", file=sys.stderr)
    differences = setting_differences(runs)
    if differences:
        what = "; ".join(differences)
        if args.strict:
            print(f"error: the runs have different settings, not comparable: {what}", file=sys.stderr)
            return 2
        print(f"warning: the runs have different settings, compare with care: {what}", file=sys.stderr)
    code = code_differences(runs)
    if code:
        print(f"warning: the runs ran different or locally modified flatflower code (git commit): {code}",
              file=sys.stderr)
    groups = machine_groups(runs)
    if (where := machine_differences(groups)) is not None:
        print(f"warning: the runs ran on different machines, whose CPU kernels can move numbers from round 0 "
              f"on (docs/run-directory.md): {where}", file=sys.stderr)
    flatness = any(has_flatness(run) for run in runs)
    privacy = any(has_privacy(run) for run in runs)
    summaries = [summarize(run, last_k=args.last_k, target=args.target, flatness=flatness, privacy=privacy)
                 for run in runs]
    print(render_table(summaries, title=f"Runs (last {args.last_k} rounds)"))
    federated = [run.run_dir.name for run in runs if run.measure == "federated"]
    if federated:
        print(f"note: no evaluation set on the server in {', '.join(federated[:5])}"
              f"{' ...' if len(federated) > 5 else ''}: accuracy there is federated evaluation's "
              "(federated_accuracy: the clients' own held-out data, weighted by its size)")
    grouped = group_by_algorithm(summaries)
    show_groups = args.by_algorithm or any(row["num_seeds"] > 1 for row in grouped)
    if show_groups:
        print(render_table(grouped, title="Per algorithm (mean ± 95% CI over seeds, t-based; "
                                          "report.json and --algorithms-csv also hold the std)"))
    comparison = compare([(s["algorithm"], pairing_key(run), run.run_dir.name, s["last_k_mean"])
                          for run, s in zip(runs, summaries) if s["last_k_mean"] is not None], args.min_gap)
    if show_groups and comparison is not None:
        print(render_table(comparison_table(comparison), title=comparison_title(comparison, args.last_k),
                           width=200))
    drift_rows = drift_by_algorithm(runs)
    if drift_rows:
        print(render_table(drift_table(drift_rows),
                           title="Client drift per algorithm (clients.jsonl: mean over rounds, "
                                 "± std over seeds)"))
    try:
        write_outputs(args, runs, {"runs": summaries, "by_algorithm": grouped, "drift": drift_rows,
                                   "setting_differences": differences, "comparison": comparison,
                                   "machines": groups, "different_machines": len(groups) > 1})
    except OSError as err:  # e.g. --out under a regular file
        print(f"error: cannot write the report: {err.filename or ''}: {err.strerror or err}", file=sys.stderr)
        return 2
    return 0


def default_out(run_dirs: Sequence[str | Path]) -> Path:
    """report.png in the run directory, or in the deepest directory holding all of them (never
    the current directory: a report run in a checkout would overwrite its files)."""
    return Path(os.path.commonpath([Path(d).resolve() for d in run_dirs])) / "report.png"


def write_outputs(args: argparse.Namespace, runs: Sequence[RunSummary], payload: dict) -> None:
    """The plots (accuracy vs rounds and vs bytes, client drift) and the --json / --csv files."""
    out = args.out or default_out(args.run_dirs)
    print(f"plot: {plot_accuracy(runs, out)}")
    out_bytes = args.out_bytes or out.with_name(f"{out.stem}-bytes{out.suffix or '.png'}")
    print(f"plot: {plot_accuracy(runs, out_bytes, x='bytes')}")
    drift_png = plot_drift(runs, out.with_name(f"{out.stem}-drift{out.suffix or '.png'}"))
    if drift_png is not None:
        print(f"plot: {drift_png}")
    flatness_png = plot_flatness(runs, out.with_name(f"{out.stem}-flatness{out.suffix or '.png'}"))
    if flatness_png is not None:
        print(f"plot: {flatness_png}")
    values: dict[str, list[float]] = {}
    for summary in payload["runs"]:
        if summary["last_k_mean"] is not None:
            values.setdefault(summary["algorithm"], []).append(summary["last_k_mean"])
    ci_png = out.with_name(f"{out.stem}-ci{out.suffix or '.png'}")
    ci_png = plot_intervals(payload["by_algorithm"], values, payload["comparison"], ci_png, args.last_k,
                            accuracy_name(runs))
    print(f"plot: {ci_png}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
        print(f"json: {args.json}")
    if args.csv is not None:
        print(f"csv: {write_csv(runs, args.csv)}")
    if args.runs_csv is not None:
        print(f"csv: {write_runs_csv(runs, args.runs_csv, args.last_k, args.target)}")
    if args.algorithms_csv is not None:
        print(f"csv: {write_algorithms_csv(payload['by_algorithm'], payload['comparison'], args.algorithms_csv)}")


if __name__ == "__main__":
    sys.exit(main())
