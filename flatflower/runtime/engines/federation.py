"""Real Flower processes on 127.0.0.1: a SuperLink, N SuperNodes, and the ``flwr`` CLI.

``LocalFederation`` starts ``flower-superlink`` (gRPC Fleet API on its own port, HTTP
Control/Runtime API on another) and one ``flower-supernode`` per client, each with its
``--node-config "partition-id=i num-partitions=N"``, all bound to loopback on free ports and
with a private ``FLWR_HOME``. With ``simulation=True`` it starts a simulation SuperLink
instead (no SuperNodes; Flower's Ray engine runs the clients). Runs are submitted with
``flwr run`` and judged by ``flwr ls`` (``flwr run --stream`` exits 0 even on failure).
Every process it started, and their children, are stopped by PID on exit.

With ``tls=True`` the federation runs as a real one should: certificates and node keys are
generated into the work directory (runtime/certs.py), the SuperLink serves both APIs over TLS
with ``--enable-supernode-auth``, every node's public key is registered with
``flwr supernode register`` before the SuperNodes start, and each SuperNode authenticates with
its own private key. ``start_supernode`` starts an extra SuperNode with any key (e.g. an
unregistered one, which Flower 1.39 refuses: "Exit Code: 305" in its log, process status 1;
see ``flower_exit_code``). Binding anything other than loopback is refused without TLS.
"""

from __future__ import annotations

import fcntl
import ipaddress
import json
import os
import re
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import tomli_w

from flatflower.common import fastpoll
from flatflower.common.fastpoll import FastPollError, check_version
from flatflower.runtime.appauth import create_secret
from flatflower.runtime.certs import generate_certs
from flatflower.server.rundir import open_file  # never through a link planted in the run's logs

FINISHED = "finished"
COMPLETED = "finished:completed"
RUNNING = "running"
# Flower 1.39's exit code for "Failed to activate SuperNode" (e.g. an unregistered key). Flower
# only logs it ("Exit Code: 305"); the process itself exits with status 1, as for every error.
EXIT_SUPERNODE_REFUSED = 305


CLIENTAPP_MODES = ("warm", "stock")  # a long-lived worker per SuperNode, or Flower's process per message


class FederationError(RuntimeError):
    """A Flower process failed to start or a ``flwr`` command failed."""


STATUS_EVERY = 10.0  # seconds between `flwr ls` calls while a run's ServerApp process is up
APP_GONE_GRACE = 10.0  # seconds a running run may have no ServerApp process before it is stopped
PORT_LEDGER = Path(tempfile.gettempdir()) / "flatflower-ports"  # ports recently handed out
PORT_QUARANTINE = 600.0  # seconds before a port handed out may be handed out again


def free_port() -> int:
    """A free TCP port on 127.0.0.1 that no other flatflower process on this machine was given in
    the last 10 minutes (a ledger under a lock: federations started side by side, as parallel
    tests do, never race for a port between choosing it and binding it)."""
    with open(PORT_LEDGER, "a+") as ledger:
        fcntl.flock(ledger, fcntl.LOCK_EX)
        ledger.seek(0)
        now = time.time()
        recent = {}
        for line in ledger.read().split():
            port, _, stamp = line.partition("@")
            if port.isdigit() and stamp.replace(".", "", 1).isdigit() and now - float(stamp) < PORT_QUARANTINE:
                recent[int(port)] = float(stamp)
        while True:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            if port not in recent:
                break
        recent[port] = now
        ledger.seek(0)
        ledger.truncate()
        ledger.write(" ".join(f"{p}@{t:.0f}" for p, t in recent.items()))
    return port


def flower_command(name: str) -> str:
    """Path of a Flower console script, preferring the running interpreter's environment."""
    local = Path(sys.executable).parent / name
    found = str(local) if local.exists() else shutil.which(name)
    if not found:
        raise FederationError(f"'{name}' not found: is flwr installed in this environment?")
    return found


def _process_table() -> dict[int, tuple[int, bytes]]:
    """pid -> (parent pid, command line) of every process: one pass over /proc (Linux; empty
    elsewhere), shared by the lookups below."""
    table = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            table[int(entry.name)] = (ppid, (entry / "cmdline").read_bytes())
        except (OSError, IndexError, ValueError):
            continue
    return table


def _children(pid: int, table: dict[int, tuple[int, bytes]] | None = None) -> list[int]:
    """All descendants of ``pid``."""
    parents: dict[int, list[int]] = {}
    for child, (ppid, _) in (_process_table() if table is None else table).items():
        parents.setdefault(ppid, []).append(child)
    out, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _detached_children(pid: int, table: dict[int, tuple[int, bytes]] | None = None) -> list[int]:
    """Processes Flower started in a new session for ``pid`` (its SuperExec, given
    ``--parent-pid <pid>``) and their descendants: still found once ``pid`` has exited (e.g. a
    refused SuperNode), when they are orphans that wait to notice it."""
    table = _process_table() if table is None else table
    flag, out = str(pid).encode(), []
    for other, (_, cmdline) in table.items():
        args = cmdline.split(b"\0")
        if any(a == b"--parent-pid" and b == flag for a, b in zip(args, args[1:])):
            out += [other, *_children(other, table)]
    return out


def _family(proc: subprocess.Popen, table: dict[int, tuple[int, bytes]] | None = None) -> list[int]:
    """``proc`` and its children, and its detached Flower children. An exited process's id may
    be reused: then only its detached children remain ours."""
    table = _process_table() if table is None else table
    family = [] if proc.poll() is not None else [proc.pid, *_children(proc.pid, table)]
    return family + _detached_children(proc.pid, table)


MARK = "FLATFLOWER_FEDERATION"  # environment variable every process of a federation inherits
REAP_POLL = 0.2  # seconds between the reaper's looks at whether its federation's owner lives
# its kill passes (0.1 s apart): at most, and empty ones to end (5 s: under load a Ray agent
# was seen to appear after a shorter quiet spell, and outlive the run)
REAP_PASSES, REAP_QUIET = 300, 50


def _marked(mark: str, sessions: set[int] | None = None, spared: frozenset[int] = frozenset()) -> list[int]:
    """Every live process (but this one) of the federation ``mark``: whose environment holds
    ``MARK=mark`` (whatever its processes started, also a process born after its parent was
    looked at, or one whose parent is gone), or which is in the session of such a process.
    The sessions count because a process may write over its environment's memory: Ray's agents
    rename themselves (``ray::DashboardAgent``) over it, and /proc/PID/environ then lacks the
    mark, but they keep the session their raylet had. Each process the federation spawns
    starts a session of its own, so no other process is in one (this process's own session,
    and 0 and 1, are never taken for one). ``sessions``: those seen so far, kept across calls
    (a reaper's passes, after the processes that held the mark are gone). ``spared``: sessions
    never taken either (the reaper's owner's: the shell or CI job that started the federation)."""
    tag, out, unmarked = f"{MARK}={mark}".encode(), [], []
    sessions = set() if sessions is None else sessions
    foreign = {0, 1, os.getsid(0), *spared}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            pid = int(entry.name)
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if pid == os.getpid() or fields[0] == "Z":  # (a zombie counts as gone)
                continue
            if tag in (entry / "environ").read_bytes().split(b"\0"):
                out.append(pid)
                if int(fields[3]) not in foreign:
                    sessions.add(int(fields[3]))
            else:
                unmarked.append((pid, int(fields[3])))
        except (OSError, ValueError, IndexError):
            continue
    return out + [pid for pid, session in unmarked if session in sessions]


def reap(mark: str, owner: int) -> None:
    """The reaper a federation starts (``python -m flatflower.runtime.engines.federation MARK OWNER``): once the
    process ``owner`` that started the federation is gone without stopping it (``kill -9``,
    the OOM killer), SIGKILL every process of it, the runs' ServerApps first (never a round
    against no SuperNodes). A federation its owner stops ends its reaper with the rest."""
    try:  # the owner's session holds its user's shell (or a CI job): never swept by session
        spared = frozenset({os.getsid(owner)})
    except OSError:
        spared = frozenset()
    while os.getppid() == owner:
        time.sleep(REAP_POLL)
    apps = [p for p in _marked(mark, spared=spared)
            if b"flwr-serverapp" in _cmdline(p) or b"flwr-simulation" in _cmdline(p)]
    _signal(apps, signal.SIGKILL)
    quiet, sessions = 0, set()
    for _ in range(REAP_PASSES):  # until none is seen for REAP_QUIET passes: some may be being born
        found = _marked(mark, sessions, spared)
        quiet = 0 if found else quiet + 1
        if quiet >= REAP_QUIET:
            break
        _signal(found, signal.SIGKILL)
        time.sleep(0.1)


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie child counts as gone
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def _terminate(pids: list[int], grace: float, proc: subprocess.Popen | None = None) -> None:
    """SIGTERM ``pids``, then SIGKILL those still alive after ``grace`` seconds (``proc``: our
    child among them, reaped while waiting)."""
    _signal(pids, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        if proc is not None:
            proc.poll()
        time.sleep(0.1)
    _signal([p for p in pids if _alive(p)], signal.SIGKILL)


def is_loopback(host: str) -> bool:
    """``localhost`` or a loopback IP address."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


class LocalFederation:
    """A SuperLink and ``num_nodes`` SuperNodes (or a simulation SuperLink) on loopback.

    ``tls=True``: TLS on both SuperLink APIs and SuperNode authentication (see the module
    docstring). ``host``: the address the SuperLink binds and the SuperNodes dial; anything but
    loopback requires ``tls=True`` (0.0.0.0 / :: are dialled as loopback, as Flower does)."""

    def __init__(self, num_nodes: int, work_dir: Path, log_dir: Path, *, simulation: bool = False,
                 node_config: Mapping[str, Any] | None = None, tls: bool = False,
                 host: str = "127.0.0.1", node_configs: Mapping[int, Mapping[str, Any]] | None = None,
                 clientapps: str = "warm", fast_poll: bool = False,
                 node_prefix: Mapping[int, list[str]] | None = None):
        if not is_loopback(host) and not tls:
            raise FederationError(f"refusing to bind {host} without TLS: everything, models "
                                  "included, would cross the network in clear text; use tls=True")
        if tls and simulation:
            raise FederationError("tls=True is for deployed SuperNodes, not the simulation engine")
        if clientapps not in CLIENTAPP_MODES:
            raise FederationError(f"clientapps={clientapps!r} is not one of {', '.join(CLIENTAPP_MODES)}")
        if fast_poll:
            try:
                check_version()
            except FastPollError as err:
                raise FederationError(str(err)) from None
        self.clientapps, self.fast_poll = clientapps, fast_poll
        self.num_nodes = num_nodes
        self.simulation = simulation
        self.tls = tls
        self.host = host.strip("[]")
        dial = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(self.host, self.host)
        self.dial_host = f"[{dial}]" if ":" in dial else dial
        self.bind_host = f"[{self.host}]" if ":" in self.host else self.host
        self.certs = None  # flatflower.runtime.certs.CertFiles once started with tls
        self.node_ids: dict[str, int] = {}  # registered node name -> node id (tls)
        self.node_config = dict(node_config or {})  # every SuperNode's extra --node-config
        self.node_configs = {int(i): dict(c) for i, c in (node_configs or {}).items()}  # per partition
        # per partition: a command prefix for its SuperNode and worker (``ip netns exec NS``: a
        # node on its own network, as the network-partition tests put it)
        self.node_prefix = {int(i): list(p) for i, p in (node_prefix or {}).items()}
        self.work_dir = Path(work_dir).resolve()
        self.log_dir = Path(log_dir).resolve()
        self.flwr_home = self.work_dir / "flwr_home"
        self.http_port = free_port()
        self.fleet_port = free_port()
        self.procs: list[tuple[str, subprocess.Popen]] = []
        # every process seen in a family (pid -> command line): a child whose parent was killed
        # (a SIGKILLed SuperLink's ServerApp) is no longer found through /proc parentage
        self.seen: dict[int, bytes] = {}
        self.env = {**os.environ, "FLWR_HOME": str(self.flwr_home), "FLWR_DISABLE_UPDATE_CHECK": "1",
                    "FLWR_TELEMETRY_ENABLED": "0", "PYTHONUNBUFFERED": "1",
                    # the one official polling knob: how often a SuperExec looks for tasks (1 s)
                    "FLWR_SUPEREXEC_TASK_POLL_INTERVAL": "0.1",
                    # Flower starts flower-superexec / flwr-clientapp by name: use our environment's
                    "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}
        self.connection = "flatflower"
        if fast_poll:
            self.env[fastpoll.ENV] = "1"  # the ServerApp patches itself (common/fastpoll.py)
        self.mark = self.env[MARK] = f"{os.getpid()}-{secrets.token_hex(8)}"  # see _marked

    # ------------------------------------------------------------------ processes
    def _spawn(self, name: str, cmd: list[str]) -> subprocess.Popen:
        log_file = open_file(self.log_dir / f"{name}.log", "w")
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=self.env,
                                cwd=self.work_dir, start_new_session=True)
        log_file.close()
        self.procs.append((name, proc))
        return proc

    def exited(self, name: str) -> bool:
        """Whether process ``name`` (started here) has ended. A Flower process that logged its
        exit code but hangs on the way out is killed (flwr 1.39's SuperNode can, after the
        SuperLink refused to activate it), with its worker; a name not running here counts as
        ended. (A worker's log may hold exit codes of ClientApp runs its supervisor outlived.)"""
        for entry_name, proc in list(self.procs):
            if entry_name == name:
                if (proc.poll() is None and not name.endswith("-worker")
                        and self.flower_exit_code(name) is not None):
                    self.kill(name)
                    return True
                return proc.poll() is not None
        return True

    def _check_alive(self, only: str | None = None) -> None:
        for name, proc in list(self.procs):
            if only and name != only:
                continue
            if self.exited(name):
                log_file = self.log_dir / (name + ".log")
                last = [line for line in _tail(log_file, 5).splitlines() if line.strip()]
                raise FederationError(
                    f"{name} exited with code {proc.returncode}"
                    + (f" ({last[-1].strip()[:200]})" if last else "") + f"; its log: {log_file}")

    def start(self, timeout: float = 60.0) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.flwr_home.mkdir(parents=True, exist_ok=True)
        self._spawn("reaper", [sys.executable, "-m", "flatflower.runtime.engines.federation", self.mark, str(os.getpid())])
        cmd = [flower_command("flower-superlink"), *self._superlink_security(),
               "--isolation", "subprocess", "--disable-runtime-dependency-installation",
               # Flower's in-memory state, not an SQLite file: a federation lives as long as
               # this object, and a file database costs the SuperLink a disk write per poll
               # (a 4-client --fast-poll round took 5.3 s with it, 2.0 s without)
               "--database", ":flwr-in-memory:",
               "--host", self.host, "--port", str(self.http_port)]
        cmd += ["--simulation"] if self.simulation else [
            "--fleet-api-address", f"{self.bind_host}:{self.fleet_port}"]
        self._spawn("superlink", cmd)
        self._wait_health(timeout)
        self._write_connection()
        nodes = 0 if self.simulation else self.num_nodes
        if self.tls:  # a node must be registered before it connects, or it is refused
            with ThreadPoolExecutor(max_workers=4) as pool:  # each `flwr` call costs ~2.5 s
                list(pool.map(lambda i: self.register(self.certs.node_keys[i], f"node-{i}"),
                              range(nodes)))
        for i in range(nodes):
            self.start_node(i)

    def start_node(self, i: int, name: str | None = None) -> subprocess.Popen:
        """Start (or restart) the SuperNode of partition ``i`` with its key and node config."""
        return self.start_supernode(name or f"supernode-{i}", i,
                                    private_key=self.certs.node_keys[i] if self.tls else None,
                                    node_config=self.node_configs.get(i))

    def kill(self, name: str) -> None:
        """SIGKILL one process started here (e.g. a SuperNode, with its ClientApp worker) and all
        its children."""
        for entry in list(self.procs):
            if entry[0] in (name, f"{name}-worker"):
                proc = entry[1]
                _signal(_family(proc), signal.SIGKILL)
                proc.wait(timeout=30)
                self.procs.remove(entry)

    def _superlink_security(self) -> list[str]:
        if not self.tls:
            return ["--insecure"]
        hosts = [] if is_loopback(self.host) or self.host in ("0.0.0.0", "::") else [self.host]
        self.certs = generate_certs(self.work_dir / "certs", max(self.num_nodes, 1), hosts,
                                    days=2, force=True)
        return ["--ssl-ca-certfile", str(self.certs.ca_cert),
                "--ssl-certfile", str(self.certs.server_cert),
                "--ssl-keyfile", str(self.certs.server_key), "--enable-supernode-auth"]

    def register(self, public_or_private_key: Path, name: str) -> int:
        """``flwr supernode register`` a node's public key (tls only); returns its node id."""
        key = Path(public_or_private_key)
        pub = key if key.suffix == ".pub" else key.with_name(key.name + ".pub")
        out = self.flwr("supernode", "register", str(pub), self.connection, "--name", name,
                        "--format", "json")
        found = (re.search(r'"node-id"\s*:\s*"?(\d+)', out)
                 or re.search(r"SuperNode (\d+) registered", out))
        if not found:
            raise FederationError(f"'flwr supernode register' printed no node id:\n{out}")
        self.node_ids[name] = int(found.group(1))
        return self.node_ids[name]

    def start_supernode(self, name: str, partition_id: int, *, private_key: Path | None = None,
                        node_config: Mapping[str, Any] | None = None) -> subprocess.Popen:
        """Start one SuperNode (log: ``<log_dir>/<name>.log``); stopped with the federation.

        With tls, it authenticates with ``private_key`` (OpenSSH format): one that was not
        registered makes Flower 1.39 exit with ``EXIT_SUPERNODE_REFUSED``."""
        config = {"partition-id": partition_id, "num-partitions": self.num_nodes,
                  **self.node_config, **(node_config or {})}
        if self.tls:
            if private_key is None:
                raise FederationError("a SuperNode needs a private key when tls=True")
            security = ["--root-certificates", str(self.certs.ca_cert),
                        "--auth-supernode-private-key", str(private_key)]
        else:
            security = ["--insecure"]
        port = free_port()
        supernode = ([sys.executable, "-m", "flatflower.common.fastpoll", "supernode"] if self.fast_poll
                     else [flower_command("flower-supernode")])
        # the node's Runtime API hands tasks only to who knows this node's secret (runtime/appauth.py):
        # its executor, never another user of this machine. Flower ignores the secret under
        # --isolation subprocess, so the stock mode starts Flower's SuperExec itself, as that does.
        secret = self.work_dir / "node-secrets" / f"{name}.secret"  # directory 0700, file 0600
        create_secret(secret)
        auth = ["--superexec-auth-secret-file", str(secret)]
        prefix = self.node_prefix.get(partition_id, [])  # `ip netns exec NS` in the tests
        proc = self._spawn(name, [
            *prefix, *supernode, *security, "--isolation", "process", *auth, "--grpc-rere",
            "--superlink", f"{self.dial_host}:{self.fleet_port}", "--port", str(port),
            "--node-config", " ".join(f"{k}={json.dumps(v)}" for k, v in config.items())])
        # the warm worker of this very checkout (runtime/worker.py; its console script,
        # flatflower-worker, may be another installation's), or Flower's SuperExec, which
        # starts a flwr-clientapp per message
        executor = ([sys.executable, "-m", "flatflower.runtime.worker"] if self.clientapps == "warm"
                    else [flower_command("flower-superexec")])
        self._spawn(f"{name}-worker", [
            *prefix, *executor, "--runtime-api-address", f"127.0.0.1:{port}", "--insecure",
            "--parent-pid", str(proc.pid), *auth])
        return proc

    def flower_exit_code(self, name: str) -> int | None:
        """The ``Exit Code: N`` a Flower process logged in ``<log_dir>/<name>.log`` (None if none).

        Flower logs its own exit codes (305: SuperNode refused) but exits with status 1."""
        found = re.findall(r"Exit Code: (\d+)", _tail(self.log_dir / f"{name}.log", lines=200))
        return int(found[-1]) if found else None

    def _wait_health(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        scheme = "https" if self.tls else "http"
        url = f"{scheme}://{self.dial_host}:{self.http_port}/health"
        context = ssl.create_default_context(cafile=str(self.certs.ca_cert)) if self.tls else None
        while time.monotonic() < deadline:
            self._check_alive()
            try:
                with urllib.request.urlopen(url, timeout=1, context=context) as resp:
                    if resp.status == 200:
                        return
            except OSError as err:
                if isinstance(getattr(err, "reason", err), ssl.SSLCertVerificationError):
                    raise FederationError(f"TLS verification of {url} failed: {err}") from None
                time.sleep(0.2)
        raise FederationError(f"SuperLink not healthy at {url} after {timeout:.0f}s; "
                              f"see {self.log_dir}")

    def _write_connection(self) -> None:
        connection: dict[str, Any] = {"address": f"{self.dial_host}:{self.http_port}"}
        if self.tls:
            connection["root-certificates"] = str(self.certs.ca_cert)
        else:
            connection["insecure"] = True
        config = {"superlink": {self.connection: connection}}
        (self.flwr_home / "config.toml").write_text(tomli_w.dumps(config))

    def stop(self, grace: float = 10.0) -> None:
        """Stop every process started here and all their children (SIGTERM, then SIGKILL),
        and any process seen in their families before that is still running.

        The runs' ServerApp (or simulation) processes go first, while the SuperLink and the
        SuperNodes are still up: a ServerApp that outlived its SuperNodes would run a round
        against none, record it as skipped and checkpoint it (a resume would then skip it)."""
        _terminate(sorted(self._app_processes(self.remember())), grace)
        for name, proc in reversed(self.procs):
            _terminate(_family(proc), grace, proc)
            proc.wait(timeout=grace)
        self.procs.clear()
        _terminate(_marked(self.mark), grace)  # born late or orphaned (Ray's workers)
        orphans = [pid for pid, cmd in self.seen.items() if _alive(pid) and _cmdline(pid) == cmd]
        _signal(orphans, signal.SIGKILL)
        self.seen.clear()

    def remember(self) -> dict[int, tuple[int, bytes]]:
        """Note the current members of every family (see ``seen``); the process table read."""
        table = _process_table()
        for pid in self.pids(table):
            self.seen.setdefault(pid, table[pid][1] if pid in table else _cmdline(pid))
        return table

    def pids(self, table: dict[int, tuple[int, bytes]] | None = None) -> set[int]:
        """Every live process started here, with all their children."""
        table = _process_table() if table is None else table
        return {pid for _, proc in self.procs for pid in _family(proc, table)}

    def __enter__(self) -> LocalFederation:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------------ flwr CLI
    def flwr(self, *args: str, timeout: float = 120.0) -> str:
        cmd = [flower_command("flwr"), *args]
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, env=self.env,
                                 cwd=self.work_dir, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise FederationError(f"'flwr {' '.join(args)}' timed out after {timeout:.0f}s") from None
        if out.returncode != 0:
            raise FederationError(f"'flwr {' '.join(args)}' failed ({out.returncode}):\n"
                                  f"{out.stdout[-2000:]}{out.stderr[-2000:]}")
        return out.stdout

    def submit(self, app_dir: Path, run_config: Mapping[str, Any],
               federation_config: Mapping[str, Any] | None = None) -> int:
        """``flwr run`` the app with the given run config; returns the run id."""
        overrides = self.work_dir / "run_config.toml"
        overrides.write_text(tomli_w.dumps(dict(run_config)))
        args = ["run", str(app_dir), self.connection, "--format", "json", "-c", str(overrides)]
        if federation_config:
            args += ["--federation-config",
                     " ".join(f"{k}={json.dumps(v)}" for k, v in federation_config.items())]
        out = self.flwr(*args)
        try:
            return int(json.loads(out)["run-id"])
        except (ValueError, KeyError):
            raise FederationError(f"unexpected 'flwr run' output:\n{out}") from None

    def status(self, run_id: int) -> dict[str, Any]:
        """The run's row of ``flwr ls --run-id`` (status, status-details, elapsed, ...);
        FederationError, in one line, when the SuperLink is gone or gives no status."""
        self._check_alive(only="superlink")
        out = self.flwr("ls", self.connection, "--run-id", str(run_id), "--format", "json")
        try:
            return json.loads(out)["runs"][0]
        except (ValueError, KeyError, IndexError, TypeError):
            self._check_alive(only="superlink")
            detail = " ".join(out.split())[:200]
            raise FederationError(f"the SuperLink gave no status for run {run_id} ({detail}); "
                                  "the last checkpoint can be resumed with --resume") from None

    def wait(self, run_id: int, timeout: float, poll: float = 2.0,
             on_poll: Callable[[], None] | None = None) -> dict[str, Any]:
        """Poll until the run finishes; stop it and raise after ``timeout`` seconds.

        ``on_poll`` and the process checks run every ``poll`` seconds. The run's status comes
        from ``flwr ls`` (a Python process: about a second of CPU), asked at once when a run's
        ServerApp process exits, every second while none runs (starting, finishing), and
        every ``STATUS_EVERY`` seconds while one runs.

        A killed ServerApp leaves its run "running" until the SuperLink misses its heartbeats
        (a minute): a run that is running with no ServerApp process here for
        ``APP_GONE_GRACE`` seconds is stopped, and its row says why."""
        deadline = time.monotonic() + timeout
        apps: set[int] = set()
        next_status, gone_since = 0.0, None
        while True:
            if on_poll:
                on_poll()
            live = self._app_processes(self.remember())
            ended, apps = bool(apps - live), live
            if ended or time.monotonic() >= next_status:
                row = self.status(run_id)
                if str(row.get("status", "")).startswith(FINISHED):
                    return row
                next_status = time.monotonic() + (STATUS_EVERY if live else 1.0)
                gone_since = (gone_since or time.monotonic()) if row.get("status") == RUNNING and not live else None
                if gone_since and time.monotonic() - gone_since > APP_GONE_GRACE:
                    row = self.stop_run(run_id)
                    if row.get("status") == COMPLETED:  # it finished after all
                        return row
                    return {**row, "status-details": "its ServerApp process ended "
                            "without finishing the run (killed?); flatflower stopped the run"}
            if time.monotonic() > deadline:
                row = self.stop_run(run_id)
                if row.get("status") == COMPLETED:
                    return row
                raise FederationError(f"run {run_id} did not finish within {timeout:.0f}s; stopped it")
            self._check_alive(only="superlink")  # a lost SuperNode is the strategy's business
            time.sleep(poll)

    def stop_run(self, run_id: int) -> dict[str, Any]:
        """``flwr stop`` the run; its row afterwards. A run the SuperLink finished in the
        meantime (it fails a run whose ServerApp missed its heartbeats) is not an error: the
        run is stopped either way, and its row says how it ended."""
        try:
            self.flwr("stop", str(run_id), self.connection)
        except FederationError as err:
            if "already finished" not in str(err):
                raise
        return self.status(run_id)

    def _app_processes(self, table: dict[int, tuple[int, bytes]]) -> set[int]:
        """The live ServerApp (or simulation) processes the SuperLink started for runs: in
        ``table`` with the command line they were seen with (a zombie's reads as empty)."""
        return {pid for pid, cmd in self.seen.items()
                if (b"flwr-serverapp" in cmd or b"flwr-simulation" in cmd)
                and table.get(pid, (0, b""))[1] == cmd}

    def save_log(self, run_id: int, path: Path) -> None:
        try:
            text = self.flwr("log", str(run_id), self.connection, "--show", timeout=60)
        except FederationError as err:
            text = f"could not fetch the run log: {err}\n"
        with open_file(path, "w") as f:
            f.write(text)


if __name__ == "__main__":
    reap(sys.argv[1], int(sys.argv[2]))
