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
import re
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flatflower.client.allowed_code import ALLOW_ENV
from flatflower.common.config import RunConfig
from flatflower.common.references import BadReference, is_reference, module_roots, resolve, with_pythonpath
from flatflower.common.schema import printable
from flatflower.runtime.engines.federation import COMPLETED, LocalFederation
from flatflower.runtime.engines.inprocess import run_inprocess, stop_runs

OnPoll = Callable[[], None]


REFERENCE_KEYS_EXCLUDED = ("run-dir", "client-state-dir", "data-dir")  # paths, never code


def user_code(cfg: RunConfig) -> tuple[list[str], list[str]]:
    """(the references of ``cfg``: every run-config value of the form package.module:callable,
    such as ``model``; the directories their modules were imported from). A process this one
    starts (a SuperNode, the ServerApp, a Ray worker) gets those directories on its
    PYTHONPATH, so it resolves the same references; a reference that does not import here is
    left to the run's own one-line error."""
    texts = [v for k, v in cfg.to_dict().items() if k not in REFERENCE_KEYS_EXCLUDED and is_reference(v)]
    for key, text in ((k, v) for k, v in cfg.to_dict().items() if v in texts):
        with contextlib.suppress(BadReference):
            resolve(text, key)
    return texts, module_roots(texts)


def fab_pattern(pattern: str):
    """A ``fab-include`` glob as a regular expression (``**/`` = any directories, ``*`` = any
    characters but ``/``)."""
    out = re.escape(pattern).replace(r"\*\*/", "(?:.*/)?").replace(r"\*", "[^/]*")
    return re.compile(f"^{out}$")


def outside_fab(app: Path, roots: list[str], texts: list[str]) -> list[str]:
    """The files of the user's modules (``texts``' modules, found under ``roots``) that lie in
    the app directory ``app`` but that its FAB leaves out (``[tool.flwr.app] fab-include``):
    ``flwr run`` ships the FAB alone, so a real deployment's SuperNodes would not have them."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib

    try:
        include = tomllib.loads((app / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["fab-include"]
    except (OSError, KeyError, ValueError):
        return []
    patterns = [fab_pattern(p) for p in include]
    missing = []
    for text in texts:
        module = sys.modules.get(text.split(":", 1)[0])
        path = Path(getattr(module, "__file__", "") or "").resolve() if module else None
        if path is None or not path.is_file() or not path.is_relative_to(app.resolve()):
            continue
        rel = path.relative_to(app.resolve()).as_posix()
        if not any(p.match(rel) for p in patterns):
            missing.append(rel)
    return missing


def hand_user_code(env: dict[str, str], cfg: RunConfig, app: Path) -> dict[str, str]:
    """``env`` with the directories of the run's own code (:func:`user_code`) on PYTHONPATH,
    after a note when that code lies in the app directory but outside its FAB."""
    texts, roots = user_code(cfg)
    for rel in outside_fab(app, roots, texts):
        print(f"note: {rel} (your code, in the app directory) is not in the FAB that 'flwr run' ships "
              f"(pyproject.toml fab-include): this local federation finds it through PYTHONPATH, but a "
              f"real deployment's SuperNodes need it installed or on their PYTHONPATH", flush=True)
    return allow_code(with_pythonpath(env, roots), texts)


def allow_code(env: dict[str, str], texts: list[str]) -> dict[str, str]:
    """``env`` whose nodes allow the modules of ``texts``: the nodes this command starts are its
    user's, who named that code (client/allowed_code.py); other entries of the variable kept."""
    modules = [t.split(":", 1)[0] for t in texts]
    current = [e for e in env.get(ALLOW_ENV, "").split(",") if e.strip()]
    if not modules:
        return env
    return {**env, ALLOW_ENV: ",".join(dict.fromkeys(current + modules))}


def seconds_text(value: Any) -> str:
    """A number of seconds as Flower reports it (``31.795824``, maybe as text) -> ``31.8s``;
    anything else as it is."""
    try:
        return f"{float(value):.1f}s"
    except (TypeError, ValueError):
        return printable(value, 40)


@dataclass(frozen=True)
class Outcome:
    ok: bool
    details: str = ""  # Flower's status details when the run did not complete


def run_local(cfg: RunConfig, clients: int, app: Path, logs: Path, *, timeout: float,
              on_poll: OnPoll, device: str = "auto", tls: bool = False, clientapps: str = "warm",
              fast_poll: bool = False, node_configs: dict[int, dict] | None = None) -> Outcome:
    """A real SuperLink and ``clients`` SuperNodes on 127.0.0.1 (runtime/engines/federation.py), each
    with a warm ClientApp worker (or Flower's process per message: ``clientapps="stock"``);
    ``node_configs``: partition id -> that SuperNode's own node-config keys (its data-dir)."""
    work = Path(tempfile.mkdtemp(prefix="flatflower-"))
    t0 = time.monotonic()
    try:
        security = " over TLS with SuperNode authentication" if tls else ""
        mode = {"warm": "warm ClientApp workers", "stock": "a ClientApp process per message"}[clientapps]
        print(f"starting a SuperLink and {clients} SuperNodes on 127.0.0.1{security}, {mode}"
              f"{', fast polling' if fast_poll else ''} ({cfg.algorithm}, {cfg.dataset}, "
              f"{cfg.num_server_rounds} rounds)", flush=True)
        node_config = {"device": device} if device != "auto" else {}
        fed = LocalFederation(clients, work, logs, node_config=node_config, tls=tls,
                              clientapps=clientapps, fast_poll=fast_poll, node_configs=node_configs)
        fed.env = hand_user_code(fed.env, cfg, app)  # before any process starts
        with fed:
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
            on_poll: OnPoll, cpus_per_client: int = 1, gpus_per_client: float = 0.0,
            ray_address: str | None = None) -> Outcome:
    """Flower's simulation engine (Ray) with ``clients`` virtual SuperNodes: on a private Ray
    of this machine, or with ``ray_address`` (HOST:PORT of a cluster's head) on that cluster,
    which the simulation process joins (``RAY_ADDRESS``, which Flower's ``ray.init`` reads)."""
    work = Path(tempfile.mkdtemp(prefix="flatflower-"))
    try:
        fed = LocalFederation(0, work, logs, simulation=True)
        fed.env["RAY_TMPDIR"] = str(work / "ray")
        if ray_address is not None:
            fed.env["RAY_ADDRESS"] = ray_address
        fed.env = hand_user_code(fed.env, cfg, app)
        where = f" on the Ray cluster at {ray_address}" if ray_address is not None else ""
        print(f"Ray simulation: {clients} virtual clients, {cfg.algorithm}{where}", flush=True)
        with fed:
            run_id = fed.submit(app, cfg.to_dict(), ray_federation_config(
                clients, cpus_per_client, gpus_per_client, joins=ray_address is not None))
            row = fed.wait(run_id, timeout, poll=0.5, on_poll=on_poll)
            fed.save_log(run_id, logs / "run.log")
        return Outcome(row.get("status") == COMPLETED, row.get("status-details", ""))
    finally:
        shutil.rmtree(work, ignore_errors=True)


def ray_federation_config(clients: int, cpus_per_client: int = 1, gpus_per_client: float = 0.0,
                          joins: bool = False) -> dict:
    """The simulation federation's settings (``flwr run --federation-config``). ``joins``: Ray
    joins a cluster that already runs, whose size is its own (``ray.init`` refuses
    ``num_cpus`` there), so this machine's CPU count is not given."""
    sizes = {} if joins else {"init-args-num-cpus": os.cpu_count() or 1}
    return {"num-supernodes": clients, "client-resources-num-cpus": cpus_per_client,
            "client-resources-num-gpus": gpus_per_client, **sizes}


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
    """The real ServerApp and ClientApps in this process (runtime/engines/inprocess.py), in a worker
    thread while ``on_poll`` runs here; a failure of the run is raised here. ``vectorized``:
    each round's local training in batched passes (runtime/engines/vectorized.py)."""
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
        stop_runs(worker, STOP_WAIT)
        raise
    if failure:
        raise failure[0]
    return Outcome(True)


STOP_WAIT = 30.0  # seconds an interrupted in-process run gets to finish its clients' calls
