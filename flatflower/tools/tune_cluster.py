"""``flatflower tune --ray-address``: the trials as Ray tasks on a cluster that already runs.

The driver (this process) counts what is left of every algorithm's budget and gives each of
``--workers`` Ray tasks (runtime/cluster.py: any node, no shared filesystem, its run directory
shipped back) a share of it; each task runs its trials one after another in its process,
reaching the study through the driver's storage, served over gRPC by Optuna's storage proxy.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import time
from pathlib import Path

from flatflower.tools.prepare import UsageError
from flatflower.tools.tune_space import Space
from flatflower.tools.tune_study import budget_used, storage, study_of, tune_trials


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


def driver_host(address: str) -> str:
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
    threading.Thread(target=run_grpc_proxy_server, args=(storage(args),), kwargs={"host": host, "port": port},
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

    proxy = serve_storage(args, driver_host(args.ray_address))
    left = {space.algorithm: max(0, args.trials - budget_used(study_of(args, space, rounds, clients)))
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
