"""Independent jobs (runs of a sweep, trials of a tune) on this machine's cores or on a Ray
cluster that already runs.

A :class:`Job` is one unit of work with a run directory of its own, either

* a Python command line (``argv``: the interpreter's arguments, e.g. ``("-m",
  "flatflower.tools.cli", "simulate", "--run-dir", "OUT/fedavg-s0", ...)``), run by the
  interpreter of the machine that runs the job, its output in ``job.log``; or
* a callable (``call``, a module-level function the worker can import) called as
  ``call(run_dir, *args)`` in a process of its own; what it returns comes back as the
  result's ``value`` (it must pickle).

:func:`run_jobs` runs a list of them and returns one :class:`Result` each, in the order they
finish; ``on_done(result)`` is called as each one finishes (a finished run is written before
the next one is waited for, so an interrupt loses none that finished). A job that fails is
reported in its result and the others go on. Two places to run:

* ``ray_address=None``: this machine, ``parallel`` jobs at a time (default: its cores), each
  in its own process (a subprocess for ``argv``, a spawned process for ``call``), writing
  straight into its run directory.
* ``ray_address="HOST:PORT"`` (the head of a cluster started with ``ray start --head``): each
  job is a Ray task holding ``job.num_cpus`` CPUs and ``job.num_gpus`` GPUs (Ray sets the
  task's ``CUDA_VISIBLE_DEVICES``; its process inherits it), placed by Ray on any node; all
  are submitted at once and Ray queues those that do not fit yet. No shared filesystem is
  assumed: the driver sends the run directory's files as they are here (none for a fresh
  run; the checkpoint of an interrupted one), the task runs the job in a temporary
  directory on its node (every ``argv`` item equal to ``str(job.run_dir)`` is replaced by
  that node-local path, and ``call`` gets it), and returns the directory's files and the
  output as one tar archive, which the driver writes into ``job.run_dir`` here (over the
  files it sent) and ``job.log``. The run's own records therefore name the node-local path
  as its run directory (config.json's ``run-dir``): where it ran. Every node needs
  flatflower (the same version of it and of Ray) and the data the jobs read; nothing else
  travels.

The address is checked first (:func:`probe`): nothing answering there, or no Ray cluster
answering, is a :class:`ClusterError` within seconds, before any job starts, as is a job
that fits on none of the cluster's nodes (:func:`check_fits`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import io
import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

CONNECT_TIMEOUT = 5.0  # seconds a TCP connection to the head's port may take
PROBE_TIMEOUT = 60.0  # seconds the whole check (a Ray driver's connection) may take
STOP_GRACE = 10.0  # seconds a stopped job's process gets after SIGTERM before SIGKILL
POLL = 1.0  # seconds between looks at the running jobs (and calls of on_poll)


class ClusterError(RuntimeError):
    """The Ray address is malformed or unreachable, or a job fits on none of its nodes."""


@dataclass(frozen=True)
class Job:
    """One job: ``argv`` (a Python command line) or ``call`` (with ``args``), see the module."""

    name: str
    run_dir: Path
    argv: tuple[str, ...] = ()
    call: Callable[..., Any] | None = None
    args: tuple[Any, ...] = ()
    log: Path | None = None  # the command's output (default: <run_dir's parent>/<name>.log)
    num_cpus: float = 1.0  # the Ray task's share (a local job is one process, whatever these say)
    num_gpus: float = 0.0

    def __post_init__(self) -> None:
        if bool(self.argv) == (self.call is not None):
            raise ValueError(f"job {self.name}: give argv or call, one of them")
        if self.num_cpus < 0 or self.num_gpus < 0:
            raise ValueError(f"job {self.name}: num_cpus and num_gpus must be >= 0")

    @property
    def log_path(self) -> Path:
        return self.log or Path(self.run_dir).parent / f"{self.name}.log"


@dataclass(frozen=True)
class Result:
    """How one job ended: ``ok`` (exit status 0, or ``call`` returned), ``code`` (the exit
    status of an ``argv`` job; None for a call or a job that never ran), ``value`` (what
    ``call`` returned), ``error`` (why it failed, one paragraph), ``where`` (``local`` or the
    Ray node's address)."""

    job: Job
    ok: bool
    code: int | None = None
    value: Any = None
    error: str = ""
    where: str = "local"


# ---------------------------------------------------------------- the address


def split_address(address: str) -> tuple[str, int]:
    """``HOST:PORT`` -> (host, port); ClusterError for anything else (Ray Client's ``ray://``
    addresses are not supported: the driver talks to the head's GCS port)."""
    host, sep, port = address.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536 or "/" in host:
        raise ClusterError(f"--ray-address {address!r} is not HOST:PORT (the head's address, as "
                           f"'ray start --head --port PORT' prints it, e.g. 10.0.0.1:6379)")
    return host.strip("[]"), int(port)


def probe(address: str, timeout: float = PROBE_TIMEOUT) -> list[dict[str, float]]:
    """The resources of each alive node of the Ray cluster at ``address`` (``{"CPU": 2.0,
    "GPU": 1.0, ...}`` per node), or ClusterError saying why not, within about ``timeout``
    seconds: first a TCP connection to the port (refused or silent: at once, or after
    CONNECT_TIMEOUT), then a Ray driver's connection in a process of its own (Ray's own
    ``ray.init`` waits minutes for a GCS that never answers; the process is killed after
    ``timeout``)."""
    host, port = split_address(address)
    try:
        socket.create_connection((host, port), timeout=CONNECT_TIMEOUT).close()
    except OSError as err:
        reason = "no answer" if isinstance(err, TimeoutError) else (err.strerror or str(err))
        raise ClusterError(f"--ray-address {address}: nothing answers there ({reason}); start the "
                           f"cluster's head with 'ray start --head --port {port}' or give its "
                           f"address") from None
    try:
        done = subprocess.run([sys.executable, "-m", "flatflower.runtime.cluster", address],
                              capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    except subprocess.TimeoutExpired:
        raise ClusterError(f"--ray-address {address}: something answers there, but no Ray cluster "
                           f"within {timeout:g} s (is it the head's GCS port, the --port of "
                           f"'ray start --head'?)") from None
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise ClusterError(f"--ray-address {address}: cannot join the Ray cluster there: {last[:300]}")
    return json.loads(lines[-1])


def _nodes_here(address: str) -> list[dict[str, float]]:
    """(In the probe's process) join the cluster, read its alive nodes' resources, leave."""
    import ray

    ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    try:
        return [dict(node["Resources"]) for node in ray.nodes() if node.get("Alive")]
    finally:
        ray.shutdown()


def check_fits(jobs: Iterable[Job], nodes: Sequence[dict[str, float]], address: str) -> None:
    """ClusterError naming the first job whose CPU/GPU share no single node of ``nodes`` has
    (Ray would queue its task forever)."""
    for job in jobs:
        if not any(node.get("CPU", 0.0) >= job.num_cpus and node.get("GPU", 0.0) >= job.num_gpus
                   for node in nodes):
            sizes = ", ".join(f"{n.get('CPU', 0):g} CPU / {n.get('GPU', 0):g} GPU" for n in nodes)
            raise ClusterError(f"{job.name} asks for {job.num_cpus:g} CPU and {job.num_gpus:g} GPU, "
                               f"and no node of the cluster at {address} has that (its nodes: {sizes or 'none'})")


# ---------------------------------------------------------------- one job, where it runs


def _die_with_parent() -> None:
    """(In a job's process, before it runs) SIGTERM when the process that started it dies
    (Linux): a Ray worker killed by a cancel leaves no run behind."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _called(conn, call: Callable[..., Any], run_dir: str, args: tuple[Any, ...], log: str) -> None:
    """(In a spawned process) ``call(run_dir, *args)`` with its output in ``log``, its value
    or traceback sent back."""
    out = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    sys.stdout.flush(), sys.stderr.flush()
    os.dup2(out, 1), os.dup2(out, 2)
    try:
        conn.send((True, call(Path(run_dir), *args)))
    except BaseException:  # reported in the result, the others go on
        conn.send((False, traceback.format_exc()))


def _received(conn) -> tuple[bool, Any] | None:
    """What a call's process sent, or None when it ended without sending."""
    try:
        return conn.recv()
    except (EOFError, OSError):
        return None


def execute(job: Job, stop: threading.Event | None = None) -> Result:
    """Run ``job`` here, in a process of its own, until it ends or ``stop`` is set (then, as on
    an interrupt of this thread, its process is stopped: SIGTERM, SIGKILL after
    STOP_GRACE); its output goes to ``job.log_path``."""
    stop = stop or threading.Event()
    log_path = job.log_path
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "a") as log:  # a resumed run adds to its log
        if job.argv:
            proc = subprocess.Popen([sys.executable, *job.argv], stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)
            alive, end = lambda: proc.poll() is None, proc.terminate
        else:
            ctx = multiprocessing.get_context("spawn")
            receive, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_called, args=(send, job.call, str(job.run_dir), job.args, str(log_path)),
                               name=f"flatflower-job-{job.name}")
            proc.start()
            send.close()
            alive, end = proc.is_alive, proc.terminate
        outcome = None
        try:
            while alive() and not stop.is_set():
                if not job.argv and receive.poll(0.2):  # read before it ends: a large value fills the pipe
                    outcome = _received(receive)
                    proc.join()
                    break
                if job.argv:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        proc.wait(0.2)
        finally:
            if alive():
                end()
                deadline = time.monotonic() + STOP_GRACE
                while alive() and time.monotonic() < deadline:
                    time.sleep(0.1)
                if alive():
                    proc.kill()
            proc.wait() if job.argv else proc.join()
    if stop.is_set() and outcome is None:
        return Result(job, False, error="stopped")
    if job.argv:
        code = proc.returncode
        return Result(job, code == 0, code, error="" if code == 0 else f"exit {code}")
    if outcome is None and receive.poll():
        outcome = _received(receive)
    if outcome is None:
        return Result(job, False, error=f"its process ended with exit {proc.exitcode} and no result")
    ok, value = outcome
    return Result(job, True, value=value) if ok else Result(job, False, error=value)


def pack(folder: Path, extra: dict[str, bytes] | None = None) -> bytes:
    """``folder``'s regular files (and directories) as a tar archive, plus ``extra`` files at
    its top (name -> bytes); symbolic links and other special files are left out."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        if folder.is_dir():
            for path in sorted(folder.rglob("*")):
                if path.is_symlink() or not (path.is_file() or path.is_dir()):
                    continue
                tar.add(path, arcname=path.relative_to(folder).as_posix(), recursive=False)
        for name, data in (extra or {}).items():
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), int(time.time())
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def unpack(data: bytes, folder: Path) -> bytes | None:
    """Write the archive ``data`` into ``folder`` (over files of the same names): regular files
    and directories only, each inside ``folder`` (tarfile's ``data`` filter); the task output
    file at its top (OUTPUT) is returned instead of written (None when there is none)."""
    with tarfile.open(fileobj=io.BytesIO(data), mode="r") as tar:
        members = tar.getmembers()
        output = next((m for m in members if m.name == OUTPUT and m.isfile()), None)
        text = tar.extractfile(output).read() if output else None
        if rest := [m for m in members if m is not output]:  # a run that wrote nothing leaves no folder
            folder.mkdir(parents=True, exist_ok=True)
            tar.extractall(folder, members=rest, filter="data")
    return text


OUTPUT = ".flatflower-job-output.log"  # the task's output, at the top of the archive it returns


def on_node(job: Job, sent: bytes) -> tuple[Result, bytes]:
    """(A Ray task's body, on whichever node Ray chose) run ``job`` in a temporary directory
    there, starting from the files ``sent`` (an archive, maybe empty); (its result, an
    archive of its run directory with its output as OUTPUT)."""
    import ray

    where = ray.util.get_node_ip_address()
    with tempfile.TemporaryDirectory(prefix="flatflower-job-") as tmp:
        here = Path(tmp) / Path(job.run_dir).name
        if sent:
            unpack(sent, here)
        moved = replace(job, run_dir=here, log=Path(tmp) / OUTPUT,
                        argv=tuple(str(here) if a == str(job.run_dir) else a for a in job.argv))
        result = execute(moved)
        output = moved.log_path.read_bytes() if moved.log_path.is_file() else b""
        return replace(result, job=job, where=where), pack(here, {OUTPUT: output})


def land(job: Job, archive: bytes) -> None:
    """(On the driver) write a task's archive into ``job.run_dir``, its output into the log."""
    output = unpack(archive, Path(job.run_dir))
    if output:
        with open(job.log_path, "ab") as log:
            log.write(output)


# ---------------------------------------------------------------- many jobs


@dataclass
class _Local:
    """This machine's cores: a thread per running job, each waiting on its job's process."""

    parallel: int
    stop: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=self.parallel)

    def start(self, job: Job) -> concurrent.futures.Future:
        Path(job.run_dir).parent.mkdir(parents=True, exist_ok=True)
        return self.pool.submit(execute, job, self.stop)

    def finished(self, handles: list, timeout: float) -> list[tuple[Any, Result]]:
        done, _ = concurrent.futures.wait(handles, timeout=timeout,
                                          return_when=concurrent.futures.FIRST_COMPLETED)
        return [(h, h.result()) for h in done]

    def close(self) -> None:
        self.stop.set()  # running jobs' processes are stopped by their threads
        self.pool.shutdown(wait=True, cancel_futures=True)


class _Ray:
    """A Ray cluster that already runs: each job a task of its own size (see the module)."""

    def __init__(self, address: str):
        import ray

        self.ray, self.started = ray, not ray.is_initialized()
        if self.started:
            with warnings.catch_warnings():  # a tip about Ray's next versions, on every start
                warnings.simplefilter("ignore", FutureWarning)
                ray.init(address=address, logging_level="ERROR", log_to_driver=False)
        self.task = ray.remote(on_node)
        self.jobs: dict[Any, Job] = {}

    def start(self, job: Job) -> Any:
        Path(job.run_dir).parent.mkdir(parents=True, exist_ok=True)
        sent = pack(Path(job.run_dir)) if Path(job.run_dir).is_dir() else b""
        ref = self.task.options(num_cpus=job.num_cpus, num_gpus=job.num_gpus, max_retries=0,
                                name=f"flatflower:{job.name}").remote(job, sent)
        self.jobs[ref] = job
        return ref

    def finished(self, handles: list, timeout: float) -> list[tuple[Any, Result]]:
        done, _ = self.ray.wait(handles, num_returns=1, timeout=timeout)
        out = []
        for ref in done:
            job = self.jobs.pop(ref)
            try:
                result, archive = self.ray.get(ref)
            except Exception as err:  # the task itself failed: node lost, worker killed, ...
                out.append((ref, Result(job, False, error=f"its Ray task failed: {str(err)[-500:]}", where="ray")))
                continue
            land(job, archive)
            out.append((ref, result))
        return out

    def close(self) -> None:
        for ref in self.jobs:  # interrupted: its task's process stops its job's (execute's finally)
            with contextlib.suppress(Exception):
                self.ray.cancel(ref)
        if self.started:
            self.ray.shutdown()


def run_jobs(jobs: Sequence[Job], *, ray_address: str | None = None, parallel: int | None = None,
             on_start: Callable[[Job], None] | None = None, on_done: Callable[[Result], None] | None = None,
             on_poll: Callable[[list[Job]], None] | None = None, poll: float = POLL) -> list[Result]:
    """Run ``jobs`` (see the module) and return their results in the order they finished.
    ``parallel``: jobs at a time (default: this machine's cores, or all at once on Ray);
    ``on_start(job)``, ``on_done(result)`` as each starts and ends, ``on_poll(running jobs)``
    every ``poll`` seconds while some run. An unusable ``ray_address`` or a job too large
    for every node raises ClusterError before any job starts. On an exception (Ctrl-C) the
    running jobs are stopped and the finished ones stay written."""
    jobs = list(jobs)
    if ray_address is not None:
        check_fits(jobs, probe(ray_address), ray_address)
        backend: _Local | _Ray = _Ray(ray_address)
        limit = parallel or len(jobs) or 1
    else:
        limit = parallel or len(os.sched_getaffinity(0))
        backend = _Local(limit)
    waiting, running, results = list(jobs), {}, []
    try:
        while waiting or running:
            while waiting and len(running) < limit:
                job = waiting.pop(0)
                running[backend.start(job)] = job
                if on_start:
                    on_start(job)
            for handle, result in backend.finished(list(running), poll):
                running.pop(handle)
                results.append(result)
                if on_done:
                    on_done(result)
            if running and on_poll:
                on_poll(list(running.values()))
    finally:
        backend.close()
    return results


if __name__ == "__main__":  # probe's process: python -m flatflower.runtime.cluster HOST:PORT
    print(json.dumps(_nodes_here(sys.argv[1])), flush=True)
