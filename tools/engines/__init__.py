"""The engines: the ways to run a federation, as functions (the CLI, the sweep and the tests
call them): a real SuperLink and SuperNodes on 127.0.0.1 (federation.py, with the warm
ClientApp worker of worker.py), Flower's Ray simulation engine, and the in-process engine (no
ports, no Ray: inprocess.py), whose vectorised form trains many clients in batched passes
(vectorized.py). Each runs ``cfg`` to its end and says whether it completed; the run directory
holds the rest.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from common.config import RunConfig
from tools.progress import seconds_text

OnPoll = Callable[[], None]


@dataclass(frozen=True)
class Outcome:
    ok: bool
    details: str = ""  # Flower's status details when the run did not complete


def run_local(cfg: RunConfig, clients: int, app: Path, logs: Path, *, timeout: float,
              on_poll: OnPoll, device: str = "auto", tls: bool = False, clientapps: str = "warm",
              fast_poll: bool = False, node_configs: dict[int, dict] | None = None) -> Outcome:
    """A real SuperLink and ``clients`` SuperNodes on 127.0.0.1 (tools/engines/federation.py), each
    with a warm ClientApp worker (or Flower's process per message: ``clientapps="stock"``);
    ``node_configs``: partition id -> that SuperNode's own node-config keys (its data-dir)."""
    from tools.engines.federation import COMPLETED, LocalFederation

    work = Path(tempfile.mkdtemp(prefix="flatflower-"))
    t0 = time.monotonic()
    try:
        security = " over TLS with SuperNode authentication" if tls else ""
        mode = {"warm": "warm ClientApp workers", "stock": "a ClientApp process per message"}[clientapps]
        print(f"starting a SuperLink and {clients} SuperNodes on 127.0.0.1{security}, {mode}"
              f"{', fast polling' if fast_poll else ''} ({cfg.algorithm}, {cfg.dataset}, "
              f"{cfg.num_server_rounds} rounds)", flush=True)
        node_config = {"device": device} if device != "auto" else {}
        with LocalFederation(clients, work, logs, node_config=node_config, tls=tls,
                             clientapps=clientapps, fast_poll=fast_poll, node_configs=node_configs) as fed:
            run_id = fed.submit(app, cfg.to_dict())
            print(f"submitted run {run_id}; waiting for rounds", flush=True)
            row = fed.wait(run_id, timeout, poll=0.5, on_poll=on_poll)
            fed.save_log(run_id, logs / "run.log")
        print(f"flower: {row.get('status')} in {time.monotonic() - t0:.1f}s "
              f"(run elapsed {seconds_text(row.get('elapsed', '?'))})", flush=True)
        return Outcome(row.get("status") == COMPLETED, row.get("status-details", ""))
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run_ray(cfg: RunConfig, clients: int, app: Path, logs: Path, *, timeout: float,
            on_poll: OnPoll, cpus_per_client: int = 1, gpus_per_client: float = 0.0) -> Outcome:
    """Flower's simulation engine (Ray) with ``clients`` virtual SuperNodes."""
    from tools.engines.federation import COMPLETED, LocalFederation

    work = Path(tempfile.mkdtemp(prefix="flatflower-"))
    try:
        fed = LocalFederation(0, work, logs, simulation=True)
        fed.env["RAY_TMPDIR"] = str(work / "ray")
        print(f"Ray simulation: {clients} virtual clients, {cfg.algorithm}", flush=True)
        with fed:
            run_id = fed.submit(app, cfg.to_dict(), ray_federation_config(clients, cpus_per_client,
                                                                         gpus_per_client))
            row = fed.wait(run_id, timeout, poll=0.5, on_poll=on_poll)
            fed.save_log(run_id, logs / "run.log")
        return Outcome(row.get("status") == COMPLETED, row.get("status-details", ""))
    finally:
        shutil.rmtree(work, ignore_errors=True)


def ray_federation_config(clients: int, cpus_per_client: int = 1, gpus_per_client: float = 0.0) -> dict:
    """The simulation federation's settings (``flwr run --federation-config``)."""
    return {"num-supernodes": clients, "client-resources-num-cpus": cpus_per_client,
            "client-resources-num-gpus": gpus_per_client, "init-args-num-cpus": os.cpu_count() or 1}


@contextlib.contextmanager
def quiet_flower():
    """Silence Flower's INFO logging while federations run (the bench's many short runs)."""
    logger = logging.getLogger("flwr")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


def run_in_process(cfg: RunConfig, clients: int, *, on_poll: OnPoll, vectorized: bool = False,
                   node_configs: dict[int, dict] | None = None) -> Outcome:
    """The real ServerApp and ClientApps in this process (tools/engines/inprocess.py), in a worker
    thread while ``on_poll`` runs here; a failure of the run is raised here. ``vectorized``:
    each round's local training in batched passes (tools/engines/vectorized.py)."""
    from tools.engines.inprocess import run_inprocess

    logging.getLogger("flwr").setLevel(logging.WARNING)
    for name in ("flwr.flatflower.server", "flwr.flatflower.client"):
        logging.getLogger(name).setLevel(logging.WARNING)
    kind = "vectorised in-process" if vectorized else "in-process"
    print(f"{kind} simulation: {clients} clients, {cfg.algorithm}", flush=True)
    failure: list[BaseException] = []

    def work() -> None:
        try:
            run_inprocess(cfg.to_dict(), clients, vectorized=vectorized, node_configs=node_configs)
        except BaseException as err:  # reported below, in the calling thread
            failure.append(err)

    worker = threading.Thread(target=work, daemon=True)
    worker.start()
    try:
        while worker.is_alive():
            on_poll()
            worker.join(0.5)
    except KeyboardInterrupt:  # let the run's threads end before the interpreter does
        from tools.engines.inprocess import stop_runs

        stop_runs(worker, STOP_WAIT)
        raise
    if failure:
        raise failure[0]
    return Outcome(True)


STOP_WAIT = 30.0  # seconds an interrupted in-process run gets to finish its clients' calls
