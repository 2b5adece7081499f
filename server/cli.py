"""The ``flatflower`` command.

    flatflower local    --algorithm A --clients N --rounds R [...]   real SuperLink + N SuperNodes
    flatflower simulate --algorithm A --clients N --rounds R [...]   Flower's Ray simulation engine
    flatflower report   RUN_DIR [RUN_DIR ...]                        table + accuracy plot
    flatflower presets                                               list configs/presets/

``--preset NAME_OR_FILE`` starts from a paper's setting (server/presets.py); ``--set`` values
override it, and the named flags override both.

Bad input (unknown algorithm, invalid value, missing dataset, a run directory that already
holds a run) is reported in one line before anything starts, with exit code 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common.config import ConfigError, RunConfig, parse_assignments
from server.presets import PresetError, available, load_preset

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
DEFAULT_CLIENTS = 4


class UsageError(Exception):
    """Bad input: printed as one line, exit code 2."""


# ---------------------------------------------------------------------------- arguments
def _run_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--algorithm", "-a", help="algorithm name, e.g. fedsam, fedgmt, fedtoga (default: run config)")
    p.add_argument("--preset", metavar="NAME_OR_FILE",
                   help="start from a preset: a TOML file or a name in configs/presets/ "
                        "(list: flatflower presets)")
    p.add_argument("--clients", "-n", type=int,
                   help=f"number of clients (default: the preset's, else {DEFAULT_CLIENTS})")
    p.add_argument("--rounds", "-r", type=int, help="server rounds (num-server-rounds)")
    p.add_argument("--dataset", help="digits | synthetic | mnist | fashion-mnist | cifar10 | cifar100")
    p.add_argument("--model", help="auto | logreg | mlp | cnn | cifar-cnn | lenet | resnet18-gn")
    p.add_argument("--partition", help="iid | dirichlet | dirichlet-balanced | pathological")
    p.add_argument("--seed", type=int)
    p.add_argument("--fraction", type=float, help="fraction of clients per round (fraction-train)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="any run-config key, e.g. --set rho=0.05 --set lr=0.05 (repeatable)")
    p.add_argument("--run-dir", help="where the run directory goes (default runs/<name>)")
    p.add_argument("--timeout", type=float, default=3600.0, help="give up after this many seconds")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flatflower", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    local = sub.add_parser("local", help="run a real Flower federation on 127.0.0.1")
    _run_arguments(local)
    local.add_argument("--device", default="auto", help="SuperNode device: auto | cpu | cuda[:i]")
    local.add_argument("--app-dir", help="Flower App directory (default: this checkout)")
    sim = sub.add_parser("simulate", help="run on Flower's simulation engine (Ray)")
    _run_arguments(sim)
    sim.add_argument("--engine", choices=("ray", "inprocess"), default="ray",
                     help="ray = Flower simulation engine (default); inprocess = no Ray, one process")
    sim.add_argument("--cpus-per-client", type=int, default=1)
    sim.add_argument("--gpus-per-client", type=float, default=0.0)
    sim.add_argument("--app-dir", help="Flower App directory (default: this checkout)")
    sub.add_parser("report", help="compare run directories (table + PNG)", add_help=False)
    sub.add_parser("presets", help="list the presets in configs/presets/")
    return parser


def apply_preset(args: argparse.Namespace) -> dict[str, Any]:
    """The --preset's [config] values ({} without one); fills in --clients when not given.

    Idempotent: the preset is read once and kept on ``args``."""
    if not hasattr(args, "preset_values"):
        preset = load_preset(args.preset) if args.preset else None
        args.preset_values = dict(preset.config) if preset else {}
        if args.clients is None:
            args.clients = preset.clients if preset and preset.clients else DEFAULT_CLIENTS
        if preset:
            print(f"preset {preset.name}: {preset.description}", flush=True)
    return args.preset_values


def resolve_config(args: argparse.Namespace, extra: dict[str, Any] | None = None) -> RunConfig:
    """Run config from the preset, then --set values, then explicit flags; validated."""
    values = dict(apply_preset(args))
    values.update(parse_assignments(args.sets))
    flags = {"algorithm": args.algorithm, "num-server-rounds": args.rounds, "dataset": args.dataset,
             "model": args.model, "partition": args.partition, "seed": args.seed,
             "fraction-train": args.fraction}
    values.update({k: v for k, v in flags.items() if v is not None})
    for key, value in (extra or {}).items():
        values.setdefault(key, value)
    if args.clients < 1:
        raise UsageError("--clients must be >= 1")
    cfg = RunConfig.from_mapping(values)
    run_dir = Path(args.run_dir or cfg.run_dir or _default_run_dir(cfg)).expanduser().resolve()
    if (run_dir / "metrics.jsonl").exists():
        raise UsageError(f"{run_dir} already holds a run; choose another --run-dir")
    return cfg.replace(run_dir=str(run_dir))


def _default_run_dir(cfg: RunConfig) -> Path:
    from server.rundir import default_run_dir

    return default_run_dir(cfg)


def preflight(cfg: RunConfig, num_clients: int) -> None:
    """Load the data and build the partition here, so bad input fails before any process starts."""
    from common.data import partitions_for

    parts = partitions_for(cfg, num_clients)
    empty = [i for i, p in enumerate(parts) if len(p) == 0]
    if empty:
        raise UsageError(f"partitions {empty} are empty; use fewer clients or another partition")


def app_dir(given: str | None) -> Path:
    path = Path(given).resolve() if given else Path(__file__).resolve().parent.parent
    toml = path / "pyproject.toml"
    if not toml.exists() or "[tool.flwr.app]" not in toml.read_text():
        raise UsageError(f"{path} is not a Flower App directory (no pyproject.toml with "
                         "[tool.flwr.app]); run from a flatflower checkout or pass --app-dir")
    return path


# ---------------------------------------------------------------------------- progress
class Progress:
    """Prints each new metrics.jsonl line of a run as it appears."""

    def __init__(self, run_dir: Path, rounds: int):
        self.path, self.rounds, self.seen, self.last = run_dir / "metrics.jsonl", rounds, 0, None

    def __call__(self) -> None:
        if not self.path.exists():
            return
        lines = self.path.read_text().splitlines()
        for line in lines[self.seen:]:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                break  # being written
            self.seen += 1
            self.last = row
            extra = ""
            if row["round"] > 0:
                ok = row["clients_replied"] - row["clients_rejected"]
                extra = f"  clients {ok}/{row['clients_sampled']}  {row['seconds']:.1f}s"
            print(f"round {row['round']:>3}/{self.rounds}  test accuracy {100 * row['test_accuracy']:6.2f}%"
                  f"  loss {row['test_loss']:.4f}{extra}", flush=True)


def _finish(cfg: RunConfig, ok: bool, progress: Progress, details: str = "") -> int:
    run_dir = Path(cfg.run_dir)
    progress()
    if ok and progress.last is not None:
        print(f"final test accuracy {100 * progress.last['test_accuracy']:.2f}% after round "
              f"{progress.last['round']}; run directory: {run_dir}")
        return EXIT_OK
    print(f"run failed{': ' + details if details else ''}\nrun directory: {run_dir} (logs in logs/)",
          file=sys.stderr)
    return EXIT_FAILED


# ---------------------------------------------------------------------------- commands
def cmd_local(args: argparse.Namespace) -> int:
    from server.federation import COMPLETED, LocalFederation

    cfg = resolve_config(args, {"min-available-nodes": args.clients})
    app = app_dir(args.app_dir)
    preflight(cfg, args.clients)
    run_dir = Path(cfg.run_dir)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="flatflower-"))
    progress = Progress(run_dir, cfg.num_server_rounds)
    t0 = time.monotonic()
    try:
        print(f"starting a SuperLink and {args.clients} SuperNodes on 127.0.0.1 "
              f"({cfg.algorithm}, {cfg.dataset}, {cfg.num_server_rounds} rounds)", flush=True)
        node_config = {"device": args.device} if args.device != "auto" else {}
        with LocalFederation(args.clients, work, run_dir / "logs", node_config=node_config) as fed:
            run_id = fed.submit(app, cfg.to_dict())
            print(f"submitted run {run_id}; waiting for rounds (Flower polls every ~3 s)", flush=True)
            row = fed.wait(run_id, args.timeout, on_poll=progress)
            fed.save_log(run_id, run_dir / "logs" / "run.log")
        print(f"flower: {row.get('status')} in {time.monotonic() - t0:.1f}s "
              f"(run elapsed {row.get('elapsed', '?')})", flush=True)
        return _finish(cfg, row.get("status") == COMPLETED, progress, row.get("status-details", ""))
    finally:
        shutil.rmtree(work, ignore_errors=True)


def cmd_simulate(args: argparse.Namespace) -> int:
    cfg = resolve_config(args)
    preflight(cfg, args.clients)
    progress = Progress(Path(cfg.run_dir), cfg.num_server_rounds)
    if args.engine == "inprocess":
        return _simulate_inprocess(cfg, args.clients, progress)

    from server.federation import COMPLETED, LocalFederation

    app = app_dir(args.app_dir)
    run_dir = Path(cfg.run_dir)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="flatflower-"))
    try:
        fed = LocalFederation(0, work, run_dir / "logs", simulation=True)
        fed.env["RAY_TMPDIR"] = str(work / "ray")
        print(f"Ray simulation: {args.clients} virtual clients, {cfg.algorithm}", flush=True)
        with fed:
            run_id = fed.submit(app, cfg.to_dict(), {
                "num-supernodes": args.clients, "client-resources-num-cpus": args.cpus_per_client,
                "client-resources-num-gpus": args.gpus_per_client,
                "init-args-num-cpus": os.cpu_count() or 1})
            row = fed.wait(run_id, args.timeout, on_poll=progress)
            fed.save_log(run_id, run_dir / "logs" / "run.log")
        return _finish(cfg, row.get("status") == COMPLETED, progress, row.get("status-details", ""))
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _simulate_inprocess(cfg: RunConfig, clients: int, progress: Progress) -> int:
    """The run in a worker thread, its rounds printed live from metrics.jsonl."""
    import threading

    from server.inprocess import run_inprocess

    logging.getLogger("flwr").setLevel(logging.WARNING)
    for name in ("flwr.flatflower.server", "flwr.flatflower.client"):
        logging.getLogger(name).setLevel(logging.WARNING)
    print(f"in-process simulation: {clients} clients, {cfg.algorithm}", flush=True)
    failure: list[BaseException] = []

    def work() -> None:
        try:
            run_inprocess(cfg.to_dict(), clients)
        except BaseException as err:  # reported below, in the main thread
            failure.append(err)

    worker = threading.Thread(target=work, daemon=True)
    worker.start()
    while worker.is_alive():
        progress()
        worker.join(0.5)
    if failure:
        raise failure[0]
    return _finish(cfg, True, progress)


def cmd_presets(args: argparse.Namespace) -> int:
    """List name, description and source of each preset in configs/presets/."""
    names = available()
    if not names:
        print("no presets in configs/presets/")
    failed = False
    for name in names:
        try:
            preset = load_preset(name)
        except PresetError as err:
            print(f"{name}: error: {err}", file=sys.stderr)
            failed = True
            continue
        clients = f"  ({preset.clients} clients)" if preset.clients else ""
        print(f"{name}{clients}\n    {preset.description}\n    source: {preset.source or '-'}")
    return EXIT_USAGE if failed else EXIT_OK


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "report":
        from server.report import main as report_main

        return report_main(argv[1:])
    args = build_parser().parse_args(argv)
    from common.datasets import DatasetUnavailableError
    from common.partition import PartitionError
    from server.federation import FederationError
    from server.rundir import RunDirError

    try:
        if args.command == "presets":
            return cmd_presets(args)
        apply_preset(args)
        return {"local": cmd_local, "simulate": cmd_simulate}[args.command](args)
    except (UsageError, ConfigError, PresetError, DatasetUnavailableError, PartitionError,
            RunDirError, OSError) as err:  # OSError: e.g. a run directory that cannot be created
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except FederationError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print("interrupted; all Flower processes were stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
