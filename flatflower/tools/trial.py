"""``flatflower bench``'s trial section: what a short run pays besides its clients' training.

A tune is hundreds of short runs (trials), so two figures decide its cost beyond training:

* **fixed cost**: from the process's start to its first round's train messages (the
  interpreter, importing torch and the engine, the run config, the data, the model, the
  server's round-0 evaluation), plus what the first round costs beyond a steady one (warm-up;
  with ``compile = on``, compiling the step). Measured in a fresh Python process per run
  (``python -m flatflower.tools.trial``), stamped on the wall clock (``time.time``, shared by
  both processes) at the process's launch, after ``import torch``, after the engine's imports,
  and when each round's train messages go out (the ServerApp's grid wrapped, as
  tools/throughput.py does).
* **per-client overhead**: a steady round's wall time when no client is training (the union of
  the clients' training intervals taken off: the ClientApp's ``local_train`` and the vectorised
  engine's ``train_together`` wrapped), divided by the round's sampled clients: the framework's
  work for a client (its message, opening, reply, validation, aggregation, its clients.jsonl
  row), the run's per-round work (central evaluation, run files) spread over its clients.

Each figure is the median over the steady rounds (rounds 2 .. rounds - 1) of each run, then
the median over the runs (engines interleaved). A trial of T rounds costs about fixed + T x a
steady round; ``share_of_20_round_trial`` is fixed / (fixed + 20 x steady round). Timings are
reported, never asserted.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TRIAL_ROUNDS = 20  # the trial whose fixed-cost share is reported (issue 56: under 10%)
VARIANTS = {  # label -> (engine, run-config overrides, warm: a tune worker's next trial)
    "inprocess": ("inprocess", {}, False),
    "vectorized": ("vectorized", {}, False),
    "vectorized, compile = on": ("vectorized", {"compile": "on"}, False),
    "inprocess, tune worker": ("inprocess", {}, True),
    "vectorized, tune worker": ("vectorized", {}, True),
}
DEFAULT_VARIANTS = ("inprocess", "vectorized", "inprocess, tune worker", "vectorized, tune worker")


@dataclass
class TrialSettings:
    model: str = "mlp"
    clients: int = 100
    rounds: int = 6  # per run; rounds 2 .. rounds - 1 are steady
    repeats: int = 2  # interleaved runs per variant
    variants: tuple[str, ...] = DEFAULT_VARIANTS
    timeout: float = 600.0  # seconds per run


def union_seconds(intervals: list[tuple[float, float]], start: float, end: float) -> float:
    """Seconds within [start, end] covered by at least one of ``intervals`` (start, end)."""
    clipped = sorted((max(a, start), min(b, end)) for a, b in intervals if b > start and a < end)
    covered, reach = 0.0, start
    for a, b in clipped:
        if b > reach:
            covered += b - max(a, reach)
            reach = b
    return covered


def figures(stamps: dict[str, float], rounds: dict[int, float], training: list[tuple[float, float]],
            clients: dict[int, int], last: int) -> dict[str, Any]:
    """One run's figures from its wall-clock stamps: ``stamps`` (launched, torch, imports),
    ``rounds`` (round -> when its train messages went out, up to ``last`` + 1),
    the clients' training intervals and each round's sampled clients."""
    steady_rounds = list(range(2, last + 1))
    length = {r: rounds[r + 1] - rounds[r] for r in range(1, last + 1)}
    idle = {r: length[r] - union_seconds(training, rounds[r], rounds[r + 1]) for r in steady_rounds}
    steady = statistics.median(length[r] for r in steady_rounds)
    startup = {"interpreter_and_torch": stamps["torch"] - stamps["launched"],
               "engine_imports": stamps["imports"] - stamps["torch"],
               "setup_to_first_round": rounds[1] - stamps["imports"],
               "first_round_extra": length[1] - steady}
    fixed = sum(startup.values())
    return {**startup, "fixed_seconds": fixed, "steady_round_seconds": steady,
            "first_round_seconds": length[1],
            "overhead_seconds_per_round": statistics.median(idle.values()),
            "overhead_seconds_per_client": statistics.median(idle[r] / clients[r] for r in steady_rounds),
            "share_of_20_round_trial": fixed / (fixed + TRIAL_ROUNDS * steady)}


def probe(cfg: dict[str, Any], clients: int, vectorized: bool, launched: float, warm: bool = False) -> dict[str, Any]:
    """Run one trial in this (fresh) process and return its stamps: what ``main`` prints.
    ``warm``: a tune worker's next trial: a first run of the same setting in this process
    (another run directory) before the timed one, whose stamps start when it is called, so
    its fixed cost is its setup and first round's extra alone (imports, data, compiled steps
    already there, as ``flatflower tune`` reuses them)."""
    stamps = {"launched": launched}
    import torch  # noqa: F401 - its import is what is timed

    stamps["torch"] = time.time()
    import flatflower.client.app as client_app
    import flatflower.runtime.engines.inprocess as inprocess
    import flatflower.server.app  # noqa: F401 - the ServerApp's imports are timed here too
    from flatflower.runtime.engines import quiet_flower
    from flatflower.tools.throughput import watching_train

    stamps["imports"] = time.time()
    rounds: dict[int, float] = {}
    sampled: dict[int, int] = {}
    training: list[tuple[float, float]] = []

    def timed(original):
        def train(*args, **kwargs):
            start = time.time()
            try:
                return original(*args, **kwargs)
            finally:
                training.append((start, time.time()))
        return train

    client_app.local_train = timed(client_app.local_train)
    inprocess.train_together = timed(inprocess.train_together)

    def sent(r: int, messages: int) -> None:
        rounds.setdefault(r, time.time())
        sampled[r] = sampled.get(r, 0) + messages

    with quiet_flower():
        if warm:
            first = {**cfg, "run-dir": f"{cfg['run-dir']}-first"}
            inprocess.run_inprocess(first, clients, server_app=watching_train(lambda r, n: None), vectorized=vectorized)
            training.clear()
            stamps.update(dict.fromkeys(("launched", "torch", "imports"), time.time()))
        inprocess.run_inprocess(cfg, clients, server_app=watching_train(sent), vectorized=vectorized)
    return {"stamps": stamps, "rounds": rounds, "training": training, "clients": sampled}


def _one_run(label: str, settings: TrialSettings, run_dir: Path) -> dict[str, Any]:
    """One trial of ``label`` in a fresh process; its figures."""
    from flatflower.tools.throughput import run_config

    engine, overrides, warm = VARIANTS[label]
    cfg = {**run_config("fedavg", settings.model, run_dir, settings.rounds), **overrides}
    args = json.dumps({"cfg": cfg, "clients": settings.clients, "vectorized": engine == "vectorized", "warm": warm})
    launched = time.time()
    done = subprocess.run([sys.executable, "-m", "flatflower.tools.trial", args, repr(launched)],
                          capture_output=True, text=True, timeout=settings.timeout)
    if done.returncode != 0:
        raise RuntimeError(f"exit {done.returncode}: {done.stderr.strip()[-400:]}")
    out = json.loads(done.stdout.strip().splitlines()[-1])
    rounds = {int(r): t for r, t in out["rounds"].items()}
    clients = {int(r): n for r, n in out["clients"].items()}
    return figures(out["stamps"], rounds, [tuple(i) for i in out["training"]], clients, settings.rounds - 1)


def bench_trial(settings: TrialSettings, workdir: Path, say=lambda text: None) -> dict[str, Any]:
    """Every variant's runs, interleaved; a row per variant (the medians over its runs, each
    run's figures kept)."""
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in settings.variants}
    errors: dict[str, str] = {}
    for rep in range(settings.repeats):
        for label in settings.variants:
            if label in errors:
                continue
            say(f"trial: {label} (run {rep + 1}/{settings.repeats})")
            try:
                run_dir = workdir / f"trial-{settings.variants.index(label)}-{rep}"
                runs[label].append(_one_run(label, settings, run_dir))
            except Exception as err:  # noqa: BLE001 - reported in its row, the others go on
                errors[label] = f"{type(err).__name__}: {err}"[-400:]
    rows = []
    for label in settings.variants:
        row: dict[str, Any] = {"variant": label, "engine": VARIANTS[label][0]}
        if runs[label]:
            row.update({key: statistics.median(run[key] for run in runs[label]) for key in runs[label][0]})
            row["runs"] = runs[label]
        else:
            row["error"] = errors.get(label, "no run")
        rows.append(row)
    return {"model": settings.model, "clients": settings.clients, "rounds": settings.rounds,
            "repeats": settings.repeats, "trial_rounds": TRIAL_ROUNDS, "rows": rows}


def render(section: dict[str, Any]) -> str:
    """The trial table: fixed cost, its parts, the steady round and the per-client overhead."""
    from flatflower.tools.report import render_table

    table = []
    for r in section["rows"]:
        if "error" in r:
            table.append({"variant": r["variant"], "fixed (s)": "error"})
            continue
        table.append({"variant": r["variant"], "fixed (s)": f"{r['fixed_seconds']:.2f}",
                      "torch (s)": f"{r['interpreter_and_torch']:.2f}",
                      "engine imports (s)": f"{r['engine_imports']:.2f}",
                      "setup (s)": f"{r['setup_to_first_round']:.2f}",
                      "1st round extra (s)": f"{r['first_round_extra']:.2f}",
                      "steady round (s)": f"{r['steady_round_seconds']:.3f}",
                      "overhead/client (ms)": f"{r['overhead_seconds_per_client'] * 1e3:.2f}",
                      f"fixed / {section['trial_rounds']}-round trial": f"{r['share_of_20_round_trial']:.1%}"})
    title = (f"trial: a fresh process's fixed cost and a steady round's per-client overhead "
             f"(FedAvg, {section['model']}, N = {section['clients']}, every client a round; median of "
             f"{section['repeats']} interleaved run(s) of {section['rounds']} rounds)")
    lines = [render_table(table, title)]
    lines += [f"  error: {r['variant']}: {r['error']}" for r in section["rows"] if "error" in r]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """The child process of one run: ``python -m flatflower.tools.trial ARGS_JSON LAUNCHED``."""
    argv = sys.argv[1:] if argv is None else argv
    args, launched = json.loads(argv[0]), float(argv[1])
    out = probe(args["cfg"], int(args["clients"]), bool(args["vectorized"]), launched, bool(args.get("warm")))
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
