"""The Optuna side of ``flatflower tune`` (tools/tune.py): each algorithm's study in one storage
(OUT/optuna.journal, ``--storage URL``, or the driver's over gRPC on a cluster), the settings a
resumed tune must match, the budget (trials that count, counted under OUT's lock), trials an
interruption cut short, one worker's loop of trials, and the records (trials.csv, best.json).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import fcntl
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from flatflower.server.rundir import path_name
from flatflower.tools.prepare import UsageError
from flatflower.tools.tune_space import Space
from flatflower.tools.tune_trial import objective_name, objective_value, round_seconds, run_trial, trial_args

STORAGE_FILE = "optuna.journal"
SETTINGS_ATTR = "flatflower.settings"  # the study's user attribute that a resumed tune must match
INTERRUPTED_ATTR = "flatflower.interrupted"  # a trial cut short: not in the budget, run again


def settings(args: argparse.Namespace, space: Space, rounds: int, clients: int) -> dict[str, Any]:
    """What makes two tunes of one algorithm the same tune (a resumed one must match it; more
    ``--trials`` extend it, for every algorithm of the command alike)."""
    return {"algorithm": space.algorithm, "rounds": rounds, "clients": clients,
            "last_k": args.last_k, "validation_fraction": args.validation_fraction, "space": space.describe(),
            "engine": args.engine, "sets": list(args.sets), "preset": args.preset, "dataset": args.dataset,
            "model": args.model, "partition": args.partition, "fraction": args.fraction,
            "pruner": args.pruner, "tune_seed": args.tune_seed, "trial_seed": args.first_seed}


def storage(args: argparse.Namespace) -> Any:
    if getattr(args, "storage_proxy", None):  # a cluster worker: the driver's storage, over gRPC
        import warnings

        from optuna.exceptions import ExperimentalWarning
        from optuna.storages import GrpcStorageProxy

        warnings.filterwarnings("ignore", category=ExperimentalWarning)

        host, port = args.storage_proxy
        return GrpcStorageProxy(host=host, port=port)
    if args.storage:
        return args.storage
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    return JournalStorage(JournalFileBackend(str(args.out / STORAGE_FILE)))


def study_of(args: argparse.Namespace, space: Space, rounds: int, clients: int) -> Any:
    """The algorithm's study (created, or the one OUT holds when its settings match)."""
    import optuna

    pruner = (optuna.pruners.MedianPruner(n_startup_trials=min(5, max(1, args.trials // 4)),
                                          n_warmup_steps=max(1, rounds // 4))
              if args.pruner == "median" else optuna.pruners.NopPruner())
    study = optuna.create_study(study_name=space.algorithm, storage=storage(args), direction="maximize",
                                sampler=optuna.samplers.TPESampler(seed=sampler_seed(args),
                                                                   n_startup_trials=startup_trials(args.trials)),
                                pruner=pruner,
                                load_if_exists=True)
    wanted = json.loads(json.dumps(settings(args, space, rounds, clients)))
    found = study.user_attrs.get(SETTINGS_ATTR)
    if found is None:
        study.set_user_attr(SETTINGS_ATTR, wanted)
    elif found != wanted:
        differ = sorted(k for k in set(found) | set(wanted) if found.get(k) != wanted.get(k))
        raise UsageError(f"{args.out} holds a tune of {space.algorithm} with other settings ({', '.join(differ)}): "
                         f"run it with the same command, or use another --out")
    return study


def sampler_seed(args: argparse.Namespace) -> int:
    """The sampler's seed in this worker: ``--tune-seed`` for the first, another for each other
    worker (the same seed would draw the same random points in every worker)."""
    import numpy as np

    index = getattr(args, "worker_index", 0)
    return args.tune_seed if not index else int(np.random.SeedSequence([args.tune_seed, index]).generate_state(1)[0])


def startup_trials(trials: int) -> int:
    """Random trials before TPE models the results: Optuna's 10, or half a smaller budget (at
    least 2), so that a budget of a few trials is not random search alone."""
    return max(2, min(10, trials // 2))


def budget_used(study: Any) -> int:
    """Trials that count in the budget: finished (complete, pruned, failed) or running, less
    those an interruption cut short."""
    import optuna

    counted = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED, optuna.trial.TrialState.FAIL,
               optuna.trial.TrialState.RUNNING)
    return sum(1 for t in study.get_trials(deepcopy=False, states=counted)
               if not t.user_attrs.get(INTERRUPTED_ATTR))


def reclaim_interrupted(study: Any) -> int:
    """Trials left running by a tune that was killed (no worker of this OUT runs now: the
    lock says so): marked interrupted and failed, their parameters queued to run again."""
    import optuna

    stale = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))
    for t in stale:
        study._storage.set_trial_user_attr(t._trial_id, INTERRUPTED_ATTR, True)
        study._storage.set_trial_state_values(t._trial_id, optuna.trial.TrialState.FAIL)
        study.enqueue_trial(t.params, skip_if_exists=False)
    return len(stale)


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def tune_trials(args: argparse.Namespace, space: Space, rounds: int, clients: int, quota: int | None = None,
                root: Path | None = None, prefix: str = "") -> None:
    """This worker's trials of one algorithm: until the study's budget is used (counted under
    OUT's lock), or ``quota`` trials (a cluster worker's share of what is left, which the
    driver counted). Their run directories go to ``root`` (default OUT)/<algorithm>/trials,
    named in the study relative to OUT as ``prefix`` + that path."""
    import optuna

    study = study_of(args, space, rounds, clients)
    root = Path(root or args.out)
    folder = root / path_name(space.algorithm) / "trials"
    folder.mkdir(parents=True, exist_ok=True)
    asked = 0
    while True:
        if quota is not None:
            if asked >= quota:
                return
            trial = study.ask()
        else:
            with locked(args.out / ".budget.lock"):
                if budget_used(study) >= args.trials:
                    return
                trial = study.ask()
        asked += 1
        values = space.suggest(trial)
        run_dir = folder / f"t{trial.number:04d}"
        trial.set_user_attr("run_dir", prefix + str(run_dir.relative_to(root)))
        started = time.monotonic()
        try:
            outcome, rows = run_trial(trial_args(args, space.algorithm, values, run_dir), trial)
        except BaseException:
            study._storage.set_trial_user_attr(trial._trial_id, INTERRUPTED_ATTR, True)
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
            study.enqueue_trial(trial.params, skip_if_exists=False)
            raise
        trial.set_user_attr("rounds_run", rows[-1][0] if rows else 0)
        trial.set_user_attr("seconds", round(time.monotonic() - started, 3))
        trial.set_user_attr("round_seconds", round(round_seconds(run_dir), 3))
        if outcome == "ok" and rows:
            value = objective_value(rows, args.last_k)
            study.tell(trial, value)
            shown = f"{value:.4f}"
        elif outcome == "pruned":
            study.tell(trial, state=optuna.trial.TrialState.PRUNED)
            shown = f"pruned after round {rows[-1][0] if rows else 0}"
        else:
            trial.set_user_attr("error", outcome)
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
            shown = f"failed ({outcome}; {run_dir}/summary.json says why)"
        print(f"tune: {space.algorithm} trial {trial.number}: {shown}  "
              + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in values.items()),
              flush=True)


def records(args: argparse.Namespace, space: Space, rounds: int, clients: int) -> dict[str, Any]:
    """The algorithm's trials.csv and best.json; its entry of tune.json."""
    import optuna

    study = study_of(args, space, rounds, clients)
    trials = [t for t in study.get_trials(deepcopy=False) if not t.user_attrs.get(INTERRUPTED_ATTR)]
    folder = args.out / path_name(space.algorithm)
    folder.mkdir(parents=True, exist_ok=True)  # a cluster's trials are under OUT/ray-*/
    keys = list(space.ranges) + list(space.fixed)
    with open(folder / "trials.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["trial", "state", "value", "rounds_run", "seconds", "round_seconds", *keys, "run_dir",
                         "error"])
        for t in trials:
            params = {**space.fixed, **t.params}
            writer.writerow([t.number, t.state.name.lower(), "" if t.value is None else repr(t.value),
                             t.user_attrs.get("rounds_run", ""), t.user_attrs.get("seconds", ""),
                             t.user_attrs.get("round_seconds", ""),
                             *(params.get(k, "") for k in keys), t.user_attrs.get("run_dir", ""),
                             t.user_attrs.get("error", "")])
    complete = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
    best = max(complete, key=lambda t: (t.value, -t.number)) if complete else None
    spent = sum(int(t.user_attrs.get("rounds_run", 0)) for t in trials) * clients
    entry = {
        "algorithm": space.algorithm, "objective": objective_name(args.last_k, args.validation_fraction),
        "best": None if best is None else {"trial": best.number, "value": best.value,
                                           "params": {**space.fixed, **best.params}},
        "budget": {"trials": args.trials, "rounds": rounds, "clients": clients,
                   "client_rounds_allotted": args.trials * rounds * clients, "client_rounds_spent": spent,
                   "trials_by_state": {s: sum(1 for t in trials if t.state.name.lower() == s)
                                       for s in ("complete", "pruned", "fail")}},
        "space": space.describe(),
    }
    (folder / "best.json").write_text(json.dumps(entry, indent=2) + "\n")
    return entry
