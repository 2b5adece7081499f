"""``flatflower sweep``: several algorithms x seeds on one partition, then one report.

Each (algorithm, seed) is exactly ``flatflower simulate --algorithm A --seed S --run-dir
OUT/A-sS [the other options]`` (flatflower.tools.commands.simulate), so every option of ``simulate``
(presets, ``--set``, ``--engine``, ...) works here too. All runs share one data partition, so
seeds vary the model init, sampling and shuffling only: ``partition-seed`` is the one given
(``--set``, else the preset's), else that of the runs already in OUT (a sweep run in pieces,
one seed at a time, stays on one partition), else the first seed. Afterwards ``flatflower
report`` summarizes all runs per algorithm (mean ± std over seeds) into OUT/report.json,
OUT/report.png (accuracy vs rounds) and OUT/report-bytes.png (accuracy vs cumulative bytes).

A run that fails is reported and the sweep goes on; finished runs are kept, and
``--resume-existing`` skips them when the sweep is run again and continues an interrupted one
from its checkpoint (``simulate --resume``: a sweep stopped at run k goes on at run k, from
its last checkpointed round); an interrupted run without a checkpoint is moved aside (to
``<run>.incomplete-<i>``, nothing is deleted) and run afresh. ``--jobs N`` runs N runs at a
time, each ``flatflower simulate`` in its own process with its output in OUT/<run>.log, and
shows which are running and how far they are (``--jobs auto``: as many as this machine has
cores). ``--ray-address HOST:PORT`` sends every run to a Ray cluster that already runs, each a
Ray task holding ``--cpus-per-run`` CPUs and ``--gpus-per-run`` GPUs, its run directory and log
written here as it finishes (runtime/cluster.py; each run's engine, in-process or vectorised,
runs inside its task).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path
from typing import Any

from flatflower.common.config import did_you_mean
from flatflower.common.schema import printable
from flatflower.common.references import is_reference
from flatflower.server.rundir import path_name
from flatflower.strategies.registry import ALGORITHMS, BUILT_IN
from flatflower.strategies.registry import get as get_spec
from flatflower.tools import commands
from flatflower.tools.parsers import sweep as build_parser
from flatflower.tools.prepare import UsageError, check_cluster, check_engine_options, engine_of

EXIT_USAGE, EXIT_FAILED = 2, 1


def algorithms_and_seeds(algorithms_text: str, seeds_text: str) -> tuple[list[str], list[int]]:
    """``--algorithms`` (known names, each once) and ``--seeds`` (distinct integers >= 0) of a
    sweep or a tune; ValueError naming what is wrong."""
    algorithms = list(dict.fromkeys(a.strip() for a in algorithms_text.split(",") if a.strip()))
    for a in algorithms:
        if is_reference(a):
            get_spec(a)  # a user's algorithm: loaded and checked now, its error in one line
    unknown = [a for a in algorithms if a not in ALGORITHMS]
    if not algorithms or unknown:
        hint = did_you_mean(unknown[0], ALGORITHMS) if unknown else ""
        raise ValueError(f"unknown algorithm(s) {', '.join(unknown) or '(none given)'}{hint}; "
                         f"valid names: {', '.join(sorted(BUILT_IN))}, or a reference package.module:callable")
    try:
        seeds = [int(s) for s in seeds_text.split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"--seeds expects comma-separated integers, got {seeds_text!r}") from None
    if not seeds or min(seeds) < 0 or len(set(seeds)) != len(seeds):
        raise ValueError(f"--seeds must be distinct integers >= 0, got {seeds_text!r}")
    return algorithms, seeds


def _parse(args: argparse.Namespace) -> tuple[list[str], list[int]]:
    if args.jobs is not None and args.jobs < 1:
        raise ValueError("--jobs must be >= 1")
    return algorithms_and_seeds(args.algorithms, args.seeds)


def ray_task_size(cpus: float | None, gpus: float | None, address: str | None, flags: tuple[str, str],
                  what: str) -> tuple[float, float]:
    """(CPUs, GPUs) each Ray task holds (given as ``flags``, None when not given: 1 and 0);
    UsageError for sizes without an ``address`` or out of range. ``what``: each task's work
    (a sweep's run, a tune's worker)."""
    given = [flag for flag, value in zip(flags, (cpus, gpus)) if value is not None]
    if address is None:
        if given:
            raise UsageError(f"{' and '.join(given)} size each {what}'s Ray task: add --ray-address")
        return 1.0, 0.0
    cpus, gpus = cpus if cpus is not None else 1.0, gpus or 0.0
    if cpus <= 0 or gpus < 0:
        raise UsageError(f"{flags[0]} must be > 0 and {flags[1]} >= 0 (got {cpus:g}, {gpus:g})")
    return cpus, gpus


def task_size(args: argparse.Namespace, engine: str | None) -> tuple[float, float]:
    """(CPUs, GPUs) each run's Ray task holds; UsageError for sizes without --ray-address, or
    for a Ray engine inside the tasks."""
    if args.ray_address is not None and engine == "ray":
        raise UsageError("--ray-address runs each run of the sweep as a Ray task with its own engine: "
                         "use --engine inprocess or vectorized there (or 'simulate --engine ray "
                         "--ray-address' for one run whose clients are the cluster's actors)")
    return ray_task_size(args.cpus_per_run, args.gpus_per_run, args.ray_address,
                         ("--cpus-per-run", "--gpus-per-run"), "run")


def partition_seed_given(args: argparse.Namespace, preset: Any) -> str | None:
    """The partition seed the command fixes: its ``--set partition-seed=``, else its preset's
    (``[config]`` or the table of one of the sweep's algorithms); None when neither does."""
    for assignment in reversed(args.sets):
        key, _, value = assignment.partition("=")
        if key.strip() == "partition-seed":
            return value.strip()
    if preset is not None:
        for values in (preset.config, *preset.algorithms.values()):
            if "partition-seed" in values:
                return str(values["partition-seed"])
    return None


def existing_partition_seed(out: Path, first_seed: int) -> int:
    """The partition seed of the runs already in ``out`` (their config.json), so that a sweep
    run again with other seeds stays on their partition; ``first_seed`` when there are none.
    Runs on different partitions there are an error: which one to join is not for us to guess."""
    found: dict[int, list[str]] = {}
    for config in sorted(out.glob("*/config.json")) if out.is_dir() else []:
        try:
            value = json.loads(config.read_text())["config"]["partition-seed"]
        except (OSError, ValueError, KeyError, TypeError, RecursionError):
            continue
        if type(value) is int and value >= 0:
            found.setdefault(value, []).append(config.parent.name)
    if len(found) > 1:
        raise UsageError(f"the runs in {out} are on different partitions ("
                         + "; ".join(f"partition-seed {k}: {', '.join(v[:3])}" for k, v in found.items())
                         + "): give --set partition-seed=<one of them>")
    return next(iter(found), first_seed)


def finished(run_dir: Path) -> bool:
    """A run that completed all its rounds (summary.json is written at the very end)."""
    return (run_dir / "summary.json").is_file() and (run_dir / "model_final.pt").is_file()


def resumed(args: argparse.Namespace, run_dir: Path, engine: str) -> argparse.Namespace:
    """``flatflower simulate --resume RUN_DIR`` for an interrupted run of the sweep (its own
    config.json and checkpoint say the rest)."""
    from flatflower.tools.prepare import resume_clients

    one = copy.copy(args)
    for name in ("algorithm", "seed", "run_dir", "preset", "dataset", "model", "partition", "fraction"):
        setattr(one, name, None)  # the sweep's --rounds stays: a resumed run goes on to it
    one.sets, one.resume, one.engine = [], str(run_dir), engine
    one.clients = resume_clients(str(run_dir))
    return one


def directory(one: argparse.Namespace) -> Path:
    """The run directory of one planned run (a resumed one's is its --resume)."""
    return Path(one.resume or one.run_dir)


def set_aside(run_dir: Path) -> Path:
    """Move an interrupted run without a checkpoint to ``<run>.incomplete-<i>`` (kept)."""
    i = 1
    while (aside := run_dir.with_name(f"{run_dir.name}.incomplete-{i}")).exists():
        i += 1
    run_dir.rename(aside)
    return aside


def main(argv: list[str] | None = None) -> int:
    from flatflower.tools.report import main as report

    args = build_parser().parse_args(argv)
    try:
        algorithms, seeds = _parse(args)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE
    try:
        from flatflower.tools.presets import PresetError, load_preset

        preset = load_preset(args.preset) if args.preset else None
        if partition_seed_given(args, preset) is None:
            args.sets = [*args.sets, f"partition-seed={existing_partition_seed(Path(args.out), seeds[0])}"]
        engine = engine_of(args, preset)
        size = task_size(args, engine)
        address, args.ray_address = args.ray_address, None  # the sweep's, not its runs'
        check_engine_options(argparse.Namespace(**{**vars(args), "engine": engine}))
        if address is not None:
            check_cluster(address, *size, "each run")
    except (PresetError, UsageError) as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE
    todo = []
    runs, failed = [], []
    for algorithm in algorithms:
        for seed in seeds:
            run_dir = args.out / f"{path_name(algorithm)}-s{seed}"
            if args.resume_existing and finished(run_dir):
                print(f"sweep: {run_dir.name} already finished, skipped", flush=True)
                runs.append(run_dir)
                continue
            if args.resume_existing and (run_dir / "checkpoint.pt").is_file():
                print(f"sweep: {run_dir.name} was interrupted: resumed from its checkpoint", flush=True)
                todo.append(resumed(args, run_dir, engine))
                continue
            if args.resume_existing and (run_dir / "metrics.jsonl").is_file():
                print(f"sweep: {run_dir.name} was interrupted before its first checkpoint: moved to "
                      f"{set_aside(run_dir).name}, run afresh", flush=True)
            one = copy.copy(args)
            one.algorithm, one.seed, one.run_dir, one.sets = algorithm, seed, str(run_dir), list(args.sets)
            one.resume = None
            todo.append(one)
    fresh = [one for one in todo if not one.resume]  # a resumed run's check would claim its directory
    alone = (args.jobs or 1) == 1 and address is None  # one after the other, in this process
    if not alone and todo:
        if fresh and commands.run("check", copy.copy(fresh[0])) == EXIT_USAGE:
            print("sweep: stopped, the first run's options are invalid (nothing was run)", file=sys.stderr)
            return EXIT_USAGE
        done, failed = run_parallel(todo, args.jobs or (None if address else 1), args.out, address, size)
        runs += done
    for one in todo if alone else []:
        run_dir = directory(one)
        print(f"sweep: {run_dir.name} -> {run_dir}" if one.resume else
              f"sweep: {one.algorithm}, seed {one.seed} -> {run_dir}", flush=True)
        code = commands.run("simulate", one)
        if code == commands.EXIT_INTERRUPTED:  # Ctrl-C / SIGTERM stops the sweep, not only this run
            print("sweep: interrupted; `--resume-existing` continues it", file=sys.stderr)
            return code
        if code == EXIT_USAGE and not runs and not failed:
            print("sweep: stopped, the first run's options are invalid (nothing else was run)",
                  file=sys.stderr)
            return EXIT_USAGE
        if code == 0:
            runs.append(run_dir)
        else:
            failed.append(run_dir.name)
            print(f"sweep: {run_dir.name} failed (exit {code}); going on", file=sys.stderr, flush=True)
    runs = _order(todo, runs)
    if runs:
        report_args = [*map(str, runs), "--by-algorithm", "--last-k", str(args.last_k),
                       "--out", str(args.out / "report.png"), "--json", str(args.out / "report.json")]
        if args.target is not None:
            report_args += ["--target", str(args.target)]
        report(report_args)
    if failed:
        print(f"sweep: {len(failed)} run(s) failed: {', '.join(failed)}", file=sys.stderr)
        return EXIT_FAILED
    return 0


def _order(todo: list[argparse.Namespace], runs: list[Path]) -> list[Path]:
    """The report's order: skipped (finished) runs, then the sweep's (algorithm, seed) order."""
    planned = [directory(one) for one in todo]
    return [r for r in runs if r not in planned] + [p for p in planned if p in runs]


def ray_sizes(one: argparse.Namespace) -> list[str]:
    """The Ray actor sizes the sweep was given (only those: other engines refuse them)."""
    return [*(["--cpus-per-client", str(one.cpus_per_client)] if one.cpus_per_client is not None else []),
            *(["--gpus-per-client", repr(one.gpus_per_client)] if one.gpus_per_client is not None else [])]


def simulate_argv(one: argparse.Namespace) -> list[str]:
    """``flatflower simulate`` arguments for one (algorithm, seed) of the sweep."""
    if one.resume:
        return ["simulate", "--resume", one.resume, "--clients", str(one.clients), "--engine", one.engine,
                *(["--rounds", str(one.rounds)] if one.rounds else []),
                "--timeout", repr(one.timeout), *ray_sizes(one),
                *(["--trust-run-dir"] if getattr(one, "trust_run_dir", False) else []),
                *(["--allow-code-change"] if getattr(one, "allow_code_change", False) else [])]
    argv = ["simulate", "--algorithm", one.algorithm, "--seed", str(one.seed), "--run-dir", one.run_dir,
            *(["--engine", one.engine] if one.engine else []), "--timeout", repr(one.timeout), *ray_sizes(one)]
    for flag, value in (("--preset", one.preset), ("--clients", one.clients), ("--rounds", one.rounds),
                        ("--dataset", one.dataset), ("--model", one.model), ("--partition", one.partition),
                        ("--fraction", one.fraction), ("--app-dir", one.app_dir)):
        if value is not None:
            argv += [flag, str(value)]
    if one.tensorboard is not None:
        argv.append("--tensorboard" if one.tensorboard else "--no-tensorboard")
    for item in one.sets:
        argv += ["--set", item]
    return argv


def _status(run_dir: Path) -> str:
    """``fedsam-s0 12/30 61.2%``: a running run's last round (metrics.jsonl)."""
    try:
        last = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
        rounds = json.loads((run_dir / "config.json").read_text())["config"]["num-server-rounds"]
        accuracy = last.get("test_accuracy", last.get("federated_accuracy"))
        return printable(f"{run_dir.name} {last['round']}/{rounds} {100 * accuracy:.1f}%", 200)
    except (OSError, ValueError, IndexError, KeyError, TypeError, AttributeError, RecursionError):
        return f"{run_dir.name} starting"


def run_parallel(todo: list[argparse.Namespace], jobs: int | None, out: Path, address: str | None = None,
                 size: tuple[float, float] = (1.0, 0.0)) -> tuple[list[Path], list[str]]:
    """Each run as its own ``flatflower simulate`` process, ``jobs`` at a time (None: all at
    once, on a Ray cluster), output in OUT/<run>.log; on this machine, or with ``address`` as
    Ray tasks of ``size`` (CPUs, GPUs) on that cluster (runtime/cluster.py); (finished run
    directories, names of the failed runs)."""
    from flatflower.runtime.cluster import Job, run_jobs
    from flatflower.tools.progress import Steps

    out.mkdir(parents=True, exist_ok=True)
    planned = [Job(directory(one).name, directory(one), argv=("-m", "flatflower.tools.cli", *simulate_argv(one)),
                   log=out / f"{directory(one).name}.log", num_cpus=size[0], num_gpus=size[1]) for one in todo]
    runs, failed, started = [], [], []
    where = f"on the Ray cluster at {address}" if address else ""
    steps = Steps("sweep", every=30.0)

    def start(job: Job) -> None:
        started.append(job)
        print(f"sweep: started {job.name} ({len(started)}/{len(todo)}){' ' + where if where else ''}, "
              f"log {job.log.name}", flush=True)

    def done(result) -> None:
        if result.ok:
            runs.append(result.job.run_dir)
            print(f"sweep: {result.job.name} finished ({_status(result.job.run_dir)})"
                  f"{' on ' + result.where if address else ''}", flush=True)
        else:
            failed.append(result.job.name)
            print(f"sweep: {result.job.name} failed ({result.error}; see {result.job.log.name}); going on",
                  file=sys.stderr, flush=True)

    def poll(running: list[Job]) -> None:
        steps(f"{len(runs) + len(failed)}/{len(todo)} done; running "
              + ", ".join(f"{j.name} {where}" if address else _status(j.run_dir) for j in running))

    try:
        run_jobs(planned, ray_address=address, parallel=jobs, on_start=start, on_done=done, on_poll=poll)
    finally:
        steps.close()
    return runs, failed


if __name__ == "__main__":
    sys.exit(main())
