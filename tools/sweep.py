"""``flatflower sweep``: several algorithms x seeds on one partition, then one report.

Each (algorithm, seed) is exactly ``flatflower simulate --algorithm A --seed S --run-dir
OUT/A-sS [the other options]`` (tools.commands.simulate), so every option of ``simulate``
(presets, ``--set``, ``--engine``, ...) works here too. All runs share one data partition: ``partition-seed`` is
set to the first seed unless given, so seeds vary the model init, sampling and shuffling
only. Afterwards ``flatflower report`` summarizes all runs per algorithm (mean ± std over
seeds) into OUT/report.json, OUT/report.png (accuracy vs rounds) and OUT/report-bytes.png
(accuracy vs cumulative bytes).

A run that fails is reported and the sweep goes on; finished runs are kept, and
``--resume-existing`` skips them when the sweep is run again.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

from common.config import cli_float, cli_int
from common.registry import ALGORITHMS
from tools import commands
from tools.prepare import add_run_arguments, add_simulate_arguments

EXIT_USAGE, EXIT_FAILED = 2, 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="flatflower sweep", description=__doc__.split("\n\n")[0].replace("``", "'"),
        allow_abbrev=False, epilog="The other options are `flatflower simulate`'s.")
    p.add_argument("--algorithms", required=True, help="comma-separated, e.g. fedavg,fedsam,fedtoga")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (default 0,1,2)")
    p.add_argument("--out", type=Path, required=True, help="directory for the runs and the report")
    p.add_argument("--last-k", type=cli_int, default=5, help="rounds averaged for the last-k mean (default 5)")
    p.add_argument("--target", type=cli_float, default=None, help="accuracy target for rounds-to-target")
    p.add_argument("--resume-existing", action="store_true",
                   help="skip (algorithm, seed) runs that already finished in OUT")
    add_run_arguments(p)
    add_simulate_arguments(p)
    return p


def _parse(args: argparse.Namespace) -> tuple[list[str], list[int]]:
    algorithms = [a.strip() for a in args.algorithms.split(",") if a.strip()]
    unknown = [a for a in algorithms if a not in ALGORITHMS]
    if not algorithms or unknown:
        raise ValueError(f"unknown algorithm(s) {', '.join(unknown) or '(none given)'}; valid names: "
                         f"{', '.join(sorted(ALGORITHMS))}")
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"--seeds expects comma-separated integers, got {args.seeds!r}") from None
    if not seeds or min(seeds) < 0 or len(set(seeds)) != len(seeds):
        raise ValueError(f"--seeds must be distinct integers >= 0, got {args.seeds!r}")
    for flag in ("algorithm", "seed", "run_dir", "resume"):
        if getattr(args, flag) is not None:
            raise ValueError(f"--{flag.replace('_', '-')} is set by the sweep; use --algorithms / "
                             "--seeds / --out")
    if args.last_k < 1:
        raise ValueError("--last-k must be >= 1")
    return algorithms, seeds


def finished(run_dir: Path) -> bool:
    """A run that completed all its rounds (summary.json is written at the very end)."""
    return (run_dir / "summary.json").is_file() and (run_dir / "model_final.pt").is_file()


def main(argv: list[str] | None = None) -> int:
    from tools.report import main as report

    args = build_parser().parse_args(argv)
    try:
        algorithms, seeds = _parse(args)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE
    if not any(s.strip().startswith("partition-seed=") for s in args.sets):
        args.sets = [*args.sets, f"partition-seed={seeds[0]}"]
    runs, failed = [], []
    for algorithm in algorithms:
        for seed in seeds:
            run_dir = args.out / f"{algorithm}-s{seed}"
            if args.resume_existing and finished(run_dir):
                print(f"sweep: {run_dir.name} already finished, skipped", flush=True)
                runs.append(run_dir)
                continue
            print(f"sweep: {algorithm}, seed {seed} -> {run_dir}", flush=True)
            one = copy.copy(args)
            one.algorithm, one.seed, one.run_dir, one.sets = algorithm, seed, str(run_dir), list(args.sets)
            code = commands.run("simulate", one)
            if code == EXIT_USAGE and not runs and not failed:
                print("sweep: stopped, the first run's options are invalid (nothing else was run)",
                      file=sys.stderr)
                return EXIT_USAGE
            if code == 0:
                runs.append(run_dir)
            else:
                failed.append(run_dir.name)
                print(f"sweep: {run_dir.name} failed (exit {code}); going on", file=sys.stderr, flush=True)
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


if __name__ == "__main__":
    sys.exit(main())
