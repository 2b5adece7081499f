"""The argument parsers of the commands that parse their own arguments (report, landscape,
bench, sweep, flatness), apart from the commands' work: this module imports no PyTorch, NumPy,
Flower or plotting library, so that ``--help`` and every argument error answer at once
(tools/cli.py parses with these before it loads the command; tests/test_cli_fast.py keeps it so).
The command-line defaults they show live here too; each command imports its parser from here.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from flatflower.common.config import cli_float, cli_int
from flatflower.common.flatness_settings import DEFAULT_RHO, HVP_METHODS, TOLERANCE
from flatflower.tools.prepare import Parser, add_run_arguments, add_simulate_arguments

# flatflower flatness / landscape: which saved model (its file in the run directory), which split
MODEL_FILES = {"final": "model_final.pt", "init": "model_init.pt", "checkpoint": "checkpoint.pt"}
SPLITS = ("test", "train")
FLATNESS_FILE = "flatness.json"  # `flatflower flatness RUN --json RUN/flatness.json`: the final model's
DEFAULT_SPAN, INTERPOLATE_SPAN, DEFAULT_STEPS = 1.0, 0.5, 21  # landscape's grid
ITERS, PROBES = 100, 100  # flatness's defaults: more precise than the per-round 20 and 10
BENCH_SECTIONS = ("compute", "overhead", "communication", "memory", "throughput", "flatness", "trial")


def positive_int(text: str) -> int:
    """argparse type: a whole number >= 1 (``--last-k 0`` would average no round)."""
    value = cli_int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, not {value}")
    return value


positive_int.__name__ = "int"


def jobs_count(text: str) -> int:
    """argparse type of ``--jobs``: a whole number (the sweep refuses one < 1), or ``auto``
    (this machine's cores)."""
    import os

    return len(os.sched_getaffinity(0)) if text.strip() == "auto" else cli_int(text)


jobs_count.__name__ = "int or auto"


def report() -> argparse.ArgumentParser:
    """The ``flatflower report`` argument parser."""
    parser = Parser(prog="flatflower report", description="Summarize run directories.")
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories to summarize")
    parser.add_argument("--last-k", type=positive_int, default=5, help="rounds averaged for the last-k mean (default 5)")
    parser.add_argument("--target", type=cli_float, default=None, help="accuracy target for rounds-to-target")
    parser.add_argument("--out", type=Path, default=None,
                        help="accuracy plot (default: report.png in the run directory, or in the "
                             "directory that holds all the RUN_DIRs)")
    parser.add_argument("--out-bytes", type=Path, default=None,
                        help="accuracy vs cumulative bytes plot (default: <out stem>-bytes.png)")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows as JSON here")
    parser.add_argument("--csv", type=Path, default=None,
                        help="also write every round of every run as CSV here (one row per run and round)")
    parser.add_argument("--runs-csv", type=Path, default=None,
                        help="also write one row per run here: algorithm, seed, engine, final / last-k / "
                             "best accuracy, best round, rounds to --target, seconds, bytes up and down, "
                             "flatness (the last-k flatness distance; sharpness and top Hessian eigenvalue "
                             f"from each run's {FLATNESS_FILE})")
    parser.add_argument("--strict", action="store_true",
                        help="refuse runs whose settings differ (clients, rounds, dataset, partition) "
                             "instead of warning")
    parser.add_argument("--by-algorithm", action="store_true", help="always print the per-algorithm table")
    parser.add_argument("--algorithms-csv", type=Path, default=None,
                        help="also write one row per algorithm here: mean, std and 95%% CI over seeds, "
                             "and its comparison with the best (test, statistic, Holm-adjusted p, verdict)")
    parser.add_argument("--min-gap", type=gap, default=0.0,
                        help="a last-k accuracy gap to the best below this (a fraction, e.g. 0.014: the "
                             "spread of one run between two machines) is never called worse (default 0)")
    return parser


def gap(text: str) -> float:
    """argparse type: an accuracy gap, a fraction in [0, 1)."""
    value = cli_float(text)
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"must be a fraction in [0, 1), not {value}")
    return value


gap.__name__ = "fraction"


def landscape() -> argparse.ArgumentParser:
    parser = Parser(prog="flatflower landscape",
                    description="Loss surfaces around saved global models (filter-normalised random "
                                "directions, Li et al. 2018), or the linear interpolation from the "
                                "initial to the final model (--interpolate), several runs on one figure.")
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories (one architecture)")
    parser.add_argument("--dims", type=cli_int, choices=(1, 2), default=None,
                        help="1: a curve along d0; 2: a surface over d0, d1 (default 2)")
    parser.add_argument("--span", type=cli_float, default=None,
                        help=f"the grid covers [-S, S] (default {DEFAULT_SPAN}); with --interpolate "
                             f"a covers [-S, 1 + S] (default {INTERPOLATE_SPAN})")
    parser.add_argument("--steps", type=cli_int, default=DEFAULT_STEPS,
                        help=f"grid points per axis, >= 3 (default {DEFAULT_STEPS})")
    parser.add_argument("--split", choices=SPLITS, default="test",
                        help="test: the server's evaluation split (default); train: the union of the "
                             "clients' training data")
    parser.add_argument("--model", choices=tuple(MODEL_FILES), default=None,
                        help="the model at the centre: final (default), init or checkpoint")
    parser.add_argument("--interpolate", action="store_true",
                        help="1-D: (1 - a) w_init + a w_final, from model_init.pt to model_final.pt")
    parser.add_argument("--seed", type=cli_int, default=0, help="seed of the random directions (default 0)")
    parser.add_argument("--batch-size", type=cli_int, default=None,
                        help="examples per forward pass (default: each run's eval-batch-size)")
    parser.add_argument("--device", default="cpu", help="cpu (default) | cuda | cuda:i")
    parser.add_argument("--threads", type=cli_int, default=1,
                        help="torch CPU threads (default 1: several fight over a busy machine's cores; "
                             "0 = torch's default)")
    parser.add_argument("--out", type=Path, default=None,
                        help="the figure (default: landscape.png in the run directory, or in the "
                             "directory that holds all the RUN_DIRs)")
    parser.add_argument("--data", type=Path, default=None, help="also write the numbers as NPZ here")
    parser.add_argument("--force", action="store_true", help="write over existing --out / --data files")
    return parser


def bench() -> argparse.ArgumentParser:
    p = Parser(prog="flatflower bench", description="``flatflower bench``: what each "
                               "algorithm costs, measured on this implementation.")
    p.add_argument("--quick", action="store_true", help="a few minutes on a 2-core CPU: small model, fewer repeats")
    p.add_argument("--full", action="store_true",
                   help="also time one round in Ray simulation and a loopback deployment, and Ray's throughput")
    p.add_argument("--model", default=None, help="model of the compute table (default: cnn quick, lenet otherwise)")
    p.add_argument("--input-shape", default=None, help="e.g. 3,32,32 (CIFAR-shaped; random tensors, no download)")
    p.add_argument("--classes", type=cli_int, default=10)
    p.add_argument("--batch-size", type=cli_int, default=None)
    p.add_argument("--steps", type=cli_int, default=None, help="local steps per timed round")
    p.add_argument("--repeats", type=cli_int, default=None)
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:i")
    p.add_argument("--threads", type=cli_int, default=1,
                   help="torch CPU threads (default 1: steadier timings; 0 = torch's default)")
    p.add_argument("--out", type=Path, default=Path("bench.json"), help="JSON report (default bench.json)")
    p.add_argument("--sections", default=",".join(BENCH_SECTIONS),
                   help=f"which sections to run, comma-separated (default all: {','.join(BENCH_SECTIONS)})")
    t = p.add_argument_group("throughput", "the simulation-throughput section (tools/throughput.py)")
    t.add_argument("--throughput-models", help="mlp,cnn (digits), lenet (CIFAR-shaped synthetic-cifar10), "
                                               "lenet5 (Fashion-MNIST); default mlp with --quick, "
                                               "else mlp,cnn,lenet")
    t.add_argument("--throughput-clients", help="numbers of clients N, e.g. 10,100,500 (the default; 10,20 with --quick)")
    t.add_argument("--throughput-engines", help="inprocess,vectorized,ray,loop (default: inprocess,vectorized; "
                                                "ray with --full; loop = the papers' plain sequential "
                                                "PyTorch loop, FedAvg / FedSAM, the yardstick)")
    t.add_argument("--throughput-algorithms", help="algorithms, e.g. fedavg,fedsam (default fedavg)")
    t.add_argument("--throughput-rounds", type=cli_int, default=None,
                   help="rounds per run: 2 .. R-1 are timed (round 1 warms up, R ends R-1); default 4, 3 with --quick")
    t.add_argument("--throughput-repeats", type=cli_int, default=None,
                   help="interleaved runs per engine, the fastest round counts (default 2)")
    t.add_argument("--throughput-ray-max-clients", type=cli_int, default=500,
                   help="skip Ray runs of more clients (default 500)")
    t.add_argument("--throughput-fraction", type=cli_float, default=1.0,
                   help="fraction of the N clients trained each round (default 1)")
    t.add_argument("--throughput-epochs", type=cli_int, default=1, help="local epochs (default 1)")
    t.add_argument("--throughput-batch-size", type=cli_int, default=32, help="batch size (default 32)")
    f = p.add_argument_group("flatness", "the flatness-cost section")
    f.add_argument("--flatness-models", help="mlp,cnn (digits), lenet (synthetic-cifar10; 5-8 min here); "
                                             "default mlp,cnn with --quick, else all three")
    return p


def sweep() -> argparse.ArgumentParser:
    p = Parser(
        prog="flatflower sweep", description="'flatflower sweep': several algorithms x seeds on one partition, "
                                            "then one report.",
        allow_abbrev=False, epilog="The other options are `flatflower simulate`'s.")
    p.add_argument("--algorithms", required=True, help="comma-separated, e.g. fedavg,fedsam,fedtoga")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (default 0,1,2)")
    p.add_argument("--out", type=Path, required=True, help="directory for the runs and the report")
    p.add_argument("--last-k", type=positive_int, default=5, help="rounds averaged for the last-k mean (default 5)")
    p.add_argument("--target", type=cli_float, default=None, help="accuracy target for rounds-to-target")
    p.add_argument("--resume-existing", action="store_true",
                   help="skip (algorithm, seed) runs that already finished in OUT, continue "
                        "interrupted ones from their checkpoint")
    p.add_argument("--jobs", "-j", type=jobs_count, default=None,
                   help="runs at a time, each in its own process (default 1: one after the other, "
                        "in this process; 'auto': this machine's cores; with --ray-address: all at "
                        "once, Ray queues them); at most the number of CPU cores helps")
    p.add_argument("--cpus-per-run", type=cli_float, default=None,
                   help="with --ray-address: the CPUs each run's Ray task holds (default 1)")
    p.add_argument("--gpus-per-run", type=cli_float, default=None,
                   help="with --ray-address: the GPUs each run's Ray task holds, e.g. 0.5 or 1 (default 0)")
    add_run_arguments(p, per_run=False)  # each run's algorithm, seed and directory: the sweep's
    add_simulate_arguments(p)
    return p


def tune() -> argparse.ArgumentParser:
    p = Parser(
        prog="flatflower tune", description="'flatflower tune': the same tuning budget for every algorithm "
        "(trials x rounds x clients), chosen on a validation split of the clients' training data, then "
        "the best settings run for --seeds on the test set and reported.",
        allow_abbrev=False, epilog="The other options are `flatflower simulate`'s (docs/tuning.md).")
    p.add_argument("--algorithms", required=True, help="comma-separated, e.g. fedavg,fedsam,fedtoga")
    p.add_argument("--trials", type=positive_int, required=True, help="trials per algorithm (the budget)")
    p.add_argument("--out", type=Path, required=True, help="directory for the trials, the records and the final runs")
    p.add_argument("--seeds", default="0,1,2", help="seeds the best settings run with on the test set "
                   "(default 0,1,2); the trials use the first")
    p.add_argument("--last-k", type=positive_int, default=5,
                   help="the objective: the validation accuracy's mean over the last K rounds (default 5)")
    p.add_argument("--validation-fraction", type=cli_float, default=0.1,
                   help="of each class of the training split, held out for the objective (default 0.1)")
    p.add_argument("--space", type=Path, default=None, help="a TOML file that changes the declared search ranges")
    p.add_argument("--pruner", choices=("median", "none"), default="median",
                   help="stop a trial whose validation accuracy is below the median of earlier trials' at "
                        "the same round (default median; none: every trial runs all rounds)")
    p.add_argument("--workers", type=positive_int, default=1,
                   help="trials at a time, each worker a process sharing the study (default 1); with "
                        "--ray-address, each worker a Ray task on the cluster")
    p.add_argument("--storage", default=None,
                   help="Optuna storage URL shared by the workers (default: OUT/optuna.journal, a journal file)")
    p.add_argument("--tune-seed", type=cli_int, default=0, help="seed of the sampler (TPE) (default 0)")
    p.add_argument("--final-rounds", type=positive_int, default=None,
                   help="rounds of the final runs on the test set (default: the trials' --rounds)")
    p.add_argument("--no-final", action="store_true", help="tune only: do not run the best settings on the test set")
    p.add_argument("--cpus-per-trial", type=cli_float, default=None,
                   help="with --ray-address: the CPUs each worker's Ray task holds (default 1)")
    p.add_argument("--gpus-per-trial", type=cli_float, default=None,
                   help="with --ray-address: the GPUs each worker's Ray task holds, e.g. 0.5 or 1 (default 0)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # a --workers process
    p.add_argument("--worker-index", type=cli_int, default=0, help=argparse.SUPPRESS)  # its sampler's seed
    add_run_arguments(p, per_run=False)  # each trial's algorithm, seed and directory: the tune's
    add_simulate_arguments(p)
    return p


def flatness() -> argparse.ArgumentParser:
    p = Parser(prog="flatflower flatness", description="'flatflower flatness RUN_DIR': how flat a saved model's "
                                                      "minimum is, measured once.",
               allow_abbrev=False)
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (flatflower local / simulate)")
    p.add_argument("--model", choices=tuple(MODEL_FILES), default="final",
                   help="final (model_final.pt, default), init (model_init.pt, before round 1) or "
                        "checkpoint (the global model of checkpoint.pt)")
    p.add_argument("--split", choices=SPLITS, default="test",
                   help="test (the server's evaluation split, default) or train (the union of "
                        "all clients' training data, partition.json)")
    p.add_argument("--rho", type=cli_float, default=DEFAULT_RHO,
                   help=f"radius of the sharpness perturbation (default {DEFAULT_RHO})")
    p.add_argument("--method", choices=("lanczos", "power"), default="lanczos",
                   help="top Hessian eigenvalue by Lanczos (default: SciPy's eigsh over Hessian-vector "
                        "products, converged, with its residual |Hv - lambda v|/|lambda|) or by power "
                        "iteration (the per-round metric's method)")
    p.add_argument("--top-k", type=cli_int, default=1,
                   help="the k largest Hessian eigenvalues, each with its residual (lanczos; default 1)")
    p.add_argument("--density", action="store_true",
                   help="also the Hessian's eigenvalue density by stochastic Lanczos quadrature "
                        "(--json holds its grid, density, nodes and weights)")
    p.add_argument("--slq-steps", type=cli_int, default=80, help="Lanczos steps per start of --density (default 80)")
    p.add_argument("--slq-starts", type=cli_int, default=4, help="random starts of --density (default 4)")
    p.add_argument("--iters", type=cli_int, default=ITERS,
                   help=f"power-iteration steps at most (--method power; default {ITERS})")
    p.add_argument("--tol", type=cli_float, default=None,
                   help=f"lanczos: relative accuracy of the eigenvalues (default 1e-8); power: stop once "
                        f"the eigenvalue changes by less than this, relative (default {TOLERANCE:g})")
    p.add_argument("--probes", type=cli_int, default=PROBES,
                   help=f"Rademacher probes of the Hutchinson trace (default {PROBES})")
    p.add_argument("--seed", type=cli_int, default=0, help="seed of the random vectors (default 0)")
    p.add_argument("--batch-size", type=cli_int, default=None,
                   help="examples per chunk of the whole-split sums (default: the run's eval-batch-size)")
    p.add_argument("--hvp", choices=HVP_METHODS, default="double-backward",
                   help="Hessian-vector products by double backward (default) or torch.func "
                        "(forward-over-reverse); the same numbers")
    p.add_argument("--device", default="cpu", help="cpu (default) | cuda | cuda:i")
    p.add_argument("--threads", type=cli_int, default=1,
                   help="torch CPU threads (default 1, as a run's server: several threads on a busy "
                        "machine can be far slower; 0 = torch's default)")
    p.add_argument("--json", type=Path, default=None, help="also write the numbers as JSON here")
    p.add_argument("--force", action="store_true", help="write over an existing --json file")
    return p


# flatflower check-algorithm (tools/conformance.py): the engines it can compare, its tiny problem's size
CHECK_ENGINES = ("inprocess", "vectorized", "ray")
CHECK_DEFAULT_ENGINES = ("inprocess", "vectorized")
CHECK_CLIENTS, CHECK_ROUNDS = 3, 3


def engine_list(text: str) -> tuple[str, ...]:
    """argparse type of ``--engines``: a comma-separated list of CHECK_ENGINES."""
    engines = tuple(dict.fromkeys(e.strip() for e in text.split(",") if e.strip()))
    unknown = [e for e in engines if e not in CHECK_ENGINES]
    if unknown or not engines:
        raise argparse.ArgumentTypeError(f"{text!r}: give engines among {', '.join(CHECK_ENGINES)}, comma-separated")
    return engines


engine_list.__name__ = "engine list"


def rounds_to_resume(text: str) -> int:
    """argparse type of check-algorithm's ``--rounds``: >= 2 (its resume checks stop a run after round 1)."""
    value = cli_int(text)
    if value < 2:
        raise argparse.ArgumentTypeError(f"must be >= 2 (the resume checks stop a run after round 1), not {value}")
    return value


rounds_to_resume.__name__ = "int"


def check_algorithm() -> argparse.ArgumentParser:
    p = Parser(prog="flatflower check-algorithm",
               description="'flatflower check-algorithm REF': the conformance kit of an algorithm, yours "
                           "(package.module:callable returning a flatflower.AlgorithmSpec) or a built-in, on a tiny "
                           "problem (logistic regression on the offline synthetic data, full-batch local steps): "
                           "it loads, the engines agree, resume is bit-identical, client state survives a node "
                           "restart, only the declared records cross the wire, bad hyperparameters are refused, "
                           "and (--reference) one round matches your float64 numpy reference. One line per "
                           "check; exit 0 when all pass, 1 when one fails, 2 on bad input (docs/check-algorithm.md).",
               allow_abbrev=False)
    p.add_argument("algorithm", metavar="REF",
                   help="a built-in algorithm (fedsam) or your own, package.module:callable (looked for on "
                        "sys.path, then in the current directory)")
    p.add_argument("--reference", metavar="MODULE:CALLABLE", default=None,
                   help="your float64 numpy reference of one round: called with a "
                        "flatflower.conformance.ReferenceProblem, it returns the new global model's trainable "
                        "parameters (docs/check-algorithm.md)")
    p.add_argument("--engines", type=engine_list, default=CHECK_DEFAULT_ENGINES,
                   help=f"the engines whose final models must agree, comma-separated among "
                        f"{', '.join(CHECK_ENGINES)} (default {','.join(CHECK_DEFAULT_ENGINES)}; the in-process "
                        "engine always runs: it is the baseline; ray starts a private Ray, about a minute)")
    p.add_argument("--rounds", type=rounds_to_resume, default=CHECK_ROUNDS,
                   help=f"rounds of each run (default {CHECK_ROUNDS}, at least 2)")
    p.add_argument("--clients", type=positive_int, default=CHECK_CLIENTS,
                   help=f"clients, all of them in every round (default {CHECK_CLIENTS})")
    p.add_argument("--work-dir", default=None, metavar="DIR",
                   help="keep the runs' directories here (default: a temporary directory, removed)")
    return p


# command -> its parser (tools/cli.py parses with it before it imports the command)
PARSERS = {"report": report, "landscape": landscape, "bench": bench, "sweep": sweep, "flatness": flatness,
           "tune": tune, "check-algorithm": check_algorithm}
