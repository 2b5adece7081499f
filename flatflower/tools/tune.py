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
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from flatflower.common.config import ConfigError
from flatflower.server.rundir import path_name
from flatflower.strategies.registry import get as get_spec
from flatflower.tools import commands
from flatflower.tools.parsers import tune as build_parser
from flatflower.tools.prepare import UsageError, check_engine_options, engine_of
from flatflower.tools.tune_cluster import tune_on_cluster
from flatflower.tools.tune_space import Space, SpaceError, read_file, space_for
from flatflower.tools.tune_study import reclaim_interrupted, records, study_of, tune_trials
from flatflower.tools.tune_trial import objective_name, trial_args

EXIT_USAGE, EXIT_FAILED = 2, 1
ENGINES = ("inprocess", "vectorized")  # a trial is pruned between rounds of this process's run


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

    one = trial_args(args, args.algorithms.split(",")[0].strip(), {}, args.out / ".check")
    with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
        apply_preset(one)
    cfg = resolve_config(one)
    return {k: v for k, v in cfg.to_dict().items() if k not in ("run-dir", "algorithm", "client-state-dir")
            and k not in cfg.params.to_dict()}, one.clients


def default_engine(base: dict[str, Any], algorithms: list[str]) -> str:
    """The trials' engine when neither the command nor its preset names one: the vectorised
    engine where it applies (a model it batches: no BatchNorm, no dropout; docs/engines.md),
    else the in-process one. Both give the same numbers to float rounding."""
    from flatflower.common.config import RunConfig
    from flatflower.runtime.engines.inprocess import check_vectorizable

    try:
        for algorithm in algorithms:
            check_vectorizable(RunConfig.from_mapping({**base, "algorithm": algorithm,
                                                       **get_spec(algorithm).params.examples()}))
    except (ValueError, ConfigError):
        return "inprocess"
    return "vectorized"


# --------------------------------------------------------------------------- the final runs
def final_runs(args: argparse.Namespace, entries: list[dict[str, Any]], seeds: list[int],
               rounds: int) -> tuple[list[Path], list[str]]:
    """Each algorithm's best parameters, once per seed, ``rounds`` rounds (``--final-rounds``,
    else the trials'), on the test split (validation off): one after another here, or with
    ``--ray-address`` all at once as Ray tasks on the cluster (the sweep's way: tools/sweep.py)."""
    from flatflower.tools.sweep import finished, resumed, run_parallel, set_aside

    done, failed, todo = [], [], []
    for entry in entries:
        if entry["best"] is None:
            print(f"tune: {entry['algorithm']} has no complete trial: no final run", file=sys.stderr)
            failed.append(entry["algorithm"])
            continue
        for seed in seeds:
            run_dir = args.out / "final" / f"{path_name(entry['algorithm'])}-s{seed}"
            one = trial_args(args, entry["algorithm"], entry["best"]["params"], run_dir, seed, validation=False)
            one.rounds = rounds
            wanted = {"seed": seed, "num-server-rounds": rounds, "validation-fraction": 0.0, **entry["best"]["params"]}
            if finished(run_dir):
                check_final(run_dir, wanted)
                done.append(run_dir)
                continue
            if (run_dir / "checkpoint.pt").is_file():  # interrupted: it goes on from its last round
                check_final(run_dir, {k: v for k, v in wanted.items() if k != "num-server-rounds"})  # to `rounds`
                print(f"tune: {run_dir} was interrupted: resumed from its checkpoint", flush=True)
                one = resumed(args, run_dir, args.engine)
                one.rounds, one.ray_address = rounds, None
            elif run_dir.exists():
                print(f"tune: {run_dir} was interrupted before its first checkpoint: moved to "
                      f"{set_aside(run_dir).name}, run afresh", flush=True)
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
        from flatflower.tools.sweep import ray_task_size

        args.cpus_per_trial, args.gpus_per_trial = ray_task_size(
            args.cpus_per_trial, args.gpus_per_trial, address, ("--cpus-per-trial", "--gpus-per-trial"), "worker")
        if address is not None:
            if args.worker:
                raise UsageError("a --worker process runs on this machine: no --ray-address")
            from flatflower.tools.prepare import check_cluster

            check_cluster(address, args.cpus_per_trial, args.gpus_per_trial, "each tune worker")
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
            study = study_of(args, space, rounds, clients)
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
        print(f"tune: {len(failed)} final run(s) failed or not run: {', '.join(map(str, failed))}", file=sys.stderr)
        return EXIT_FAILED
    return 0
