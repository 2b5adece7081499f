"""``flatflower tune``: every algorithm tuned with the same budget, on validation data, then tested.

For each algorithm of ``--algorithms``, ``--trials`` trials, each a ``flatflower simulate`` of
``--rounds`` rounds over ``--clients`` clients (the same budget, trials x rounds x clients, for
every algorithm) at a point of the algorithm's search space (tools/tune_space.py: ranges declared
beside the keys, changed by ``--space FILE``), drawn by Optuna's TPE sampler (``--tune-seed``).
A trial trains on the training split less a validation split (``validation-fraction``: of each
class, drawn with the partition seed, so every trial sees the same one) and is scored on that
split only: the objective is the validation accuracy's mean over the last ``--last-k`` rounds.
The test split is never read while tuning. A trial below the median of the earlier trials at the
same round is stopped early (Optuna's MedianPruner, ``--pruner none`` turns it off); it counts
in the budget as allotted, and the rounds it ran are the budget spent.

Then the best point of each algorithm runs with each of ``--seeds`` on the whole training split
and is evaluated on the test split (OUT/final/<algorithm>-s<seed>, ``flatflower simulate``'s run
directories), and ``flatflower report`` compares them (OUT/report.json, OUT/report.png). All
trials and final runs share one partition seed (``--set partition-seed``, else the first seed).

Records (docs/tuning.md): OUT/optuna.journal (Optuna's journal storage: every trial, its
parameters, per-round values and state), OUT/<algorithm>/trials.csv, OUT/<algorithm>/best.json
(the best parameters, their value, the objective's name, the budget allotted and spent) and
OUT/tune.json (all of them, the command and the settings). The trials' run directories are
OUT/<algorithm>/trials/t<number>.

Interrupted (Ctrl-C, a kill, a crash) and run again with the same command, a tune goes on where
it stopped: finished trials are kept in the storage; a trial cut short is run again from its
start with the same parameters; finished final runs are skipped. The same OUT with other
settings is refused. ``--workers N`` runs N trials at a time, each worker a process sharing the
storage (OUT/optuna.journal, or ``--storage URL``, e.g. an RDB that workers on other machines
reach); the budget is counted under a lock, so it is never overshot.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import csv
import fcntl
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from flatflower.common.config import ConfigError
from flatflower.strategies.registry import ALGORITHMS
from flatflower.tools import commands
from flatflower.tools.parsers import tune as build_parser
from flatflower.tools.prepare import UsageError, check_engine_options, engine_of
from flatflower.tools.runfiles import RunFileError, read_jsonl
from flatflower.tools.tune_space import Space, SpaceError, read_file, space_for

EXIT_USAGE, EXIT_FAILED = 2, 1
ENGINES = ("inprocess", "vectorized")  # a trial is pruned between rounds of this process's run
STORAGE_FILE = "optuna.journal"
SETTINGS_ATTR = "flatflower.settings"  # the study's user attribute that a resumed tune must match
INTERRUPTED_ATTR = "flatflower.interrupted"  # a trial cut short: not in the budget, run again


def objective_name(last_k: int, fraction: float) -> str:
    return (f"validation accuracy, mean of the last {last_k} rounds (validation split: {fraction:g} of each "
            f"class of the training split, trained on by no client; the test split is not read)")


class TrialRunFailed(RuntimeError):
    """A trial's run failed (it diverged, its model went non-finite, ...): a FAIL in the budget."""


# --------------------------------------------------------------------------- the plan
def _parse(args: argparse.Namespace) -> tuple[list[str], list[int]]:
    from flatflower.tools.sweep import algorithms_and_seeds

    try:
        algorithms, seeds = algorithms_and_seeds(args.algorithms, args.seeds)
    except ValueError as err:
        raise UsageError(str(err)) from None
    if not (math.isfinite(args.validation_fraction) and 0 < args.validation_fraction < 1):
        raise UsageError(f"--validation-fraction must be in (0, 1), got {args.validation_fraction:g}")
    if args.engine not in ENGINES:
        raise UsageError(f"tune runs its trials with --engine inprocess or vectorized (a trial is stopped "
                         f"between rounds in this process), not {args.engine}")
    for item in args.sets:
        if item.split("=", 1)[0].strip() in ("validation-fraction", "num-server-rounds", "seed", "run-dir",
                                             "resume", "algorithm"):
            raise UsageError(f"--set {item}: tune sets this key itself (use its own options)")
    return algorithms, seeds


def _base_values(args: argparse.Namespace) -> tuple[dict[str, Any], int]:
    """(the run-config values every trial shares: preset, --set, flags, for checking spaces;
    the number of clients)."""
    from flatflower.tools.prepare import apply_preset, resolve_config

    one = _trial_args(args, args.algorithms.split(",")[0].strip(), {}, args.out / ".check")
    with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
        apply_preset(one)
    cfg = resolve_config(one)
    return {k: v for k, v in cfg.to_dict().items() if k not in ("run-dir", "algorithm", "client-state-dir")
            and k not in cfg.params.to_dict()}, one.clients


def _trial_args(args: argparse.Namespace, algorithm: str, values: dict[str, Any], run_dir: Path,
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
TRIAL_DEFAULTS = ("checkpoint-every=0",)


def default_engine(base: dict[str, Any], algorithms: list[str]) -> str:
    """The trials' engine when neither the command nor its preset names one: the vectorised
    engine where it applies (a model it batches: no BatchNorm, no dropout; docs/engines.md),
    else the in-process one. Both give the same numbers to float rounding."""
    from flatflower.common.config import RunConfig
    from flatflower.runtime.engines.inprocess import check_vectorizable

    try:
        for algorithm in algorithms:
            check_vectorizable(RunConfig.from_mapping({**base, "algorithm": algorithm,
                                                       **ALGORITHMS[algorithm].params.examples()}))
    except (ValueError, ConfigError):
        return "inprocess"
    return "vectorized"


def _toml(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (str, bool)) else repr(value)


def settings(args: argparse.Namespace, space: Space, rounds: int, clients: int) -> dict[str, Any]:
    """What makes two tunes of one algorithm the same tune (a resumed one must match it; more
    ``--trials`` extend it, for every algorithm of the command alike)."""
    return {"algorithm": space.algorithm, "rounds": rounds, "clients": clients,
            "last_k": args.last_k, "validation_fraction": args.validation_fraction, "space": space.describe(),
            "engine": args.engine, "sets": list(args.sets), "preset": args.preset, "dataset": args.dataset,
            "model": args.model, "partition": args.partition, "fraction": args.fraction,
            "pruner": args.pruner, "tune_seed": args.tune_seed, "trial_seed": args.first_seed}


# --------------------------------------------------------------------------- one trial
def _accuracies(run_dir: Path) -> list[tuple[int, float]]:
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
            rows = _accuracies(run_dir)
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

    with engines.quiet_flower(), open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
        code = commands.run("simulate", one, handler=handler)
    rows = _accuracies(Path(one.run_dir))
    if code == commands.EXIT_INTERRUPTED and not state["pruned"]:
        raise KeyboardInterrupt
    return ("pruned" if code == PRUNED else "ok" if code == 0 else f"failed:{code}"), rows


PRUNED = -1  # run_trial's handler: the pruner stopped the run


def objective_value(rows: list[tuple[int, float]], last_k: int) -> float:
    """The mean validation accuracy of the last ``last_k`` evaluated rounds."""
    tail = [acc for _, acc in rows[-last_k:]]
    return sum(tail) / len(tail)


# --------------------------------------------------------------------------- the study
def _storage(args: argparse.Namespace) -> Any:
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


def _study(args: argparse.Namespace, space: Space, rounds: int, clients: int) -> Any:
    """The algorithm's study (created, or the one OUT holds when its settings match)."""
    import optuna

    pruner = (optuna.pruners.MedianPruner(n_startup_trials=min(5, max(1, args.trials // 4)),
                                          n_warmup_steps=max(1, rounds // 4))
              if args.pruner == "median" else optuna.pruners.NopPruner())
    study = optuna.create_study(study_name=space.algorithm, storage=_storage(args), direction="maximize",
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
def _locked(path: Path) -> Iterator[None]:
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

    study = _study(args, space, rounds, clients)
    root = Path(root or args.out)
    folder = root / space.algorithm / "trials"
    folder.mkdir(parents=True, exist_ok=True)
    asked = 0
    while True:
        if quota is not None:
            if asked >= quota:
                return
            trial = study.ask()
        else:
            with _locked(args.out / ".budget.lock"):
                if budget_used(study) >= args.trials:
                    return
                trial = study.ask()
        asked += 1
        values = space.suggest(trial)
        run_dir = folder / f"t{trial.number:04d}"
        trial.set_user_attr("run_dir", prefix + str(run_dir.relative_to(root)))
        started = time.monotonic()
        try:
            outcome, rows = run_trial(_trial_args(args, space.algorithm, values, run_dir), trial)
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


# --------------------------------------------------------------------------- a Ray cluster
def cluster_worker(run_dir: Path, args: argparse.Namespace, spaces: list[Space], quotas: dict[str, int],
                   rounds: int, clients: int, prefix: str) -> dict[str, int]:
    """(A Ray task's job, on any node) ``quotas[algorithm]`` trials of each algorithm, one after
    another in this process, their run directories under ``run_dir`` (shipped back to OUT/``prefix``
    by runtime/cluster.py), the study reached through the driver's storage (args.storage_proxy)."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    for space in spaces:
        tune_trials(args, space, rounds, clients, quota=quotas.get(space.algorithm, 0), root=run_dir, prefix=prefix)
    return dict(quotas)


def shares(left: int, workers: int) -> list[int]:
    """``left`` trials split over ``workers`` as evenly as whole trials allow."""
    return [left // workers + (1 if i < left % workers else 0) for i in range(workers)]


def _driver_host(address: str) -> str:
    """This machine's address as the cluster's head sees it (the interface that reaches it)."""
    import socket

    from flatflower.runtime.cluster import split_address

    host, port = split_address(address)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, port))
        return probe.getsockname()[0]


def serve_storage(args: argparse.Namespace, host: str) -> tuple[str, int]:
    """The study's storage served over gRPC (Optuna's proxy) on a free port of ``host``, in a
    daemon thread of this process: the cluster's workers reach the one storage through it."""
    import socket
    import threading

    import warnings

    from optuna.exceptions import ExperimentalWarning
    from optuna.storages import run_grpc_proxy_server

    warnings.filterwarnings("ignore", category=ExperimentalWarning)  # the proxy is Optuna's, since 4.2

    with socket.socket() as s:
        s.bind((host, 0))
        port = s.getsockname()[1]
    threading.Thread(target=run_grpc_proxy_server, args=(_storage(args),), kwargs={"host": host, "port": port},
                     daemon=True, name="flatflower-tune-storage").start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=1):
            return host, port
        time.sleep(0.1)
    raise UsageError(f"could not serve the study's storage on {host}:{port} for the cluster's workers")


def tune_on_cluster(args: argparse.Namespace, spaces: list[Space], rounds: int, clients: int) -> list[str]:
    """What is left of every algorithm's budget, as ``--workers`` Ray tasks on the cluster at
    ``--ray-address`` (each a process running its share of trials); the failures, one line each."""
    from flatflower.runtime.cluster import Job, run_jobs

    proxy = serve_storage(args, _driver_host(args.ray_address))
    left = {space.algorithm: max(0, args.trials - budget_used(_study(args, space, rounds, clients)))
            for space in spaces}
    workers = max(1, min(args.workers, max(left.values(), default=0)))
    split = {a: shares(n, workers) for a, n in left.items()}
    stamp = time.strftime("%Y%m%d-%H%M%S")
    jobs = []
    for i in range(workers):
        quotas = {a: split[a][i] for a in left}
        if not any(quotas.values()):
            continue
        name = f"ray-{stamp}-w{i}"
        remote = copy.copy(args)
        remote.ray_address, remote.storage_proxy, remote.worker_index = None, proxy, i + 1
        jobs.append(Job(name=name, run_dir=args.out / name, call=cluster_worker,
                        args=(remote, spaces, quotas, rounds, clients, f"{name}/"),
                        num_cpus=args.cpus_per_trial, num_gpus=args.gpus_per_trial))
    if not jobs:
        return []
    print(f"tune: {sum(left.values())} trial(s) as {len(jobs)} Ray task(s) on {args.ray_address}", flush=True)
    results = run_jobs(jobs, ray_address=args.ray_address, parallel=len(jobs))
    return [f"{r.job.name} on {r.where}: {r.error.strip().splitlines()[-1] if r.error else 'failed'}"
            for r in results if not r.ok]


# --------------------------------------------------------------------------- records
def records(args: argparse.Namespace, space: Space, rounds: int, clients: int) -> dict[str, Any]:
    """The algorithm's trials.csv and best.json; its entry of tune.json."""
    import optuna

    study = _study(args, space, rounds, clients)
    trials = [t for t in study.get_trials(deepcopy=False) if not t.user_attrs.get(INTERRUPTED_ATTR)]
    folder = args.out / space.algorithm
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


# --------------------------------------------------------------------------- the final runs
def final_runs(args: argparse.Namespace, entries: list[dict[str, Any]], seeds: list[int],
               rounds: int) -> tuple[list[Path], list[str]]:
    """Each algorithm's best parameters, once per seed, ``rounds`` rounds (``--final-rounds``,
    else the trials'), on the test split (validation off): one after another here, or with
    ``--ray-address`` all at once as Ray tasks on the cluster (the sweep's way: tools/sweep.py)."""
    from flatflower.tools.sweep import finished, run_parallel, set_aside

    done, failed, todo = [], [], []
    for entry in entries:
        if entry["best"] is None:
            print(f"tune: {entry['algorithm']} has no complete trial: no final run", file=sys.stderr)
            failed.append(entry["algorithm"])
            continue
        for seed in seeds:
            run_dir = args.out / "final" / f"{entry['algorithm']}-s{seed}"
            one = _trial_args(args, entry["algorithm"], entry["best"]["params"], run_dir, seed, validation=False)
            one.rounds = rounds
            if finished(run_dir):
                check_final(run_dir, {"seed": seed, "num-server-rounds": rounds,
                                      "validation-fraction": 0.0, **entry["best"]["params"]})
                done.append(run_dir)
                continue
            if run_dir.exists():
                print(f"tune: {run_dir} was interrupted: moved to {set_aside(run_dir).name}, run afresh", flush=True)
            if args.ray_address:
                todo.append(one)
                continue
            print(f"tune: final {entry['algorithm']}, seed {seed} -> {run_dir}", flush=True)
            code = commands.run("simulate", one)
            if code == commands.EXIT_INTERRUPTED:
                raise KeyboardInterrupt
            (done if code == 0 else failed).append(run_dir if code == 0 else run_dir.name)
    if todo:
        ran, lost = run_parallel(todo, None, args.out / "final", args.ray_address,
                                 (args.cpus_per_trial, args.gpus_per_trial))
        done, failed = done + ran, failed + lost
    return done, failed


def check_final(run_dir: Path, wanted: dict[str, Any]) -> None:
    """UsageError when a finished final run in OUT ran other values than the tune's best
    (a best that changed since, other --final-rounds): it would be reported as this tune's."""
    try:
        config = json.loads((run_dir / "config.json").read_text())["config"]
    except (OSError, ValueError, KeyError, TypeError):
        raise UsageError(f"{run_dir} has no readable config.json: move it away to run it again") from None
    differ = [k for k, v in wanted.items() if v is not None and not _same(config.get(k), v)]
    if differ:
        raise UsageError(f"{run_dir} ran other values of {', '.join(differ)} than this tune's final run: "
                         f"move it away to run it again")


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return math.isclose(a, b, rel_tol=1e-12, abs_tol=0.0)
    return a == b


# --------------------------------------------------------------------------- the command
def _workers(args: argparse.Namespace, argv: list[str]) -> list[subprocess.Popen]:
    """``--workers N``: N - 1 more processes running this tune's trials (this one is the Nth)."""
    extra = []
    for i in range(1, args.workers):
        log = open(args.out / f"worker-{i}.log", "a")
        extra.append(subprocess.Popen([sys.executable, "-m", "flatflower.tools.cli", "tune", *argv, "--worker",
                                       "--worker-index", str(i)],
                                      stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
    return extra


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[2:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    try:
        from flatflower.tools.presets import PresetError, load_preset

        preset = load_preset(args.preset) if args.preset else None
        chosen = args.engine or (preset.engine if preset else None)
        args.engine = engine_of(args, preset)
        address, args.ray_address = args.ray_address, None  # the tune's cluster, not its trials' engine
        check_engine_options(args)
        algorithms, seeds = _parse(args)
        args.first_seed = seeds[0]
        if not any(s.split("=", 1)[0].strip() == "partition-seed" for s in args.sets):
            args.sets = [*args.sets, f"partition-seed={seeds[0]}"]
        overrides = read_file(args.space) if args.space else {}
        base, args.clients = _base_values(args)
        if chosen is None:  # neither the command nor its preset names one
            args.engine = default_engine(base, algorithms)
        rounds, clients = int(base["num-server-rounds"]), args.clients
        if args.last_k > rounds:
            raise UsageError(f"--last-k {args.last_k} is more than the trials' {rounds} rounds")
        spaces = [space_for(a, overrides, base) for a in algorithms]
        if address is not None:
            if args.worker:
                raise UsageError("a --worker process runs on this machine: no --ray-address")
            if not (args.cpus_per_trial > 0 and args.gpus_per_trial >= 0):
                raise UsageError("--cpus-per-trial must be > 0 and --gpus-per-trial >= 0")
            from flatflower.tools.prepare import check_cluster

            check_cluster(address, args.cpus_per_trial, args.gpus_per_trial, "each tune worker")
        elif (args.cpus_per_trial, args.gpus_per_trial) != (1.0, 0.0):
            raise UsageError("--cpus-per-trial and --gpus-per-trial size each worker's Ray task: add --ray-address")
        args.ray_address = address
        args.out.mkdir(parents=True, exist_ok=True)
    except (UsageError, SpaceError, PresetError, ConfigError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    if args.worker:
        for space in spaces:
            tune_trials(args, space, rounds, clients)
        return 0
    from flatflower.server.rundir import RunDirError, claim

    try:
        lock = claim(args.out / ".tune.lock", f"another tune is running in {args.out}")
    except RunDirError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE
    try:
        return _run(args, argv, algorithms, seeds, spaces, rounds, clients)
    finally:
        os.close(lock)


def _run(args: argparse.Namespace, argv: list[str], algorithms: list[str], seeds: list[int],
         spaces: list[Space], rounds: int, clients: int) -> int:
    """The tune itself, under OUT's lock."""
    try:
        for space in spaces:  # a tune with other settings in OUT is refused before any trial runs
            study = _study(args, space, rounds, clients)
            if n := reclaim_interrupted(study):
                print(f"tune: {space.algorithm}: {n} trial(s) cut short by an interruption will run again", flush=True)
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE
    print(f"tune: {len(algorithms)} algorithm(s) x {args.trials} trials x {rounds} rounds x {clients} clients; "
          f"objective: {objective_name(args.last_k, args.validation_fraction)}", flush=True)
    workers = [] if args.ray_address else _workers(args, argv)
    try:
        failures = tune_on_cluster(args, spaces, rounds, clients) if args.ray_address else []
        for failure in failures:
            print(f"tune: a cluster worker failed: {failure}", file=sys.stderr, flush=True)
        if not args.ray_address:
            for space in spaces:
                tune_trials(args, space, rounds, clients)
    except KeyboardInterrupt:
        print("tune: interrupted; run the same command again to go on (finished trials are kept)", file=sys.stderr)
        return commands.EXIT_INTERRUPTED
    finally:
        for proc in workers:
            proc.wait()
    entries = [records(args, space, rounds, clients) for space in spaces]
    summary = {"command": ["flatflower", "tune", *argv], "objective": entries[0]["objective"],
               "seeds": seeds, "algorithms": entries}
    (args.out / "tune.json").write_text(json.dumps(summary, indent=2) + "\n")
    for e in entries:
        b = e["budget"]
        best = "no complete trial" if e["best"] is None else f"best {e['best']['value']:.4f} " + ", ".join(
            f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in e["best"]["params"].items())
        print(f"tune: {e['algorithm']}: {best} (client-rounds {b['client_rounds_spent']} of "
              f"{b['client_rounds_allotted']}; {b['trials_by_state']})", flush=True)
    if failures:  # the budgets are not all spent: no final run would compare equals
        print("tune: some trials did not run; run the same command again to finish the budget (finished "
              "trials are kept)", file=sys.stderr)
        return EXIT_FAILED
    if args.no_final:
        return 0
    try:
        runs, failed = final_runs(args, entries, seeds, args.final_rounds or rounds)
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("tune: interrupted; run the same command again to go on (finished runs are kept)", file=sys.stderr)
        return commands.EXIT_INTERRUPTED
    if runs:
        from flatflower.tools.report import main as report

        report([*map(str, runs), "--by-algorithm", "--last-k", str(args.last_k),
                "--out", str(args.out / "report.png"), "--json", str(args.out / "report.json")])
    if failed:
        print(f"tune: {len(failed)} final run(s) failed: {', '.join(map(str, failed))}", file=sys.stderr)
        return EXIT_FAILED
    return 0
