"""Preparing a run from the command line: its config (a preset, then ``--set`` values, then the
named flags; or a ``--resume``'d run's own), checked before anything starts, so bad input is one
line and exit code 2 (:class:`UsageError`), and nothing is written for a run that never starts.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from flatflower.common.config import (MAX_SECONDS, ConfigError, RunConfig, check_types, cli_float, cli_int,
                                      flat_keys, parse_assignments, user_path)
from flatflower.runtime.args import Parser  # noqa: F401 - the commands' parser, here with their arguments
from flatflower.tools.presets import load_preset

DEFAULT_CLIENTS = 4
CLIENT_STATE = "client-state"  # the clients' state mirror, inside the run directory


class UsageError(Exception):
    """Bad input: printed as one line, exit code 2."""


# ---------------------------------------------------------------------------- arguments
def add_run_arguments(p: argparse.ArgumentParser, per_run: bool = True) -> None:
    """The options of every command that runs a federation (local, simulate; sweep without
    the ``per_run`` ones it sets itself: --algorithm, --seed, --run-dir, --resume)."""
    if per_run:
        p.add_argument("--algorithm", "-a",
                       help="algorithm name, e.g. fedsam, fedgmt, fedtoga (default: run config)")
    p.add_argument("--preset", metavar="NAME_OR_FILE",
                   help="start from a preset: a TOML file or a name in tools/presets/ "
                        "(list: flatflower presets)")
    p.add_argument("--clients", "-n", type=cli_int,
                   help=f"number of clients (default: the preset's, else {DEFAULT_CLIENTS})")
    p.add_argument("--rounds", "-r", type=cli_int, help="server rounds (num-server-rounds)")
    p.add_argument("--dataset", help="digits | synthetic | synthetic-fedprox | mnist1d | synthetic-cifar10 (offline); "
                   "mnist | fashion-mnist | cifar10 | cifar100 (torchvision); your own: npz | csv | imagefolder "
                   "(files in data-dir) or package.module:callable")
    p.add_argument("--model", help="auto | logreg | mlp | cnn | cifar-cnn | lenet | lenet5 | resnet18-gn, or your "
                   "own: package.module:callable (taking (input_shape, num_classes) or nothing, returning an nn.Module)")
    p.add_argument("--partition", help="iid | dirichlet | dirichlet-balanced | pathological | "
                   "natural (synthetic-fedprox's own clients) | fds:<Partitioner> (Flower Datasets'; "
                   "its keyword arguments in the key partition-args)")
    if per_run:
        p.add_argument("--seed", type=cli_int)
    p.add_argument("--fraction", type=cli_float, help="fraction of clients per round (fraction-train)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="any run-config key, e.g. --set sam.rho=0.05 --set lr=0.05 (repeatable)")
    if per_run:
        p.add_argument("--run-dir", help="where the run directory goes (default runs/<name>)")
    p.add_argument("--tensorboard", action=argparse.BooleanOptionalAction, default=None,
                   help="TensorBoard event files in the run directory (default: on when the "
                        "tensorboard package is installed)")
    if per_run:
        p.add_argument("--resume", metavar="RUN_DIR",
                       help="continue the run in RUN_DIR from its last checkpoint (same config; "
                            "--rounds may extend it)")
    p.add_argument("--trust-run-dir", action="store_true",
                   help="when a run is resumed: accept its run directory although its "
                        "manifest.json is not sealed by your record key (an older flatflower's, copied from "
                        "another machine or user, or with none) as it is; the resume seals it under your key "
                        "(docs/run-directory.md)")
    p.add_argument("--allow-code-change", action="store_true",
                   help="when a run is resumed: go on although a referenced module "
                        "(model, dataset, train-transform, algorithm) or flatflower itself changed since "
                        "the run started; config.json records it (docs/run-directory.md)")
    p.add_argument("--flatness-every", type=cli_int, metavar="K",
                   help="measure the global model's sharpness, top Hessian eigenvalue and Hessian "
                        "trace every K rounds and at the last (flatness-every; default 0 = off)")
    p.add_argument("--timeout", type=cli_float, default=3600.0,
                   help=f"give up after this many seconds (at most {MAX_SECONDS:.0f})")


def add_node_data_argument(p: argparse.ArgumentParser) -> None:
    """``--node-data DIR`` (local, simulate): each client's own folder, one per client, in
    partition order; the run is ``partition = local`` (docs/local-data.md)."""
    p.add_argument("--node-data", action="append", default=[], metavar="DIR",
                   help="one client's own data folder (its node config's data-dir), once per client "
                        "in partition order: every client trains on all of its own data "
                        "(partition=local; set input-shape and num-classes, and dataset, e.g. npz)")


def node_configs(args: argparse.Namespace) -> dict[int, dict[str, str]] | None:
    """Partition id -> its node config's own keys (``data-dir`` from ``--node-data``), or None."""
    dirs = getattr(args, "node_data", None) or []
    return {i: {"data-dir": str(user_path(d, "--node-data").resolve())} for i, d in enumerate(dirs)} or None


ENGINES = ("ray", "inprocess", "vectorized")
# simulate's engine without --engine: the fastest that gives Ray's result (bit-identical models,
# without Ray's start-up or its per-message serialisation: docs/benchmarks.md)
DEFAULT_ENGINE = "inprocess"


def add_simulate_arguments(p: argparse.ArgumentParser) -> None:
    """The options of the simulation engines (simulate, sweep)."""
    p.add_argument("--engine", choices=ENGINES, default=None,
                   help="inprocess = no Ray, one process (default, unless the preset or a "
                        "--resume'd run names its engine, or Ray's --cpus/--gpus-per-client are given: "
                        "the same result as Ray, faster); "
                        "ray = Flower's simulation engine; "
                        "vectorized = in one process, each round's local training in batched passes "
                        "over all sampled clients (torch.func.vmap)")
    p.add_argument("--cpus-per-client", type=cli_int, default=None,
                   help="Ray's CPUs per client actor (--engine ray only; default 1)")
    p.add_argument("--gpus-per-client", type=cli_float, default=None,
                   help="Ray's GPU share per client actor, e.g. 0.25 (--engine ray only; default 0)")
    p.add_argument("--ray-address", default=None, metavar="HOST:PORT",
                   help="a Ray cluster that already runs (its head: 'ray start --head --port PORT'): "
                        "simulate --engine ray runs its clients there, sweep runs each run there as a "
                        "Ray task, tune its workers and final runs (docs/engines.md)")
    p.add_argument("--app-dir", help="Flower App directory (default: this checkout)")


def apply_preset(args: argparse.Namespace) -> dict[str, Any]:
    """The --preset's [config] values ({} without one); fills in --clients when not given.

    Idempotent: the preset is read once and kept on ``args``."""
    if not hasattr(args, "preset_values"):
        from flatflower.common.schema import printable

        preset = load_preset(args.preset) if args.preset else None
        args.preset_values = dict(preset.config) if preset else {}
        args.preset_algorithms = dict(preset.algorithms) if preset else {}
        if getattr(args, "engine", "") is None:  # simulate / sweep without --engine
            args.engine = engine_of(args, preset)
        if getattr(args, "engine", None):
            check_engine_options(args)
        if args.clients is None and getattr(args, "node_data", None):
            args.clients = len(args.node_data)  # one client per --node-data folder
        if args.clients is None and args.resume:
            args.clients = resume_clients(args.resume)
        if args.clients is None:
            args.clients = preset.clients if preset and preset.clients else DEFAULT_CLIENTS
        if preset:
            print(f"preset {preset.name}: {printable(preset.description)}", flush=True)
    return args.preset_values


def resolve_config(args: argparse.Namespace, extra: dict[str, Any] | None = None) -> RunConfig:
    """Run config from the preset, then --set values, then explicit flags; validated."""
    if args.resume:
        return _resume_config(args, extra)
    values = dict(apply_preset(args))
    sets = parse_assignments(args.sets)
    check_types(sets)  # a --set value a flag overrides is checked too
    algorithm = args.algorithm or sets.get("algorithm") or values.get("algorithm") or RunConfig.algorithm
    values.update(args.preset_algorithms.get(algorithm, {}))  # the preset's table for the algorithm
    values.update(sets)
    flags = {"algorithm": args.algorithm, "num-server-rounds": args.rounds, "dataset": args.dataset,
             "model": args.model, "partition": args.partition, "seed": args.seed,
             "fraction-train": args.fraction, "tensorboard": getattr(args, "tensorboard", None),
             "flatness-every": getattr(args, "flatness_every", None)}
    values.update({k: v for k, v in flags.items() if v is not None})
    if values.get("dataset") == "synthetic-fedprox":
        values.setdefault("partition", "natural")  # its clients are generated, not split
    if getattr(args, "node_data", None):  # each client on its own folder: no partition to cut
        if values.setdefault("partition", "local") != "local":
            raise UsageError(f"--node-data gives each client its own data: partition must be local, "
                             f"not {values['partition']!r}")
    for key, value in (extra or {}).items():
        values.setdefault(key, value)
    check_run_arguments(args)
    values.setdefault("num-partitions", args.clients)
    cfg = RunConfig.from_mapping(values)
    if cfg.num_partitions != args.clients:
        raise UsageError(f"num-partitions={cfg.num_partitions} disagrees with --clients {args.clients}")
    return place_run(cfg, args.run_dir)


def place_run(cfg: RunConfig, run_dir: str | None = None) -> RunConfig:
    """``cfg`` with its run directory (``run_dir``, else its own ``run-dir``, else
    runs/<name>) made absolute and checked (no run in it yet, writable, no links), its clients'
    state mirrored inside it and its ``data-dir`` absolute: the CLI's and the Python API's
    (flatflower.run_simulation) last step before a run starts. UsageError otherwise."""
    run_dir = user_path(str(run_dir or cfg.run_dir or _default_run_dir(cfg)), "--run-dir").resolve()
    if (run_dir / "metrics.jsonl").exists():
        raise UsageError(f"{run_dir} already holds a run; choose another --run-dir "
                         "(or continue it with --resume)")
    _check_writable(run_dir)
    if run_dir.is_dir():
        from flatflower.server.rundir import refuse_links

        refuse_links(run_dir)
    # clients mirror their state into the run directory (a relative client-state-dir is inside
    # it: the directory can be moved or copied), so --resume is exact
    state_dir = cfg.client_state_dir or CLIENT_STATE
    # a data-dir relative to where the command runs means the same folder to the ServerApp and
    # the SuperNodes this command starts, whose working directories are elsewhere
    data_dir = str(user_path(cfg.data_dir, "data-dir").resolve()) if cfg.data_dir else ""
    return cfg.replace(run_dir=str(run_dir), client_state_dir=state_dir, data_dir=data_dir)


def check_run_arguments(args: argparse.Namespace) -> None:
    """UsageError for out-of-range command-line numbers (before anything starts)."""
    if args.clients is not None and args.clients < 1:
        raise UsageError("--clients must be >= 1")
    dirs = getattr(args, "node_data", None)
    if dirs and args.clients != len(dirs):
        raise UsageError(f"--clients {args.clients} disagrees with the {len(dirs)} --node-data folders "
                         "(one per client)")
    if dirs and getattr(args, "engine", None) == "ray":
        raise UsageError("--node-data: Ray's simulation gives every virtual node the same node config; "
                         "use --engine inprocess or vectorized, or flatflower local")
    if not 0 < args.timeout <= MAX_SECONDS:
        raise UsageError(f"--timeout must be in (0, {MAX_SECONDS:.0f}] seconds (got {args.timeout:g})")


@contextlib.contextmanager
def resume_acceptance(args: argparse.Namespace, cfg: RunConfig) -> Iterator[None]:
    """For the block (the preflight and the run): what the user accepted for the run directory
    a resume continues (--trust-run-dir, --allow-code-change), in the environment the ServerApp
    reads, this process's and those it starts (server/manifest.py TRUST_ENV, server/codeid.py
    ENV: the run directory's path; nothing for a run that is not resumed)."""
    from flatflower.server.codeid import ENV as CODE_ENV
    from flatflower.server.manifest import TRUST_ENV

    given = [env for env, flag in ((TRUST_ENV, "trust_run_dir"), (CODE_ENV, "allow_code_change"))
             if cfg.resume and getattr(args, flag, False)]
    saved = {env: os.environ.get(env) for env in given}
    for env in given:
        os.environ[env] = os.pathsep.join([v for v in [saved[env], cfg.run_dir] if v])
    try:
        yield
    finally:
        for env, value in saved.items():
            if value is None:
                os.environ.pop(env, None)
            else:
                os.environ[env] = value


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
    from flatflower.server.rundir import check_resumable, claim, load_checkpoint, refuse_links

    run_dir = user_path(args.resume, "--resume").resolve()
    given = [flag for flag, value in (
        ("--preset", args.preset), ("--set", args.sets), ("--algorithm", args.algorithm),
        ("--dataset", args.dataset), ("--model", args.model), ("--partition", args.partition),
        ("--seed", args.seed), ("--fraction", args.fraction), ("--run-dir", args.run_dir)) if value]
    if given:
        raise UsageError(f"--resume continues a run as it was configured: {', '.join(given)} "
                         "cannot be combined with it (only --rounds, --clients, --timeout)")
    check_run_arguments(args)
    if run_dir.is_dir():
        refuse_links(run_dir)
    saved = _saved_config(run_dir)
    # the directory itself (the ServerApp locks its .lock file): nothing is written here
    args.run_dir_claim = claim(run_dir, f"{run_dir} is being resumed or run by another "
                                        "flatflower command")
    values = {**saved, "resume": True, "run-dir": str(run_dir)}
    if args.rounds is not None:
        values["num-server-rounds"] = args.rounds
    for key in ("tensorboard", "flatness_every"):  # what a resumed run may change
        if getattr(args, key, None) is not None:
            values[key.replace("_", "-")] = getattr(args, key)
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
    from flatflower.server.rundir import open_file

    path = run_dir / "config.json"
    if not run_dir.is_dir():
        raise UsageError(f"run directory {run_dir} does not exist")
    if not path.is_file():
        raise UsageError(f"{run_dir} is not a flatflower run directory (no config.json)")
    try:
        with open_file(path) as f:
            saved = json.loads(f.read())["config"]
        if not isinstance(saved, dict):
            raise TypeError("'config' is not a table")
    except (ValueError, KeyError, TypeError, RecursionError) as err:  # ValueError: not JSON or UTF-8
        raise UsageError(f"{path} is corrupt: {err}") from None
    return saved


def engine_of(args: argparse.Namespace, preset: Any) -> str:
    """The engine of a simulate / sweep command: its --engine, else the --resume'd run's, else
    the preset's, else Ray when Ray's actor sizes are given, else DEFAULT_ENGINE."""
    ray_sizes = args.cpus_per_client is not None or args.gpus_per_client is not None
    return (args.engine or (recorded_engine(args.resume) if getattr(args, "resume", None) else None)
            or (preset.engine if preset else None) or ("ray" if ray_sizes else DEFAULT_ENGINE))


def check_engine_options(args: argparse.Namespace) -> None:
    """UsageError when Ray's actor sizes are given for an engine without actors (they would
    be ignored: a GPU share asked for and never used)."""
    given = [flag for flag, value in (("--cpus-per-client", args.cpus_per_client),
                                      ("--gpus-per-client", args.gpus_per_client)) if value is not None]
    if given and args.engine != "ray":
        raise UsageError(f"{' and '.join(given)} size Ray's client actors; the {args.engine} engine "
                         f"runs every client in this process: add --engine ray")
    if args.cpus_per_client is not None and args.cpus_per_client < 1:
        raise UsageError(f"--cpus-per-client must be >= 1 (got {args.cpus_per_client})")
    if args.gpus_per_client is not None and not 0 <= args.gpus_per_client <= 1:
        raise UsageError(f"--gpus-per-client must be in [0, 1] (got {args.gpus_per_client:g})")
    address = getattr(args, "ray_address", None)
    if address is not None and args.engine != "ray":
        raise UsageError(f"--ray-address runs Flower's Ray simulation engine on a cluster; the "
                         f"{args.engine} engine runs every client in this process: add --engine ray")
    if args.engine == "ray" and not ray_installed():
        raise UsageError("--engine ray is Flower's simulation engine, which needs Ray: "
                         "pip install 'flwr[simulation]==1.39.0' (or --engine inprocess: the same "
                         "result, without Ray)")
    if address is not None:
        check_cluster(address, args.cpus_per_client or 1, args.gpus_per_client or 0.0, "each client")
        return
    # Ray sizes its actor pool from what the machine has; a client that fits nowhere ends the
    # simulation after Ray's start-up with "ActorPool is empty": say so before anything starts
    cpus = os.cpu_count() or 1
    if args.cpus_per_client is not None and args.cpus_per_client > cpus:
        raise UsageError(f"--cpus-per-client {args.cpus_per_client} is more than this machine's {cpus} "
                         f"CPUs: Ray could place no client")
    if args.gpus_per_client and not cuda_gpu_count():
        raise UsageError(f"--gpus-per-client {args.gpus_per_client:g} gives each client a share of a GPU, "
                         f"and PyTorch sees no CUDA GPU here: Ray could place no client (leave the flag "
                         f"out to run the clients on the CPU)")


def check_cluster(address: str, cpus: float, gpus: float, what: str) -> None:
    """UsageError unless the Ray cluster at ``address`` answers and one of its nodes has
    ``cpus`` CPUs and ``gpus`` GPUs for ``what`` (runtime/cluster.py: within seconds)."""
    from flatflower.runtime.cluster import ClusterError, Job, check_fits, probe

    try:
        check_fits([Job(what, Path("."), argv=("-V",), num_cpus=cpus, num_gpus=gpus)], probe(address), address)
    except ClusterError as err:
        raise UsageError(str(err)) from None


def check_device(text: str) -> None:
    """UsageError unless the SuperNodes of this machine can train on ``--device text``: a GPU
    that is not here is refused at once, not after the federation started."""
    import re

    from flatflower.client.node import DEVICES, device_missing

    if not re.fullmatch(DEVICES, text):
        raise UsageError(f"--device {text!r} is not one of: auto, cpu, cuda, cuda:<i>, mps")
    missing = device_missing(text)
    if missing:
        raise UsageError(f"--device {text}: {missing} on this machine")


def ray_installed() -> bool:
    """Whether Ray imports here (without it Flower's simulation ends with exit code 701)."""
    import importlib.util

    return importlib.util.find_spec("ray") is not None


def cuda_gpu_count() -> int:
    """CUDA GPUs PyTorch sees here (Ray places GPU-sized actors only where there are some)."""
    import torch

    return torch.cuda.device_count()


def recorded_engine(run_dir: str) -> str | None:
    """The simulation engine that ran ``run_dir`` (its config.json), so that its resume
    continues on it; None for a deployment's run or an unreadable record."""
    from flatflower.server.rundir import open_file

    try:
        with open_file(Path(run_dir) / "config.json") as f:
            engine = json.loads(f.read()).get("engine")
    except (OSError, ValueError, AttributeError, RecursionError):
        return None
    return engine if engine in ENGINES else None


def resume_clients(run_dir: str) -> int | None:
    """Number of clients of the run in ``run_dir`` (partition.json, else its checkpoint)."""
    from flatflower.server.rundir import RunDirError, load_checkpoint, open_file

    try:
        with open_file(Path(run_dir) / "partition.json") as f:
            n = json.loads(f.read())["num_partitions"]
        if type(n) is int and n >= 1:
            return n
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        pass
    try:
        return load_checkpoint(run_dir)["num_partitions"]
    except (RunDirError, ConfigError):
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
    from flatflower.server.rundir import default_run_dir

    return default_run_dir(cfg)


def preflight(cfg: RunConfig, num_clients: int, engine: str = "",
              nodes: dict[int, dict[str, str]] | None = None) -> None:
    """Set the run up here (server/setup.py: the ServerApp's own setup: data, model, strategy,
    checkpoint and client state), so bad input fails before any process starts; and what only
    this command knows: every client's partition is non-empty, each node's folder (``nodes``:
    --node-data, partition = local) loads and fits, the vectorised engine can batch the model,
    the aggregator gets enough clients per round."""
    from flatflower.common.data import partitions_for
    from flatflower.server import recordkey
    from flatflower.server.setup import prepare_run

    try:  # the record key that will seal the run directory (made here on first use, outside it)
        recordkey.load(create=True)
    except recordkey.RecordKeyError as err:
        raise UsageError(str(err)) from None
    if cfg.local_data():
        check_node_folders(cfg, nodes)
    else:
        parts = partitions_for(cfg, num_clients)
        empty = [i for i, p in enumerate(parts) if len(p) == 0]
        if empty:
            raise UsageError(f"partitions {empty} are empty; use fewer clients or another partition")
    try:
        setup = prepare_run(cfg)  # the server's evaluation device included
        model = setup.model
    except ValueError as err:  # BadReference, TransformError, a model that does not fit, a damaged checkpoint
        raise UsageError(str(err)) from None
    for note in (setup.note, setup.code_note):  # what a resume goes on with because the user accepted it
        if note:
            print(f"note: {note}", flush=True)
    if engine == "vectorized":
        from flatflower.runtime.engines.vectorized import check_batchable, check_compilable

        try:
            check_batchable(model, cfg.resolved_model())
            check_compilable(cfg)
        except ValueError as err:
            raise UsageError(str(err)) from None
    per_round = num_clients if cfg.sampling == "bernoulli" else max(
        1, min(num_clients, math.floor(cfg.fraction_train * num_clients + 0.5)))
    from flatflower.strategies.aggregate import Aggregator

    need = Aggregator.from_config(cfg).required()
    if need > per_round:
        raise UsageError(f"aggregator {cfg.aggregator} needs at least {need} clients per round "
                         f"(aggregator-f={cfg.aggregator_f}); {per_round} are sampled "
                         f"({num_clients} clients, fraction-train={cfg.fraction_train:g})")
    if cfg.min_replies > per_round:
        raise UsageError(f"min-replies={cfg.min_replies} exceeds the {per_round} clients sampled per "
                         f"round ({num_clients} clients, fraction-train={cfg.fraction_train:g}): "
                         "every round would be skipped")


def check_node_folders(cfg: RunConfig, nodes: dict[int, dict[str, str]] | None) -> None:
    """partition = local: every node's folder (else the run config's data-dir, which nodes
    without one read) exists, loads and fits the run's model; the server's own data-dir, its
    evaluation set, too. UsageError naming the first that does not."""
    from flatflower.common.augment import check_train_transform
    from flatflower.common.data import check_local_data

    folders = [(f"--node-data {c['data-dir']}", c["data-dir"], True) for _, c in sorted((nodes or {}).items())]
    if cfg.data_dir or not folders:  # the server's evaluation set; the nodes' data when they have none
        folders.append((f"data-dir {cfg.data_dir or '(none)'}", cfg.data_dir, not folders))
    for what, folder, trains in folders:
        if folder and not Path(folder).expanduser().is_dir():
            raise UsageError(f"{what}: no such directory")
        try:
            check_train_transform(cfg.train_transform, check_local_data(cfg, folder, trains))
        except ValueError as err:  # DataError, TransformError
            raise UsageError(f"{what}: {err}") from None


def app_dir(given: str | None, cfg: RunConfig | None = None) -> Path:
    """The Flower App directory `local`, Ray and `flwr run` ship as a FAB: ``--app-dir``, else
    this checkout (the repository root beside flatflower/), else, for an installed package
    with no checkout, one generated from the code (:func:`installed_app_dir`). Flower refuses a
    run-config key its app's [tool.flwr.app.config] lacks: a run of a user's algorithm
    (``cfg``'s keys beyond the built-ins') gets the generated app, whose table holds every
    registered key, or, with ``--app-dir``, a one-line refusal naming the missing keys."""
    if given:
        path = Path(given).resolve()
    else:
        path = Path(__file__).resolve().parents[2]
        if not (path / "pyproject.toml").exists() or _missing_keys(path, cfg):  # site-packages: no checkout
            return installed_app_dir()
    toml = path / "pyproject.toml"
    if not toml.exists() or "[tool.flwr.app]" not in toml.read_text():
        raise UsageError(f"{path} is not a Flower App directory (no pyproject.toml with [tool.flwr.app]); "
                         "pass --app-dir with a flatflower checkout, or omit it to use the installed package")
    missing = _missing_keys(path, cfg)
    if missing:
        raise UsageError(f"{toml}: [tool.flwr.app.config] lacks {', '.join(missing)} (keys of algorithm "
                         f"{cfg.algorithm}), and Flower refuses a run-config key its app lacks; add them, "
                         "or omit --app-dir")
    return path


def _missing_keys(path: Path, cfg: RunConfig | None) -> list[str]:
    """``cfg``'s run-config keys that the app at ``path`` does not declare (a user's algorithm's)."""
    if cfg is None or not (path / "pyproject.toml").exists():
        return []
    try:
        table = tomllib.loads((path / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    except (KeyError, TypeError, tomllib.TOMLDecodeError):
        return []
    declared = set(flat_keys(table))
    return sorted(k for k in cfg.to_dict() if k not in declared)


def installed_app_dir() -> Path:
    """A Flower App directory for the installed package (no checkout): a pyproject.toml whose
    components are the installed ``flatflower.server.app:app`` / ``flatflower.client.app:app``
    and whose [tool.flwr.app.config] is the code's defaults (common/config.py ``defaults()``,
    the same table a checkout's pyproject holds). Its FAB ships nothing but that file: the
    code is installed where the SuperLink and SuperNodes run. Generated, not package data, so it
    cannot drift from the code; written once per content into the user cache directory."""
    import hashlib

    import tomli_w

    from flatflower.common.config import defaults
    from flatflower.common.params import PLACEHOLDER, is_unset

    config: dict[str, Any] = {}
    for key, value in defaults().items():
        head, _, tail = key.partition(".")
        value = PLACEHOLDER if is_unset(value) else value
        (config.setdefault(head, {}).__setitem__(tail, value) if tail else config.__setitem__(head, value))
    text = tomli_w.dumps({
        "project": {"name": "flatflower-app", "version": "1.0.0", "description": "flatflower (installed)",
                    "license": "Apache-2.0", "dependencies": []},
        "tool": {"flwr": {"app": {"publisher": "flatflower", "fab-include": ["pyproject.toml"],
                                  "components": {"serverapp": "flatflower.server.app:app",
                                                 "clientapp": "flatflower.client.app:app"},
                                  "config": config}}}})
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "flatflower"
    path = base / f"app-{hashlib.sha256(text.encode()).hexdigest()[:12]}"
    try:
        if not (path / "pyproject.toml").exists() or (path / "pyproject.toml").read_text() != text:
            path.mkdir(parents=True, exist_ok=True)
            (path / "pyproject.toml").write_text(text)
    except OSError as err:
        raise UsageError(f"cannot write the installed Flower App to {path} ({err.strerror}); "
                         "set XDG_CACHE_HOME to a writable directory or pass --app-dir") from None
    return path
