"""One trial of ``flatflower tune`` (tools/tune.py): its ``flatflower simulate`` arguments, its run
in this process with each round's validation accuracy reported to the Optuna trial and the run
stopped when the pruner says so, and its objective.

A trial trains on the training split less the validation split (``validation-fraction``) and is
scored on that split only: the mean validation accuracy of its last ``--last-k`` rounds.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
from pathlib import Path
from typing import Any

from flatflower.tools import commands
from flatflower.tools.runfiles import RunFileError, read_jsonl

EXIT_FAILED = 1


def objective_name(last_k: int, fraction: float) -> str:
    return (f"validation accuracy, mean of the last {last_k} rounds (validation split: {fraction:g} of each "
            f"class of the training split, trained on by no client; the test split is not read)")


# what a trial skips unless the command sets it: checkpoints (a trial cut short runs again from
# its start) and TensorBoard files; neither changes a number of the run
TRIAL_DEFAULTS = ("checkpoint-every=0",)


def trial_args(args: argparse.Namespace, algorithm: str, values: dict[str, Any], run_dir: Path,
                seed: int | None = None, validation: bool = True) -> argparse.Namespace:
    """``flatflower simulate``'s arguments for one trial (or, ``validation`` off, one final run)."""
    one = copy.copy(args)
    one.algorithm, one.seed, one.run_dir, one.resume = algorithm, seed if seed is not None else args.first_seed, \
        str(run_dir), None
    one.ray_address = None  # the tune's cluster runs whole trials and runs, not their clients
    one.sets = [*(TRIAL_DEFAULTS if validation else []), *args.sets, *(f"{k}={_toml(v)}" for k, v in values.items()),
                *([f"validation-fraction={args.validation_fraction!r}"] if validation else [])]
    if validation and args.tensorboard is None:
        one.tensorboard = False  # a trial's curves are in its metrics.jsonl and the study
    return one


# what a trial skips unless the command sets it: checkpoints (a trial cut short runs again from
# its start) and TensorBoard files; neither changes a number of the run


def _toml(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (str, bool)) else repr(value)


def accuracies(run_dir: Path) -> list[tuple[int, float]]:
    """(round, validation accuracy) of the rounds the run has written so far."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    try:
        rows = [row for _, row in read_jsonl(path)]
    except RunFileError:
        return []
    return [(int(r["round"]), float(r["test_accuracy"])) for r in rows
            if isinstance(r, dict) and isinstance(r.get("test_accuracy"), (int, float))]


def round_seconds(run_dir: Path) -> float:
    """The seconds the run's rounds took (metrics.jsonl's ``seconds``): a trial's wall time
    less this is its fixed cost (configuration, data, model, the initial evaluation)."""
    try:
        rows = [row for _, row in read_jsonl(run_dir / "metrics.jsonl")]
    except (RunFileError, OSError):
        return 0.0
    return float(sum(r["seconds"] for r in rows if isinstance(r, dict) and isinstance(r.get("seconds"), (int, float))))


@contextlib.contextmanager
def trial_output():
    """Flower's and the server's log at ERROR while a trial runs: a trial's refused updates and
    skipped rounds are in its metrics.jsonl, and hundreds of trials would bury the tune's lines."""
    import logging

    def errors_only(record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR

    handlers = list(logging.getLogger("flwr").handlers)  # the engine sets the loggers' levels itself
    for handler in handlers:
        handler.addFilter(errors_only)
    try:
        yield
    finally:
        for handler in handlers:
            handler.removeFilter(errors_only)


def run_trial(one: argparse.Namespace, trial: Any) -> tuple[str, list[tuple[int, float]]]:
    """Run one trial's simulation in this process, reporting each round's validation accuracy
    to ``trial`` and stopping the run when the pruner says so. ("ok" | "pruned" | "failed:<code>",
    the (round, accuracy) rows); KeyboardInterrupt when the user interrupts."""
    from flatflower.runtime import engines
    from flatflower.runtime.engines.inprocess import LIVE, RunStopped
    from flatflower.tools.prepare import preflight, resolve_config

    state = {"reported": 0, "pruned": False}

    def handler(a: argparse.Namespace) -> int:
        cfg = resolve_config(a)
        preflight(cfg, a.clients, a.engine)
        run_dir = Path(cfg.run_dir)

        def poll() -> None:
            rows = accuracies(run_dir)
            for rnd, acc in rows[state["reported"]:]:
                trial.report(acc, rnd)
            state["reported"] = len(rows)
            if rows and not state["pruned"] and trial.should_prune():
                state["pruned"] = True
                for grid in list(LIVE):  # no further message: the run ends after this round
                    grid.stopping = True

        try:
            outcome = engines.run_in_process(cfg, a.clients, on_poll=poll, vectorized=a.engine == "vectorized")
        except RunStopped:
            if state["pruned"]:
                poll()  # the round that ended after the pruner's word
                return PRUNED
            raise
        poll()
        return 0 if outcome.ok else EXIT_FAILED

    with trial_output(), open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
        code = commands.run("simulate", one, handler=handler)
    rows = accuracies(Path(one.run_dir))
    if code == commands.EXIT_INTERRUPTED:  # also after the pruner's word: the trial runs again
        raise KeyboardInterrupt
    return ("pruned" if code == PRUNED else "ok" if code == 0 else f"failed:{code}"), rows


PRUNED = -1  # run_trial's handler: the pruner stopped the run


def objective_value(rows: list[tuple[int, float]], last_k: int) -> float:
    """The mean validation accuracy of the last ``last_k`` evaluated rounds."""
    tail = [acc for _, acc in rows[-last_k:]]
    return sum(tail) / len(tail)
