"""What each ``flatflower`` command does, as functions of its parsed arguments (the CLI, the
sweep and the tests call them): prepare the run (tools/prepare.py), run it on an engine
(runtime/engines/__init__.py), print its rounds and outcome (tools/progress.py). Each returns the exit code.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flatflower.runtime import engines
from flatflower.tools.prepare import (UsageError, app_dir, check_device, log_dir, node_configs, preflight,
                                     resolve_config, resume_acceptance)
from flatflower.tools.presets import PresetError, available, load_preset
from flatflower.tools.progress import EXIT_FAILED, EXIT_OK, Progress, finish

EXIT_USAGE = 2
EXIT_PIPE = 141  # 128 + SIGPIPE: the reader of our output went away (`| head`), as a shell reports it
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a Ctrl-C


def stdout_gone() -> bool:
    """True when standard output is a pipe whose reader has gone away (``flatflower presets |
    head``); what is left to print then goes to /dev/null, not into a BrokenPipeError at exit."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        gone = any(events & select.POLLERR for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll() here, or no real stdout
        return False
    if gone:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return gone


def run(command: str, args: argparse.Namespace | list[str], handler: Callable[[Any], int] | None = None) -> int:
    """Run ``command`` with ``handler`` (default: its function in :data:`COMMANDS`, over the
    arguments cli.py parsed; a command that parses its own arguments gets its argument list)
    and turn its failures into exit codes and one ``error:`` line: bad input 2 (nothing
    started), a failed run 1, an interrupt 130."""
    from flatflower.common.config import ConfigError
    from flatflower.common.datasets import DatasetUnavailableError
    from flatflower.common.partition import PartitionError
    from flatflower.server.run import RunFailed
    from flatflower.server.rundir import RunDirError, RunWriteError
    from flatflower.strategies.participation import NoNodesError
    from flatflower.runtime.engines.federation import FederationError
    from flatflower.tools.prepare import apply_preset

    try:
        if command in ("local", "simulate", "check"):
            apply_preset(args)  # before the command: --clients may come from the preset
        return (handler or COMMANDS[command])(args)
    except BrokenPipeError:
        if stdout_gone():
            return EXIT_PIPE
        print("error: broken pipe", file=sys.stderr)
        return EXIT_FAILED
    except (UsageError, ConfigError, PresetError, DatasetUnavailableError, PartitionError,
            RunDirError, OSError) as err:  # OSError: e.g. a run directory that cannot be created
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except (FederationError, RunFailed, RunWriteError, NoNodesError) as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:  # what the command started is stopped on the way out (finally blocks)
        print(f"{command}: interrupted" if handler else "interrupted; all Flower processes were stopped",
              file=sys.stderr)
        return EXIT_INTERRUPTED


def local(args: argparse.Namespace) -> int:
    """A real SuperLink + SuperNodes on 127.0.0.1."""
    check_device(args.device)
    cfg = resolve_config(args, {"min-available-nodes": args.clients})
    app = app_dir(args.app_dir, cfg)
    nodes = node_configs(args)
    with resume_acceptance(args, cfg):  # --trust-run-dir, --allow-code-change: the ServerApp's environment
        preflight(cfg, args.clients, nodes=nodes)
        progress = Progress(Path(cfg.run_dir), cfg.num_server_rounds)
        try:
            outcome = engines.run_local(cfg, args.clients, app, log_dir(cfg), timeout=args.timeout,
                                        on_poll=progress, device=args.device, tls=args.tls,
                                        clientapps=args.clientapps, fast_poll=args.fast_poll,
                                        node_configs=nodes)
        except BaseException:
            progress.close()
            raise
    return finish(cfg, outcome.ok, progress, outcome.details)


def simulate(args: argparse.Namespace) -> int:
    """Flower's Ray simulation engine, or the in-process engine (vectorised or not)."""
    cfg = resolve_config(args)
    nodes = node_configs(args)
    with resume_acceptance(args, cfg):  # --trust-run-dir, --allow-code-change: the ServerApp's environment
        preflight(cfg, args.clients, args.engine, nodes=nodes)
        progress = Progress(Path(cfg.run_dir), cfg.num_server_rounds)
        try:
            if args.engine in ("inprocess", "vectorized"):
                outcome = engines.run_in_process(cfg, args.clients, on_poll=progress,
                                                 vectorized=args.engine == "vectorized", node_configs=nodes)
            else:
                outcome = engines.run_ray(cfg, args.clients, app_dir(args.app_dir, cfg), log_dir(cfg),
                                          timeout=args.timeout, on_poll=progress,
                                          **{k: v for k, v in (("cpus_per_client", args.cpus_per_client),
                                                               ("gpus_per_client", args.gpus_per_client),
                                                               ("ray_address", getattr(args, "ray_address", None)))
                                             if v is not None})
        except BaseException:
            progress.close()
            raise
    return finish(cfg, outcome.ok, progress, outcome.details)


def check(args: argparse.Namespace) -> int:
    """What ``simulate`` checks before it starts (config, data, partition, model), and nothing
    else: the sweep asks it before starting runs in parallel processes."""
    preflight(resolve_config(args), args.clients, args.engine, nodes=node_configs(args))
    return EXIT_OK


def presets(args: argparse.Namespace) -> int:
    """List name, description and source of each preset in tools/presets/ (control characters
    shown escaped: a preset file cannot write to the terminal)."""
    from flatflower.common.schema import printable

    names = available()
    if not names:
        print("no presets in tools/presets/")
    failed = False
    for name in names:
        try:
            preset = load_preset(name)
        except PresetError as err:
            print(f"{name}: error: {err}", file=sys.stderr)
            failed = True
            continue
        clients = f"  ({preset.clients} clients)" if preset.clients else ""
        print(f"{printable(name)}{clients}\n    {printable(preset.description)}\n    "
              f"source: {printable(preset.source or '-')}")
    return EXIT_USAGE if failed else EXIT_OK


def data(args: argparse.Namespace) -> int:
    """``data check``: each dataset, usable offline here or what it needs (one line each)."""
    from flatflower.tools.datacheck import check

    print(check(args.data_dir))
    return EXIT_OK


def algorithms(args: argparse.Namespace) -> int:
    """The algorithms, from the registry: paper, records down/up, client state, gradient passes
    per local step, and their own run-config keys with defaults and the half that reads each
    (``--markdown``: the table of docs/algorithms.md; ``--json``: all of it as data). Names
    given: only those, a user's algorithm (``package.module:callable``) loaded and checked."""
    from flatflower.strategies.registry import BUILT_IN, as_data, get

    try:
        specs = [get(name) for name in dict.fromkeys(args.names or BUILT_IN)]
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE
    if args.json:
        print(json.dumps(as_data(specs), indent=1))
    else:
        print(algorithm_table(markdown=args.markdown, specs=specs))
    return EXIT_OK


READ_BY = {"client": "the client", "server": "the server", "both": "both halves"}


def searched(search: dict | None) -> str:
    """``; tuned over 0.001-0.5, log`` for a key with a search range (flatflower tune)."""
    if search is None:
        return ""
    return f"; tuned over {search['low']:g}-{search['high']:g}{', log' if search['log'] else ''}"


def algorithm_table(markdown: bool = False, specs=None) -> str:
    from flatflower.strategies.registry import as_data

    rows = []
    for alg in as_data(specs):
        keys = [f"{k['name']} (required)" if k["required"] else f"{k['name']} = {k['default']!r}"
                for k in alg["keys"]]
        passes = f"{alg['passes']}" + (f" + {alg['forwards']} forward" if alg["forwards"] else "")
        rows.append((alg["name"], alg["summary"], ", ".join(alg["down"] + alg["values"]) or "-", ", ".join(alg["up"]) or "-",
                     ", ".join(alg["state"]) or "-", passes, keys, alg["keys"]))
    if markdown:
        out = ["| algorithm | records down | up | client state | passes per step | keys (default; read by) |",
               "|---|---|---|---|---|---|"]
        out += [f"| `{name}` | {down} | {up} | {state} | {passes} | "
                + ("<br>".join(f"`{k}` ({key['read_by']})" for k, key in zip(keys, fields)) or "-") + " |"
                for name, _, down, up, state, passes, keys, fields in rows]
        return "\n".join(out)
    out = []
    for name, summary, down, up, state, passes, keys, fields in rows:
        out.append(f"{name}: {summary}\n    records down: {down}; up: {up}; client state: {state}; "
                   f"gradient passes per step: {passes}")
        out += [f"    {k}    {key['meaning']} [read by {READ_BY[key['read_by']]}{searched(key['search'])}]"
                for k, key in zip(keys, fields)]
    return "\n".join(out)


def certs(args: argparse.Namespace) -> int:
    """Write a CA, the SuperLink's certificate and --nodes SuperNode key pairs to OUT_DIR."""
    from flatflower.runtime.certs import CertError, generate_certs, summary

    try:
        files = generate_certs(Path(args.out_dir), args.nodes, args.hosts, days=args.days,
                               force=args.force)
    except CertError as err:
        raise UsageError(str(err)) from None
    print(summary(files))
    return EXIT_OK


def check_algorithm(argv: list[str]) -> int:
    """``check-algorithm REF``: the conformance kit (tools/conformance.py), one line per check and
    a summary; exit 0 when every check passes, 1 when one fails, 2 when REF or ``--reference``
    cannot be loaded (nothing run)."""
    import time

    from flatflower.tools.conformance import BadInput, build_parser, run_checks, summary

    args = build_parser().parse_args(argv)
    t0 = time.monotonic()
    try:
        results = run_checks(args.algorithm, reference=args.reference, engines=args.engines, rounds=args.rounds,
                             clients=args.clients, work_dir=args.work_dir, out=lambda line: print(line, flush=True))
    except BadInput as err:
        raise UsageError(str(err)) from None
    print(summary(results, time.monotonic() - t0))
    return EXIT_OK if all(r.ok for r in results) else EXIT_FAILED


# every command that takes what flatflower.tools.cli.build_parser parsed -> its function (``check``: the
# sweep's dry run of simulate); tools/cli.py adds the commands that parse their own arguments
COMMANDS = {"local": local, "simulate": simulate, "check": check, "presets": presets, "data": data,
            "algorithms": algorithms, "certs": certs}
