"""The ``flatflower`` command: argument parsing and exit codes over tools/commands.py.

    flatflower local    --algorithm A --clients N --rounds R [...]   real SuperLink + N SuperNodes
    flatflower simulate --algorithm A --clients N --rounds R [...]   one machine: in-process, vectorised or Ray
    flatflower report   RUN_DIR [RUN_DIR ...]                        table + accuracy plot
    flatflower landscape RUN_DIR [RUN_DIR ...]                       loss surfaces (PNG + NPZ)
    flatflower sweep    --algorithms A,B --seeds 0,1,2 --out DIR     algorithms x seeds, then a report
    flatflower tune     --algorithms A,B --trials N --out DIR        equal tuning budgets, validation objective
    flatflower flatness RUN_DIR                                      sharpness, Hessian of a saved model
    flatflower bench    [--quick | --full]                           cost, overhead, bytes, memory, throughput
    flatflower check-algorithm REF [--reference MODULE:CALLABLE]    the conformance kit of an algorithm
    flatflower presets                                               list the presets
    flatflower data check                                            datasets usable offline here
    flatflower certs    OUT_DIR --nodes N [--host H ...]             TLS certificates + node keys

``--preset NAME_OR_FILE`` starts from a paper's setting (tools/presets.py); ``--set`` values
override it, and the named flags override both.

Bad input (unknown algorithm, invalid value, missing dataset, a run directory that already
holds a run) is reported in one line before anything starts, with exit code 2; a run that fails
is one ``error:`` line and exit code 1.
"""

from __future__ import annotations

import argparse
import sys

from flatflower.common.config import cli_int
from flatflower.tools.parsers import PARSERS
from flatflower.tools.prepare import Parser, add_node_data_argument, add_run_arguments, add_simulate_arguments

# Nothing above imports PyTorch, NumPy or Flower: ``--help``, ``--version`` and every argument
# error answer before a command's modules load (flatflower.tools.commands and what it runs, after parsing;
# tests/test_cli_fast.py fails if one of these paths imports torch).


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    def of(dist: str) -> str:
        try:
            return installed(dist)
        except PackageNotFoundError:
            return "not installed"

    return f"flatflower {of('flatflower')} (flwr {of('flwr')}, torch {of('torch')})"


# the commands that parse their own arguments (their parsers in tools/parsers.py; their modules
# load only once the arguments parsed); the others are flatflower.tools.commands.COMMANDS, over what
# build_parser parses: both go through commands.run
def _report(argv: list[str]) -> int:
    from flatflower.tools.report import main
    return main(argv)


def _landscape(argv: list[str]) -> int:
    from flatflower.tools.landscape import main
    return main(argv)


def _bench(argv: list[str]) -> int:
    from flatflower.tools.bench import main
    return main(argv)


def _sweep(argv: list[str]) -> int:
    from flatflower.tools.sweep import main
    return main(argv)


def _flatness(argv: list[str]) -> int:
    from flatflower.tools.flatness_cmd import main
    return main(argv)


def _tune(argv: list[str]) -> int:
    from flatflower.tools.tune import main
    return main(argv)


def _check_algorithm(argv: list[str]) -> int:
    from flatflower.tools.commands import check_algorithm
    return check_algorithm(argv)


OWN_PARSERS = {"report": _report, "landscape": _landscape, "bench": _bench, "sweep": _sweep,
               "flatness": _flatness, "tune": _tune, "check-algorithm": _check_algorithm}


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="flatflower", description="Sharpness-aware federated learning on Flower: run, "
        "simulate, compare and benchmark the SAM family of algorithms.")
    parser.add_argument("--version", action="version", version=version())
    sub = parser.add_subparsers(dest="command", required=True)
    local = sub.add_parser("local", help="run a real Flower federation on 127.0.0.1")
    add_run_arguments(local)
    local.add_argument("--device", default="auto", help="SuperNode device: auto | cpu | cuda[:i] | mps "
                       "(one this machine lacks is refused before anything starts)")
    local.add_argument("--app-dir", help="Flower App directory (default: this checkout)")
    local.add_argument("--clientapps", choices=("warm", "stock"), default="warm",
                       help="warm (default): one long-lived ClientApp worker per SuperNode "
                            "(--isolation process); stock: Flower's new process per message")
    local.add_argument("--fast-poll", action="store_true",
                       help="shorten the waits hard-coded inside flwr 1.39.0's SuperNode and "
                            "ServerApp (patches Flower; refused with any other flwr version)")
    local.add_argument("--tls", action="store_true",
                       help="TLS on the SuperLink's APIs and SuperNode authentication "
                            "(certificates and node keys generated for the run)")
    add_node_data_argument(local)
    sim = sub.add_parser("simulate", help="run on one machine: in one process (default: inprocess, "
                         "or vectorized), or Flower's Ray simulation engine (--engine ray)")
    add_run_arguments(sim)
    add_simulate_arguments(sim)
    add_node_data_argument(sim)
    sub.add_parser("report", help="compare run directories (table + PNG)", add_help=False)
    sub.add_parser("landscape", help="loss surfaces around saved models, or the interpolation "
                   "from the initial to the final model (PNG + NPZ)", add_help=False)
    sub.add_parser("bench", help="cost per local step, framework overhead, bytes, memory, simulation "
                   "throughput (JSON + tables)",
                   add_help=False)
    sub.add_parser("sweep", help="several algorithms x seeds on one partition, then one report",
                   add_help=False)
    sub.add_parser("tune", help="every algorithm tuned with the same budget on a validation split, "
                   "then its best settings run for several seeds on the test set", add_help=False)
    sub.add_parser("flatness", help="sharpness, Hessian top eigenvalues (Lanczos), trace and density of a saved model",
                   add_help=False)
    sub.add_parser("check-algorithm", help="the conformance kit of an algorithm (yours: package.module:callable): "
                   "loads, engines agree, resume, client state, wire records, bad keys, your reference",
                   add_help=False)
    sub.add_parser("presets", help="list the presets (paper settings)")
    data = sub.add_parser("data", help="datasets: `flatflower data check` says which are usable offline")
    data.add_argument("action", choices=("check",), help="check: one line per dataset")
    data.add_argument("--data-dir", default="", help="where torchvision datasets live "
                                                     "(default $FLATFLOWER_DATA or ~/.cache/flatflower/data)")
    algs = sub.add_parser("algorithms", help="list the algorithms, their records and their keys")
    algs.add_argument("names", nargs="*", metavar="NAME_OR_REFERENCE",
                      help="only these: built-in names, or your own algorithm as package.module:callable "
                           "(docs/own-algorithm.md); default: every built-in")
    shape = algs.add_mutually_exclusive_group()
    shape.add_argument("--markdown", action="store_true", help="as the table of docs/algorithms.md")
    shape.add_argument("--json", action="store_true",
                       help="the registry as data: per algorithm its keys (default, meaning, which half "
                            "reads it), records, client state, passes and the class of each half")
    certs = sub.add_parser("certs", help="generate a CA, a SuperLink certificate and SuperNode keys")
    certs.add_argument("out_dir", metavar="OUT_DIR", help="where the files go")
    certs.add_argument("--nodes", type=cli_int, required=True, help="number of SuperNode key pairs")
    certs.add_argument("--host", dest="hosts", action="append", default=[], metavar="NAME_OR_IP",
                       help="a name or IP address the SuperNodes use to reach the SuperLink "
                            "(repeatable; localhost, 127.0.0.1 and ::1 are always included)")
    certs.add_argument("--days", type=cli_int, default=365, help="validity in days (default 365)")
    certs.add_argument("--force", action="store_true", help="replace existing files")
    return parser


def _stop_on_signals() -> None:
    """SIGTERM and SIGINT (also when started in the background, where the shell ignores
    SIGINT) stop the command through KeyboardInterrupt, so every Flower process it started is
    stopped too."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return

    def stop(signum, frame):
        raise KeyboardInterrupt(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in OWN_PARSERS:  # it parses its own arguments
        command, args, handler = argv[0], argv[1:], OWN_PARSERS[argv[0]]
        PARSERS[command]().parse_args(args)  # --help and argument errors end here, before its imports
    else:
        parsed = build_parser().parse_args(argv)
        command, args, handler = parsed.command, parsed, None
    from flatflower.tools import commands
    _stop_on_signals()  # SIGTERM too ends a run, a sweep's runs, a landscape, ...
    code = commands.run(command, args, handler)
    return commands.EXIT_PIPE if commands.stdout_gone() else code


def entry() -> None:
    """The ``flatflower`` program: :func:`main`, then the exit. An interrupted command (exit
    130) has stopped its runs and written their files (atomically) before it returns; it then
    leaves without finalising the interpreter, unless Ray runs in this process (its own exit
    handlers stop its processes). A daemon thread still inside torch at finalisation (CPython
    before 3.14 ends such threads with pthread_exit) aborts the process ("terminate called
    without an active exception", SIGABRT) instead of exiting 130: seen under load after an
    in-process run's SIGTERM."""
    code = main()
    import threading

    from flatflower.tools import commands

    # a ClientApp thread of an in-process run the server stopped waiting for (round-timeout)
    # may still be inside torch: the same abort (exit 134 instead of the run's own code)
    inprocess = sys.modules.get("flatflower.runtime.engines.inprocess")  # only an in-process run has them
    busy = inprocess is not None and any(t.name == inprocess.CLIENT_THREAD and t.is_alive()
                                         for t in threading.enumerate())
    if (code == commands.EXIT_INTERRUPTED or busy) and "ray" not in sys.modules:
        import logging
        import os

        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a closed pipe: nothing more to say
                pass
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()
