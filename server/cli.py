"""The ``flatflower`` command.

    flatflower local    --algorithm A --clients N --rounds R [...]   real SuperLink + N SuperNodes
    flatflower simulate --algorithm A --clients N --rounds R [...]   Flower's Ray simulation engine
    flatflower report   RUN_DIR [RUN_DIR ...]                        table + accuracy plot
    flatflower presets                                               list configs/presets/
    flatflower certs    OUT_DIR --nodes N [--host H ...]             TLS certificates + node keys

``--preset NAME_OR_FILE`` starts from a paper's setting (server/presets.py); ``--set`` values
override it, and the named flags override both.

Bad input (unknown algorithm, invalid value, missing dataset, a run directory that already
holds a run) is reported in one line before anything starts, with exit code 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common.config import MAX_SECONDS, ConfigError, RunConfig, cli_float, cli_int, parse_assignments
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
    p.add_argument("--clients", "-n", type=cli_int,
                   help=f"number of clients (default: the preset's, else {DEFAULT_CLIENTS})")
    p.add_argument("--rounds", "-r", type=cli_int, help="server rounds (num-server-rounds)")
    p.add_argument("--dataset", help="digits | synthetic | mnist | fashion-mnist | cifar10 | cifar100")
    p.add_argument("--model", help="auto | logreg | mlp | cnn | cifar-cnn | lenet | resnet18-gn")
    p.add_argument("--partition", help="iid | dirichlet | dirichlet-balanced | pathological")
    p.add_argument("--seed", type=cli_int)
    p.add_argument("--fraction", type=cli_float, help="fraction of clients per round (fraction-train)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="any run-config key, e.g. --set rho=0.05 --set lr=0.05 (repeatable)")
    p.add_argument("--run-dir", help="where the run directory goes (default runs/<name>)")
    p.add_argument("--resume", metavar="RUN_DIR",
                   help="continue the run in RUN_DIR from its last checkpoint (same config; "
                        "--rounds may extend it)")
    p.add_argument("--timeout", type=cli_float, default=3600.0,
                   help=f"give up after this many seconds (at most {MAX_SECONDS:.0f})")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flatflower", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    local = sub.add_parser("local", help="run a real Flower federation on 127.0.0.1")
    _run_arguments(local)
    local.add_argument("--device", default="auto", help="SuperNode device: auto | cpu | cuda[:i]")
    local.add_argument("--app-dir", help="Flower App directory (default: this checkout)")
    local.add_argument("--tls", action="store_true",
                       help="TLS on the SuperLink's APIs and SuperNode authentication "
                            "(certificates and node keys generated for the run)")
    sim = sub.add_parser("simulate", help="run on Flower's simulation engine (Ray)")
    _run_arguments(sim)
    sim.add_argument("--engine", choices=("ray", "inprocess"), default="ray",
                     help="ray = Flower simulation engine (default); inprocess = no Ray, one process")
    sim.add_argument("--cpus-per-client", type=cli_int, default=1)
    sim.add_argument("--gpus-per-client", type=cli_float, default=0.0)
    sim.add_argument("--app-dir", help="Flower App directory (default: this checkout)")
    sub.add_parser("report", help="compare run directories (table + PNG)", add_help=False)
    sub.add_parser("bench", help="cost per local step, framework overhead, bytes, memory (JSON + tables)",
                   add_help=False)
    sub.add_parser("sweep", help="several algorithms x seeds on one partition, then one report",
                   add_help=False)
    sub.add_parser("presets", help="list the presets in configs/presets/")
    certs = sub.add_parser("certs", help="generate a CA, a SuperLink certificate and SuperNode keys")
    certs.add_argument("out_dir", metavar="OUT_DIR", help="where the files go")
    certs.add_argument("--nodes", type=cli_int, required=True, help="number of SuperNode key pairs")
    certs.add_argument("--host", dest="hosts", action="append", default=[], metavar="NAME_OR_IP",
                       help="a name or IP address the SuperNodes use to reach the SuperLink "
                            "(repeatable; localhost, 127.0.0.1 and ::1 are always included)")
    certs.add_argument("--days", type=cli_int, default=365, help="validity in days (default 365)")
    certs.add_argument("--force", action="store_true", help="replace existing files")
    return parser


def apply_preset(args: argparse.Namespace) -> dict[str, Any]:
    """The --preset's [config] values ({} without one); fills in --clients when not given.

    Idempotent: the preset is read once and kept on ``args``."""
    if not hasattr(args, "preset_values"):
        preset = load_preset(args.preset) if args.preset else None
        args.preset_values = dict(preset.config) if preset else {}
        if args.clients is None and args.resume:
            args.clients = resume_clients(args.resume)
        if args.clients is None:
            args.clients = preset.clients if preset and preset.clients else DEFAULT_CLIENTS
        if preset:
            print(f"preset {preset.name}: {preset.description}", flush=True)
    return args.preset_values


def resolve_config(args: argparse.Namespace, extra: dict[str, Any] | None = None) -> RunConfig:
    """Run config from the preset, then --set values, then explicit flags; validated."""
    if args.resume:
        return _resume_config(args, extra)
    values = dict(apply_preset(args))
    values.update(parse_assignments(args.sets))
    flags = {"algorithm": args.algorithm, "num-server-rounds": args.rounds, "dataset": args.dataset,
             "model": args.model, "partition": args.partition, "seed": args.seed,
             "fraction-train": args.fraction}
    values.update({k: v for k, v in flags.items() if v is not None})
    for key, value in (extra or {}).items():
        values.setdefault(key, value)
    check_run_arguments(args)
    values.setdefault("num-partitions", args.clients)
    cfg = RunConfig.from_mapping(values)
    if cfg.num_partitions != args.clients:
        raise UsageError(f"num-partitions={cfg.num_partitions} disagrees with --clients {args.clients}")
    run_dir = Path(args.run_dir or cfg.run_dir or _default_run_dir(cfg)).expanduser().resolve()
    if (run_dir / "metrics.jsonl").exists():
        raise UsageError(f"{run_dir} already holds a run; choose another --run-dir "
                         "(or continue it with --resume)")
    _check_writable(run_dir)
    # clients mirror their state into the run directory, so --resume is exact
    state_dir = cfg.client_state_dir or str(run_dir / "client-state")
    return cfg.replace(run_dir=str(run_dir), client_state_dir=state_dir)


def check_run_arguments(args: argparse.Namespace) -> None:
    """UsageError for out-of-range command-line numbers (before anything starts)."""
    if args.clients is not None and args.clients < 1:
        raise UsageError("--clients must be >= 1")
    if not 0 < args.timeout <= MAX_SECONDS:
        raise UsageError(f"--timeout must be in (0, {MAX_SECONDS:.0f}] seconds (got {args.timeout:g})")


def _check_writable(run_dir: Path) -> None:
    """UsageError now (before any process starts) if ``run_dir`` cannot be created or written."""
    existing = run_dir
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise UsageError(f"cannot create run directory {run_dir}: {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(f"cannot create run directory {run_dir}: {existing} is not writable")


def _resume_config(args: argparse.Namespace, extra: dict[str, Any] | None) -> RunConfig:
    """The config of the run in ``--resume RUN_DIR``, checked against its checkpoint. The
    directory stays claimed by this command (a second resume of it is refused at once)."""
    from server.rundir import check_resumable, claim, load_checkpoint

    run_dir = Path(args.resume).expanduser().resolve()
    given = [flag for flag, value in (
        ("--preset", args.preset), ("--set", args.sets), ("--algorithm", args.algorithm),
        ("--dataset", args.dataset), ("--model", args.model), ("--partition", args.partition),
        ("--seed", args.seed), ("--fraction", args.fraction), ("--run-dir", args.run_dir)) if value]
    if given:
        raise UsageError(f"--resume continues a run as it was configured: {', '.join(given)} "
                         "cannot be combined with it (only --rounds, --clients, --timeout)")
    check_run_arguments(args)
    saved = _saved_config(run_dir)
    # the directory itself (the ServerApp locks its .lock file): nothing is written here
    args.run_dir_claim = claim(run_dir, f"{run_dir} is being resumed or run by another "
                                        "flatflower command")
    values = {**saved, "resume": True, "run-dir": str(run_dir)}
    if args.rounds is not None:
        values["num-server-rounds"] = args.rounds
    values.update(extra or {})
    try:
        cfg = RunConfig.from_mapping(values)
    except ConfigError as err:
        raise UsageError(f"{run_dir / 'config.json'}: {err}") from None
    ckpt = load_checkpoint(run_dir)
    check_resumable(cfg, ckpt)
    if args.clients != ckpt["num_partitions"]:
        raise UsageError(f"the run in {run_dir} has {ckpt['num_partitions']} clients, "
                         f"not --clients {args.clients}")
    print(f"resuming {run_dir} after round {ckpt['round']} of {cfg.num_server_rounds}", flush=True)
    return cfg


def _saved_config(run_dir: Path) -> dict[str, Any]:
    """config.json's run config of a run directory (UsageError when there is none)."""
    path = run_dir / "config.json"
    if not run_dir.is_dir():
        raise UsageError(f"run directory {run_dir} does not exist")
    if not path.is_file():
        raise UsageError(f"{run_dir} is not a flatflower run directory (no config.json)")
    try:
        saved = json.loads(path.read_text())["config"]
        if not isinstance(saved, dict):
            raise TypeError("'config' is not a table")
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise UsageError(f"{path} is corrupt: {err}") from None
    return saved


def resume_clients(run_dir: str) -> int | None:
    """Number of clients of the run in ``run_dir`` (partition.json, else its checkpoint)."""
    from server.rundir import RunDirError, load_checkpoint

    try:
        return int(json.loads((Path(run_dir) / "partition.json").read_text())["num_partitions"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    try:
        return int(load_checkpoint(run_dir)["num_partitions"])
    except (RunDirError, KeyError, TypeError, ValueError):
        return None  # the resume itself reports what is wrong


def log_dir(cfg: RunConfig) -> Path:
    """Where the Flower logs of this command go: <run dir>/logs, or a new subdirectory of it
    when resuming (the first attempt's logs are kept)."""
    logs = Path(cfg.run_dir) / "logs"
    if cfg.resume:
        logs = logs / time.strftime("resume-%Y%m%d-%H%M%S")
    logs.mkdir(parents=True, exist_ok=True)
    return logs


def _default_run_dir(cfg: RunConfig) -> Path:
    from server.rundir import default_run_dir

    return default_run_dir(cfg)


def preflight(cfg: RunConfig, num_clients: int) -> None:
    """Load the data and build the partition here, so bad input fails before any process starts."""
    from common.data import partitions_for

    from common.data import dataset_for
    from common.models import build_model

    parts = partitions_for(cfg, num_clients)
    empty = [i for i, p in enumerate(parts) if len(p) == 0]
    if empty:
        raise UsageError(f"partitions {empty} are empty; use fewer clients or another partition")
    data = dataset_for(cfg)
    try:
        build_model(cfg.resolved_model(), data.input_shape, data.num_classes, seed=0)
    except ValueError as err:
        raise UsageError(f"model {cfg.resolved_model()!r} does not fit dataset {cfg.dataset!r}: {err}") from None
    per_round = num_clients if cfg.sampling == "bernoulli" else max(
        1, min(num_clients, math.floor(cfg.fraction_train * num_clients + 0.5)))
    from strategies.aggregate import Aggregator

    need = Aggregator.from_config(cfg).required()
    if need > per_round:
        raise UsageError(f"aggregator {cfg.aggregator} needs at least {need} clients per round "
                         f"(aggregator-f={cfg.aggregator_f}); {per_round} are sampled "
                         f"({num_clients} clients, fraction-train={cfg.fraction_train:g})")
    if cfg.min_replies > per_round:
        raise UsageError(f"min-replies={cfg.min_replies} exceeds the {per_round} clients sampled per "
                         f"round ({num_clients} clients, fraction-train={cfg.fraction_train:g}): "
                         "every round would be skipped")


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
    reason = failure_reason(run_dir) or details
    print(f"error: run failed{': ' + reason if reason else ''}\nrun directory: {run_dir} (logs in logs/)",
          file=sys.stderr)
    return EXIT_FAILED


def failure_reason(run_dir: Path) -> str:
    """The one-line reason a failed run wrote to its summary.json ('' if none)."""
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return ""
    return str(summary.get("error", "")) if isinstance(summary, dict) and summary.get("status") == "failed" else ""


# ---------------------------------------------------------------------------- commands
def cmd_local(args: argparse.Namespace) -> int:
    from server.federation import COMPLETED, LocalFederation

    cfg = resolve_config(args, {"min-available-nodes": args.clients})
    app = app_dir(args.app_dir)
    preflight(cfg, args.clients)
    run_dir = Path(cfg.run_dir)
    logs = log_dir(cfg)
    work = Path(tempfile.mkdtemp(prefix="flatflower-"))
    progress = Progress(run_dir, cfg.num_server_rounds)
    t0 = time.monotonic()
    try:
        security = " over TLS with SuperNode authentication" if args.tls else ""
        print(f"starting a SuperLink and {args.clients} SuperNodes on 127.0.0.1{security} "
              f"({cfg.algorithm}, {cfg.dataset}, {cfg.num_server_rounds} rounds)", flush=True)
        node_config = {"device": args.device} if args.device != "auto" else {}
        with LocalFederation(args.clients, work, logs, node_config=node_config,
                             tls=args.tls) as fed:
            run_id = fed.submit(app, cfg.to_dict())
            print(f"submitted run {run_id}; waiting for rounds (Flower polls every ~3 s)", flush=True)
            row = fed.wait(run_id, args.timeout, on_poll=progress)
            fed.save_log(run_id, logs / "run.log")
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
    logs = log_dir(cfg)
    work = Path(tempfile.mkdtemp(prefix="flatflower-"))
    try:
        fed = LocalFederation(0, work, logs, simulation=True)
        fed.env["RAY_TMPDIR"] = str(work / "ray")
        print(f"Ray simulation: {args.clients} virtual clients, {cfg.algorithm}", flush=True)
        with fed:
            run_id = fed.submit(app, cfg.to_dict(), {
                "num-supernodes": args.clients, "client-resources-num-cpus": args.cpus_per_client,
                "client-resources-num-gpus": args.gpus_per_client,
                "init-args-num-cpus": os.cpu_count() or 1})
            row = fed.wait(run_id, args.timeout, on_poll=progress)
            fed.save_log(run_id, logs / "run.log")
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


def cmd_certs(args: argparse.Namespace) -> int:
    """Write a CA, the SuperLink's certificate and --nodes SuperNode key pairs to OUT_DIR."""
    from server.certs import CertError, generate_certs, summary

    try:
        files = generate_certs(Path(args.out_dir), args.nodes, args.hosts, days=args.days,
                               force=args.force)
    except CertError as err:
        raise UsageError(str(err)) from None
    print(summary(files))
    return EXIT_OK


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
    if argv and argv[0] == "report":
        from server.report import main as report_main

        return report_main(argv[1:])
    if argv and argv[0] == "bench":
        from server.bench import main as bench_main

        return bench_main(argv[1:])
    if argv and argv[0] == "sweep":
        from server.sweep import main as sweep_main

        return sweep_main(argv[1:])
    args = build_parser().parse_args(argv)
    _stop_on_signals()
    from common.datasets import DatasetUnavailableError
    from common.partition import PartitionError
    from server.federation import FederationError
    from server.run import RunFailed
    from server.rundir import RunDirError, RunWriteError
    from strategies.participation import NoNodesError

    try:
        if args.command == "presets":
            return cmd_presets(args)
        if args.command == "certs":
            return cmd_certs(args)
        apply_preset(args)
        return {"local": cmd_local, "simulate": cmd_simulate}[args.command](args)
    except (UsageError, ConfigError, PresetError, DatasetUnavailableError, PartitionError,
            RunDirError, OSError) as err:  # OSError: e.g. a run directory that cannot be created
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except (FederationError, RunFailed, RunWriteError, NoNodesError) as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print("interrupted; all Flower processes were stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
